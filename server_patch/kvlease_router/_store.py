"""Conversation state stores: the interface and the in-memory implementation.

A store maps a tenant-scoped conversation key (see ``_identity``) to the last
:class:`ConversationRecord` the router saw for it. TTL semantics, for every backend:

* ``put(key, state, keep_for)`` replaces the state; after ``keep_for`` seconds ``get`` returns
  ``None`` (the entry is gone). ``keep_for`` is the lease plus a grace period, so the router can tell
  ``expired`` (state present, ``state.expires_at`` passed) from ``first`` (no state).
* ``get`` never extends the TTL. ``delete`` returns what it removed.
* ``get_many`` / ``put_many`` are the batched twins (one round trip: a renew's thousands of ids
  cost one ``MGET`` and one pipeline, not one call each).
* ``renew_many(keys, records, expires_at, keep_for)`` renews records read by ``get_many``: each key
  still present gets the lease end ``expires_at`` (nothing else of its record changes) and lives
  ``keep_for`` more seconds, in one round trip; a key gone meanwhile (expired, released) stays
  gone. The memory store updates its entries in place (a record a turn replaced meanwhile is left
  as it is); Redis rewrites only each record's expiry part (a record a turn replaced meanwhile
  is left as it is, see ``_redis_store``).
* A backend failure raises :class:`StoreError`; callers degrade to the miss path.

What a shared backend (Redis) holds is untrusted: :class:`RecordSeal` MACs each record, bound to its
key, under a key derived from the router's key secret (which never sits in the backend), and tags
its lease end apart (one tag per lease end, so a renewal rewrites 49 bytes and computes no MAC per
record); a record that fails the MAC or does not parse reads as absent (it costs reuse, never an
error), a lease end that fails its tag is ignored. Records of older formats (``v1``, ``v2``) read as
absent: an upgrade costs each conversation one turn of reuse.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import struct
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields, replace
from itertools import compress
from operator import itemgetter
from typing import Any, Protocol

import orjson

__all__ = ["ConversationRecord", "MemoryStore", "RecordSeal", "StateStore", "StoreError"]

#: One write of a batch: (key, record, keep_for seconds).
PutItem = tuple[str, "ConversationRecord", float]


class StoreError(RuntimeError):
    """The state backend failed (unreachable, timed out, corrupt entry)."""


@dataclass(frozen=True, slots=True)
class ConversationRecord:
    """What the router remembers about one conversation between turns.

    Slotted: a renew reads thousands of them, a few fields each, in bulk (``plan_renew``), and a
    slot is read at a fixed offset of a small object, where an instance dict or its inline values
    cost another lookup and another cache line per record."""

    #: URL of the decode node that served the last turn (decode affinity).
    decode: str | None
    #: D's ``kv_transfer_params`` from the last turn (the block handle), ``None`` if none captured.
    params: dict[str, Any] | None
    #: D's id for the retained blocks (kvlease ``lease_id`` or ``remote_request_id``).
    lease_id: str | None
    #: Control endpoint of the D that holds the lease (kvlease connector), else ``None``.
    control: str | None
    #: Tokens D holds for this conversation (prompt + generated), 0 if unknown.
    tokens: int
    #: Wall-clock (epoch seconds) end of the router's lease.
    expires_at: float
    #: Stock-vLLM continuity digest of what D holds, and the prefix length it covers.
    continuity: str | None = None
    prefix_len: int = 0
    turns: int = 1

    def expires_in(self, now: float) -> float:
        return self.expires_at - now

    def with_expiry(self, expires_at: float) -> ConversationRecord:
        """This record with another lease end (cheaper than ``replace``; see :func:`own_copy`)."""
        new = own_copy(self)
        object.__setattr__(new, "expires_at", expires_at)
        return new

    def without_handle(self) -> ConversationRecord:
        return replace(self, params=None, lease_id=None, control=None, tokens=0)

    def dumps(self) -> bytes:
        return orjson.dumps(self)  # orjson writes a dataclass's fields itself (as ``asdict`` has them)

    @classmethod
    def loads(cls, raw: bytes | str) -> ConversationRecord:
        try:
            data = orjson.loads(raw)
            params = data["params"]
            # the fields set one by one, each parsed and checked as it is set
            rec = object.__new__(cls)
            set_ = object.__setattr__
            set_(rec, "decode", _opt_str(data["decode"]))
            set_(rec, "params", params if isinstance(params, dict) else None)
            set_(rec, "lease_id", _opt_str(data["lease_id"]))
            set_(rec, "control", _opt_str(data["control"]))
            set_(rec, "tokens", int(data["tokens"]))
            set_(rec, "expires_at", float(data["expires_at"]))
            set_(rec, "continuity", _opt_str(data.get("continuity")))
            set_(rec, "prefix_len", int(data.get("prefix_len", 0)))
            set_(rec, "turns", int(data.get("turns", 1)))
            return rec
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise StoreError(f"corrupt state entry: {e}") from e


def _opt_str(v: object) -> str | None:
    if v is None or isinstance(v, str):
        return v
    raise TypeError(f"expected a string or null, got {type(v).__name__}")


class RecordSeal:
    """MACs of stored records (format ``v3``): ``v3.<E>.<T>.<M>.<json>``, ASCII up to the JSON.

    * ``M``, the body MAC: HMAC-SHA256 (128 bits, hex) over the record's key, 0x00 and its JSON,
      under a subkey derived from the router's key secret for this use only. Bound to the key, so a
      record copied to another conversation's (or tenant's) key fails.
    * ``E``, the lease end: the IEEE-754 double, big-endian, in 16 hex digits (exact, fixed width).
    * ``T``, the lease-end tag: keyed BLAKE2b-128 (a MAC by design, as in ``_identity.Keyer``) of
      ``E`` alone under a second subkey: it says a router with this secret wrote that lease end, for
      some record. It is the same for every record renewed to the same ``E`` (a renew of thousands
      of ids computes it once), so a renewal costs no MAC per id: it rewrites ``E.T`` (49 bytes at
      offset ``EXPIRY_AT``), no JSON, no body MAC.

    What a reader accepts, and why that is safe:

    * the body only under a valid ``M`` (else the record reads as absent, counted in ``rejected``);
      the handle, the decode node and the control URL are in the body, so nobody without the
      secret can make the router offer a handle, or call a control endpoint, it did not store;
    * ``E`` only under a valid ``T`` (else it is ignored: the record reads with the lease end in its
      JSON, what the turn that wrote it granted, and counts in ``rejected``), and only where leases
      are renewed (``renewals``: the kvlease connector). With stock vLLM nothing renews, ``E`` is
      always the JSON's lease end, and it is not read at all: there P pulls by length on the
      router's word, so the lease end must be the sealed one.

    ``T`` does not bind the key: a Redis writer can copy one record's ``E.T`` to another, or replay
    an older one, as it can delete or replay whole records. That moves a lease end the router
    wrote (within the TTL of its writing) onto another sealed record of the same secret. With the
    kvlease connector the router's lease end is advisory: P claims the lease on D before a pull
    (D's lease table is authoritative and a failed claim recomputes), or, with claims off, checks
    the expiry D sealed into the handle. So a moved lease end costs at most a failed claim and a
    recompute: never a pull of blocks D no longer holds, never another tenant's KV.

    Records of an older format (``v1``, ``v2``) read as absent: the state is a cache, so an upgrade
    costs each conversation one turn of reuse, and routers of different formats on one Redis do not
    share state.
    """

    __slots__ = ("_inner", "_outer", "_renewals", "_tag", "_tags", "rejected")

    PREFIX = "v3."
    #: Offsets in a sealed value: ``E`` (then ``.``), ``T``, ``M``, the JSON.
    EXPIRY_AT, TAG_AT, MAC_AT, BODY_AT = 3, 20, 53, 86
    #: Lease-end tags remembered (a pure function of the secret and ``E``; cleared whole past it).
    TAGS_MAX = 1024

    def __init__(self, key_secret: str, *, renewals: bool = True) -> None:
        """``renewals``: whether leases are renewed (the kvlease connector): only then is a stored
        lease end apart from the JSON's read (see the class docstring)."""
        secret = key_secret.encode("utf-8")
        mac_key = hmac.digest(secret, b"kvlease store record mac v2", "sha256")
        # HMAC-SHA256 under ``mac_key`` (RFC 2104) from inner and outer states primed once (a copy
        # of a primed state costs less than OpenSSL's one-shot HMAC). Same MACs as
        # ``hmac.digest(mac_key, ..., "sha256")``.
        padded = mac_key.ljust(64, b"\x00")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in padded))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in padded))
        tag_key = hmac.digest(secret, b"kvlease store lease end mac v3", "sha256")
        self._tag = hashlib.blake2b(key=tag_key, digest_size=16)
        self._tags: dict[str, str] = {}
        self._renewals = renewals
        #: Records that failed the body MAC or did not parse (each read as absent), and expiry parts
        #: that failed the tag (each ignored).
        self.rejected = 0

    def _mac(self, key: str, body: bytes) -> str:
        inner = self._inner.copy()
        inner.update(key.encode("utf-8", "surrogatepass") + b"\x00")
        inner.update(body)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()[:16].hex()

    @staticmethod
    def expiry_code(expires_at: float) -> str:
        """``E`` of a lease end."""
        return struct.pack(">d", expires_at).hex()

    def tag(self, code: str) -> str:
        """``T`` of the lease end whose ``E`` is ``code`` (remembered: a renew's ids share one)."""
        tag = self._tags.get(code)
        if tag is None:
            state = self._tag.copy()
            state.update(code.encode("ascii", "surrogateescape"))
            tag = state.hexdigest()
            if len(self._tags) >= self.TAGS_MAX:
                self._tags.clear()
            self._tags[code] = tag
        return tag

    def part(self, expires_at: float) -> str:
        """``E.T`` of a lease end: what a renewal writes at ``EXPIRY_AT``."""
        code = self.expiry_code(expires_at)
        return f"{code}.{self.tag(code)}"

    def seal_parts(self, key: str, record: ConversationRecord) -> tuple[str, str, bytes]:
        """(``v3.E.T.M.``, ``M``, the JSON) of ``record`` under ``key``."""
        body = record.dumps()
        mac = self._mac(key, body)
        return f"{self.PREFIX}{self.part(record.expires_at)}.{mac}.", mac, body

    def seal(self, key: str, record: ConversationRecord) -> bytes:
        head, _, body = self.seal_parts(key, record)
        return head.encode("ascii") + body

    def expiry(self, part: str) -> float | None:
        """The lease end in an expiry part ``E.T`` (``raw[3:52]`` of a value whose body MAC is
        known good), or ``None``: the part fails the tag (counted in ``rejected``), or leases are
        not renewed here (see ``renewals``). The caller then uses the JSON's lease end."""
        if not self._renewals:
            return None
        code = part[:16]
        if len(part) == 49 and part[16] == "." and _same(part[17:], self.tag(code)):
            try:
                got = float(struct.unpack(">d", bytes.fromhex(code))[0])
                if math.isfinite(got):
                    return got
            except (ValueError, struct.error):  # pragma: no cover - the router wrote it
                pass
        self.rejected += 1
        return None

    def unseal(self, key: str, raw: str) -> tuple[ConversationRecord, str, float] | None:
        """(the record with its lease end, ``M``, the JSON's lease end), or ``None`` when forged,
        moved from another key or corrupt (counted in ``rejected``). ``raw``: the value as text
        (bytes decoded with ``surrogateescape``, so they encode back exactly)."""
        mac = raw[53:85]
        try:
            body = raw[86:].encode("utf-8", "surrogateescape")
            good = (
                raw[:3] == self.PREFIX
                and raw[52:53] + raw[85:86] == ".."
                and _same(mac, self._mac(key, body))
            )
        except UnicodeEncodeError:
            good = False
        if not good:
            self.rejected += 1
            return None
        try:
            record = ConversationRecord.loads(body)
        except StoreError:  # a MAC-valid record a newer/older router wrote differently
            self.rejected += 1
            return None
        sealed_at = record.expires_at
        expires_at = self.expiry(raw[3:52])
        if expires_at is not None and expires_at != sealed_at:
            record = record.with_expiry(expires_at)
        return record, mac, sealed_at

    def open(self, key: str, raw: bytes | str | None) -> ConversationRecord | None:
        """The record, or ``None`` when absent, forged, moved from another key or corrupt."""
        if raw is None:
            return None
        if isinstance(raw, bytes):
            raw = raw.decode("utf-8", "surrogateescape")
        opened = self.unseal(key, raw)
        return None if opened is None else opened[0]


