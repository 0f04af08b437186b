"""Shared test configuration."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def redis_server() -> Iterator[Any]:
    """A real ``redis-server`` per test (:class:`kvlease_stack.testing.RedisServer`); CI installs it."""
    from kvlease_stack.testing import RedisServer  # the server extra: not in the SDK-only venv

    if not RedisServer.available():
        pytest.skip("redis-server binary not installed (apt-get install redis-server)")
    server = RedisServer.start()
    yield server
    server.stop()
