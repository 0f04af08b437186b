"""Redis state store: keys expire with the lease (plus the grace period), shared by replicas.

redis-py is imported lazily (extra ``kvlease[router]``); the client is injected so tests and
deployments choose the connection. Every failure becomes :class:`StoreError`, and after one the store
answers ``StoreError`` at once for ``backoff`` seconds, so a dead Redis costs turns nothing but their
reuse (no per-turn connect timeouts).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kvlease_router._store import ConversationRecord, StoreError

__all__ = ["RedisStore", "redis_client_from_url"]

KEY_PREFIX = "kvlease:conv:"


def redis_client_from_url(url: str, timeout: float) -> Any:
    """A ``redis.asyncio.Redis`` for ``url`` with short timeouts and no client-side retries."""
    try:
        import redis.asyncio as aioredis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ModuleNotFoundError as e:  # pragma: no cover - depends on the install
        raise RuntimeError("the Redis state store needs redis-py: pip install 'kvlease[router]'") from e
    return aioredis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
    )


class RedisStore:
    name = "redis"

    def __init__(
        self, client: Any, *, timeout: float = 0.25, backoff: float = 1.0, prefix: str = KEY_PREFIX
    ) -> None:
        self._client = client
        self._timeout = timeout
        self._backoff = backoff
        self._prefix = prefix
        self._down_until = 0.0

    async def _call(self, coro: Any) -> Any:
        if time.monotonic() < self._down_until:
            coro.close()
            raise StoreError("redis is unavailable (backing off)")
        try:
            return await asyncio.wait_for(coro, self._timeout)
        except StoreError:
            raise
        except (Exception, asyncio.TimeoutError) as e:
            self._down_until = time.monotonic() + self._backoff
            raise StoreError(f"redis: {type(e).__name__}: {e}") from e

    async def get(self, key: str) -> ConversationRecord | None:
        raw = await self._call(self._client.get(self._prefix + key))
        return None if raw is None else ConversationRecord.loads(raw)

    async def put(self, key: str, state: ConversationRecord, keep_for: float) -> None:
        ms = int(keep_for * 1000)
        if ms <= 0:
            await self._call(self._client.delete(self._prefix + key))
            return
        await self._call(self._client.set(self._prefix + key, state.dumps(), px=ms))

    async def delete(self, key: str) -> ConversationRecord | None:
        raw = await self._call(self._client.getdel(self._prefix + key))
        return None if raw is None else ConversationRecord.loads(raw)

    async def ping(self) -> bool:
        try:
            return bool(await self._call(self._client.ping()))
        except StoreError:
            return False

    async def close(self) -> None:
        try:
            await self._client.aclose()
        except Exception:
            pass
