"""Redis state store: keys expire with the lease (plus the grace period), shared by replicas.

redis-py is imported lazily (extra ``kvlease[router]``); the client is injected so tests and
deployments choose the connection. :func:`redis_client_from_url` builds one on a bounded *blocking*
pool: past ``max_connections`` a call waits (at most the store timeout) for a free connection
instead of failing, and a renew of thousands of ids costs one read and one write on one connection
(a script call each, see ``_GET_MANY_LUA``; ``MGET`` and a pipeline where scripts are refused).

Every failure becomes :class:`StoreError`. After a connection error (refused, reset, closed), or
``failures_before_backoff`` (3) other failures in a row (timeouts: a hung Redis), the store answers
``StoreError`` at once for ``backoff`` seconds, so a dead or hung Redis costs turns nothing but
their reuse (no per-turn timeouts), while one slow call under load fails that call only. A busy
pool (no free connection within the timeout) fails that one call only too: load is not an
outage, and one client's burst must not switch reuse off for every tenant.

What Redis holds is untrusted (anyone who can write it could plant records): every record is
sealed by :class:`~kvlease_router._store.RecordSeal` under a key derived from the router's key
secret, which is configuration, never stored here. A forged, moved or garbled record reads as absent;
a lease end without its tag is ignored. The lease end is tagged apart from the record (format
``v3``, one tag per lease end: see ``RecordSeal`` for what that allows and why it is safe), so a
renewal rewrites 49 bytes of each value (``SETRANGE``), the same 49 for every id of one renew: no
JSON, no re-seal, no MAC per id. Records written by an older router (formats ``v1``, ``v2``) read as
absent: the state is a cache, so an upgrade costs each conversation one turn of reuse.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from itertools import islice
from operator import is_, itemgetter
from typing import Any

import orjson

from kvlease_router._store import ConversationRecord, PutItem, RecordSeal, StoreError, own_copy

__all__ = ["RedisStore", "redis_client_from_url"]

KEY_PREFIX = "kvlease:conv:"
#: Default size of the connection pool of one router process.
DEFAULT_MAX_CONNECTIONS = 32

# A renew's batches as one command each, its keys and per-key strings packed into a few arguments
# and its answer in one bulk reply: redis-py packs each argument and parses each reply in Python
# (about 10 µs a command, 2 µs a value), so 10,000 ``SET``s in a pipeline, or 10,000 values of an
# ``MGET``, cost the router hundreds of milliseconds where one string costs a few. The keys go
# concatenated, with their widths (in bytes: one number where all have it, as the router's keys
# do, else a JSON list), and the fixed-width strings per key (fingerprints, lease ends) concatenated
# (see ``_packed``). The scripts only move bytes: what they read is opened by the router as any
# read (``RedisStore._open``), and what they write was sealed (or tagged) by it. A Redis without
# scripting (or a reply that is not JSON: a planted value that is not UTF-8) falls back to ``MGET``
# and a pipeline. ``pcall`` and the type checks: a key of another type (planted) reads as absent
# and is not written, instead of failing the whole batch.
_KEYS_LUA = """
local function key_at(p, blob, width, widths, at, i)
  local w = width or widths[i]
  return p .. string.sub(blob, at, at + w - 1), at + w
end
local function widths_of(w)
  local width = tonumber(w)
  if width then
    return width, nil
  end
  return nil, cjson.decode(w)
end
"""
# The read: ARGV prefix, the number of keys, the keys and their widths, per key the fingerprint
# (``M[:16]``) of the body MAC this process remembers for it (16 characters; spaces if none),
# concatenated, then the lease ends ``E`` it remembers: one (16 characters) where every key has the
# same (a keeper's ids, renewed together), else one per key, concatenated. A value with that MAC and
# lease end answers "" (as this process left it), one with that MAC and another lease end (a
# replica renewed it) its expiry part ``E.T`` (49 bytes), any other the whole value (see
# ``RedisStore._open``); and when every value is as this process left it, the answer is ``=``. So a
# renew of records this process knows reads a few bytes, whatever the size of D's handles.
_GET_MANY_LUA = (
    _KEYS_LUA
    + """
local p, n, blob = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local width, widths = widths_of(ARGV[4])
local fps, codes = ARGV[5], ARGV[6]
local common = nil
if #codes == 16 then
  common = codes
