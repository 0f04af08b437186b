"""The capacity planner's replay against the real stack, turn for turn.

One conversation through the real router and the real vLLM CPU P/D pair, with the SDK writing its
turn log and no heartbeats, so the router's lease is a fixed TTL counted from each turn's end: a
short pause keeps D's KV, a pause past the TTL loses it. The planner replays that turn log
(``Policy.TTL`` with the router's TTL, no cap) and must predict, for every follow-up turn, whether
the KV was still there, exactly as the router's status says (retained: the handle was offered,
``hit`` / ``miss`` / ``mismatch``; gone: ``expired``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvlease._analyze._plan import Policy, prepare, replay
from kvlease._analyze._plan_api import read_turns
from kvlease_stack import StackSpec

from ._specs import ALWAYS_PULL
from .test_router_real_stack import QUESTION, RouterProcess

pytestmark = pytest.mark.integration

ROUTER_TTL_S = 8.0
#: Pauses before turns 2.. (seconds): well inside, then well past, then inside the TTL again.
PAUSES = (1.0, 3 * ROUTER_TTL_S, 1.0)
RETAINED = {"hit", "miss", "mismatch", "local_hit"}


@pytest.fixture
def stack(stack_factory: Callable[[StackSpec], Any]) -> Any:
    return stack_factory(StackSpec(prefix_caching=False, kvlease=ALWAYS_PULL))


@pytest.fixture
def router(stack: Any) -> Iterator[RouterProcess]:
    r = RouterProcess(stack, "--ttl", str(ROUTER_TTL_S))
    yield r
    r.stop()


def test_planner_predicts_the_router_statuses(stack: Any, router: RouterProcess, tmp_path: Path) -> None:
    from openai import OpenAI

    import kvlease

    log = tmp_path / "turns.jsonl"
    kc = kvlease.wrap(
        OpenAI(base_url=router.url + "/v1", api_key="plan-key", max_retries=0, timeout=600),
        heartbeat=False,
        turn_log=log,
    )
    model = stack.model_name
    with kc.conversation() as conv:
        messages: list[dict[str, str]] = [{"role": "user", "content": QUESTION}]
        for i in range(len(PAUSES) + 1):
            if i:
                time.sleep(PAUSES[i - 1])
            r = conv.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0.0)
            messages += [
                {"role": "assistant", "content": r.choices[0].message.content or ""},
                {"role": "user", "content": f"Go on, part {i}."},
            ]
        statuses = [t.status.value if t.status else None for t in conv.turns]
    kc.close()
    assert statuses[0] == "first"

    turns, info = read_turns(log)
    assert info["records"] == len(PAUSES) + 1
    trace_rows = sorted(turns, key=lambda row: row[1])
    predicted = []
    for n in range(2, len(trace_rows) + 1):  # no cap: each turn's outcome depends only on its past
        before = replay(prepare(trace_rows[: n - 1]), Policy.TTL, ROUTER_TTL_S, bytes_per_token=1).hits
        after = replay(prepare(trace_rows[:n]), Policy.TTL, ROUTER_TTL_S, bytes_per_token=1).hits
        predicted.append(after - before == 1)
    measured = [s in RETAINED for s in statuses[1:]]
    assert predicted == measured, (statuses, predicted)
    assert predicted == [True, False, True]  # the trace really has both outcomes
    assert statuses[2] == "expired"
