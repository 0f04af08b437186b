"""Shared test configuration."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def redis_server() -> Iterator[Any]:
    """A real ``redis-server`` per test (:class:`kvlease_stack.testing.RedisServer`); CI installs it."""
    from kvlease_stack.testing import RedisServer  # the server extra: not in the SDK-only venv

    if not RedisServer.available():
        if os.environ.get("KVLEASE_REQUIRE_REDIS") == "1":  # set by .ci/run: CI never skips these
            pytest.fail("redis-server binary not installed, and KVLEASE_REQUIRE_REDIS=1")
        pytest.skip("redis-server binary not installed (apt-get install redis-server)")
    server = RedisServer.start()
    yield server
    server.stop()
