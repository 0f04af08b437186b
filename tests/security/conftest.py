"""Fixtures: the real router in front of the fake vLLM P/D pair, over real HTTP on 127.0.0.1."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from security._cluster import Cluster, Listener, running_cluster


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    async with running_cluster(max_body_bytes=1024 * 1024) as c:
        yield c


@pytest.fixture
async def listener() -> AsyncIterator[Listener]:
    async with Listener() as li:
        yield li