def _same(a: str, b: str) -> bool:
    """``hmac.compare_digest`` of two strings, ``False`` where one is not ASCII."""
    try:
        return hmac.compare_digest(a, b)
    except TypeError:
        return False


_RECORD_FIELDS = tuple(f.name for f in fields(ConversationRecord))


def own_copy(state: ConversationRecord) -> ConversationRecord:
    """A store's own copy of a record (a shallow one: the handle's dict is shared, and never
    changed), its slots set one by one as ``__init__`` sets them."""
    new = object.__new__(ConversationRecord)
    set_ = object.__setattr__
    for name in _RECORD_FIELDS:
        set_(new, name, getattr(state, name))
    return new


class StateStore(Protocol):
    """Where conversation state lives between turns (TTL semantics in the module docstring)."""

    name: str

    async def get(self, key: str) -> ConversationRecord | None: ...

    async def put(self, key: str, state: ConversationRecord, keep_for: float) -> None: ...

    async def delete(self, key: str) -> ConversationRecord | None: ...

    async def get_many(self, keys: Sequence[str]) -> list[ConversationRecord | None]:
        """``get`` of each key, in order, in one round trip."""
        ...

    async def put_many(self, items: Sequence[PutItem]) -> None:
        """``put`` of each ``(key, state, keep_for)``, in one round trip."""
        ...

    async def renew_many(
        self, keys: Sequence[str], records: Sequence[ConversationRecord], expires_at: float, keep_for: float
    ) -> None:
        """Each ``keys[i]`` still present, read by ``get_many`` as ``records[i]``: lease end
        ``expires_at``, kept ``keep_for`` more seconds (a key gone meanwhile stays gone), in one
        round trip."""
        ...

    async def close(self) -> None: ...


