"""The router's upstream connections: bounded per node, and a request the node did not take (a
connection it closed or refused) is sent again once instead of failing the turn.

A small TCP proxy sits between the router and the fake D: it counts concurrent connections and can
close the first ones right after reading the request, without answering (a node restarting, a
keep-alive connection closed under the router, a full listen backlog).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import pytest
from _router_cluster import ClusterFactory, assistant_text

from kvlease.protocol import HEADER_STATUS
from kvlease_router import ConfigError, NodeSpec, RouterSettings
from kvlease_stack.testing import FakeConfig, FakePair


class Proxy:
    def __init__(self, target: str, drop_first: int = 0) -> None:
        u = urlsplit(target)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.drop_first = drop_first
        self.connections = 0
        self.open = 0
        self.peak = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        self.peak = max(self.peak, self.open)
        try:
            if self.connections <= self.drop_first:
                await reader.read(1024)  # the request arrives, no answer comes
                return
            up_r, up_w = await asyncio.open_connection(self.host, self.port)
            try:
                await asyncio.gather(_pipe(reader, up_w), _pipe(up_r, writer))
            finally:
                up_w.close()
        finally:
            self.open -= 1
            writer.close()


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
    with contextlib.suppress(OSError):
        dst.write_eof()


@pytest.fixture
async def proxies() -> AsyncIterator[list[Proxy]]:
    made: list[Proxy] = []
    yield made
    for p in made:
        await p.stop()


async def _with_proxy(
    make_cluster: ClusterFactory, proxies: list[Proxy], config: FakeConfig, drop_first: int = 0, **kw: object
):
    holder: dict[str, str] = {}

    def to_proxy(url: str) -> str:
        return holder["url"]

    pair = await FakePair(config, 1).__aenter__()
    proxy = Proxy(pair.decodes[0].url, drop_first)
    proxies.append(proxy)
    holder["url"] = await proxy.start()
    cluster = await make_cluster(pair=pair, decode_url=to_proxy, **kw)
    return cluster, proxy


async def test_connections_per_node_are_bounded_and_extra_turns_wait(
    make_cluster: ClusterFactory, proxies: list[Proxy]
) -> None:
    cluster, proxy = await _with_proxy(
        make_cluster, proxies, FakeConfig(token_delay=0.02, default_max_tokens=10), upstream_connections=3
    )
    turns = [
        cluster.chat([{"role": "user", "content": f"question {i}"}], cid=f"c{i}", stream=True)
        for i in range(12)
    ]
    results = await asyncio.gather(*turns)
    assert [r.status for r, _ in results] == [200] * 12
    assert all(assistant_text(b, True) for _, b in results)
    assert 1 <= proxy.peak <= 3  # 12 concurrent streams, never more than 3 connections to D
    assert cluster.pair.decodes[0].stats["streams"] == 12


async def test_a_request_d_did_not_take_is_sent_again_once(
    make_cluster: ClusterFactory, proxies: list[Proxy]
) -> None:
    cluster, _ = await _with_proxy(make_cluster, proxies, FakeConfig(), drop_first=1)
    before = cluster.router.metrics.upstream_retries._value.get()
    r, body = await cluster.chat([{"role": "user", "content": "hello"}], cid="retry-me")
    assert r.status == 200 and assistant_text(body, False)
    assert r.headers[HEADER_STATUS] == "first"
    assert cluster.router.metrics.upstream_retries._value.get() == before + 1
    assert cluster.pair.decodes[0].stats["requests"] == 1  # the dropped one never reached D


async def test_a_node_that_drops_twice_is_a_502_not_a_hang(
    make_cluster: ClusterFactory, proxies: list[Proxy]
) -> None:
    cluster, _ = await _with_proxy(make_cluster, proxies, FakeConfig(), drop_first=2)
    r, body = await cluster.chat([{"role": "user", "content": "hello"}], cid="gone")
    assert r.status == 502 and "decode" in body["error"]["message"]
    # the next turn goes through: one bad moment does not take the only D out of service
    r, body = await cluster.chat([{"role": "user", "content": "again"}], cid="gone")
    assert r.status == 200 and assistant_text(body, False)


def test_pool_settings_are_validated() -> None:

    nodes = {"prefill": (NodeSpec("http://p"),), "decode": (NodeSpec("http://d"),)}
    with pytest.raises(ConfigError, match="upstream_connections"):
        RouterSettings(**nodes, upstream_connections=0)
    with pytest.raises(ConfigError, match="keepalive_timeout"):
        RouterSettings(**nodes, keepalive_timeout=0)
