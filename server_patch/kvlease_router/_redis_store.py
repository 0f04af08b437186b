"""Redis state store: keys expire with the lease (plus the grace period), shared by replicas.

redis-py is imported lazily (extra ``kvlease[router]``); the client is injected so tests and
deployments choose the connection. :func:`redis_client_from_url` builds one on a bounded *blocking*
pool: past ``max_connections`` a call waits (at most the store timeout) for a free connection
instead of failing, and a renew of thousands of ids costs one ``MGET`` on one connection.

Every failure becomes :class:`StoreError`, and after one the store answers ``StoreError`` at once
for ``backoff`` seconds, so a dead Redis costs turns nothing but their reuse (no per-turn connect
timeouts). A busy pool (no free connection within the timeout) fails that one call only: load is
not an outage, and one client's burst must not switch reuse off for every tenant.

What Redis holds is untrusted (anyone who can write it could plant records): every record is
sealed by :class:`~kvlease_router._store.RecordSeal` under a key derived from the router's key
secret, which is configuration, never stored here. A forged, moved or garbled record reads as absent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from kvlease_router._store import ConversationRecord, PutItem, RecordSeal, StoreError

__all__ = ["RedisStore", "redis_client_from_url"]

KEY_PREFIX = "kvlease:conv:"
#: Default size of the connection pool of one router process.
DEFAULT_MAX_CONNECTIONS = 32


def redis_client_from_url(url: str, timeout: float, max_connections: int = DEFAULT_MAX_CONNECTIONS) -> Any:
    """A ``redis.asyncio.Redis`` for ``url`` with short timeouts, no client-side retries and a
    bounded blocking pool (a call waits at most ``timeout`` for a free connection)."""
    try:
        import redis.asyncio as aioredis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ModuleNotFoundError as e:  # pragma: no cover - depends on the install
        raise RuntimeError("the Redis state store needs redis-py: pip install 'kvlease[router]'") from e
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=timeout,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
    )
    return aioredis.Redis(connection_pool=pool)


def _pool_busy(e: BaseException) -> bool:
    """redis-py's BlockingConnectionPool found no free connection in time (load, not an outage)."""
    return type(e).__name__ == "ConnectionError" and "No connection available" in str(e)


class RedisStore:
    name = "redis"

    def __init__(
        self,
        client: Any,
        *,
        secret: str,
        timeout: float = 0.25,
        backoff: float = 1.0,
        prefix: str = KEY_PREFIX,
    ) -> None:
        """``secret``: the router's key secret (a record MAC key is derived from it)."""
        self._client = client
        self._seal = RecordSeal(secret)
        self._timeout = timeout
        self._backoff = backoff
        self._prefix = prefix
        self._down_until = 0.0

    @property
    def rejected(self) -> int:
        """Records read as absent because they failed the MAC or did not parse."""
        return self._seal.rejected

    async def _call(self, coro: Any) -> Any:
        if time.monotonic() < self._down_until:
            coro.close()
            raise StoreError("redis is unavailable (backing off)")
        try:
            return await asyncio.wait_for(coro, self._timeout)
        except StoreError:
            raise
        except (Exception, asyncio.TimeoutError) as e:
            if not _pool_busy(e):
                self._down_until = time.monotonic() + self._backoff
            raise StoreError(f"redis: {type(e).__name__}: {e}") from e

    async def get(self, key: str) -> ConversationRecord | None:
        raw = await self._call(self._client.get(self._prefix + key))
        return self._seal.open(key, raw)

    async def get_many(self, keys: Sequence[str]) -> list[ConversationRecord | None]:
        if not keys:
            return []
        p = self._prefix
        raws = await self._call(self._client.mget([p + k for k in keys]))
        if not isinstance(raws, list) or len(raws) != len(keys):
            raise StoreError("redis: MGET answered the wrong number of values")
        seal = self._seal
        return [None if raw is None else seal.open(k, raw) for k, raw in zip(keys, raws)]

    async def put(self, key: str, state: ConversationRecord, keep_for: float) -> None:
        ms = int(keep_for * 1000)
        if ms <= 0:
            await self._call(self._client.delete(self._prefix + key))
            return
        await self._call(self._client.set(self._prefix + key, self._seal.seal(key, state), px=ms))

    async def put_many(self, items: Sequence[PutItem]) -> None:
        if not items:
            return
        pipe = self._client.pipeline(transaction=False)
        for key, state, keep_for in items:
            ms = int(keep_for * 1000)
            if ms <= 0:
                pipe.delete(self._prefix + key)
            else:
                pipe.set(self._prefix + key, self._seal.seal(key, state), px=ms)
        await self._call(pipe.execute())

    async def renew_many(
        self, keys: Sequence[str], records: Sequence[ConversationRecord], expires_at: float, keep_for: float
    ) -> None:
        """One pipeline of ``SET XX``: the record is re-sealed with its new lease end (the MAC covers
        it), and a key gone meanwhile (expired, released) is not brought back."""
        if not keys:
            return
        ms = int(keep_for * 1000)
        pipe = self._client.pipeline(transaction=False)
        p, seal = self._prefix, self._seal.seal
        if ms <= 0:
            for key in keys:
                pipe.delete(p + key)
        else:
            for key, record in zip(keys, records):
                pipe.set(p + key, seal(key, record.with_expiry(expires_at)), px=ms, xx=True)
        await self._call(pipe.execute())

    async def delete(self, key: str) -> ConversationRecord | None:
        raw = await self._call(self._client.getdel(self._prefix + key))
        return self._seal.open(key, raw)

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
        try:  # a client given its own pool does not close it
            await self._client.connection_pool.disconnect()
        except Exception:
            pass
