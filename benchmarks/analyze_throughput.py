"""``kvlease analyze`` throughput and peak memory on a generated request log.

Generates a seeded request log (``conversations`` interleaved agent conversations, timestamps in
order, ~100 bytes a line), then runs the analyzer in fresh subprocesses and prints:

* ``lines_per_s`` (wall clock) and ``lines_per_cpu_s`` (process CPU time, steadier on a busy machine)
  with orjson, and with the standard library's json (orjson blocked, the real fallback path);
* ``peak_rss_mib`` of the analysing process, for the log and for a log twice as long with the same
  conversations: memory should depend on the conversations, not on the file size;
* ``tracemalloc_peak_mib``: peak Python allocations during the analysis of the log;
* the same with ``reorder_window=0`` (input known to be sorted per conversation): the window's
  pending turns are most of the per-conversation state.

Goal: >= 200k lines/s; memory independent of file size beyond the per-conversation state.
Run: ``python benchmarks/analyze_throughput.py [--quick] [--lines N] [--conversations C]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvlease._analyze._model import DEFAULT_REORDER_WINDOW

GOAL_LINES_PER_S = 200_000

_CHILD = r"""
import json, resource, sys, time
if sys.argv[2] == "json":
    import importlib.abc
    class _NoOrjson(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "orjson":
                raise ImportError("blocked: measuring the json fallback")
    sys.meta_path.insert(0, _NoOrjson())
trace = sys.argv[3] == "trace"
if trace:
    import tracemalloc
from kvlease._analyze import analyze
from kvlease._analyze._formats import JSON_BACKEND
base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if trace:
    tracemalloc.start()
t0, c0 = time.perf_counter(), time.process_time()
report = analyze(sys.argv[1], reorder_window=int(sys.argv[4]))
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
peak = tracemalloc.get_traced_memory()[1] if trace else None
print(json.dumps({
    "backend": JSON_BACKEND, "lines": report.input.lines, "conversations": report.conversations,
    "wall_s": wall, "cpu_s": cpu, "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    "import_rss_kib": base_rss, "tracemalloc_peak": peak,
    "share_lower_bound": report.repeated_share_lower_bound,
}))
"""


def generate_log(path: Path, lines: int, conversations: int, seed: int = 1) -> int:
    """Write a request log: each line a turn of a random conversation, prompts growing per turn."""
    rng = random.Random(seed)
    prompts = [rng.randint(500, 4000) for _ in range(conversations)]
    t = 1_760_000_000.0
    out: list[str] = []
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(lines):
            c = rng.randrange(conversations)
            prompts[c] += rng.randint(50, 800)
            t += rng.expovariate(50.0)
            out.append(
                f'{{"conversation_id": "conv-{c:06d}", "ts": {t:.3f}, "prompt_tokens": {prompts[c]}, '
                f'"completion_tokens": {rng.randint(10, 500)}}}\n'
            )
            if len(out) >= 50_000:
                f.write("".join(out))
                out.clear()
        f.write("".join(out))
    return path.stat().st_size


def _measure(
    path: Path, backend: str, trace: bool = False, window: int = DEFAULT_REORDER_WINDOW
) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), backend, "trace" if trace else "-", str(window)],
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    data: dict[str, Any] = json.loads(proc.stdout)
    return data


def run(quick: bool = False, lines: int | None = None, conversations: int | None = None) -> dict[str, Any]:
    n = lines or (100_000 if quick else 1_000_000)
    convs = conversations or (5_000 if quick else 50_000)
    with tempfile.TemporaryDirectory() as tmp:
        log, log2 = Path(tmp) / "log.jsonl", Path(tmp) / "log2.jsonl"
        t0 = time.perf_counter()
        size = generate_log(log, n, convs)
        size2 = generate_log(log2, 2 * n, convs)
        gen_s = time.perf_counter() - t0
        fast = _measure(log, "orjson")
        slow = _measure(log, "json")
        double = _measure(log2, "orjson")
        traced = _measure(log, "orjson", trace=True)
        no_window = _measure(log, "orjson", window=0)
        no_window_traced = _measure(log, "orjson", trace=True, window=0)
    result = {
        "lines": n,
        "conversations": convs,
        "file_mib": round(size / 2**20, 1),
        "file2_mib": round(size2 / 2**20, 1),
        "generate_s": round(gen_s, 1),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "orjson": {
            "backend": fast["backend"],
            "lines_per_s": round(n / fast["wall_s"]),
            "lines_per_cpu_s": round(n / fast["cpu_s"]),
        },
        "json": {
            "backend": slow["backend"],
            "lines_per_s": round(n / slow["wall_s"]),
            "lines_per_cpu_s": round(n / slow["cpu_s"]),
        },
        "reorder_window": DEFAULT_REORDER_WINDOW,
        "orjson_window_0": {
            "lines_per_s": round(n / no_window["wall_s"]),
            "peak_rss_mib": round(no_window["peak_rss_kib"] / 1024, 1),
            "tracemalloc_bytes_per_conversation": round(no_window_traced["tracemalloc_peak"] / convs),
        },
        "peak_rss_mib": round(fast["peak_rss_kib"] / 1024, 1),
        "peak_rss_mib_2x_lines": round(double["peak_rss_kib"] / 1024, 1),
        "import_rss_mib": round(fast["import_rss_kib"] / 1024, 1),
        "tracemalloc_peak_mib": round(traced["tracemalloc_peak"] / 2**20, 1),
        "tracemalloc_bytes_per_conversation": round(traced["tracemalloc_peak"] / convs),
        "goal_lines_per_s": GOAL_LINES_PER_S,
        "share_lower_bound": fast["share_lower_bound"],
    }
    result["goal_met"] = result["orjson"]["lines_per_s"] >= GOAL_LINES_PER_S
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="100k lines, 5k conversations")
    ap.add_argument("--lines", type=int, default=None)
    ap.add_argument("--conversations", type=int, default=None)
    args = ap.parse_args(argv)
    res = run(quick=args.quick, lines=args.lines, conversations=args.conversations)
    print(json.dumps(res, indent=2))
    o, j = res["orjson"], res["json"]
    print(
        f"\n{res['lines']:,} lines ({res['file_mib']} MiB), {res['conversations']:,} conversations: "
        f"{o['lines_per_s']:,} lines/s wall, {o['lines_per_cpu_s']:,} lines/CPU-s with {o['backend']}; "
        f"{j['lines_per_s']:,} lines/s with {j['backend']}. Peak RSS {res['peak_rss_mib']} MiB "
        f"({res['peak_rss_mib_2x_lines']} MiB for twice the lines, {res['import_rss_mib']} MiB after "
        f"import); tracemalloc peak {res['tracemalloc_peak_mib']} MiB. Load average {res['load_avg_1m']} "
        f"on {res['cpu_count']} CPUs."
    )


if __name__ == "__main__":
    main()
