"""The lease desk of a decode node: the retention table (device blocks) and, with host placement,
the host arena's budget (:mod:`kvlease_vllm._hostlease`), shared by the scheduler thread and the
control endpoint's threads under one short lock.

A lease placed in the host arena is in both: the table keeps its deadline, claims and tenant (what
the control endpoint and the workers' expiry sweep already speak) with 0 device blocks once its
blocks were given back; the arena keeps its bytes, its priority (renewals and claims raise it)
and its hard end. A lease the arena evicts (pressure, lifetime, expiry) is released in the table,
so the workers end it and the SDK's next renewal answers ``expired``.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable, Sequence
from typing import Final

from kvlease.protocol import LEASE_STATUS_MAX_TENANTS, LeaseStatus, TenantLeases
from kvlease_vllm._arena import Eviction
from kvlease_vllm._hostlease import Demotion, HostLeases
from kvlease_vllm._metrics import ConnectorMetrics
from kvlease_vllm._retention import AddResult, RetentionTable

#: Ids renewed per hold of the lock the scheduler shares.
RENEW_CHUNK: Final = 256

__all__ = ["RENEW_CHUNK", "LeaseDesk"]


class LeaseDesk:
    """A :class:`RetentionTable` shared by the scheduler thread and the control endpoint's threads."""

    def __init__(
        self,
        table: RetentionTable,
        metrics: ConnectorMetrics,
        clock: Callable[[], float] = time.perf_counter,
        host: HostLeases | None = None,
    ) -> None:
        self._table = table
        #: The host arena's budget (``kvlease.placement`` auto / host), None without an arena.
        self.host = host
        self._lock = threading.Lock()
        self.metrics = metrics
        self.clock = clock
        metrics.capacity_blocks.set(table.capacity_blocks)

    # control endpoint side
    def renew(
        self,
        ids: tuple[str, ...],
        ttl: float,
        *,
        pin: bool = False,
        claimant: str | None = None,
        deadlines: dict[str, float] | None = None,
        tenant: str | None = None,
    ) -> dict[str, float | None]:
        """Seconds left per id (None: unknown, or claimed by another reader); ``deadlines``, when
        given, receives the absolute deadlines (this clock) of the leases renewed. ``tenant``: the
        opaque tenant tag the leases are counted under (the per-tenant retention quota; a lease is
        tagged at creation already, :meth:`add`).

        The scheduler shares the lock, so it is taken per :data:`RENEW_CHUNK` ids and holds only the
        table updates; the answer is built outside it (a 10,000-id renew never holds the scheduler
        for more than one chunk's worth of dict updates)."""
        out: dict[str, float | None] = {}
        table = self._table
        for start in range(0, len(ids), RENEW_CHUNK):
            chunk = ids[start : start + RENEW_CHUNK]
            with self._lock:
                now = self.clock()
                got = [table.renew(lid, ttl, now, pin=pin, claimant=claimant, tenant=tenant) for lid in chunk]
                if self.host is not None:
                    for lid, deadline in zip(chunk, got):
                        if deadline is not None:
                            self.host.renew(lid, ttl, now, pin=pin, claimant=claimant, tenant=tenant)
            for lid, deadline in zip(chunk, got):
                out[lid] = None if deadline is None else deadline - now
                if deadline is not None and deadlines is not None:
                    deadlines[lid] = deadline
        ok = sum(v is not None for v in out.values())
        self.metrics.renewals.labels("ok").inc(ok)
        self.metrics.renewals.labels("unknown").inc(len(out) - ok)
        return out

    def release(self, ids: tuple[str, ...], cause: str = "request") -> int:
        with self._lock:
            now = self.clock()
            n = sum(self._table.release(lid, now) for lid in ids)
            if self.host is not None:
                for lid in ids:
                    self._evicted(self.host.release(lid, now), now)
            self._gauges()
        self.metrics.releases.labels(cause).inc(n)
        return n

    def unclaim(self, ids: tuple[str, ...], claimant: str) -> int:
        """``claimant`` will not read these leases after all: end its pins (the leases stay)."""
        with self._lock:
            now = self.clock()
            if self.host is not None:
                for lid in ids:
                    self.host.unpin(lid, claimant, now)
            return sum(self._table.unpin(lid, claimant, now) for lid in ids)

    # scheduler side
    def add(self, lease_id: str, blocks: int, deadline: float, tenant: str | None = None) -> AddResult:
        """A finished request's lease, tagged at creation with ``tenant`` (the router's opaque tag
        from D's request, :func:`kvlease.protocol.tenant_tag_of`; None: untagged)."""
        with self._lock:
            result = self._table.add(lease_id, blocks, deadline, self.clock(), tenant=tenant)
            self._gauges()
        if result.released:
            self.metrics.releases.labels("cap").inc(len(result.released))
        return result

    def forget(self, lease_ids: set[str] | list[str]) -> None:
        if not lease_ids:
            return
        with self._lock:
            for lid in lease_ids:
                self._table.forget(lid)
            if self.host is not None:
                self._evicted(self.host.forget(lease_ids, self.clock()), self.clock())
            self._gauges()

    def relieve(self, blocks_needed: int, *, limit: int | None = None) -> list[str]:
        with self._lock:
            released = self._table.relieve(blocks_needed, self.clock(), limit=limit)
            self._gauges()
        if released:
            self.metrics.releases.labels("pressure").inc(len(released))
        return released

    def take_updates(self) -> dict[str, float]:
        with self._lock:
            now = self.clock()
            self._table.sweep(now)
            if self.host is not None:
                self._evicted(self.host.sweep(now), now)
                self._gauges()
            return self._table.take_updates()

    # host placement (scheduler side)
    def place_host(
        self, lease_id: str, block_ids: Sequence[int], tenant: str | None
    ) -> tuple[Demotion | None, str]:
        """Admit a lease the table holds into the host arena (its demotion order), or None and why
        not (the lease then stays held on the device). Leases evicted to make room are released."""
        assert self.host is not None
        with self._lock:
            now = self.clock()
            left = self._table.expires_in(lease_id, now)
            if left is None:
                return None, "the lease already ended"
            result, order = self.host.admit(lease_id, block_ids, left, now, tenant)
            self._evicted(result.evicted, now)
            self._gauges()
        if order is None:
            return None, result.refusal.value if result.refusal else "nothing to place"
        self.metrics.demotions.inc()
        self.metrics.demotion_bytes.inc(order.nbytes)
        return order, ""

    def unhold(self, lease_ids: Sequence[str]) -> None:
        """The scheduler gave these leases' device blocks back to vLLM (they were written through)."""
        with self._lock:
            for lid in lease_ids:
                self._table.unhold(lid)
            self._gauges()

    def take_orders(self) -> tuple[tuple[str, ...], tuple[Demotion, ...]]:
        """The workers' arena orders since the last step: (drops, demotions)."""
        if self.host is None:
            return (), ()
        with self._lock:
            return self.host.take_orders()

    def in_arena(self, lease_id: str) -> bool:
        return self.host is not None and lease_id in self.host.arena

    def _evicted(self, evicted: Sequence[Eviction], now: float) -> None:
        """Leases that left the arena end (held lock): released in the table, counted."""
        for e in evicted:
            self._table.release(e.lease_id, now)
            self.metrics.evictions.labels(e.reason.value).inc()

    def held(self) -> bool:
        """Any lease held (a lock-free peek for the scheduler's hot path)."""
        return len(self._table) > 0

    def releasing_blocks(self) -> int:
        with self._lock:
            return self._table.releasing_blocks

    def snapshot(self) -> tuple[int, int]:
        """(leases, retained blocks)."""
        with self._lock:
            return len(self._table), self._table.retained_blocks

    def status(self) -> LeaseStatus:
        """The table per tenant tag, for ``GET /info`` (bounded: the top
        :data:`~kvlease.protocol.LEASE_STATUS_MAX_TENANTS` tags by blocks)."""
        table = self._table
        with self._lock:
            counts = table.by_tenant()
            leases, retained = len(table), table.retained_blocks
        n, b = counts.pop(None, (0, 0))
        top = heapq.nsmallest(LEASE_STATUS_MAX_TENANTS, counts.items(), key=lambda kv: (-kv[1][1], kv[0]))
        return LeaseStatus(
            leases=leases,
            retained_blocks=retained,
            capacity_blocks=table.capacity_blocks,
            tenant_quota_blocks=int(table.tenant_quota_fraction * table.capacity_blocks),
            tenant_count=len(counts),
            untagged=TenantLeases(None, n, b),
            tenants=tuple(TenantLeases(tag, tn, tb) for tag, (tn, tb) in top),
        )

    def _gauges(self) -> None:
        self.metrics.leases.set(len(self._table))
        self.metrics.retained_blocks.set(self._table.retained_blocks)
        self.metrics.device_blocks_held.set(self._table.retained_blocks)
        if self.host is not None:
            self.metrics.host_bytes_used.set(self.host.arena.bytes_used)
            self.metrics.host_bytes_capacity.set(self.host.arena.capacity)
