"""Lease keeper at scale: 10,000 open conversations on one wrapped client.

Each conversation is opened with ``kc.conversation()`` and has one real turn against the fake
OpenAI-compatible router (its own process, ``tests/fakes/openai_server.py``), which grants a lease
with a short TTL so several renewal periods pass quickly. Then the keeper's background thread runs
alone for a few periods. Figures: renew requests per period (goal: one per router), ids per
request, the time of one renewal round of all conversations, and the client's memory for the open
conversations (tracemalloc, Python allocations that stay alive; and the RSS growth). Goal: <= 50 MB.

Run: ``python benchmarks/lease_keeper_scale.py [--quick]``; importable: ``run(quick) -> dict``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from openai import OpenAI
from sdk_overhead import fake_server_process

import kvlease

TTL_S = 4.0  # renewals every 0.6 * TTL = 2.4 s
PERIODS = 3


def _rss_mb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def run(quick: bool = False) -> dict[str, Any]:
    n = 1_000 if quick else 10_000
    out: dict[str, Any] = {"conversations": n, "ttl_s": TTL_S}
    with fake_server_process("--ttl", str(TTL_S), "--content", "ok") as base_url:
        raw = OpenAI(base_url=base_url, api_key="k", max_retries=2)
        gc.collect()
        rss0 = _rss_mb()
        tracemalloc.start()
        base, _ = tracemalloc.get_traced_memory()
        kc = kvlease.wrap(raw, heartbeat=True)
        t0 = time.perf_counter()
        convs = []
        for i in range(n):
            conv = kc.conversation(id=f"conv-{i:05d}")
            conv.chat.completions.create(model="m", messages=[{"role": "user", "content": f"task {i}"}])
            convs.append(conv)
        out["setup_s"] = round(time.perf_counter() - t0, 2)
        gc.collect()
        current, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rss1 = _rss_mb()
        out["client_memory_mb_tracemalloc"] = round((current - base) / 2**20, 2)
        out["bytes_per_conversation"] = round((current - base) / n)
        out["client_rss_growth_mb"] = None if rss0 is None or rss1 is None else round(rss1 - rss0, 1)
        assert len(kc.keeper) == n, "every conversation must hold a lease"

        period = 0.6 * TTL_S
        r0 = kc.keeper.renew_requests
        time.sleep(PERIODS * period + 0.3)
        r1 = kc.keeper.renew_requests
        out["renew_period_s"] = period
        out["renew_requests_in_window"] = r1 - r0
        out["renew_requests_per_period"] = round((r1 - r0) / PERIODS, 2)
        out["conversations_still_leased"] = len(kc.keeper)
        out["renew_failures"] = kc.keeper.renew_failures

        t1 = time.perf_counter()
        kc.keeper.renew_now()
        out["one_round_all_ids_ms"] = round((time.perf_counter() - t1) * 1e3, 1)
        out["ids_per_request"] = min(n, kvlease.protocol.RENEW_MAX_IDS)
        t2 = time.perf_counter()
        kc.close()
        out["close_release_all_s"] = round(time.perf_counter() - t2, 2)
        raw.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,000 conversations instead of 10,000")
    args = parser.parse_args()
    r = run(quick=args.quick)
    print(
        f"Lease keeper with {r['conversations']:,} open conversations (TTL {r['ttl_s']} s, renew every {r['renew_period_s']} s)"
    )
    print(
        f"  renew requests per period: {r['renew_requests_per_period']} "
        f"({r['renew_requests_in_window']} in {PERIODS} periods, {r['ids_per_request']:,} ids each, "
        f"{r['renew_failures']} failed); still leased: {r['conversations_still_leased']:,}"
    )
    print(f"  one renewal round of all ids: {r['one_round_all_ids_ms']} ms")
    print(
        f"  client memory for the open conversations: {r['client_memory_mb_tracemalloc']} MB (tracemalloc, "
        f"{r['bytes_per_conversation']} B each); RSS growth {r['client_rss_growth_mb']} MB"
    )
    print(f"  setup (one turn each): {r['setup_s']} s; close (release all): {r['close_release_all_s']} s")


if __name__ == "__main__":
    main()