end
local none = string.rep(' ', 16)
local out = {}
local same = true
local at, k = 1, nil
for i = 1, n do
  k, at = key_at(p, blob, width, widths, at, i)
  local fp = string.sub(fps, 16 * i - 15, 16 * i)
  local v = redis.pcall('GET', k)
  if type(v) ~= 'string' or v == '' then
    v = false
    same = false
  elseif fp ~= none and string.sub(v, 54, 69) == fp then
    if string.sub(v, 4, 19) == (common or string.sub(codes, 16 * i - 15, 16 * i)) then
      v = ''
    else
      v = string.sub(v, 4, 52)
      same = false
    end
  else
    same = false
  end
  out[i] = v
end
if same then
  return '='
end
return cjson.encode(out)
"""
)
# The renewal: ARGV prefix, PX milliseconds, the new expiry part ``E.T`` (one for all), the number
# of keys, the keys and their widths, per key the fingerprint of the body MAC it must still have
# (16 characters, concatenated: as the read sent them; ``E.T`` goes at offset 3 and the TTL moves,
# only where that MAC is still there: a key gone stays gone, a record a turn replaced meanwhile is
# left as it is), then keys and whole sealed values (JSON lists) for ``SET XX`` (records this
# process does not remember). Answers the (1-based) indexes of the first keys that were not
# renewed.
_RENEW_MANY_LUA = (
    _KEYS_LUA
    + """
