"""Clients that stop reading cannot take the upstream pool (issue 31).

With a pool of 8 connections to D, 8 clients that start a long stream and never read it held
every connection: other turns waited for the 30 s write timeout. Now one client address holds at
most its share of the pool (``max_turns_per_ip``, a sixteenth by default: past it its turns wait),
and a stream whose client acknowledged nothing for ``stream_stall_timeout`` is closed, its D
request aborted. The guarded server on 127.0.0.1, the fake P/D pair, real sockets (clients on other
loopback addresses where the address matters).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from _router_cluster import guarded_site

from kvlease_router import NodeSpec, RouterSettings
from kvlease_router._app import ROUTER_KEY
from kvlease_router._clients import FairShare
from kvlease_stack.testing import FakeConfig

#: Generous bound of the victim's turn (what the old code took: the 30 s write timeout).
VICTIM_BOUND_S = 15.0
#: The stalled readers' streams: far longer than any buffer takes (~6 MB of SSE).
STALL_TOKENS = 40_000


def _request(i: int, stream: bool, max_tokens: int) -> bytes:
    body = orjson.dumps(
        {
            "model": "fake-model",
            "messages": [{"role": "user", "content": f"turn {i}"}],
            "stream": stream,
            "max_tokens": max_tokens,
        }
    )
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer t%d\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
        % (i, len(body), body)
    )


async def _stalled_reader(port: int, addr: str, i: int) -> socket.socket:
    """A client on ``addr`` that sends a long streaming turn and never reads (4 KiB receive buffer)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.bind((addr, 0))
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await asyncio.wait_for(loop.sock_connect(sock, ("127.0.0.1", port)), 5.0)
    await asyncio.wait_for(loop.sock_sendall(sock, _request(i, True, STALL_TOKENS)), 5.0)
    return sock


async def _victim_turn(port: int, addr: str) -> bytes:
    """A short non-streamed turn from ``addr``, read to the end (the router closes after it)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(addr, 0))
    try:
        writer.write(_request(999, False, 4))
        return await asyncio.wait_for(reader.read(), VICTIM_BOUND_S)
    finally:
        writer.close()


async def _until(cond: Any, seconds: float = 10.0) -> bool:
    for _ in range(int(seconds / 0.02)):
        if cond():
            return True
        await asyncio.sleep(0.02)
    return bool(cond())


@contextlib.asynccontextmanager
async def _stalled(port: int, addrs: list[str]) -> AsyncIterator[list[socket.socket]]:
    socks: list[socket.socket] = []
    try:
        for i, addr in enumerate(addrs):
            socks.append(await _stalled_reader(port, addr, i))
        yield socks
    finally:
        for s in socks:
            s.close()


async def test_one_address_holds_only_its_share_of_the_pool() -> None:
    """8 stalled readers from one address, a pool of 8: the address holds 1 (8 // 16, at least 1),
    its other 7 turns wait, and a turn from another address is served while they hold."""
    config = FakeConfig(token_delay=0.001)
    settings = {"upstream_connections": 8, "stream_stall_timeout": 600.0}
    async with guarded_site(config, **settings) as (port, pair, app):
        router = app[ROUTER_KEY]
        assert router.ip_share.limit == 1
        async with _stalled(port, ["127.0.0.3"] * 8):
            assert await _until(lambda: router.ip_share.waiting("127.0.0.3") == 7)
            assert router.ip_share.held("127.0.0.3") == 1
            assert await _until(lambda: pair.decode.stats["open_streams"] == 1)
            raw = await _victim_turn(port, "127.0.0.2")
            assert raw.startswith(b"HTTP/1.1 200"), raw[:200]
            assert b'"choices"' in raw
            assert pair.decode.stats["open_streams"] == 1  # the stalled one still holds
            assert router.ip_share.waiting("127.0.0.3") == 7
    assert router.ip_share.held("127.0.0.3") == 0 and router.ip_share.waiting("127.0.0.3") == 0


async def test_stalled_readers_lose_their_streams_and_d_aborts_them() -> None:
    """8 stalled readers from 8 addresses hold the whole pool of 8 (each within its share): each
    stream is cut once its client acknowledged nothing for the stall timeout, D's request is
    aborted, and another address's turn is served (it waited for a connection, not for the 30 s
    write timeout)."""
    config = FakeConfig(token_delay=0.001)
    async with guarded_site(config, upstream_connections=8, stream_stall_timeout=0.5) as (port, pair, app):
        router = app[ROUTER_KEY]
        assert router.settings.stream_write_timeout == 30.0
        async with _stalled(port, [f"127.0.0.{10 + i}" for i in range(8)]) as socks:
            assert await _until(lambda: pair.decode.stats["streams"] == 8)
            raw = await _victim_turn(port, "127.0.0.2")
            assert raw.startswith(b"HTTP/1.1 200"), raw[:200]
            assert b'"choices"' in raw
            assert await _until(lambda: pair.decode.stats["streams_aborted"] == 8)
            assert router.metrics.stalled_streams._value.get() == 8
            assert pair.decode.stats["open_streams"] == 0
            for s in socks:  # each stalled reader's connection was closed by the router
                assert await _closed(s)


async def _closed(sock: socket.socket) -> bool:
    """Whether the router closed ``sock`` (its buffered bytes are read and dropped)."""
    loop = asyncio.get_running_loop()
    try:
        while await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 10.0):
            pass
    except ConnectionError:
        pass
    return True


async def test_fair_share_hands_slots_over_in_order_and_forgets_idle_keys() -> None:
    share = FairShare(2)
    await share.acquire("a")
    await share.acquire("a")
    order: list[int] = []

    async def waiter(i: int) -> None:
        await share.acquire("a")
        order.append(i)

    tasks = [asyncio.create_task(waiter(i)) for i in range(3)]
    await asyncio.sleep(0)
    assert share.waiting("a") == 3 and share.held("a") == 2
    assert share.try_acquire("b")  # another key is not held up
    tasks[1].cancel()  # a waiter that gives up loses its place, nobody else's
    share.release("a")
    share.release("a")
    await asyncio.sleep(0)
    assert order == [0, 2] and share.held("a") == 2 and share.waiting("a") == 0
    share.release("a")
    share.release("a")
    share.release("b")
    assert share.held("a") == 0 and share._keys == {}  # no key kept once idle
    unbounded = FairShare(0)
    assert all([unbounded.try_acquire("a") for _ in range(1000)])


def test_the_share_and_the_stall_timeout_are_settings() -> None:
    nodes = {"prefill": (NodeSpec("http://p"),), "decode": (NodeSpec("http://d"),)}
    s = RouterSettings(**nodes)  # type: ignore[arg-type]
    assert s.turns_per_ip == 16 and s.turns_per_ip < s.upstream_connections <= s.max_connections_per_ip
    assert s.max_turns_per_tenant == 0 and s.stream_stall_timeout < s.stream_write_timeout
    assert RouterSettings(**nodes, upstream_connections=8).turns_per_ip == 1  # type: ignore[arg-type]
    assert RouterSettings(**nodes, max_turns_per_ip=0).turns_per_ip == 0  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_turns_per_ip"):
        RouterSettings(**nodes, max_turns_per_ip=-1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stream_stall_timeout"):
        RouterSettings(**nodes, stream_stall_timeout=0)  # type: ignore[arg-type]
