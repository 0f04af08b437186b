"""The cluster simulator (``kvlease plan --cluster``) against the real stack, turn for turn.

A small agent trace: a few sessions, run side by side through the real router and the real vLLM
CPU P/D pair, each turn after a recorded think time, the SDK writing its turn log with no
heartbeats. The router's lease is then a fixed TTL counted from each turn's end, so a think time
well inside the TTL keeps D's KV and one well past it loses it. The stack pulls whenever a handle
is offered (``ALWAYS_PULL``: its cost model never declines) and P's own prefix cache is off, so a
retained turn is a ``hit`` and a lost one ``expired``.

The simulator reads that turn log (think times from its ``gap_s``) with the same TTL, P's prefix
cache off and a prefill rate of this CPU stack (at which every pull beats recomputing, as on the
stack), and writes its ``--per-turn`` JSONL. For every follow-up turn its ``hit`` must equal the
stack's (``X-KVLease-Status: hit``), under both policies that model this stack: ``ttl`` (a fixed TTL
in HBM) and ``lease`` (leases in HBM whose max-idle is the TTL: no heartbeat renews them). The
stack's spec is the one ``test_plan_real_stack.py`` and ``test_router_real_stack.py`` use, so in
one session the pair is started once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from kvlease._analyze.plan_cli import plan_command
from kvlease_stack import StackSpec

from ._specs import ALWAYS_PULL
from .test_router_real_stack import QUESTION, RouterProcess

pytestmark = pytest.mark.integration

ROUTER_TTL_S = 6.0
SHORT, LONG = 1.0, 2 * ROUTER_TTL_S + 1.0
#: Think times before turns 2.. of each session: kept (SHORT) and lost (LONG) in different orders.
TRACE: dict[str, tuple[float, ...]] = {
    "a": (SHORT, LONG, SHORT),
    "b": (LONG, SHORT),
    "c": (SHORT, SHORT, LONG),
}
#: This CPU stack's prefill rate, tokens/s (RESULTS.md ``ttft``: 2,048 tokens recomputed in ~850 ms).
#: At this rate a device pull (~5 ms fixed, in the simulator's H200 costs) beats recomputing any
#: prompt of this trace, so the simulator pulls every retained turn, as the stack (ALWAYS_PULL) does.
STACK_PREFILL_TPS = 2400
#: Bound on the whole replay (about 20 s on a quiet machine: the longest session's think times).
REPLAY_TIMEOUT_S = 300.0


@pytest.fixture
def stack(stack_factory: Callable[[StackSpec], Any]) -> Any:
    return stack_factory(StackSpec(prefix_caching=False, kvlease=ALWAYS_PULL))


@pytest.fixture
def router(stack: Any) -> Iterator[RouterProcess]:
    r = RouterProcess(stack, "--ttl", str(ROUTER_TTL_S))
    yield r
    r.stop()


async def _replay(url: str, model: str, log: Path) -> dict[str, list[str | None]]:
    """Every session of :data:`TRACE` side by side; each session's statuses by turn."""
    from openai import AsyncOpenAI

    import kvlease

    client = AsyncOpenAI(base_url=url + "/v1", api_key="cluster-key", max_retries=0, timeout=120)
    kc = kvlease.wrap(client, heartbeat=False, turn_log=log)

    async def session(name: str, thinks: tuple[float, ...]) -> list[str | None]:
        async with kc.conversation() as conv:
            messages: list[dict[str, str]] = [{"role": "user", "content": f"Session {name}. {QUESTION}"}]
            for i in range(len(thinks) + 1):
                if i:
                    await asyncio.sleep(thinks[i - 1])
                r = await conv.chat.completions.create(
                    model=model, messages=messages, max_tokens=12, temperature=0.0
                )
                messages += [
                    {"role": "assistant", "content": r.choices[0].message.content or ""},
                    {"role": "user", "content": f"Go on, part {i}."},
                ]
            return [t.status.value if t.status else None for t in conv.turns]

    try:
        got = await asyncio.wait_for(
            asyncio.gather(*(session(n, t) for n, t in TRACE.items())), REPLAY_TIMEOUT_S
        )
    finally:
        await kc.close()
        await client.close()
    return dict(zip(TRACE, got))


def _simulate(log: Path, out: Path) -> list[dict[str, Any]]:
    app = typer.Typer()
    app.command()(plan_command)
    args = [
        str(log), "--cluster", "--model", "8b", "--nodes", "1", "--p-cache", "0",
        "--prefill-tps", str(STACK_PREFILL_TPS), "--ttl", str(ROUTER_TTL_S),
        "--max-idle", str(ROUTER_TTL_S), "--retained-fraction", "1", "--no-sweep", "--jobs", "1",
        "--per-turn", str(out), "--json",
    ]  # fmt: skip
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, (res.stdout, res.stderr)
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_simulator_agrees_with_the_stack_turn_for_turn(
    stack: Any, router: RouterProcess, tmp_path: Path
) -> None:
    log = tmp_path / "turns.jsonl"
    statuses = asyncio.run(_replay(router.url, stack.model_name, log))

    # the stack: per conversation id (the turn log's), each turn's status, in order
    logged: dict[str, list[dict[str, Any]]] = {}
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        logged.setdefault(rec["conversation_id"], []).append(rec)
    assert sorted(len(v) for v in logged.values()) == sorted(len(t) + 1 for t in TRACE.values())
    stack_hit: dict[tuple[str, int], bool] = {}
    for cid, recs in logged.items():
        recs.sort(key=lambda r: r["ts"])
        assert recs[0]["status"] == "first", recs
        for i, rec in enumerate(recs[1:], start=1):
            stack_hit[cid, i] = rec["status"] == "hit"
    # the trace has both outcomes on the stack, where its think times put them
    expected = sorted(t < ROUTER_TTL_S for thinks in TRACE.values() for t in thinks)
    assert sorted(stack_hit.values()) == expected, statuses
    for name, thinks in TRACE.items():
        assert statuses[name][1:] == ["hit" if t < ROUTER_TTL_S else "expired" for t in thinks], statuses

    sim = _simulate(log, tmp_path / "per_turn.jsonl")
    for policy in ("ttl", "lease"):
        rows = {(r["conversation_id"], r["turn"]): r for r in sim if r["policy"] == policy}
        assert len(rows) == len(stack_hit) + len(TRACE), policy
        assert all(rows[cid, 0]["source"] == "first" for cid in logged)
        predicted = {key: rows[key]["hit"] for key in stack_hit}
        assert predicted == stack_hit, (policy, statuses, {k: rows[k]["source"] for k in stack_hit})
        # a hit reuses tokens in both (the simulator: the previous prompt and answer, from D)
        assert all(rows[k]["source"] == "device" for k, hit in stack_hit.items() if hit)
    no_reuse = [r for r in sim if r["policy"] == "no-reuse" and r["turn"] > 0]
    assert no_reuse and not any(r["hit"] for r in no_reuse)
