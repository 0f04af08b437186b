"""Router CPU per renew of 10,000 conversation ids (``POST /v1/kvlease/renew``), in this process.

Drives the router's renew handler directly (the request body as the SDK keeper sends it: one batch
of :data:`kvlease.protocol.RENEW_MAX_IDS` ids) and reads this process's CPU time, so the figure is
the router's own work: parsing and validating the ids, keying them (keyed BLAKE2b), one ``get_many``
on the store, grouping by decode node, folding D's answers, one ``renew_many`` and the answer. Both
stores: the in-memory one (deadlines renewed in place) and, where ``redis-server`` is installed, a
real Redis (records read through one script call, which answers only the 49-byte expiry part of a
record this process remembers; one small MAC per id for its new lease end, written back through one
script call that rewrites only that part: no record is re-serialized or re-sealed; each call's keys
and per-key strings go packed in a few arguments; the redis-py client's work is the router's,
Redis's own CPU is not counted).
aiohttp's HTTP parsing and the decode node's work are not in it (D's control call is a stub that
renews everything). Two cases:

* ``unknown``: 10,000 ids the router has no state for (what an attacker sends);
* ``renewed``: 10,000 live leases, all renewed on one decode node.

Goal (issue 15): <= 20 ms of router CPU per 10,000-id renew.
Run: ``python benchmarks/renew_cost.py [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from kvlease.protocol import RENEW_MAX_IDS, RENEW_PATH, ControlRenewResponse
from kvlease_router import ConversationRecord, MemoryStore, NodeSpec, RouterSettings
from kvlease_router._lease_api import handle_renew
from kvlease_router._runtime import RouterRuntime
from kvlease_router._upstreams import Upstreams
from kvlease_router._validate import ClusterPlan

GOAL_MS = 20.0
CONTROL = "http://127.0.0.1:9"  # never contacted: the control client is a stub


class _Request:
    """What ``handle_renew`` reads of an aiohttp request."""

    transport = None  # no socket: the client address reads as unknown

    def __init__(self, body: bytes, headers: Mapping[str, str]) -> None:
        self._body, self.headers = body, headers

    async def read(self) -> bytes:
        return self._body


class _StubControl:
    async def renew(self, lease_ids: Sequence[str], ttl: float, **_: Any) -> ControlRenewResponse:
        return ControlRenewResponse(dict.fromkeys(lease_ids, ttl))


def _router(store: Any = None) -> RouterRuntime:
    settings = RouterSettings(
        prefill=(NodeSpec("http://127.0.0.1:1", "http://127.0.0.1:8"),),
        decode=(NodeSpec("http://127.0.0.1:2", CONTROL),),
        control_secret="bench",
        key_secret="bench-key",
        renew_ids_per_s=1e12,  # the budgets are not what is measured
        renew_burst_ids=10**12,
        renew_ip_ids_per_s=1e12,
        renew_ip_burst_ids=10**12,
        renew_global_ids_per_s=1e12,
        renew_global_burst_ids=10**12,
    )
    if store is None:
        store = MemoryStore(4 * RENEW_MAX_IDS)
    rt = RouterRuntime(settings, store, Upstreams(settings.prefill, settings.decode))
    rt.plan = ClusterPlan(300.0, 305.0, True, 16, None, None, ())
    rt.control = lambda url: _StubControl()  # type: ignore[method-assign]
    return rt


async def _measure(rt: RouterRuntime, body: bytes, headers: Mapping[str, str], rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        c0 = time.process_time()
        resp = await handle_renew(_Request(body, headers), rt)  # type: ignore[arg-type]
        out.append((time.process_time() - c0) * 1e3)
        assert resp.status == 200, resp.text
    return out


async def _case(rt: RouterRuntime, rounds: int) -> tuple[list[float], list[float]]:
    """(unknown, renewed) CPU ms of each round."""
    n = RENEW_MAX_IDS
    headers = {"Authorization": "Bearer bench-client"}
    ids = [f"conv-{i:06d}" for i in range(n)]
    body = orjson.dumps({"conversation_ids": ids})
    await _measure(rt, body, headers, 2)  # warm up
    unknown = await _measure(rt, body, headers, rounds)
    now = time.time()
    from kvlease_router._identity import tenant_from

    tenant = tenant_from(headers, None)
    decode = CONTROL.replace(":9", ":2")
    await rt.store.put_many(
        [
            (key, ConversationRecord(decode, {"remote_block_ids": [1]}, cid, CONTROL, 64, now + 300), 900)
            for cid, key in zip(ids, rt.keyer.keys(tenant, ids))
        ]
    )
    await _measure(rt, body, headers, 2)  # warm up, as for unknown ids
    renewed = await _measure(rt, body, headers, rounds)
    return unknown, renewed


async def _redis_case(rounds: int) -> tuple[list[float], list[float]] | None:
    """The same on a real ``redis-server`` (``None`` where none is installed)."""
    from kvlease_router._redis_store import RedisStore, redis_client_from_url
    from kvlease_stack.testing._redis import RedisServer

    if not RedisServer.available():
        return None
    server = RedisServer.start()
    try:
        client = redis_client_from_url(server.url, timeout=10.0)
        store = RedisStore(client, secret="bench-key", timeout=10.0)
        try:
            return await _case(_router(store), rounds)
        finally:
            await store.close()
    finally:
        server.stop()


async def _run(quick: bool) -> dict[str, Any]:
    rounds = 5 if quick else 30
    n = RENEW_MAX_IDS
    unknown, renewed = await _case(_router(), rounds)
    redis = await _redis_case(rounds)
    out: dict[str, Any] = {
        "ids_per_renew": n,
        "rounds": rounds,
        "unknown_cpu_ms_p50": round(statistics.median(unknown), 2),
        "unknown_cpu_ms_max": round(max(unknown), 2),
        "renewed_cpu_ms_p50": round(statistics.median(renewed), 2),
        "renewed_cpu_ms_max": round(max(renewed), 2),
        "goal_ms": GOAL_MS,
        "meets_goal": statistics.median(unknown) <= GOAL_MS and statistics.median(renewed) <= GOAL_MS,
        "endpoint": RENEW_PATH,
    }
    if redis is not None:
        r_unknown, r_renewed = redis
        out["redis_unknown_cpu_ms_p50"] = round(statistics.median(r_unknown), 2)
        out["redis_renewed_cpu_ms_p50"] = round(statistics.median(r_renewed), 2)
        out["redis_renewed_cpu_ms_max"] = round(max(r_renewed), 2)
        out["redis_meets_goal"] = max(statistics.median(r_unknown), statistics.median(r_renewed)) <= GOAL_MS
    out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    return out


def run(quick: bool = False) -> dict[str, Any]:
    return asyncio.run(_run(quick))


def print_table(result: dict[str, Any]) -> None:
    print(
        f"router CPU per {result['ids_per_renew']:,}-id renew ({result['rounds']} rounds), goal <= {GOAL_MS} ms"
    )
    print(
        f"  unknown ids : p50 {result['unknown_cpu_ms_p50']:7.2f} ms   max {result['unknown_cpu_ms_max']:7.2f} ms"
    )
    print(
        f"  renewed ids : p50 {result['renewed_cpu_ms_p50']:7.2f} ms   max {result['renewed_cpu_ms_max']:7.2f} ms"
    )
    print(f"  meets goal  : {result['meets_goal']}")
    if "redis_renewed_cpu_ms_p50" in result:
        print(
            f"  redis store : unknown p50 {result['redis_unknown_cpu_ms_p50']:7.2f} ms   renewed p50 "
            f"{result['redis_renewed_cpu_ms_p50']:7.2f} ms   meets goal {result['redis_meets_goal']}"
        )
    print(f"  load average (1 min): {result['load_avg_1m']}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    res = run(ap.parse_args().quick)
    print_table(res)
    print(json.dumps(res))
