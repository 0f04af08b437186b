"""``kvlease plan`` replay speed: turns per minute on one core for one policy and one cap.

Generates a seeded agent trace with tool pauses (``kvlease._analyze._synth.agent_trace``, about 1M
turns; ``--quick`` about 100k), writes it as a request log, then measures on this process's one
core (CPU time, steadier on a busy machine, and wall time):

* ``replay``: the sans-IO replay alone (``_plan.replay``), for the fixed TTL, uncapped leases and
  leases under a cap of a quarter of their uncapped need (evictions on the hot path);
* ``end_to_end``: reading the log through the analyzer's readers, sorting (``prepare``) and one
  capped replay: what ``kvlease plan --cap X --points 0`` costs per policy.

* ``cluster``: the session-level simulator (``kvlease plan --cluster``): a generated trace of 100k
  agent sessions (``--quick``: 10k) grouped into sessions (``_cluster.build_sessions``) and
  simulated under each of the five policies at the trace's own load, 8 P and 8 D nodes of the
  8B class, one after the other in this process (CPU and wall per policy), then the five in 2
  processes (``plan_cluster`` with a process pool, as ``kvlease plan --cluster`` runs them on large
  traces); then the sessions-per-decode-node sweep of one policy.

Goals: >= 1M turns/min for one policy/cap; the 100k-session trace simulated (all five policies)
in under 60 s. Run: ``python benchmarks/plan_speed.py [--quick] [--cluster-only]``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from kvlease._analyze._cluster import SOURCES, SimPolicy, build_sessions, simulate
from kvlease._analyze._cluster_costs import cluster_config
from kvlease._analyze._cluster_report import capacity, plan_cluster
from kvlease._analyze._plan import PRESETS, prepare, replay
from kvlease._analyze._plan_api import read_turns
from kvlease._analyze._synth import agent_trace, write_requests

GOAL_TURNS_PER_MIN = 1_000_000
NODES = 8
CLUSTER_SESSIONS = 100_000
GOAL_CLUSTER_S = 60.0
JOBS = 2


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


def run_cluster(sessions: int = CLUSTER_SESSIONS) -> dict[str, Any]:
    """Simulate ``sessions`` generated agent sessions under every policy; time it (CPU and wall)."""
    cfg = cluster_config("8b", p_nodes=NODES, d_nodes=NODES)
    rows = agent_trace(sessions, seed=1)
    w0, c0 = time.perf_counter(), time.process_time()
    trace = build_sessions(rows, cfg.decode_tps.value)
    del rows
    build_cpu = time.process_time() - c0
    policies: dict[str, Any] = {}
    for pol in SimPolicy:
        r, wall, cpu = _timed(partial(simulate, trace, cfg, pol))
        policies[pol.value] = {
            "cpu_s": round(cpu, 2),
            "wall_s": round(wall, 2),
            "ttft_p50_p90_p99_s": [round(r.ttft_at(q) or 0.0, 3) for q in (0.5, 0.9, 0.99)],
            "sources": dict(zip(SOURCES, r.sources)),
        }
    total_wall, total_cpu = time.perf_counter() - w0, time.process_time() - c0
    with ProcessPoolExecutor(max_workers=JOBS) as pool:
        _, par_wall, _ = _timed(lambda: plan_cluster(trace, cfg, sweep=False, map_fn=pool.map))
    cap, sweep_wall, sweep_cpu = _timed(partial(capacity, trace, cfg, SimPolicy.LEASE))
    return {
        "sessions": trace.sessions,
        "turns": trace.turns,
        "nodes": f"{NODES} P + {NODES} D, 8b class",
        "build_cpu_s": round(build_cpu, 2),
        "policies": policies,
        "all_policies_cpu_s": round(total_cpu, 1),
        "all_policies_wall_s": round(total_wall, 1),
        "all_policies_wall_s_2_processes": round(par_wall, 1),
        "lease_sweep": {
            "sessions_per_d_node": cap.sessions,
            "points": len(cap.points),
            "cpu_s": round(sweep_cpu, 1),
            "wall_s": round(sweep_wall, 1),
        },
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "goal_s": GOAL_CLUSTER_S,
        "goal_met": min(total_wall, par_wall) < GOAL_CLUSTER_S,
    }


def print_cluster(res: dict[str, Any]) -> None:
    print(json.dumps(res, indent=2))
    print(
        f"\n{res['sessions']:,} sessions, {res['turns']:,} turns, {res['nodes']}: five policies simulated in "
        f"{res['all_policies_wall_s']} s wall ({res['all_policies_cpu_s']} s CPU) in one process, "
        f"{res['all_policies_wall_s_2_processes']} s wall in {JOBS} (kvlease plan --cluster's default on "
        f"large traces), load {res['load_avg_1m']}; "
        f"goal {res['goal_s']:.0f} s: {'met' if res['goal_met'] else 'NOT met'}."
    )


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
    ap.add_argument("--cluster-only", action="store_true", help="only the cluster simulator")
    args = ap.parse_args(argv)
    if not args.cluster_only:
        print_table(run(quick=args.quick, conversations=args.conversations))
    print_cluster(run_cluster(CLUSTER_SESSIONS // 10 if args.quick else CLUSTER_SESSIONS))


if __name__ == "__main__":
    main()
