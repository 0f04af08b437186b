"""What the Redis store tests share: the key secret, the key prefix, two lease ends and a record
factory (a module of its own: ``conftest`` is a name several test folders use)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvlease_router import ConversationRecord, RedisStore, redis_client_from_url
from kvlease_stack.testing import RedisServer

KEY_SECRET = "test-key-secret"
P = "kvlease:conv:"
SEALED_AT = 1_900_000_000.0
RENEWED_TO = 1_950_000_000.0


def record(n: int = 0, expires_at: float = SEALED_AT, *, tokens: int = 8) -> ConversationRecord:
    """Record ``n`` (its handle and lease id name it) of ``tokens`` tokens, ending at ``expires_at``."""
    return ConversationRecord(
        "http://d", {"remote_block_ids": [1, n]}, f"lease-{n}", "http://c", tokens, expires_at
    )


@pytest.fixture(name="client")
async def redis_client(redis_server: RedisServer) -> AsyncIterator[Any]:
    """A redis-py client of the real test server (``redis_server``: the suite's fixture)."""
    c = redis_client_from_url(redis_server.url, 2.0)
    yield c
    await c.aclose()


def store_of(client: Any) -> RedisStore:
    return RedisStore(client, secret=KEY_SECRET, timeout=2.0)
