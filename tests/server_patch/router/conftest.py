"""Fixtures: a fake vLLM P/D pair (real HTTP on 127.0.0.1) with the real router in front of it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from _router_cluster import SECRET, Cluster, ClusterFactory

from kvlease_router import MemoryStore, StateStore, create_app
from kvlease_stack.testing import FakeConfig, FakePair, pair_settings, serve


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
        settings = pair_settings(
            pair,
            control_secret=SECRET,
            decode_url=decode_url,
            key_secret="test-key-secret",
            health_interval=0.2,
            unhealthy_for=0.5,
            startup_timeout=5.0,
            **overrides,
        )
        app = create_app(settings, store if store is not None else MemoryStore(1000))
        runner, url = await serve(app, access_log=None, handle_signals=False, shutdown_timeout=0.5)
        cluster = Cluster(pair, url, app, runner, aiohttp.ClientSession(), settings)
        made.append(cluster)
        return cluster

    yield factory
    for c in made:
        await c.stop()


@pytest.fixture
async def cluster(make_cluster: ClusterFactory) -> Cluster:
    return await make_cluster()