class MemoryStore:
    """Bounded LRU with per-entry TTL, in this process (state is lost on restart).

    ``clock`` is injectable (monotonic seconds) so tests need no real time. At ``max_entries`` the
    least recently used entry is evicted.
    """

    name = "memory"
    local = True  # answers without I/O (see ``RouterRuntime.store_is_local``)

    #: An entry's deadline and record (``entry[0]``, ``entry[1]``), in C.
    _DEADLINE, _RECORD = itemgetter(0), itemgetter(1)

    @staticmethod
    def _drain(it: Iterable[object]) -> None:
        """Run an iterator to its end (the per-id work of a ``map`` in C, no Python loop)."""
        deque(it, maxlen=0)

    _own_copy = staticmethod(own_copy)

    def __init__(self, max_entries: int = 100_000, clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self._max = max_entries
        self._clock = clock
        #: key -> [deadline (clock seconds), the store's own copy of the record]
        self._data: OrderedDict[str, list[Any]] = OrderedDict()
        self.evictions = 0
        #: The keys (the caller's list object) and entries of the last ``get_many`` that found every
        #: key live, so its renewal finds the entries without a second lookup per key.
        self._last_read: tuple[Sequence[str], list[list[Any]]] | None = None

    def __len__(self) -> int:
        return len(self._data)

    async def get(self, key: str) -> ConversationRecord | None:
        return self._get(key, self._clock())

    def _get(self, key: str, now: float) -> ConversationRecord | None:
        item = self._data.get(key)
        if item is None:
            return None
        if now >= item[0]:
            del self._data[key]
            return None
        self._data.move_to_end(key)
        state: ConversationRecord = item[1]
        return state

    async def get_many(self, keys: Sequence[str]) -> list[ConversationRecord | None]:
        now = self._clock()
        data, move = self._data, self._data.move_to_end
        entries: list[list[Any] | None] = list(map(data.get, keys))
        live = list(filter(None, entries))  # an entry is a 2-item list: always true
        if not live:  # none known (an attacker's ids): nothing to move or expire
            return entries  # type: ignore[return-value]
        if min(map(self._DEADLINE, live)) > now:  # none expired (a keeper's renew): in C, per id
            self._drain(map(move, compress(keys, entries)))  # the LRU moves of the hits, in order
            if len(live) == len(entries):
                self._last_read = (keys, live)
                return list(map(self._RECORD, live))
            return [None if entry is None else entry[1] for entry in entries]
        out: list[ConversationRecord | None] = []
        append = out.append
        for key in keys:  # ``_get`` of each, inlined (some expired)
            entry = data.get(key)
            if entry is None:
                append(None)
            elif now >= entry[0]:
                del data[key]
                append(None)
            else:
                move(key)
                append(entry[1])
        return out

    async def put_many(self, items: Sequence[PutItem]) -> None:
        now = self._clock()
        for key, state, keep_for in items:
            self._put(key, state, keep_for, now)

    async def renew_many(
        self, keys: Sequence[str], records: Sequence[ConversationRecord], expires_at: float, keep_for: float
    ) -> None:
        """In place: the entry's deadline, and the lease end of the record this store holds (no new
        objects: a renew rewrites thousands). A key whose record a turn replaced since ``get_many``
        keeps the newer record as it is."""
        now = self._clock()
        deadline = now + keep_for
        data = self._data  # no LRU move: ``get_many`` of this renew made them recent
        set_ = object.__setattr__
        last, self._last_read = self._last_read, None
        # the entries that read these records where this renewal follows that read (no lookup per
        # key): an entry a turn replaced or a release removed since is no longer in ``data``, and
        # its record is not the one read or no longer stored, so renewing it changes nothing stored
        reuse = last is not None and last[0] is keys and len(records) == len(keys)
        entries: Iterable[list[Any] | None] = last[1] if reuse else map(data.get, keys)  # type: ignore[index]
        for key, entry, record in zip(keys, entries, records):
            if entry is None or entry[1] is not record:  # gone, or replaced meanwhile
                continue
            if now >= entry[0] or keep_for <= 0:
                if data.get(key) is entry:
                    del data[key]
                continue
            entry[0] = deadline
            # The one write to a stored record, and why it is safe: the store copied it on ``put``
            # (no caller's object changes), only its lease end moves, and a holder of it (a turn
            # or renew that read it) sees the lease as it now is. Set as ``__init__`` sets it.
            set_(record, "expires_at", expires_at)

    async def put(self, key: str, state: ConversationRecord, keep_for: float) -> None:
        self._put(key, state, keep_for, self._clock())

    def _put(self, key: str, state: ConversationRecord, keep_for: float, now: float) -> None:
        if keep_for <= 0:
            self._data.pop(key, None)
            return
        self._data[key] = [now + keep_for, self._own_copy(state)]
        self._data.move_to_end(key)
        while len(self._data) > self._max:
            self._data.popitem(last=False)
            self.evictions += 1

    async def delete(self, key: str) -> ConversationRecord | None:
        entry = self._data.pop(key, None)
        if entry is None or self._clock() >= entry[0]:
            return None
        record: ConversationRecord = entry[1]
        return record

    async def close(self) -> None:
        self._data.clear()
