"""The worker's bookkeeping types: one staged pull in flight on P (:class:`_Staged`), a READ given
up on while posted (:class:`_Abandoned`), and upstream's NIXL stats with kvlease's figures
(:class:`KVLeaseStats`)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvlease.protocol._staging import STAGED_FROM_DEVICE, StagingReply
from kvlease_vllm._compat import NixlKVConnectorStats
from kvlease_vllm._metrics import STAT_KEYS

_ASK = "ask"


class KVLeaseStats(NixlKVConnectorStats):  # type: ignore[misc]
    """Upstream's NIXL connector stats with kvlease's keys (:data:`STAT_KEYS`), so that every
    worker's stats aggregate alike and a step with only kvlease's figures is still sent."""

    def reset(self) -> None:
        super().reset()
        for key in STAT_KEYS:
            self.data[key] = []

    def is_empty(self) -> bool:
        return bool(super().is_empty()) and not any(self.data.get(k) for k in STAT_KEYS)

    def record(self, key: str, value: float) -> None:
        self.__dict__.setdefault("data", {}).setdefault(key, []).append(value)


@dataclass
class _Staged:
    """P side: one staged pull, from the request to D until the scatter is done."""

    meta: Any  # upstream's ReqMeta
    future: Future[StagingReply]
    deadline: float
    host: str
    port: int
    agent: str  # D's NIXL agent (upstream's, from its handshake)
    notif: bytes  # upstream's completion notification for D
    local_ids: list[int]
    slot: int  # P's staging range
    offset: int
    nbytes: int
    read_by: float  # P uses the READ only if it is seen done by then (D holds its range longer)
    stage: str = _ASK
    reply: StagingReply | None = None
    handle: Any = None
    event: Any = None
    t0: float = field(default_factory=time.perf_counter)
    source: str = STAGED_FROM_DEVICE  # where D's bytes came from (StagingReply.source)


@dataclass
class _Abandoned:
    """P side: a READ given up on while posted; its handle and P's range are kept until it ends."""

    rid: str
    engine_id: str
    slot: int
