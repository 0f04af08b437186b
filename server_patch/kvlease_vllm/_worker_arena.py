"""D's worker side of host placement: the arena's memory, demotions, and where a pull's bytes come from.

The scheduler (:mod:`kvlease_vllm._hostlease`) decides; a worker carries out, per step, in
``handle_preemptions`` (vLLM calls it with the step's connector metadata before the step zeroes,
copies or writes any block, also in steps without a forward):

1. every block the step allocated gets a new generation, and the step's compute stream waits for
   any demotion still reading one of them;
2. leases that left the arena are dropped from this worker's map (before any demotion reuses
   their range);
3. each demotion snapshots its blocks' generations and copies them into the arena on the arena
   stream, after the engine's mark (the step that wrote the last token).

A staged pull (the staging thread, :meth:`ArenaStore.read_plan`) then reads, for a lease whose
device blocks D no longer holds:
- the device copy, when the placement allows it (``auto``) and its generations still equal the
  snapshot; the gather is checked again after it ran (:meth:`ArenaStore.intact`), and a copy
  reused meanwhile is promoted from the arena instead;
- otherwise the arena, promoted into the staging buffer (:meth:`ArenaStore.promote`), ordered after
  the lease's demotion by the arena stream (on CPU the copies are synchronous under one lock).
A lease D still holds (``device`` placement, or one the arena refused) is gathered as before, with
the same generation check around the gather.

On CUDA the arena is pinned host memory (allocated once, at start); it is not registered with
NIXL: P never reads it directly (a NIXL READ of pinned host memory on one host ran at 0.9 GB/s on
an H200, a promotion at 55 GB/s); P reads the staging buffer as for a device-held lease.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch

from kvlease.protocol._staging import STAGED_FROM_DEVICE, STAGED_FROM_HOST
from kvlease_vllm import _arena_copy
from kvlease_vllm._config import ConfigError, check_arena_memory
from kvlease_vllm._hostlease import ALLOCATED_ATTR, DEMOTES_ATTR, DROPS_ATTR, Demotion

logger = logging.getLogger("vllm.kvlease.arena")  # under vLLM's handler inside a server

#: Why a read was not served (the staging refusal's detail).
REUSED: Final = "the device copy was reused and the lease is not in the host arena"


@dataclass
class _Placed:
    """One lease whose device blocks D gave back (``offset`` None: not in the arena)."""

    block_ids: tuple[int, ...]
    gens: tuple[int, ...]  # the blocks' generations when the scheduler let them go
    device_ok: bool
    offset: int | None
    nbytes: int = 0
    copy: _arena_copy.CopyHandle | None = None
    started: float = 0.0

    def positions(self, block_ids: Sequence[int]) -> list[int] | None:
        index = {b: i for i, b in enumerate(self.block_ids)}
        out = [index.get(int(b), -1) for b in block_ids]
        return None if -1 in out else out


@dataclass(frozen=True)
class ReadPlan:
    """Where a staged read of a lease comes from: ``source`` device (gather the blocks, then
    check :meth:`ArenaStore.intact` with ``gens``) or host (promote); ``refusal`` when neither."""

    source: str | None
    gens: tuple[int, ...] = ()
    refusal: str | None = None


class ArenaStore:
    """One worker's arena and block generations (the engine thread and the staging thread share
    it under one lock)."""

    def __init__(
        self,
        nbytes: int,
        views: Sequence[torch.Tensor],
        region_bytes: Sequence[int],
        *,
        pin: bool,
        stream: Any = None,
        on_demoted: Callable[[float], None] | None = None,
    ) -> None:
        self.on_demoted = on_demoted
        self.arena = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) if nbytes else None
        self.capacity = nbytes
        self.views = list(views)
        self.region_bytes = tuple(region_bytes)
        self.block_bytes = sum(self.region_bytes)
        self.stream = stream
        self._lock = threading.Lock()
        self._gen: dict[int, int] = {}
        self._placed: dict[str, _Placed] = {}
        #: Demotions not yet seen done (the only ones a step may have to wait for, or time).
        self._pending: list[_Placed] = []
        self._by_offset: dict[int, str] = {}

    # -------------------------------------------------------------- engine thread
    def before_step(self, meta: Any, mark: Callable[[], Any]) -> None:
        """The step's orders (see the module docstring), before the step touches any block."""
        allocated = getattr(meta, ALLOCATED_ATTR, None) or ()
        drops = getattr(meta, DROPS_ATTR, None) or ()
        demotes: Sequence[Demotion] = getattr(meta, DEMOTES_ATTR, None) or ()
        with self._lock:
            if allocated:
                self._bump(allocated)
            for rid in drops:
                self._drop_range(rid)
            if demotes:
                after = mark()
                for order in demotes:
                    self._demote(order, after)
        self._timings()

    def forget(self, live: Callable[[str], bool]) -> None:
        """Once a step: leases that ended on this worker are no longer placed."""
        with self._lock:
            for rid in [r for r in self._placed if not live(r)]:
                self._drop_range(rid)
                del self._placed[rid]

    def placed(self, rid: str) -> bool:
        return rid in self._placed

    def wait(self, rid: str) -> bool:
        """Block until the lease's demotion is done (tests and benchmarks); False: not demoted."""
        with self._lock:
            placed = self._placed.get(rid)
            copy = placed.copy if placed is not None else None
        if copy is None:
            return False
        copy.wait()
        return True

    def _bump(self, allocated: Iterable[int]) -> None:
        gen = self._gen
        for b in allocated:
            gen[b] = gen.get(b, 0) + 1
        if self.stream is not None and self._pending:  # a block still being demoted: the step waits
            blocks = set(allocated)
            for p in self._pending:
                if p.copy is not None and p.copy.event is not None and not blocks.isdisjoint(p.block_ids):
                    torch.cuda.current_stream().wait_event(p.copy.event)

    def _drop_range(self, rid: str) -> None:
        placed = self._placed.get(rid)
        if placed is not None and placed.offset is not None:
            self._by_offset.pop(placed.offset, None)
            placed.offset = None

    def _demote(self, order: Demotion, after: Any) -> None:
        gens = tuple(self._gen.get(b, 0) for b in order.block_ids)
        placed = _Placed(order.block_ids, gens, order.device_ok, None)
        self._placed[order.lease_id] = placed
        need = len(order.block_ids) * self.block_bytes
        if self.arena is None or need > order.nbytes or order.offset + need > self.capacity:
            logger.warning(
                "kvlease %s: not written through (%d bytes of this worker's shard, %d budgeted, arena "
                "of %d); served from the device copy while it is intact",
                order.lease_id,
                need,
                order.nbytes,
                self.capacity,
            )
            return
        for other in [
            r
            for off, r in self._by_offset.items()
            if off < order.offset + need and order.offset < off + self._placed[r].nbytes
        ]:
            self._drop_range(other)  # the scheduler dropped it already; never two leases in a range
        placed.started = time.perf_counter()
        placed.copy = _arena_copy.demote(
            self.views, order.block_ids, self.arena, order.offset, stream=self.stream, after=after
        )
        placed.offset, placed.nbytes = order.offset, need
        self._by_offset[order.offset] = order.lease_id
        self._pending.append(placed)

    def _timings(self) -> None:
        """The demotion histogram, for copies seen done (CUDA: polled once a step)."""
        now = time.perf_counter()
        with self._lock:
            done: list[_Placed] = []
            still: list[_Placed] = []
            for p in self._pending:
                (done if p.copy is None or p.copy.done() else still).append(p)
            self._pending = still
        if self.on_demoted is not None:
            for p in done:
                self.on_demoted(now - p.started)

    # -------------------------------------------------------------- staging thread
    def read_plan(self, rid: str, block_ids: Sequence[int]) -> ReadPlan:
        """Where a read of ``block_ids`` of lease ``rid`` comes from now."""
        with self._lock:
            placed = self._placed.get(rid)
            gens = tuple(self._gen.get(int(b), 0) for b in block_ids)
            if placed is None:  # D holds the blocks: the device copy, checked after the gather
                return ReadPlan(STAGED_FROM_DEVICE, gens)
            positions = placed.positions(block_ids)
            if positions is None:
                return ReadPlan(None, refusal="a block the lease does not have")
            if placed.device_ok and gens == tuple(placed.gens[i] for i in positions):
                return ReadPlan(STAGED_FROM_DEVICE, gens)
            if placed.offset is None:
                return ReadPlan(None, refusal=REUSED)
            return ReadPlan(STAGED_FROM_HOST)

    def intact(self, block_ids: Sequence[int], gens: Sequence[int]) -> bool:
        """After a gather: no step allocated any of the blocks since ``gens`` were read."""
        with self._lock:
            return all(self._gen.get(int(b), 0) == g for b, g in zip(block_ids, gens))

    def promote(self, rid: str, block_ids: Sequence[int], staging: torch.Tensor, staging_offset: int) -> bool:
        """Copy the lease's ``block_ids`` from the arena into ``staging[staging_offset:]``, laid out
        as a gather; False when the lease is no longer in the arena."""
        with self._lock:
            placed = self._placed.get(rid)
            if placed is None or placed.offset is None or self.arena is None:
                return False
            positions = placed.positions(block_ids)
            if positions is None:
                return False
            plan = _arena_copy.promote_plan(self.region_bytes, len(placed.block_ids), positions)
            after = None
            if self.stream is not None:  # ordered by the arena stream alone, not the compute stream
                after = torch.cuda.Event()
                after.record(self.stream)
            handle = _arena_copy.promote_pieces(
                self.arena, placed.offset, plan, staging, staging_offset, stream=self.stream, after=after
            )
        handle.wait()  # the arena stream orders it after the demotion and before any later one
        return True

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                "placed": len(self._placed),
                "in_arena": sum(p.offset is not None for p in self._placed.values()),
                "arena_bytes": self.capacity,
            }


