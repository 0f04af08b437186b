"""One entry point for every kvlease benchmark: runs them, prints their tables, writes JSON and
regenerates ``benchmarks/RESULTS.md`` and its plots (figures are re-measured, never edited by hand).

    python benchmarks/run.py                    # everything (the real-stack ones take minutes)
    python benchmarks/run.py sdk router --quick # a selection, shorter runs
    python benchmarks/run.py --report-only      # render RESULTS.md + PNGs from results.json only

Each benchmark module exposes ``run(quick: bool) -> dict`` and may expose ``print_table(result)``.
Results are merged into ``benchmarks/results.json`` so a partial run updates only its sections.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

#: name -> (module, what it measures, needs the real vLLM stack)
BENCHMARKS: dict[str, tuple[str, str, bool]] = {
    "sdk": ("sdk_overhead", "SDK per-call overhead vs the raw openai client (fake server)", False),
    "keeper": ("lease_keeper_scale", "Lease keeper with 10,000 open conversations", False),
    "router": (
        "router_overhead",
        "Router added latency and throughput vs direct and a FastAPI+httpx proxy",
        False,
    ),
    "soak": (
        "soak",
        "Soak: 2 rounds of 1,000 conversations x 5 turns with mid-stream hang-ups (fake P/D)",
        False,
    ),
    "hostile": (
        "hostile_load",
        "Hostile load: a legit tenant's turn latency and reuse under renew floods, slow clients, "
        "stalled streams and garbage (fake P/D, Redis state)",
        False,
    ),
    "analyze": ("analyze_throughput", "Analyzer throughput and memory on a generated log", False),
    "plan": (
        "plan_speed",
        "Capacity planner: replay turns per minute on one core (generated agent trace)",
        False,
    ),
    "renew": ("renew_cost", "Router CPU per 10,000-id renew (unknown ids; live leases)", False),
    "plugin": ("bench_plugin_stream", "vLLM plugin: streaming overhead (stand-in stream generator)", False),
    "ttft": ("turn_ttft", "Turn-2 prefill time: kvlease pull vs recompute vs upstream pull", True),
    "trace": ("trace_replay", "Trace replay with tool pauses: reuse share and TTFT, three arms", True),
    "fragmentation": (
        "fragmentation",
        "Pull fragmentation under the trace's agents: descriptors and block-id runs",
        True,
    ),
    "agents": (
        "agent_load",
        "Agent sessions at equal load: plain P/D, upstream NixlConnector, kvlease",
        True,
    ),
    "cluster": (
        "plan_cluster",
        "Agent sessions at cluster scale, simulated (kvlease plan --cluster): five policies at equal load",
        False,
    ),
}


def machine() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory": mem,
        "python": platform.python_version(),
        "os": platform.platform(terse=True),
    }


def _report() -> Any:
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    return importlib.import_module("_report")


def _layout() -> dict[str, Any]:
    return {
        "titles": {name: spec[1] for name, spec in BENCHMARKS.items()},
        "real_stack": {name for name, spec in BENCHMARKS.items() if spec[2]},
    }


def write_markdown(results: dict[str, Any]) -> str:
    """RESULTS.md for ``results`` (tables; :func:`write_report` also draws the plots)."""
    return str(_report().render_markdown(results, **_layout()))


def write_report(results: dict[str, Any]) -> None:
    """RESULTS.md and the PNG plots beside it, rendered by ``benchmarks/_report.py``."""
    _report().write_report(results, HERE, **_layout())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help=f"subset of: {', '.join(BENCHMARKS)}")
    ap.add_argument("--quick", action="store_true", help="shorter runs")
    ap.add_argument(
        "--report-only", action="store_true", help="only render RESULTS.md and the plots from results.json"
    )
    ap.add_argument(
        "--no-stack", action="store_true", help="skip the benchmarks that need the real vLLM stack"
    )
    a = ap.parse_args(argv)
    unknown = [n for n in a.names if n not in BENCHMARKS]
    if unknown:
        ap.error(f"unknown benchmark(s): {', '.join(unknown)}")
    names = a.names or [n for n, (_, _, real) in BENCHMARKS.items() if not (a.no_stack and real)]
    sys.path[:0] = [str(HERE), str(ROOT)]
    store = HERE / "results.json"
    results: dict[str, Any] = json.loads(store.read_text()) if store.exists() else {}
    if a.report_only:
        write_report(results)
        return 0
    failed = []
    for name in names:
        module_name, title, _ = BENCHMARKS[name]
        print(f"\n=== {name}: {title}", flush=True)
        mod = importlib.import_module(module_name)
        t0 = time.monotonic()
        try:
            res = mod.run(quick=a.quick)
        except Exception as e:  # report and go on with the others
            print(f"{name} failed: {type(e).__name__}: {e}", flush=True)
            failed.append(name)
            continue
        if hasattr(mod, "print_table"):
            mod.print_table(res)
        else:
            print(json.dumps(res, indent=2, default=str))
        results[name] = {
            "command": f"python benchmarks/run.py {name}" + (" --quick" if a.quick else ""),
            "when": time.strftime("%Y-%m-%d"),
            "machine": machine(),
            "wall_s": time.monotonic() - t0,
            "result": res,
        }
        store.write_text(json.dumps(results, indent=2, default=str) + "\n")
        write_report(results)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
