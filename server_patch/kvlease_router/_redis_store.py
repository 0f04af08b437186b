"""Redis state store: keys expire with the lease (plus the grace period), shared by replicas.

redis-py is imported lazily (extra ``kvlease[router]``); the client is injected so tests and
deployments choose the connection. :func:`redis_client_from_url` builds one on a bounded *blocking*
pool: past ``max_connections`` a call waits (at most the store timeout) for a free connection
instead of failing, and a renew of thousands of ids costs one read and one write on one connection
(a script call each, see ``_GET_MANY_LUA``; ``MGET`` and a pipeline where scripts are refused).

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

import orjson

from kvlease_router._store import ConversationRecord, PutItem, RecordSeal, StoreError

__all__ = ["RedisStore", "redis_client_from_url"]

KEY_PREFIX = "kvlease:conv:"
#: Default size of the connection pool of one router process.
DEFAULT_MAX_CONNECTIONS = 32

# A renew's batches as one command each, its keys and values in one JSON argument and its answer in
# one bulk reply: redis-py packs each argument and parses each reply in Python (about 10 µs a
# command, 2 µs a value), so 10,000 ``SET``s in a pipeline, or 10,000 values of an ``MGET``, cost
# the router hundreds of milliseconds where one JSON string costs a few. The scripts only move
# bytes: what they read is opened (MAC-checked) by the router as any read, and what they write was
# sealed by it. A Redis without scripting (or a reply that is not JSON: a planted value that is not
# UTF-8) falls back to ``MGET`` and a pipeline.
_GET_MANY_LUA = """
local keys = cjson.decode(ARGV[1])
local out = {}
for i = 1, #keys do
  out[i] = redis.call('GET', keys[i])
end
return cjson.encode(out)
"""
_RENEW_MANY_LUA = """
local keys = cjson.decode(ARGV[2])
local values = cjson.decode(ARGV[3])
local n = 0
for i = 1, #keys do
  if redis.call('SET', keys[i], values[i], 'PX', ARGV[1], 'XX') then n = n + 1 end
