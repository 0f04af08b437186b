"""Trace replay with tool pauses against the real local stack (time-compressed).

~20 conversations of 4-6 turns run concurrently through the kvlease router on a real vLLM P/D pair.
Between turns each agent waits for a "tool"; the pauses are drawn so that about a third exceed the
decode node's retention TTL (15 s here, instead of minutes in production). Three arms, same trace:

- ``fixed-ttl``: reuse on, no heartbeats (upstream behaviour: the blocks expire after the TTL);
- ``heartbeats``: kvlease as shipped (the SDK renews leases while the tools run);
- ``no-reuse``: every turn recomputed (``X-KVLease-Reuse: off``).

Reports the share of follow-up turns that reused KV and the median TTFT of each arm.

    python benchmarks/trace_replay.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

D_TTL = 15.0
ARMS = ("fixed-ttl", "heartbeats", "no-reuse")


@dataclass(frozen=True)
class ConvPlan:
    name: str
    turns: int
    pauses: tuple[float, ...]  # pause after turn i (len == turns - 1)


def make_trace(n: int, seed: int = 7, long_share: float = 1 / 3) -> list[ConvPlan]:
    """Pauses: ~``long_share`` of them beyond D's TTL (18-24 s), the rest short (1-6 s)."""
    rng = random.Random(seed)
    plans = []
    for i in range(n):
        turns = rng.randint(4, 6)
        pauses = tuple(
            round(rng.uniform(18, 24), 1) if rng.random() < long_share else round(rng.uniform(1, 6), 1)
            for _ in range(turns - 1)
        )
        plans.append(ConvPlan(f"c{i:02d}", turns, pauses))
    return plans


async def _conversation(kc: Any, model: str, plan: ConvPlan, arm: str) -> list[dict[str, Any]]:
    from kvlease.protocol import CACHE_SALT, HEADER_REUSE, REUSE_OFF

    messages: list[dict[str, Any]] = [
        {"role": "system", "content": f"Agent {plan.name}. " + "def f(x):\n    return x\n" * 120},
        {"role": "user", "content": f"Task for {plan.name}: refactor the module."},
    ]
    out = []
    headers = {HEADER_REUSE: REUSE_OFF} if arm == "no-reuse" else {}
    async with kc.conversation(id=f"{arm}-{plan.name}") as conv:
        for turn in range(plan.turns):
            stream = await conv.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=16,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={CACHE_SALT: f"{arm}-{plan.name}"},
                extra_headers=headers,
            )
            answer = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            t = conv.turns[-1]
            out.append(
                {
                    "turn": turn,
                    "status": t.status and t.status.value,
                    "ttft_s": t.ttft_s,
                    "reused": t.reused_tokens,
                    "prompt_tokens": t.prompt_tokens,
                }
            )
            messages.append({"role": "assistant", "content": answer})
            if turn < plan.turns - 1:
                await asyncio.sleep(plan.pauses[turn])
                messages.append({"role": "user", "content": f"tool output {turn}: ok\n" + "y = 1\n" * 20})
    return out


async def _arm(router: str, model: str, plans: list[ConvPlan], arm: str) -> list[list[dict[str, Any]]]:
    from openai import AsyncOpenAI

    import kvlease

    raw = AsyncOpenAI(base_url=router + "/v1", api_key="bench", max_retries=0, timeout=300)
    async with kvlease.wrap(raw, heartbeat=(arm == "heartbeats")) as kc:
        return list(await asyncio.gather(*(_conversation(kc, model, p, arm) for p in plans)))


def summarize(results: list[list[dict[str, Any]]], plans: list[ConvPlan]) -> dict[str, Any]:
    follow = [t for conv in results for t in conv[1:]]
    hits = sum(1 for t in follow if t["status"] == "hit")
    ttfts = [t["ttft_s"] for t in follow if t["ttft_s"] is not None]
    long_follow = [
        conv[i + 1] for conv, p in zip(results, plans) for i, pause in enumerate(p.pauses) if pause > D_TTL
    ]
    return {
        "follow_up_turns": len(follow),
        "reuse_share": hits / len(follow) if follow else 0.0,
        "reuse_share_after_long_pause": (
            sum(1 for t in long_follow if t["status"] == "hit") / len(long_follow) if long_follow else None
        ),
        "median_ttft_ms": statistics.median(ttfts) * 1000 if ttfts else None,
        "statuses": {
            s: sum(1 for t in follow if t["status"] == s) for s in sorted({str(t["status"]) for t in follow})
        },
    }


def run(quick: bool = False) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from kvlease_stack import Stack, StackSpec, default_dtype
    from kvlease_stack.demo import router_process

    plans = make_trace(8 if quick else 20)
    long_pauses = sum(1 for p in plans for x in p.pauses if x > D_TTL)
    total_pauses = sum(len(p.pauses) for p in plans)
    out: dict[str, Any] = {
        "conversations": len(plans),
        "follow_up_turns": total_pauses,
        "pauses_beyond_ttl": long_pauses,
        "d_ttl_s": D_TTL,
        "arms": {},
    }
    spec = StackSpec(model="small", ttl=D_TTL, prefix_caching=False, dtype=default_dtype())
    with Stack.start(spec, timeout=600) as stack, router_process(stack) as router:
        for arm in ARMS:
            t0 = time.monotonic()
            res = asyncio.run(_arm(router, stack.model_name, plans, arm))
            out["arms"][arm] = summarize(res, plans) | {"wall_s": round(time.monotonic() - t0, 1)}
            print(arm, json.dumps(out["arms"][arm]), flush=True)
    return out


def print_table(res: dict[str, Any]) -> None:
    print(
        f"\n{res['conversations']} conversations, {res['follow_up_turns']} follow-up turns, "
        f"{res['pauses_beyond_ttl']} pauses beyond D's TTL ({res['d_ttl_s']:.0f} s)"
    )
    print(f"{'arm':<12} {'reuse share':>12} {'after long pause':>17} {'median TTFT':>12}")
    for arm, r in res["arms"].items():
        long = r["reuse_share_after_long_pause"]
        print(
            f"{arm:<12} {r['reuse_share'] * 100:>11.1f}% "
            f"{'n/a' if long is None else f'{long * 100:.1f}%':>17} {r['median_ttft_ms']:>9.0f} ms"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path, help="write the figures here")
    a = ap.parse_args()
    res = run(quick=a.quick)
    print_table(res)
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
