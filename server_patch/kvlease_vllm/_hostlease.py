"""D's scheduler side of host placement (``kvlease.placement`` ``auto`` / ``host``).

When a leased request finishes, D's scheduler gives the lease a range of the host arena
(:class:`~kvlease_vllm._arena.HostArena`, the lease budget) and orders its workers to copy the
blocks there (a :class:`Demotion`, in the next step's connector metadata). In that same
``build_connector_meta`` it drops its own references on the blocks, which go back to vLLM as
ordinary reusable blocks: prefix-cached and evictable, or free.

Why this order is safe with no report back from the workers:
- vLLM allocates a step's blocks before it builds the step's connector metadata, so blocks given
  back in step N's metadata are allocated at step N + 1 at the earliest;
- every step's metadata names the blocks allocated in it (:func:`allocated_blocks`), and a worker
  reads it before the step's forward is queued: it makes that forward wait for any demotion still
  copying one of those blocks, and bumps each block's generation, so a device copy is trusted for
  a pull only while the generations it was written through with are unchanged (checked again after
  the gather, as the staged path checks the lease);
- arena ranges: every eviction is a :data:`DROPS_ATTR` order sent no later than the demotion that
  reuses its range, and a worker applies drops before demotions and runs its arena copies in one
  stream order (``_worker_arena``), so a promotion never reads another lease's bytes.

Pure: no vLLM, no torch; the desk (:class:`~kvlease_vllm._desk.LeaseDesk`) calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from kvlease_vllm._arena import AdmitResult, Eviction, EvictReason, HostArena

#: Connector-metadata attributes D's scheduler sets for its workers (absent: nothing to do).
DEMOTES_ATTR: Final = "kvlease_demotes"  # tuple[Demotion, ...]
DROPS_ATTR: Final = "kvlease_arena_drops"  # tuple[str, ...]: leases that left the arena
ALLOCATED_ATTR: Final = "kvlease_allocated"  # tuple[int, ...]: blocks allocated this step
#: Reader name of a claim without a claimant (one anonymous reader at a time, as the table's).
ANONYMOUS: Final = "-"


@dataclass(frozen=True)
class Demotion:
    """A worker's order: copy ``block_ids`` (the lease's blocks, in the handle's order) into the
    arena at ``offset``; ``nbytes`` is what the scheduler budgeted (the worker checks its shard
    fits); ``device_ok``: the device copy may serve pulls while intact (``auto``; ``host``: never)."""

    lease_id: str
    offset: int
    nbytes: int
    block_ids: tuple[int, ...]
    device_ok: bool


@dataclass
class HostLeases:
    """The host arena's budget and the orders not yet sent to the workers (not thread-safe)."""

    arena: HostArena
    #: Bytes of one block in one worker's shard (every KV region's row).
    block_bytes: int
    device_ok: bool
    _demotes: list[Demotion] = field(default_factory=list)
    _drops: list[str] = field(default_factory=list)
    demotions: int = 0
    demotion_bytes: int = 0

    def admit(
        self, lease_id: str, block_ids: Sequence[int], ttl: float, now: float, tenant: str | None
    ) -> tuple[AdmitResult, Demotion | None]:
        """Place a finished request's lease; its demotion order, or None (refused: keep the device
        hold). The result's ``evicted`` leases left the arena (the caller releases them)."""
        nbytes = len(block_ids) * self.block_bytes
        if nbytes <= 0:
            return AdmitResult(None), None
        result = self.arena.admit(lease_id, nbytes, ttl, now, tenant=tenant)
        self._gone(result.evicted)
        if result.offset is None:
            return result, None
        order = Demotion(lease_id, result.offset, nbytes, tuple(int(b) for b in block_ids), self.device_ok)
        self._demotes.append(order)
        self.demotions += 1
        self.demotion_bytes += nbytes
        return result, order

    def renew(
        self, lease_id: str, ttl: float, now: float, *, pin: bool, claimant: str | None, tenant: str | None
    ) -> None:
        """A renewal the table granted: a touch (priority), and a read pin for a claim."""
        if lease_id not in self.arena:
            return
        if pin:
            self.arena.pin(lease_id, claimant or ANONYMOUS, now, ttl)
        self.arena.renew(lease_id, ttl, now, tenant=tenant)

    def unpin(self, lease_id: str, claimant: str, now: float) -> None:
        self.arena.unpin(lease_id, claimant, now)

    def release(self, lease_id: str, now: float) -> list[Eviction]:
        """An explicit or early release (pinned: when the pins end, at a later sweep); the leases
        that left the arena (each one a drop order)."""
        lease = self.arena.get(lease_id)
        if lease is None or not self.arena.release(lease_id, now):
            return []
        out = self.sweep(now)
        if lease_id not in self.arena:  # unpinned: it left at once
            now_gone = Eviction(lease_id, EvictReason.RELEASE, lease.nbytes, lease.tenant)
            self._gone((now_gone,))
            out.insert(0, now_gone)
        return out

    def forget(self, lease_ids: Iterable[str], now: float) -> list[Eviction]:
        """The workers ended these leases (read, expired, released): their ranges are free now,
        whatever pins remain (the pins were for reads that are over)."""
        out: list[Eviction] = []
        for lid in lease_ids:
            lease = self.arena.get(lid)
            if lease is None:
                continue
            lease.pins.clear()
            self.arena.release(lid, now)
            out.append(Eviction(lid, EvictReason.RELEASE, lease.nbytes, lease.tenant))
        self._gone(out)
        return out + self.sweep(now)

    def sweep(self, now: float) -> list[Eviction]:
        evicted = self.arena.sweep(now)
        self._gone(evicted)
        return evicted

    def take_orders(self) -> tuple[tuple[str, ...], tuple[Demotion, ...]]:
        """(drops, demotions) since the last call: a worker applies the drops first. A lease that
        left the arena before its order was taken is not demoted (it stays held on the device until
        the workers end it)."""
        live = [
            d for d in self._demotes if (x := self.arena.get(d.lease_id)) is not None and x.offset == d.offset
        ]
        drops, demotes = tuple(self._drops), tuple(live)
        self._drops.clear()
        self._demotes.clear()
        return drops, demotes

    def _gone(self, evicted: Iterable[Eviction]) -> None:
        self._drops.extend(e.lease_id for e in evicted)


def allocated_blocks(scheduler_output: Any) -> tuple[int, ...]:
    """Every block id vLLM allocated (or handed out from its prefix cache) in this step: new and
    resumed requests' blocks, running requests' new blocks, every KV cache group. A superset of the
    blocks this step may write."""
    out: list[int] = []
    for req in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
        for group in req.block_ids or ():
            out.extend(group)
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    for groups in getattr(cached, "new_block_ids", None) or ():
        for group in groups or ():
            out.extend(group)
    return tuple(out)