end
return n
"""
#: Records this process wrote (or opened) and still remembers, per store: see ``RedisStore._open``.
MEMO_ENTRIES = 20_000
#: Batches below this size go as plain commands (the scripts pay off on large ones).
_SCRIPT_MIN_KEYS = 64
_NO_SCRIPT = object()


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
        self._scripts: tuple[Any, Any] | None = None
        self._scripts_ok = True
        #: key -> (the exact bytes this process sealed or opened for it, their record)
        self._memo: dict[str, tuple[bytes, ConversationRecord]] = {}

    def _remember(self, key: str, raw: bytes, record: ConversationRecord) -> None:
        memo = self._memo
        memo[key] = (raw, record)
        if len(memo) > MEMO_ENTRIES:
            del memo[next(iter(memo))]  # the oldest

    def _open(self, key: str, raw: bytes | str | None) -> ConversationRecord | None:
        """``RecordSeal.open``, skipped for bytes identical to the ones this process last sealed
        or opened for this key: ``open`` is a function of (key, bytes) alone (the same MAC over
        the same key and body, the same parse), so the memo is only a cache of it, right whatever
        Redis holds now (a renew reads back what the last renew wrote). Anything else, a value
        another replica wrote or one planted in Redis included, is MAC-checked and parsed as always."""
        if raw is None:
            return None
        if isinstance(raw, str):
            raw = raw.encode("utf-8", "surrogatepass")
        seen = self._memo.get(key)
        if seen is not None and seen[0] == raw:
            return seen[1]
        record = self._seal.open(key, raw)
        if record is not None:
            self._remember(key, raw, record)
        return record

    def _sealed(self, key: str, record: ConversationRecord) -> bytes:
        raw = self._seal.seal(key, record)
        self._remember(key, raw, record)
        return raw

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

    def _script(self, i: int) -> Any:
        if self._scripts is None:
            register = self._client.register_script
            self._scripts = (register(_GET_MANY_LUA), register(_RENEW_MANY_LUA))
        return self._scripts[i]

    async def _run_script(self, i: int, args: list[Any]) -> Any:
        """The script's answer, or :data:`_NO_SCRIPT` when this Redis refuses scripts (then the
        plain commands are used from now on; not an outage, so no back-off)."""
        from redis.exceptions import ResponseError

        try:
            return await self._script(i)(keys=[], args=args)
        except ResponseError:
            self._scripts_ok = False
            return _NO_SCRIPT

    async def get(self, key: str) -> ConversationRecord | None:
        raw = await self._call(self._client.get(self._prefix + key))
        return self._open(key, raw)

    async def get_many(self, keys: Sequence[str]) -> list[ConversationRecord | None]:
        if not keys:
            return []
        p = self._prefix
        raws: Any = _NO_SCRIPT
        if self._scripts_ok and len(keys) >= _SCRIPT_MIN_KEYS:
            blob = await self._call(self._run_script(0, [orjson.dumps([p + k for k in keys])]))
            if blob is not _NO_SCRIPT:
                try:
                    raws = orjson.loads(blob)
                except orjson.JSONDecodeError:  # a planted value that is not UTF-8: read it plainly
                    raws = _NO_SCRIPT
        if raws is _NO_SCRIPT:
            raws = await self._call(self._client.mget([p + k for k in keys]))
        if not isinstance(raws, list) or len(raws) != len(keys):
            raise StoreError("redis: MGET answered the wrong number of values")
        # the script's JSON has ``false`` for a missing key, and each value as a string
        open_ = self._open
        return [open_(k, raw) if raw else None for k, raw in zip(keys, raws)]

    async def put(self, key: str, state: ConversationRecord, keep_for: float) -> None:
        ms = int(keep_for * 1000)
        self._memo.pop(key, None)
        if ms <= 0:
            await self._call(self._client.delete(self._prefix + key))
            return
        await self._call(self._client.set(self._prefix + key, self._sealed(key, state), px=ms))

    async def put_many(self, items: Sequence[PutItem]) -> None:
        if not items:
            return
        pipe = self._client.pipeline(transaction=False)
        for key, state, keep_for in items:
            ms = int(keep_for * 1000)
            self._memo.pop(key, None)
            if ms <= 0:
                pipe.delete(self._prefix + key)
            else:
                pipe.set(self._prefix + key, self._sealed(key, state), px=ms)
        await self._call(pipe.execute())

    async def renew_many(
        self, keys: Sequence[str], records: Sequence[ConversationRecord], expires_at: float, keep_for: float
    ) -> None:
        """One pipeline of ``SET XX``: the record is re-sealed with its new lease end (the MAC covers
        it), and a key gone meanwhile (expired, released) is not brought back."""
        if not keys:
            return
        ms = int(keep_for * 1000)
        p, seal = self._prefix, self._sealed
        if ms > 0 and self._scripts_ok and len(keys) >= _SCRIPT_MIN_KEYS:
            values = [
                seal(key, record.with_expiry(expires_at)).decode() for key, record in zip(keys, records)
            ]
            args = [ms, orjson.dumps([p + k for k in keys]), orjson.dumps(values)]
            if await self._call(self._run_script(1, args)) is not _NO_SCRIPT:
                return
        pipe = self._client.pipeline(transaction=False)
        if ms <= 0:
            for key in keys:
                pipe.delete(p + key)
        else:
            for key, record in zip(keys, records):
                pipe.set(p + key, seal(key, record.with_expiry(expires_at)), px=ms, xx=True)
        await self._call(pipe.execute())

    async def delete(self, key: str) -> ConversationRecord | None:
        raw = await self._call(self._client.getdel(self._prefix + key))
        record = self._open(key, raw)
        self._memo.pop(key, None)
        return record

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
