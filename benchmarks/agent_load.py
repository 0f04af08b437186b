"""Agent sessions at equal offered load: plain P/D, upstream's NixlConnector and kvlease, side by side.

Offered load is the number N of live agent sessions. Each live slot replays recorded sessions back to
back (``benchmarks/data/agent_sessions.jsonl``: AIPerf's agentic-code synthesizer, parameters in
``benchmarks/data/agent_sessions.md``), with each turn's recorded think/tool delay before it, the
history resent every turn, for a fixed run length. Every arm replays the same sessions with the same
delays, one arm after another on the same local real stack (vLLM CPU P/D with NIXL, the ``tiny``
model), through kvlease's router:

- ``plain``: NixlConnector P->D only (``bidirectional_kv_xfer`` off): every turn is recomputed on P
  (beyond P's own prefix cache); router in stock-vLLM mode; a plain openai client.
- ``upstream``: NixlConnector with ``bidirectional_kv_xfer`` and its fixed TTL on D; router in
  stock-vLLM mode (told D's TTL, ``--node-ttl``); a plain openai client (``X-Session-Id``: nothing
  renews D's blocks). Its turns are *not streamed*: in stock-vLLM mode the router captures D's
  handle from non-streamed answers only (``kvlease_router._turn.record``), even where D streams it
  (kvlease's vLLM plugin on 0.32, vLLM 0.33 natively), so streamed turns would never be offered
  D's blocks. Its TTFT is estimated: the turn's end-to-end time less ``completion_tokens - 1``
  times D's mean inter-token latency over the run (``vllm:inter_token_latency_seconds``); its ITL
  percentiles are that histogram's. The streamed arms report the same estimate's error against
  their measured TTFT (``ttft_estimate_error_s``).
- ``kvlease-device`` / ``kvlease-auto`` / ``kvlease-host``: KVLeaseConnector with ``placement``
  ``device`` / ``auto`` / ``host`` (the last two with a host arena); the SDK (``kvlease.wrap``,
  heartbeats on) keeps leases across tool pauses.

AIPerf does not drive the stack here: on 2 cores its worker processes starve P and D (the replay is
a light asyncio client in this process). To replay the real SemiAnalysis Claude Code traces with
AIPerf against a real deployment (GPUs; the traces download from a hub)::

    pip install agentx-harness==1.0.12   # AIPerf 0.13.0 underneath
    aiperf profile --model MODEL --url http://ROUTER:8000 --endpoint-type chat --streaming \\
        --input-file semianalysis_claude_code.jsonl --custom-dataset-type mooncake_trace \\
        --session-header X-Session-ID --benchmark-duration 900

Answers are shaped by structured outputs (a closed word list) so that the resent history
re-tokenizes to the tokens D generated; the round-trip rate per arm says how often it did.

    python benchmarks/agent_load.py [--quick] [--arms plain,kvlease-device] [--n 2,4,8] [--duration 120]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(HERE), str(ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _agent_sessions as S  # noqa: E402
import _report_agents as RA  # noqa: E402
from _agent_replay import Progress, _replay  # noqa: E402
from _report_agents import print_table  # noqa: E402  (run.py calls ``agent_load.print_table``)

MODEL = "tiny"
#: vLLM CPU's KV block (tokens); D's block count below is in these.
BLOCK_TOKENS = 128
#: The host arena of the ``auto`` / ``host`` arms (bytes).
HOST_ARENA_BYTES = 64 << 20
#: TTFT p90 target of "supported sessions" (seconds, this CPU stack).
TTFT_TARGET_S = 1.5
#: D's TTL, every arm (upstream: the fixed ``decoder_kv_blocks_ttl``; kvlease: the lease TTL the
#: SDK's heartbeats renew). The router's lease is D's TTL less its 5 s margin, and the SDK's keeper
#: renews at 60 % of the router's: 60 s gives a 33 s renewal period, far above any stall of a
#: loaded 2-core machine (at 6 s the router's lease was 1 s and renewals came every 0.6 s, so a
#: 0.4 s stall expired it). Scaled gaps (x 0.25 / x 0.1) keep most turns inside it for upstream.
TTL_S = 60.0
#: The SDK keeper's renewal period as a share of the router's lease (``kvlease._renewal``).
RENEW_FRACTION = 0.6
#: The router's margin below D's TTL (``RouterSettings.ttl_margin``).
ROUTER_TTL_MARGIN_S = 5.0


@dataclass(frozen=True)
class Arm:
    name: str
    connector: str  # "kvlease" | "nixl"
    bidir: bool
    kvlease: dict[str, Any] = field(default_factory=dict)
    sdk: bool = False
    what: str = ""
    #: Streamed turns (TTFT measured at the first token); else TTFT is estimated (module doc).
    stream: bool = True


ARMS: tuple[Arm, ...] = (
    Arm("plain", "nixl", False, what="P: NixlConnector, D: NixlConnector (P->D only, no retention)"),
    Arm(
        "upstream",
        "nixl",
        True,
        what="P/D: NixlConnector, bidirectional_kv_xfer, D fixed TTL; non-streamed turns, TTFT estimated",
        stream=False,
    ),
    Arm(
        "kvlease-device",
        "kvlease",
        True,
        {"placement": "device"},
        sdk=True,
        what="P/D: KVLeaseConnector, leases in D's KV cache, SDK heartbeats",
    ),
    Arm(
        "kvlease-auto",
        "kvlease",
        True,
        {"placement": "auto", "host_arena_bytes": HOST_ARENA_BYTES},
        sdk=True,
        what="P/D: KVLeaseConnector, leases written through to a host arena at finish, D's blocks given back (HBM a cache: pulls read the intact device copy, else the arena)",
    ),
    Arm(
        "kvlease-host",
        "kvlease",
        True,
        {"placement": "host", "host_arena_bytes": HOST_ARENA_BYTES},
        sdk=True,
        what="P/D: KVLeaseConnector, leases written through to a host arena at finish, pulls always from the arena",
    ),
)
QUICK_ARMS = ("upstream", "kvlease-device")


@dataclass(frozen=True)
class Plan:
    arms: tuple[Arm, ...]
    ns: tuple[int, ...]
    duration_s: float
    gap_scale: float  # recorded delays x this
    ttl_s: float  # D's TTL (upstream's fixed TTL; kvlease's lease TTL, renewed by heartbeats)
    d_blocks: int
    sizing: str


def size_d(sessions: list[S.Session], ns: tuple[int, ...]) -> tuple[int, str]:
    """D's KV blocks: room for three of the longest prompts at once (no turn is ever too long for
    D), plus what the mean session holds between turns at the sweep's middle N, halved: from that N
    up, retention and the running batch compete for the same blocks."""
    lengths = []
    for s in sessions:
        total = 0
        for t in s.turns:
            total += t.input_tokens + t.output_tokens
            lengths.append(total)
    longest = max(lengths)
    mean_hist = sum(lengths) / len(lengths)
    per_long = math.ceil((longest + 64) / BLOCK_TOKENS)
    per_session = math.ceil(mean_hist / BLOCK_TOKENS)
    mid = ns[len(ns) // 2]
    blocks = 3 * per_long + (mid * per_session) // 2
    why = (
        f"D: {blocks} KV blocks of {BLOCK_TOKENS} tokens (--num-gpu-blocks-override): 3 x the longest "
        f"prompt ({longest} tokens, {per_long} blocks) + half of what {mid} sessions hold between turns "
        f"({per_session} blocks each, mean history {mean_hist:.0f} tokens): from N~{mid} up, retained "
        "blocks compete with the running batch"
    )
    return blocks, why


def make_plan(quick: bool, arms: str | None, ns: str | None, duration: float | None) -> Plan:
    sessions = S.load_sessions()
    names = (
        [a.strip() for a in arms.split(",")]
        if arms
        else list(QUICK_ARMS if quick else [a.name for a in ARMS])
    )
    by = {a.name: a for a in ARMS}
    bad = [n for n in names if n not in by]
    if bad:
        raise ValueError(f"unknown arm(s) {bad}; known: {list(by)}")
    sweep = tuple(int(x) for x in ns.split(",")) if ns else ((4,) if quick else (2, 4))
    blocks, why = size_d(sessions, sweep)
    return Plan(
        arms=tuple(by[n] for n in names),
        ns=sweep,
        duration_s=duration or 60.0,
        gap_scale=0.1 if quick else 0.25,
        ttl_s=TTL_S,
        d_blocks=blocks,
        sizing=why,
    )


def _spec(arm: Arm, plan: Plan) -> Any:
    from kvlease_stack import StackSpec, default_dtype

    return StackSpec(
        model=MODEL,
        connector=arm.connector,
        bidir=arm.bidir,
        ttl=plan.ttl_s,
        kvlease=arm.kvlease,
        prefix_caching=True,
        dtype=default_dtype(),
        decode_args=("--num-gpu-blocks-override", str(plan.d_blocks)),
    )


def _budgets(arm: Arm, plan: Plan) -> str:
    d = f"D KV {plan.d_blocks} blocks x {BLOCK_TOKENS} tokens"
    if arm.kvlease.get("host_arena_bytes"):
        d += f", host arena {arm.kvlease['host_arena_bytes'] >> 20} MiB"
    if not arm.bidir:
        return d
    return d + f", TTL {plan.ttl_s:g} s" + (" (fixed)" if not arm.sdk else " (renewed by heartbeats)")


def run_arm(arm: Arm, plan: Plan, sessions: list[S.Session], progress: Progress) -> dict[str, Any]:
    from kvlease_stack import Stack
    from kvlease_stack.demo import router_process

    res: dict[str, Any] = {
        "connectors": arm.what,
        "budgets": _budgets(arm, plan),
        "kvlease": arm.kvlease,
        "by_n": {},
    }
    progress.say(f"{arm.name}: starting the stack ({arm.what})", 90)
    try:
        stack = Stack.start(_spec(arm, plan), timeout=420)
    except Exception as e:  # the arm's stack refused (e.g. a key this connector does not know)
        res["not_run"] = f"{type(e).__name__}: {str(e)[-600:]}"
        progress.say(f"{arm.name}: not run: {res['not_run'][:160]}")
        return res
    try:
        # stock-vLLM mode: the router cannot ask D its TTL (/v1/models does not say), so tell it
        args = [] if arm.connector == "kvlease" else ["--node-ttl", f"{plan.ttl_s:g}"]
        with stack, router_process(stack, extra_args=args) as router:
            for n in plan.ns:
                progress.say(f"{arm.name}: N={n} replay ({plan.duration_s:g} s)", plan.duration_s)
                r = asyncio.run(_replay(arm, stack, router, sessions, n, plan))
                res["by_n"][str(n)] = r
                print(f"  {arm.name} N={n}: {RA.run_line(r)}", flush=True)
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {str(e)[-600:]}"
    p90 = {int(n): r["ttft_s"]["p90"] for n, r in res["by_n"].items()}
    res["supported_sessions"] = S.supported_sessions(p90, TTFT_TARGET_S)
    return res


def settings_line(plan: Plan) -> str:
    router = plan.ttl_s - ROUTER_TTL_MARGIN_S
    return (
        f"Settings, every arm: N {','.join(map(str, plan.ns))}, {plan.duration_s:g} s per N, recorded gaps "
        f"x {plan.gap_scale:g}; D's TTL {plan.ttl_s:g} s (upstream: fixed decoder_kv_blocks_ttl; kvlease: "
        f"lease TTL); router lease {router:g} s (D's less {ROUTER_TTL_MARGIN_S:g} s; stock mode told "
        f"--node-ttl); SDK keeper renews every {RENEW_FRACTION * router:g} s (kvlease arms, heartbeats on); "
        f"host arena {HOST_ARENA_BYTES >> 20} MiB per worker (auto/host)"
    )


def run(
    quick: bool = False, arms: str | None = None, ns: str | None = None, duration: float | None = None
) -> dict[str, Any]:
    plan = make_plan(quick, arms, ns, duration)
    sessions = S.load_sessions()
    print(plan.sizing, flush=True)
    print(settings_line(plan), flush=True)
    total = len(plan.arms) * (90 + len(plan.ns) * plan.duration_s)
    progress = Progress(total)
    out: dict[str, Any] = {
        "model": MODEL,
        "sessions_file": "benchmarks/data/agent_sessions.jsonl (AIPerf 0.13.0 agentic-code synthesizer)",
        "sessions": len(sessions),
        "ns": list(plan.ns),
        "duration_s": plan.duration_s,
        "gap_scale": plan.gap_scale,
        "gap_note": (
            f"recorded think/tool delays x {plan.gap_scale:g} (buckets by recorded gap)"
            if plan.gap_scale != 1
            else "recorded delays"
        ),
        "ttl_s": plan.ttl_s,
        "settings": settings_line(plan),
        "d_blocks": plan.d_blocks,
        "d_sizing": plan.sizing,
        "ttft_target_s": TTFT_TARGET_S,
        "replay": "light asyncio client in the benchmark process (AIPerf generated the sessions, does not drive the stack)",
        "arms": {},
    }
    for arm in plan.arms:
        out["arms"][arm.name] = run_arm(arm, plan, sessions, progress)
    progress.say("done")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help=f"arms {','.join(QUICK_ARMS)}, N=4, 60 s, gaps x 0.1"
    )
    ap.add_argument("--arms", help=f"comma-separated, of {','.join(a.name for a in ARMS)}")
    ap.add_argument("--n", help="comma-separated live-session counts (the sweep)")
    ap.add_argument("--duration", type=float, help="run length per N (s)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    a = ap.parse_args()
    res = run(quick=a.quick, arms=a.arms, ns=a.n, duration=a.duration)
    print_table(res)
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