local p, ms, e, n, blob = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local width, widths = widths_of(ARGV[6])
local fps = ARGV[7]
local missed = {}
local at, k = 1, nil
for i = 1, n do
  k, at = key_at(p, blob, width, widths, at, i)
  if redis.pcall('GETRANGE', k, 53, 68) == string.sub(fps, 16 * i - 15, 16 * i) then
    redis.call('SETRANGE', k, 3, e)
    redis.call('PEXPIRE', k, ms)
  else
    missed[#missed + 1] = i
  end
end
local fk = cjson.decode(ARGV[8])
local fv = cjson.decode(ARGV[9])
for i = 1, #fk do
  redis.pcall('SET', p .. fk[i], fv[i], 'PX', ms, 'XX')
end
return missed
"""
)
#: Records this process wrote (or opened) and still remembers, per store: see ``RedisStore._open``.
#: Past it the oldest tenth goes at once: one pass over the dict, where one ``next(iter(d))`` per
#: eviction walks every slot deleted from the dict's front before it (quadratic: 10,000 evictions
#: from a full memo cost 50 ms).
MEMO_ENTRIES = 20_000
#: Batches below this size go as plain commands (the scripts pay off on large ones).
_SCRIPT_MIN_KEYS = 64
_NO_SCRIPT = object()
#: A memo entry, a list (a renewal updates it in place): the fingerprint ``M[:16]`` the scripts
#: match, the lease end ``E`` as last written or read (16 ASCII characters, see ``_ascii_code``;
#: a renewal sets one string object for all its ids), the record (the store's own object), ``M``,
#: and the lease end in the record's JSON.
_Memo = list[Any]
#: A ``get_many`` the memo answered whole: its keys, its answer, the memo entries that answered it,
#: the keys packed (see ``_packed``) and the fingerprints sent (the renewal sends them again).
_Read = tuple[list[str], list[ConversationRecord], list[_Memo], tuple[str, str], str]
_FP, _CODE, _REC = (itemgetter(i) for i in range(3))
_PART_LEN = 49
#: What the read script is sent for a key this process does not remember (no fingerprint).
_NOT_SEEN = " " * 16
_set = object.__setattr__


def _ascii_code(code: str) -> str:
    """A lease end ``E`` read from Redis as the memo keeps it: as it is where it has 16 ASCII
    characters (every one the router writes: hex), else 16 ``?`` (a planted one: a fixed width
    keeps the scripts' packed arguments aligned and encodable; it matches only an ``E`` of ``?``,
    which fails the tag check as the planted one does, so the memo answers what a full check
    would)."""
    return code if len(code) == 16 and code.isascii() else "?" * 16


def _packed(keys: Sequence[str]) -> tuple[str, str]:
    """The scripts' form of ``keys``: their concatenation, and their widths in bytes (one number
    where all have it, as the router's keys do, else a JSON list)."""
    blob = "".join(keys)
    if blob.isascii():
        widths = set(map(len, keys))
        if len(widths) == 1:
            return blob, str(widths.pop())
        return blob, orjson.dumps(list(map(len, keys))).decode()
    return blob, orjson.dumps([len(k.encode("utf-8", "surrogatepass")) for k in keys]).decode()


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


def _outage(e: BaseException) -> bool:
    """A connection error (refused, reset, closed: Redis is down), not a timeout or a busy pool."""
    if isinstance(e, (asyncio.TimeoutError, TimeoutError)) or "Timeout" in type(e).__name__:
        return False
    if isinstance(e, (ConnectionError, EOFError)):
        return True
    return type(e).__name__ == "ConnectionError" and not _pool_busy(e)


class RedisStore:
    name = "redis"

    def __init__(
        self,
        client: Any,
        *,
        secret: str,
        renewals: bool = True,
        timeout: float = 0.25,
        backoff: float = 1.0,
        prefix: str = KEY_PREFIX,
        failures_before_backoff: int = 3,
    ) -> None:
        """``secret``: the router's key secret (a record MAC key is derived from it); ``renewals``:
        whether leases are renewed (the kvlease connector; see ``RecordSeal``)."""
        self._client = client
        self._seal = RecordSeal(secret, renewals=renewals)
        self._timeout = timeout
        self._backoff = backoff
        self._prefix = prefix
        self._down_until = 0.0
        self._failures_before_backoff = max(1, failures_before_backoff)
        self._failures = 0  # failures in a row that were not connection errors
        self._scripts: tuple[Any, Any] | None = None
        self._scripts_ok = True
        #: key -> memo entry (see ``_Memo``), oldest first.
        self._memo: dict[str, _Memo] = {}
        #: The last ``get_many`` the memo answered whole, so its renewal finds its memo entries
        #: without a second lookup per id (and its keys packed).
        self._last_read: _Read | None = None
        #: The keys of the last scripted read, and their packed form (a keeper renews the same ids
        #: every period: its keys are the keyer's cached strings, compared by identity first).
        self._last_packed: tuple[list[str], tuple[str, str]] | None = None

    def _remember(self, key: str, code: str, mac: str, record: ConversationRecord, sealed_at: float) -> None:
        memo = self._memo
        memo.pop(key, None)  # a new record: the newest
        fp = mac[:16]
        memo[key] = [fp, _ascii_code(code), record, mac, sealed_at]
        if len(memo) > MEMO_ENTRIES:  # the oldest tenth at once, see ``MEMO_ENTRIES``
            for old in list(islice(memo, len(memo) - MEMO_ENTRIES + MEMO_ENTRIES // 10)):
                del memo[old]

    def _open(self, key: str, seen: _Memo | None, raw: bytes | str | None) -> ConversationRecord | None:
        """The record of a stored value (``None``: absent, forged, moved or garbled). ``raw``: the
        whole value, or its expiry part ``E.T`` alone (the read script's answer where the stored
        MAC has the fingerprint of ``seen``, this key's memo entry when the value was asked for).

        The memo spares the body MAC and the JSON of records this process wrote or verified: a
        value with the remembered ``M`` (or, from the script, its fingerprint) is the remembered
        record, with the remembered lease end where it has the remembered ``E`` (checked when it
        was read or written), and with another one (a replica renewed it) after one tag check: a
        part that fails it is ignored, as in ``RecordSeal.unseal``. Sound: ``M`` is this process's
        MAC over (key, body), so the one body it stands for is the remembered one. A value with
        that MAC (or fingerprint) and other bytes elsewhere answers a state this router stored
        under this key, as a writer replaying that value would make any reader answer, never
        anything else. Anything else (a value another replica wrote, one planted in Redis) is
        MAC-checked and parsed as always."""
        if not raw:
            return None
        if isinstance(raw, bytes):
            raw = raw.decode("utf-8", "surrogateescape")  # exact: the MAC is over the bytes
        if seen is not None:
            mac = seen[3]
            part = raw if len(raw) == _PART_LEN else raw[3:52] if raw[53:85] == mac else None
            if part is not None:
                if part[:16] == seen[1]:
                    return seen[2]  # type: ignore[no-any-return]
                expires_at = self._seal.expiry(part)
                # in place, as a renewal from this process (the store's own record)
                seen[1] = _ascii_code(part[:16])
                _set(seen[2], "expires_at", seen[4] if expires_at is None else expires_at)
                return seen[2]  # type: ignore[no-any-return]
        opened = self._seal.unseal(key, raw)
        if opened is None:
            return None
        record, mac, sealed_at = opened
        self._remember(key, raw[3:19], mac, record, sealed_at)
        return record

    def _sealed(self, key: str, record: ConversationRecord) -> bytes:
        """The sealed value of ``record``, remembered with the store's own copy of it (a renewal
        moves the lease end of the memo's records in place; a caller's object never changes)."""
        head, mac, body = self._seal.seal_parts(key, record)
        self._remember(key, head[3:19], mac, own_copy(record), record.expires_at)
        return head.encode("ascii") + body

    @property
    def rejected(self) -> int:
        """Records read as absent because they failed the MAC or did not parse, and lease ends
        ignored because they failed theirs."""
        return self._seal.rejected

    async def _call(self, coro: Any) -> Any:
        if time.monotonic() < self._down_until:
            coro.close()
            raise StoreError("redis is unavailable (backing off)")
        try:
            got = await asyncio.wait_for(coro, self._timeout)
        except StoreError:
            raise
        except (Exception, asyncio.TimeoutError) as e:
            if _outage(e):  # refused, reset, closed: down now
                self._back_off()
            elif not _pool_busy(e):  # a timeout: an outage only when it keeps on (a hung Redis)
                self._failures += 1
                if self._failures >= self._failures_before_backoff:
                    self._back_off()
            raise StoreError(f"redis: {type(e).__name__}: {e}") from e
        self._failures = 0
        return got

    def _back_off(self) -> None:
        self._failures = 0
        self._down_until = time.monotonic() + self._backoff

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

    def _packed_as_last(self, keys: Sequence[str]) -> tuple[str, str]:
        """``_packed(keys)``, reused where the last scripted read had the same keys."""
        last = self._last_packed
        if last is not None and last[0] == keys:
            return last[1]
        packed = _packed(keys)
        self._last_packed = (list(keys), packed)
        return packed

    async def get(self, key: str) -> ConversationRecord | None:
        raw = await self._call(self._client.get(self._prefix + key))
        return self._open(key, self._memo.get(key), raw)

    async def get_many(self, keys: Sequence[str]) -> list[ConversationRecord | None]:
        if not keys:
            return []
        seen: list[Any] = list(map(self._memo.get, keys))  # as asked: the script answers for these
        raws: Any = _NO_SCRIPT
        if self._scripts_ok and len(keys) >= _SCRIPT_MIN_KEYS:
            if all(seen):  # every one remembered (an entry is a 5-item list: always true)
                fps = "".join(map(_FP, seen))
                codes = list(map(_CODE, seen))
                first = codes[0]  # (compared by identity first: one renewal set one object)
                code = first if codes.count(first) == len(codes) else "".join(codes)
            elif seen.count(None) == len(seen):  # none remembered (an attacker's ids)
                fps, code = _NOT_SEEN * len(seen), _NOT_SEEN
            else:
                fps = "".join(e[0] if e else _NOT_SEEN for e in seen)
                code = "".join(e[1] if e else _NOT_SEEN for e in seen)
            packed = self._packed_as_last(keys)
            blob = await self._call(self._run_script(0, [self._prefix, len(keys), *packed, fps, code]))
            if blob == b"=":  # every one as this process left it
                mine: list[ConversationRecord] = list(map(_REC, seen))
                self._last_read = (self._last_packed[0], mine, seen, packed, fps)  # type: ignore[index]
                return mine  # type: ignore[return-value]
            if blob is not _NO_SCRIPT:
                try:
                    raws = orjson.loads(blob)
                except orjson.JSONDecodeError:  # a planted value that is not UTF-8: read it plainly
                    raws = _NO_SCRIPT
        if raws is _NO_SCRIPT:
            raws = await self._call(self._client.mget([self._prefix + k for k in keys]))
        if not isinstance(raws, list) or len(raws) != len(keys):
            raise StoreError("redis: MGET answered the wrong number of values")
        if raws.count(None) + raws.count(False) == len(raws):  # none there (an attacker's ids)
            return [None] * len(keys)
        # the script's JSON has ``false`` for a missing key, "" for one as this process left it
        # (only where it sent a tag), and other values as strings
        open_ = self._open
        out: list[ConversationRecord | None] = []
        append = out.append
        for key, entry, raw in zip(keys, seen, raws):
            if raw == "" and entry is not None:
                append(entry[2])
            else:
                append(open_(key, entry, raw))
        return out

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
        """A key gone meanwhile (expired, released) is not brought back. Through the script, a
        record this process remembers (the one ``get_many`` answered) gets a new expiry part
        (``E`` and its tag, one small MAC) where its body MAC is still the one read: a record a turn
        replaced meanwhile is left as it is. Any other record, and every record without scripts,
        is re-sealed whole and written with ``SET XX`` (the renewal wins)."""
        if not keys:
            return
        ms = int(keep_for * 1000)
        scripted = ms > 0 and self._scripts_ok and len(keys) >= _SCRIPT_MIN_KEYS
        if scripted and await self._renew_by_script(keys, records, expires_at, ms):
            return
        p, seal = self._prefix, self._sealed
        pipe = self._client.pipeline(transaction=False)
        if ms <= 0:
            for key in keys:
                pipe.delete(p + key)
                self._memo.pop(key, None)
        else:
            for key, record in zip(keys, records):
                pipe.set(p + key, seal(key, record.with_expiry(expires_at)), px=ms, xx=True)
        await self._call(pipe.execute())

    async def _renew_by_script(
        self, keys: Sequence[str], records: Sequence[ConversationRecord], expires_at: float, ms: int
    ) -> bool:
        """``renew_many`` through the script; ``False`` when this Redis refuses scripts."""
        part = self._seal.part(expires_at)  # ``E.T``: the same for every id (no MAC per id)
        code = part[:16]
        tagged: Sequence[str] = keys
        whole: list[str] = []
        values: list[str] = []
        entries: list[Any]
        packed: tuple[str, str] | None = None
        fps: str | None = None
        last, self._last_read = self._last_read, None
        if (
            last is not None
            and len(last[1]) == len(records)
            and all(map(is_, records, last[1]))
            and keys == last[0]
        ):
            # the records of the last read, as the memo answered them: its entries (each is still
            # the one that read its record; one the memo dropped or replaced since is updated
            # unseen, and Redis's record is renewed only where its body MAC is still the one read),
            # its packed keys and the fingerprints it sent
            entries, packed, fps = last[2], last[3], last[4]
        else:
            entries = list(map(self._memo.get, keys))
            if None in entries or not all(map(is_, map(_REC, entries), records)):
                # some are not the records this store answered (the memo forgot them, or a caller's
                # own): those are re-sealed whole
                mine = [e is not None and e[2] is r for e, r in zip(entries, records)]
                tagged = [k for k, m in zip(keys, mine) if m]
                entries = [e for e, m in zip(entries, mine) if m]
                for key, record, m in zip(keys, records, mine):
                    if not m:
                        whole.append(key)
                        values.append(self._sealed(key, record.with_expiry(expires_at)).decode("utf-8"))
        if fps is None:
            fps = "".join(map(_FP, entries))
        # The memo as Redis will be: the new lease end, and the record's in place (as the memory
        # store: the store's own copy; a holder sees the lease as it now is; D has renewed it).
        # Set before the write, so no second pass: where the write fails or
        # misses, Redis's lease end differs from this one and the next read checks Redis's anew.
        for entry in entries:
            entry[1] = code
            _set(entry[2], "expires_at", expires_at)
        dumps = orjson.dumps
        args = [
            self._prefix,
            ms,
            part,
            len(tagged),
            *(packed or _packed(tagged)),
            fps,
            dumps(whole),
            dumps(values),
        ]
        missed = await self._call(self._run_script(1, args))
        if missed is _NO_SCRIPT:
            return False
        memo = self._memo
        for i in missed:  # gone, or replaced meanwhile: nothing renewed, nothing to remember
            key, entry = tagged[int(i) - 1], entries[int(i) - 1]
            if memo.get(key) is entry:  # (not a record a turn of this process wrote since)
                del memo[key]
        return True

    async def delete(self, key: str) -> ConversationRecord | None:
        raw = await self._call(self._client.getdel(self._prefix + key))
        record = self._open(key, self._memo.get(key), raw)
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
