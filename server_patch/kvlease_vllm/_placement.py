"""The scheduler's glue for host placement (``kvlease.placement``), on both sides of a pull.

D (:class:`HostPlacer`): which finished leases go to the host arena, the orders each step carries
to the workers, and the device blocks given back once ordered (see :mod:`kvlease_vllm._hostlease`
for why no report back is needed). A lease stays held on the device, per request and logged, when
its placement cannot be proven: no staging buffer on every worker (the arena is served through
it), several KV cache groups (hybrid / sliding-window models), a sequence longer than the staging
buffer, or an arena that refused it (too large, held by pinned leases).

P (:func:`host_pull_refusal`): a host-placed handle is read by a staged pull or not at all.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Final

from kvlease_vllm._arena import HostArena
from kvlease_vllm._config import PLACEMENT_AUTO, PLACEMENT_DEVICE, KVLeaseConfig
from kvlease_vllm._desk import LeaseDesk
from kvlease_vllm._hostlease import ALLOCATED_ATTR, DEMOTES_ATTR, DROPS_ATTR, HostLeases, allocated_blocks
from kvlease_vllm._metrics import ConnectorMetrics
from kvlease_vllm._retention import BlockRefs

#: How often the scheduler recounts the intact device copies (``kvlease_device_blocks_cached``).
CACHED_RECOUNT_S: Final = 1.0


def host_leases(cfg: KVLeaseConfig, kv_role: str | None, block_bytes: int) -> HostLeases | None:
    """D's arena budget, or None (device placement, or not a decode node)."""
    placement = cfg.resolved_placement()
    if placement == PLACEMENT_DEVICE or kv_role not in ("kv_consumer", "kv_both") or block_bytes <= 0:
        return None
    arena = HostArena(
        cfg.host_arena_bytes,
        max_lease_lifetime_s=cfg.max_lease_lifetime_s,
        max_ttl=cfg.max_ttl_s,
        renew_guard=cfg.renew_guard_s,
        tenant_quota_fraction=cfg.tenant_quota_fraction,
        max_pin_s=cfg.claim_hold_s,
    )
    return HostLeases(arena, block_bytes=block_bytes, device_ok=placement == PLACEMENT_AUTO)


class HostPlacer:
    """D's scheduler: places finished leases, carries the orders, gives the blocks back."""

    def __init__(
        self, desk: LeaseDesk, refs: BlockRefs, metrics: ConnectorMetrics, cfg: KVLeaseConfig
    ) -> None:
        self.desk, self.refs, self.metrics, self.cfg = desk, refs, metrics, cfg
        #: Leases given back, with each block's prefix-cache hash then (for the cached gauge).
        self._given: dict[str, list[tuple[int, Any]]] = {}
        self._counted_at = 0.0

    @property
    def enabled(self) -> bool:
        return self.desk.host is not None

    def unplaceable(
        self, *, staging_ports: Sequence[int] | None, multi_group: bool, num_tokens: int, own_refs: bool
    ) -> str | None:
        """Why this lease stays held on the device (None: it may go to the arena)."""
        if not staging_ports:
            return "D's workers advertise no staging buffer (the arena is served through it)"
        if multi_group:
            return "several KV cache groups (hybrid or sliding-window model)"
        if not own_refs:
            return "D does not hold the blocks with its own reference"
        if num_tokens > self.cfg.staging_max_tokens:
            return f"{num_tokens} tokens exceed kvlease.staging_max_tokens ({self.cfg.staging_max_tokens})"
        return None

    def place(self, rid: str, block_ids: Sequence[int], tenant: str | None) -> str | None:
        """Admit the lease into the arena; None when placed, else why not (kept on the device)."""
        order, why = self.desk.place_host(rid, block_ids, tenant)
        if order is None:
            self.metrics.placements.labels("device_fallback").inc()
            return f"the host arena refused it: {why}"
        self.metrics.placements.labels("host").inc()
        return None

    def attach(self, meta: Any, scheduler_output: Any, pool: Any) -> None:
        """This step's orders on the workers' metadata; the ordered leases' blocks given back."""
        drops, demotes = self.desk.take_orders()
        setattr(meta, ALLOCATED_ATTR, allocated_blocks(scheduler_output))
        if drops:
            setattr(meta, DROPS_ATTR, drops)
        if not demotes:
            self._count_cached(pool)
            return
        setattr(meta, DEMOTES_ATTR, demotes)
        rids = [d.lease_id for d in demotes]
        if pool is not None and self.cfg.resolved_placement() == PLACEMENT_AUTO:
            for d in demotes:
                self._given[d.lease_id] = [(b, pool.blocks[b].block_hash) for b in d.block_ids]
        # vLLM allocated this step's blocks before building its metadata: these are reused at the
        # next step at the earliest, whose metadata the workers read before it writes them
        self.refs.give_back(pool, rids)
        self.desk.unhold(rids)
        self._count_cached(pool, force=True)

    def forget(self, rids: Sequence[str] | set[str]) -> None:
        for rid in rids:
            self._given.pop(rid, None)

    def _count_cached(self, pool: Any, force: bool = False) -> None:
        """``kvlease_device_blocks_cached``: blocks of given-back leases still free and still
        holding the hash they were given back with (recounted at most once a second)."""
        now = time.monotonic()
        if pool is None or (not force and now - self._counted_at < CACHED_RECOUNT_S):
            return
        self._counted_at = now
        n = 0
        for blocks in self._given.values():
            for b, h in blocks:
                block = pool.blocks[b]
                n += int(h is not None and block.ref_cnt == 0 and block.block_hash == h)
        self.metrics.device_blocks_cached.set(n)


def host_pull_refusal(cfg: KVLeaseConfig, staging_ports: Sequence[int] | None, tokens: int) -> str | None:
    """P: why a host-placed lease cannot be read here (None: a staged pull may read it)."""
    if cfg.staging == "off":
        return "D placed the lease in its host arena, which only a staged pull reads, and kvlease.staging is off here"
    if not staging_ports:
        return "D placed the lease in its host arena but advertises no staging port"
    if tokens > cfg.staging_max_tokens:
        return f"{tokens} tokens exceed this node's kvlease.staging_max_tokens ({cfg.staging_max_tokens})"
    return None
