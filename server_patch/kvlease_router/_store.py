"""Conversation state stores: the interface and the in-memory implementation.

A store maps a tenant-scoped conversation key (see ``_identity``) to the last
:class:`ConversationRecord` the router saw for it. TTL semantics, for every backend:

* ``put(key, state, keep_for)`` replaces the state; after ``keep_for`` seconds ``get`` returns
  ``None`` (the entry is gone). ``keep_for`` is the lease plus a grace period, so the router can tell
  ``expired`` (state present, ``state.expires_at`` passed) from ``first`` (no state).
* ``get`` never extends the TTL. ``delete`` returns what it removed.
* A backend failure raises :class:`StoreError`; callers degrade to the miss path.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

import orjson

__all__ = ["ConversationRecord", "MemoryStore", "StateStore", "StoreError"]


class StoreError(RuntimeError):
    """The state backend failed (unreachable, timed out, corrupt entry)."""


@dataclass(frozen=True)
class ConversationRecord:
    """What the router remembers about one conversation between turns."""

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

    def without_handle(self) -> ConversationRecord:
        return replace(self, params=None, lease_id=None, control=None, tokens=0)

    def dumps(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def loads(cls, raw: bytes | str) -> ConversationRecord:
        try:
            data = orjson.loads(raw)
            params = data["params"]
            return cls(
                decode=data["decode"],
                params=params if isinstance(params, dict) else None,
                lease_id=data["lease_id"],
                control=data["control"],
                tokens=int(data["tokens"]),
                expires_at=float(data["expires_at"]),
                continuity=data.get("continuity"),
                prefix_len=int(data.get("prefix_len", 0)),
                turns=int(data.get("turns", 1)),
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise StoreError(f"corrupt state entry: {e}") from e


class StateStore(Protocol):
    """Where conversation state lives between turns (TTL semantics in the module docstring)."""

    name: str

    async def get(self, key: str) -> ConversationRecord | None: ...

    async def put(self, key: str, state: ConversationRecord, keep_for: float) -> None: ...

    async def delete(self, key: str) -> ConversationRecord | None: ...

    async def close(self) -> None: ...


class MemoryStore:
    """Bounded LRU with per-entry TTL, in this process (state is lost on restart).

    ``clock`` is injectable (monotonic seconds) so tests need no real time. At ``max_entries`` the
    least recently used entry is evicted.
    """

    name = "memory"
    local = True  # answers without I/O (see ``RouterRuntime.store_is_local``)

    def __init__(self, max_entries: int = 100_000, clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self._max = max_entries
        self._clock = clock
        self._data: OrderedDict[str, tuple[float, ConversationRecord]] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._data)

    async def get(self, key: str) -> ConversationRecord | None:
        item = self._data.get(key)
        if item is None:
            return None
        deadline, state = item
        if self._clock() >= deadline:
            del self._data[key]
            return None
        self._data.move_to_end(key)
        return state

    async def put(self, key: str, state: ConversationRecord, keep_for: float) -> None:
        if keep_for <= 0:
            self._data.pop(key, None)
            return
        self._data[key] = (self._clock() + keep_for, state)
        self._data.move_to_end(key)
        while len(self._data) > self._max:
            self._data.popitem(last=False)
            self.evictions += 1

    async def delete(self, key: str) -> ConversationRecord | None:
        item = self._data.pop(key, None)
        if item is None or self._clock() >= item[0]:
            return None
        return item[1]

    async def close(self) -> None:
        self._data.clear()
