"""Shared test configuration."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Generator, Iterator
from typing import Any

import pytest

#: The name of a sync client's lease keeper thread (``kvlease._keeper.LeaseKeeper``).
KEEPER_THREAD = "kvlease-lease-keeper"
#: How long a keeper that is closing gets to stop at the session's end before it counts as left
#: running (``close()`` joins its thread; one in a renew round finishes it first).
KEEPER_STOP_WAIT = 10.0
#: The test during which each keeper thread still running was first seen (thread id -> node id).
_KEEPERS_SEEN: dict[int, str] = {}


def _keepers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == KEEPER_THREAD and t.is_alive()]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    """After each test's teardown: remember which test left a keeper thread running."""
    yield
    for t in _keepers():
        _KEEPERS_SEEN.setdefault(id(t), item.nodeid)


@pytest.fixture(scope="session", autouse=True)
def _no_keeper_left_running() -> Iterator[None]:
    """Fail the session when a wrapped client's lease keeper is still running at its end: a keeper
    that outlives its test renews against a router that is gone, long after the run's summary."""
    yield
    deadline = time.monotonic() + KEEPER_STOP_WAIT
    left = _keepers()
    while left and time.monotonic() < deadline:
        left[0].join(0.1)
        left = _keepers()
    if left:
        who = sorted({_KEEPERS_SEEN.get(id(t), "?") for t in left})
        pytest.fail(
            f"{len(left)} lease keeper thread(s) still running at the session's end, left by: "
            + ", ".join(who)
            + " (close the wrapped client: `with kvlease.wrap(...)` or `.close()`)",
            pytrace=False,
        )


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
