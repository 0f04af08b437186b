"""``kvlease plan`` replay speed: turns per minute on one core for one policy and one cap.

Generates a seeded agent trace with tool pauses (``kvlease._analyze._synth.agent_trace``, about 1M
turns; ``--quick`` about 100k), writes it as a request log, then measures on this process's one
core (CPU time, steadier on a busy machine, and wall time):

* ``replay``: the sans-IO replay alone (``_plan.replay``), for the fixed TTL, uncapped leases and
  leases under a cap of a quarter of their uncapped need (evictions on the hot path);
* ``end_to_end``: reading the log through the analyzer's readers, sorting (``prepare``) and one
  capped replay: what ``kvlease plan --cap X --points 0`` costs per policy.

Goal: >= 1M turns/min for one policy/cap. Run: ``python benchmarks/plan_speed.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from kvlease._analyze._plan import PRESETS, prepare, replay
from kvlease._analyze._plan_api import read_turns
from kvlease._analyze._synth import agent_trace, write_requests

GOAL_TURNS_PER_MIN = 1_000_000
NODES = 8


def _timed(fn: Any) -> tuple[Any, float, float]:
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w0, time.process_time() - c0


def run(quick: bool = False, conversations: int | None = None) -> dict[str, Any]:
    convs = conversations or (9_000 if quick else 90_000)
    bpt = PRESETS["llama-3.1-8b"].bytes_per_token
    rows, gen_s, _ = _timed(lambda: agent_trace(convs, seed=1))
    trace, _, prep_cpu = _timed(lambda: prepare(rows))
    n = trace.turns
    lease = replay(trace, "lease", 1800, bytes_per_token=bpt, nodes=NODES)
    cap = max(1, lease.peak_bytes // 4)
    replays: dict[str, Any] = {}
    for name, policy, retention, c in (
        ("ttl", "ttl", 480.0, None),
        ("lease", "lease", 1800.0, None),
        ("lease_capped", "lease", 1800.0, cap),
    ):
        one = partial(replay, trace, policy, retention, bytes_per_token=bpt, nodes=NODES, cap_bytes=c)
        res, wall, cpu = _timed(one)
        replays[name] = {
            "turns_per_min_cpu": round(n / cpu * 60),
            "turns_per_min_wall": round(n / wall * 60),
            "hit_rate": round(res.hit_rate or 0.0, 4),
            "evictions": res.evictions,
        }
    with tempfile.TemporaryDirectory() as tmp:
        log = write_requests(rows, Path(tmp) / "trace.jsonl")
        size = log.stat().st_size

        def end_to_end() -> Any:
            turns, _ = read_turns(log)
            return replay(prepare(turns), "lease", 1800, bytes_per_token=bpt, nodes=NODES, cap_bytes=cap)

        _, e2e_wall, e2e_cpu = _timed(end_to_end)
    slowest = min(r["turns_per_min_cpu"] for r in replays.values())
    return {
        "turns": n,
        "conversations": convs,
        "nodes": NODES,
        "file_mib": round(size / 2**20, 1),
        "generate_s": round(gen_s, 1),
        "prepare_turns_per_min_cpu": round(n / prep_cpu * 60),
        "replay": replays,
        "end_to_end": {
            "turns_per_min_cpu": round(n / e2e_cpu * 60),
            "turns_per_min_wall": round(n / e2e_wall * 60),
        },
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "goal_turns_per_min": GOAL_TURNS_PER_MIN,
        "slowest_replay_turns_per_min_cpu": slowest,
        "goal_met": slowest >= GOAL_TURNS_PER_MIN and n / e2e_cpu * 60 >= GOAL_TURNS_PER_MIN,
    }


def print_table(res: dict[str, Any]) -> None:
    print(json.dumps(res, indent=2))
    print(
        f"\n{res['turns']:,} turns, {res['conversations']:,} conversations, {res['nodes']} nodes: replay "
        + ", ".join(f"{k} {v['turns_per_min_cpu']:,}/min" for k, v in res["replay"].items())
        + f" (CPU); end to end (read + sort + one capped replay) {res['end_to_end']['turns_per_min_cpu']:,}"
        f" turns/min. Goal {res['goal_turns_per_min']:,}/min: {'met' if res['goal_met'] else 'NOT met'}."
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="about 100k turns")
    ap.add_argument("--conversations", type=int, default=None)
    args = ap.parse_args(argv)
    print_table(run(quick=args.quick, conversations=args.conversations))


if __name__ == "__main__":
    main()
