"""The three findings of ``benchmarks/hostile_load.py``; each test failed on the code before the fix.

1. a refused renew cost ~3 ms of router CPU (its 10,000 ids were read and parsed first);
2. rotating bearer tokens (a new tenant each) got a fresh renew budget each, and the Redis load
   they made backed the store off for everyone after one timeout;
3. a client that never read a stream held it (and its D stream) for minutes: the kernel's send
   buffer took the whole answer, so the router's writes never waited.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from _router_cluster import Cluster, ClusterFactory, guarded_site

from kvlease.protocol import ERROR_RATE_LIMITED, HEADER_RETRY_AFTER, RENEW_PATH, ErrorBody
from kvlease_router import NodeSpec, RouterSettings, StoreError
from kvlease_router._app import ROUTER_KEY
from kvlease_router._ratelimit import TenantBuckets
from kvlease_router._redis_store import RedisStore
from kvlease_stack.testing import FakeConfig, FakePair


async def _renew_raw(cluster: Cluster, body: bytes, token: str) -> tuple[int, dict[str, str], bytes]:
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    async with cluster.client.post(cluster.url + RENEW_PATH, data=body, headers=headers) as r:
        return r.status, dict(r.headers), await r.read()


def _ids(n: int, tag: str = "x") -> bytes:
    return orjson.dumps({"conversation_ids": [f"{tag}{i}" for i in range(n)]})


def _is_429(status: int, headers: dict[str, str], raw: bytes) -> bool:
    if status != 429:
        return False
    assert int(headers[HEADER_RETRY_AFTER]) >= 1
    assert ErrorBody.from_json(orjson.loads(raw)).type == ERROR_RATE_LIMITED
    return True


# ---- 1: a 429 before the body is read ------------------------------------------------------------


def test_buckets_peek_spends_nothing_and_charge_goes_into_debt() -> None:
    b = TenantBuckets(rate=100.0, burst=1000.0)
    assert b.peek("t", 1000, 0.0) == 0.0  # an unseen tenant: a full bucket
    b.charge("t", 900, 0.0)
    assert b.peek("t", 100, 0.0) == 0.0
    assert b.peek("t", 200, 0.0) == pytest.approx(1.0)
    assert b.peek("t", 200, 0.0) == pytest.approx(1.0)  # peeking spent nothing
    b.charge("t", 600, 0.0)  # 100 held, 600 charged: 500 in debt
    assert b.peek("t", 100, 0.0) == pytest.approx(6.0)
    assert b.peek("t", 100, 6.0) == 0.0  # paid back at the rate
    b.charge("t", 10**9, 6.0)  # one charge is at most the burst: 100 - 1000
    assert b.peek("t", 0, 6.0) == pytest.approx(9.0)
    b.charge("t", 10**9, 6.0)
    assert b.peek("t", 0, 6.0) == pytest.approx(10.0)  # debt is bounded by the burst


async def test_a_tenant_in_debt_gets_429_before_its_body_is_parsed(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster(renew_ids_per_s=100.0, renew_burst_ids=2000)
    assert (await _renew_raw(cluster, _ids(1800), "greedy"))[0] == 200  # 1900 of 2000
    # refused after parsing (1500 ids, ~100 held), and charged: the tenant is in debt now
    assert _is_429(*await _renew_raw(cluster, _ids(1500), "greedy"))
    # not JSON at all: a 400 if the body were read and parsed; a 429 since it is not
    assert _is_429(*await _renew_raw(cluster, b"{not json", "greedy"))
    assert (await _renew_raw(cluster, b"{not json", "someone-else"))[0] == 400  # others parse


# ---- 2: budgets that made-up tokens do not renew -------------------------------------------------


async def test_rotating_tokens_hit_the_per_address_renew_budget(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster(renew_ip_ids_per_s=100.0, renew_ip_burst_ids=5000)
    statuses = []
    for i in range(4):  # a new tenant (a full tenant budget) every time, one address
        status, headers, raw = await _renew_raw(cluster, _ids(2000, f"r{i}-"), f"made-up-{i}")
        statuses.append(429 if _is_429(status, headers, raw) else status)
    assert statuses[:2] == [200, 200] and statuses[-1] == 429


async def test_all_tenants_share_a_global_renew_budget(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster(renew_global_ids_per_s=100.0, renew_global_burst_ids=3000)
    assert (await _renew_raw(cluster, _ids(1000), "a"))[0] == 200
    assert (await _renew_raw(cluster, _ids(1000), "b"))[0] == 200
    assert _is_429(*await _renew_raw(cluster, _ids(1000), "c"))  # 3300 asked of 3000
    assert _is_429(*await _renew_raw(cluster, _ids(10), "d"))  # and in debt: before parsing


def test_renew_budget_settings_are_validated() -> None:
    nodes = {"prefill": (NodeSpec("http://p"),), "decode": (NodeSpec("http://d"),)}
    with pytest.raises(ValueError, match="renew_ip_ids_per_s"):
        RouterSettings(**nodes, renew_ip_ids_per_s=0.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="renew_global_burst_ids"):
        RouterSettings(**nodes, renew_global_burst_ids=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="client_send_buffer"):
        RouterSettings(**nodes, client_send_buffer=-1)  # type: ignore[arg-type]
    s = RouterSettings(**nodes)  # type: ignore[arg-type]
    assert s.renew_global_ids_per_s >= 10 * s.renew_ids_per_s and s.client_send_buffer > 0


class _ScriptedRedis:
    """A redis client whose ``get`` fails as scripted: ``hang`` (past the store timeout),
    ``refuse`` (a connection error) or ``ok``; ``calls`` counts what reached it."""

    def __init__(self, script: list[str]) -> None:
        self.script = script
        self.calls = 0

    async def get(self, key: str) -> None:
        self.calls += 1
        what = self.script.pop(0) if self.script else "ok"
        if what == "hang":
            await asyncio.sleep(30)
        if what == "refuse":
            raise ConnectionRefusedError(111, "Connection refused")

    async def aclose(self) -> None:
        pass


async def _outcome(store: RedisStore) -> str:
    try:
        await store.get("k")
        return "ok"
    except StoreError as e:
        return "off" if "backing off" in str(e) else "error"


async def test_one_redis_timeout_does_not_back_the_store_off() -> None:
    client = _ScriptedRedis(["hang", "ok", "hang", "hang", "ok"])
    store = RedisStore(client, secret="s", timeout=0.05, backoff=60.0)
    # one timeout fails that call only, and a success resets the count
    assert [await _outcome(store) for _ in range(5)] == ["error", "ok", "error", "error", "ok"]
    assert client.calls == 5


async def test_a_hung_redis_still_backs_off_after_a_few_timeouts() -> None:
    client = _ScriptedRedis(["hang"] * 10)
    store = RedisStore(client, secret="s", timeout=0.05, backoff=60.0, failures_before_backoff=3)
    got = [await _outcome(store) for _ in range(5)]
    assert got == ["error", "error", "error", "off", "off"]
    assert client.calls == 3  # no per-turn timeout once it backs off


async def test_a_refused_connection_backs_off_at_once() -> None:
    client = _ScriptedRedis(["refuse"])
    store = RedisStore(client, secret="s", timeout=1.0, backoff=60.0)
    assert [await _outcome(store) for _ in range(3)] == ["error", "off", "off"]
    assert client.calls == 1


# ---- 3: a bounded send buffer, so a stalled reader is noticed ------------------------------------


@pytest.fixture
async def long_streams() -> AsyncIterator[tuple[int, FakePair]]:
    async with guarded_site(FakeConfig(token_delay=0.0), stream_write_timeout=0.3) as (port, pair, app):
        yield port, pair, app[ROUTER_KEY]


async def test_a_client_that_never_reads_a_stream_is_cut_off(long_streams: Any) -> None:
    """~2.5 MB of answer: less than the kernel's own send buffer (up to 4 MiB) takes, far more than
    the bounded one; the client's receive buffer is 4 KiB and it never reads."""
    port, pair, router = long_streams
    body = orjson.dumps(
        {
            "model": "fake-model",
            "messages": [{"role": "user", "content": "talk"}],
            "stream": True,
            "max_tokens": 12_000,
        }
    )
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        await asyncio.wait_for(loop.sock_connect(sock, ("127.0.0.1", port)), 5.0)
        await asyncio.wait_for(loop.sock_sendall(sock, head + body), 5.0)
        gauge = router.metrics.in_flight._value
        for _ in range(200):  # bounded: until the router is done with the turn, either way
            await asyncio.sleep(0.05)
            if pair.decode.stats["streams"] >= 1 and gauge.get() == 0:
                break
        assert gauge.get() == 0
        got = bytearray()
        # now read what reached the client (until the end, [DONE], or 5 s of silence): the
        # stream was cut, so no [DONE]
        with contextlib.suppress(ConnectionResetError, TimeoutError):
            while len(got) < 8 * 2**20 and b"[DONE]" not in got[-4096:]:
                chunk = await asyncio.wait_for(loop.sock_recv(sock, 2**16), 5.0)
                if not chunk:
                    break
                got += chunk
        assert got.startswith(b"HTTP/1.1 200")
        assert b"[DONE]" not in got[-4096:]
    finally:
        sock.close()