def stage_lease(
    arena: ArenaStore | None,
    copier: Any,
    staging: torch.Tensor,
    rid: str,
    block_ids: Sequence[int],
    offset: int,
    after: Any,
    live: Callable[[str], bool],
) -> tuple[str | None, str]:
    """D's staging thread: lay the lease's ``block_ids`` out at ``staging[offset:]``, from the
    device copy while it is provably intact (the gather by ``copier``, a
    :class:`~kvlease_vllm._stagecopy.StagingCopier`, after ``after``; checked again after it ran),
    else from the host arena. The source (``device`` / ``host``), or None and why."""
    plan = arena.read_plan(rid, block_ids) if arena is not None else ReadPlan(STAGED_FROM_DEVICE)
    if plan.source == STAGED_FROM_DEVICE:
        copier.gather(block_ids, offset, after=after)
        if not live(rid):  # expired during the gather: the blocks may be reused
            return None, "expired while staging"
        if arena is None or arena.intact(block_ids, plan.gens):
            return STAGED_FROM_DEVICE, ""
        plan = ReadPlan(STAGED_FROM_HOST)  # a step took a block during the gather
    if plan.source != STAGED_FROM_HOST:
        return None, plan.refusal or "not staged"
    assert arena is not None
    if not arena.promote(rid, block_ids, staging, offset) or not live(rid):
        return None, "the lease left the host arena"
    return STAGED_FROM_HOST, ""


def available_host_bytes() -> int:
    """Host memory available to new allocations now (``MemAvailable``; else free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def allocate_arena(
    nbytes: int,
    views: Sequence[torch.Tensor],
    region_bytes: Sequence[int],
    *,
    device: torch.device,
    workers_on_host: int,
    on_demoted: Callable[[float], None] | None = None,
) -> ArenaStore:
    """This worker's arena, checked against host memory first; a :class:`ConfigError` naming
    ``kvlease.host_arena_bytes`` when it does not fit or cannot be allocated (pinned on CUDA)."""
    check_arena_memory(
        arena_bytes=nbytes, workers_on_host=workers_on_host, available_bytes=available_host_bytes()
    )
    cuda = device.type == "cuda"
    try:
        stream = torch.cuda.Stream(device=device) if cuda else None
        return ArenaStore(nbytes, views, region_bytes, pin=cuda, stream=stream, on_demoted=on_demoted)
    except (RuntimeError, MemoryError) as e:
        raise ConfigError(
            f"kvlease.host_arena_bytes={nbytes}: the host arena could not be allocated "
            f"({'pinned, ' if cuda else ''}{type(e).__name__}: {e}); lower it, or set it to 0"
        ) from e
