"""Fragmentation of pulls on the real CPU stack: descriptors and block-id runs per pull.

Runs the trace benchmark's agents (``trace_replay``: concurrent conversations with tool pauses,
kvlease with heartbeats) through the router on a real vLLM P/D pair, then reads the connector's
histograms ``kvlease_pull_descriptors`` and ``kvlease_pull_block_runs`` from each node's control
endpoint ``/metrics`` (pulls are counted on the node that reads, P). One contiguous run per side
lets NIXL merge a pull into one READ per KV region; the per-block cost is ~3 µs per descriptor.

    python benchmarks/fragmentation.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: result field -> (histogram, labels) of the connector's metrics (``kvlease_vllm._metrics``)
HISTOGRAMS: dict[str, tuple[str, dict[str, str]]] = {
    "descriptors": ("kvlease_pull_descriptors", {}),
    "local_runs": ("kvlease_pull_block_runs", {"side": "local"}),
    "remote_runs": ("kvlease_pull_block_runs", {"side": "remote"}),
}


def histogram(metrics: Any, name: str, **labels: str) -> dict[str, Any]:
    """One histogram of parsed ``/metrics`` pages: count, mean and its cumulative buckets."""
    count = metrics.total(f"{name}_count", **labels)
    total = metrics.total(f"{name}_sum", **labels)
    bounds = sorted(
        {k.split('le="', 1)[1].split('"', 1)[0] for k in metrics if k.startswith(f"{name}_bucket")},
        key=lambda le: float("inf") if le == "+Inf" else float(le),
    )
    buckets = {le: metrics.total(f"{name}_bucket", le=le, **labels) for le in bounds}
    return {"pulls": int(count), "mean": total / count if count else None, "cumulative_buckets": buckets}


def run(quick: bool = False) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import trace_replay as tr

    from kvlease.protocol import CONTROL_AUTH_HEADER, CONTROL_METRICS_PATH
    from kvlease_stack import Metrics, Stack, StackSpec, default_dtype, parse_prometheus
    from kvlease_stack.demo import router_process

    plans = tr.make_trace(8 if quick else 20)
    load_before = _uptime()
    spec = StackSpec(model="small", ttl=tr.D_TTL, prefix_caching=False, dtype=default_dtype())
    with Stack.start(spec, timeout=600) as stack, router_process(stack) as router:
        asyncio.run(tr._arm(router, stack.model_name, plans, "heartbeats"))
        merged = Metrics()
        for node in (stack.prefill, stack.decode):
            if node.control is None:
                continue
            # the control endpoint's /metrics needs the control secret
            req = urllib.request.Request(
                node.control + CONTROL_METRICS_PATH,
                headers={CONTROL_AUTH_HEADER: f"Bearer {stack.control_secret}"},
            )
            with urllib.request.urlopen(req, timeout=30) as resp:
                for key, value in parse_prometheus(resp.read().decode()).items():
                    merged[key] = merged.get(key, 0.0) + value
    out: dict[str, Any] = {
        "conversations": len(plans),
        "arm": "heartbeats",
        "uptime_before": load_before,
        "uptime_after": _uptime(),
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
    }
    for field, (name, labels) in HISTOGRAMS.items():
        out[field] = histogram(merged, name, **labels)
    return out


def _uptime() -> str:
    """``uptime``'s line (the machine's load: the stack shares its 2 cores with other work)."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def print_table(res: dict[str, Any]) -> None:
    print(f"\n{res['conversations']} conversations ({res['arm']}): per pull")
    print(f"uptime before: {res.get('uptime_before')}\nuptime after:  {res.get('uptime_after')}")
    for field in HISTOGRAMS:
        h = res[field]
        mean = "n/a" if h["mean"] is None else f"{h['mean']:.1f}"
        print(
            f"{field:<12} pulls {h['pulls']:>5}  mean {mean:>10}  buckets {json.dumps(h['cumulative_buckets'])}"
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
