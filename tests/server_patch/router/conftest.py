"""Fixtures: a fake vLLM P/D pair (real HTTP on 127.0.0.1) with the real router in front of it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from _router_cluster import SECRET, Cluster, ClusterFactory
from aiohttp import web

from kvlease_router import MemoryStore, NodeSpec, RouterSettings, StateStore, create_app
from kvlease_stack.testing import FakeConfig, FakePair


@pytest.fixture
async def make_cluster() -> AsyncIterator[ClusterFactory]:
    made: list[Cluster] = []

    async def factory(
        config: FakeConfig | None = None,
        *,
        n_decode: int = 1,
        store: StateStore | None = None,
        pair: FakePair | None = None,
        decode_url: Callable[[str], str] = lambda url: url,
        **overrides: Any,
    ) -> Cluster:
        """``decode_url`` maps each fake D's URL to the one the router is given (e.g. a proxy's)."""
        if pair is None:
            pair = await FakePair(config or FakeConfig(), n_decode).__aenter__()
        kvlease = pair.config.kvlease
        settings = RouterSettings(
            prefill=(NodeSpec(pair.prefill.url, pair.prefill.control if kvlease else None),),
            decode=tuple(NodeSpec(decode_url(d.url), d.control if kvlease else None) for d in pair.decodes),
            control_secret=SECRET if kvlease else None,
            key_secret="test-key-secret",
            health_interval=0.2,
            unhealthy_for=0.5,
            startup_timeout=5.0,
            **overrides,
        )
        app = create_app(settings, store if store is not None else MemoryStore(1000))
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        cluster = Cluster(pair, f"http://127.0.0.1:{port}", app, runner, aiohttp.ClientSession(), settings)
        made.append(cluster)
        return cluster

    yield factory
    for c in made:
        await c.stop()


@pytest.fixture
async def cluster(make_cluster: ClusterFactory) -> Cluster:
    return await make_cluster()
