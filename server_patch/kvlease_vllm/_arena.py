"""The host arena of a decode node: where leases live once their KV is written through to host memory.

Issue 30 moves D's leases out of GPU memory: when a request finishes with a lease, D copies its
blocks into one contiguous range of a host arena (``_arena_copy.demote``) and HBM becomes an
evictable cache over it. This module is the arena's budget, the sibling of the retention table
(:mod:`kvlease_vllm._retention`) for the host tier and of the staging buffer's
:class:`~kvlease_vllm._staging.RangeAllocator` for its byte ranges.

Sans-IO: every method takes ``now`` (D's lease clock, ``time.perf_counter``) and returns decisions;
nothing here sleeps, reads a clock, does IO or imports torch, and nothing is thread-safe (the
caller holds one lock around it, as for the retention table).

Rules:
- Ranges: one contiguous range per lease, its start and size rounded to ``align``. Best fit (the
  smallest hole that fits, the lowest address on a tie) and no compaction: a range's address is
  registered with NIXL and may be under a read, so ranges never move. Best rather than first fit
  because leases are long-lived and differ 24-fold in size (1k-24k tokens): best fit leaves the
  large holes a long conversation needs to the long conversations.
- Priority: a decaying score of the lease's touches (its creation, each renewal, each read pin),
  each worth 1 and halving every ``priority_half_life_s``. It is kept as the time ``p`` at which
  one touch would score what the lease scores now, ``p = H log2(sum 2^(t_i / H))``, so that leases
  compare alike at every ``now`` and no stored score ever decays: a lease touched once at ``t`` has
  priority ``t``; ``n`` touches at ``t`` give ``t + H log2 n``; a lease whose heartbeats stopped
  sinks below every lease touched in the last few half-lives. With the half-life at about a
  heartbeat period this is recency with a bonus for frequent use (SGLang replaced hard TTL pins by
  such a decaying priority; the hard end below bounds what heartbeats can buy).
- Deadlines are monotone (a renewal never shortens a lease) and capped by the hard end
  ``created_at + max_lease_lifetime_s`` whatever the heartbeats. A lease past its deadline or its
  hard end is gone at the next :meth:`HostArena.sweep` (reason ``expiry``, or ``lifetime`` when the
  cap was what ended it) and is never renewed again.
- The sweep pops a heap of (due time, lease) entries and re-checks each against the lease; a
  renewal pushes a new entry and leaves the old one stale. Nothing depends on the order leases were
  added or renewed in (vLLM issue #58222: a reaper that assumes entries sorted by expiry strands
  leases once heartbeats reorder them).
- Pressure: :meth:`HostArena.admit` sweeps first, then takes unpinned leases in priority order
  (lowest first) until freeing them would open a hole that fits the new lease (worked out on a
  copy of the holes), and evicts those of them that lie in that hole: never a lease of higher
  priority than the last one needed, never one whose eviction does not help, and nothing at all
  when even evicting every unpinned lease would not open a hole (pinned leases split the arena).
- Per-tenant quota: past ``tenant_quota_fraction`` of the capacity, counting the lease being
  admitted, a tenant's lowest-priority leases (down to the quota) are evicted under pressure before
  anyone else's, as in the retention table. Untagged leases count for no one.
- Read pins: a reader (a promotion into the staging buffer, a demotion still writing the range)
  pins the lease for at most ``max_pin_s``; a pinned lease is never evicted, expired or released
  under the read: its end waits for the pin to end or lapse (bounded by ``max_pin_s``).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Final

#: Arena ranges start on this boundary (bytes): a page, as the staging buffer's.
ALIGN: Final = 4096

#: The metric names issue 30 fixes (the numbers are :class:`ArenaCounters`; wiring comes later).
METRIC_HOST_BYTES_USED: Final = "kvlease_host_bytes_used"
METRIC_HOST_BYTES_CAPACITY: Final = "kvlease_host_bytes_capacity"
METRIC_EVICTIONS: Final = "kvlease_evictions_total"


class ArenaError(ValueError):
    """A bad argument to the arena (a configuration, a size, a time, a duplicate lease)."""


class DuplicateLease(ArenaError):
    """A lease id the arena already holds."""


class EvictReason(str, Enum):
    """Why a lease left the arena (the ``reason`` label of ``kvlease_evictions_total``)."""

    PRESSURE = "pressure"
    LIFETIME = "lifetime"
    EXPIRY = "expiry"
    RELEASE = "release"


class Refusal(str, Enum):
    """Why :meth:`HostArena.admit` did not admit a lease (D then keeps today's device hold or
    declines, and logs this)."""

    TOO_LARGE = "larger than the arena"
    PINNED = "the arena is held by pinned leases"


@dataclass(frozen=True)
class Eviction:
    lease_id: str
    reason: EvictReason
    nbytes: int
    tenant: str | None = None


@dataclass(frozen=True)
class AdmitResult:
    #: The lease's range in the arena (None: not admitted).
    offset: int | None
    #: Leases that left the arena during the admission: due ones first, then pressure evictions.
    evicted: tuple[Eviction, ...] = ()
    refusal: Refusal | None = None

    @property
    def admitted(self) -> bool:
        return self.offset is not None


@dataclass(frozen=True)
class ArenaCounters:
    bytes_used: int
    bytes_capacity: int
    evictions: dict[EvictReason, int]
    evicted_bytes: dict[EvictReason, int]
    refused: int

    def metrics(self) -> dict[str, float]:
        """The figures under their exported names (labels in Prometheus' text form)."""
        out = {METRIC_HOST_BYTES_USED: float(self.bytes_used)}
        out[METRIC_HOST_BYTES_CAPACITY] = float(self.bytes_capacity)
        for reason in EvictReason:
            out[f'{METRIC_EVICTIONS}{{reason="{reason.value}"}}'] = float(self.evictions[reason])
        return out


# ------------------------------------------------------------------------------------- allocator
class ArenaAllocator:
    """Best-fit byte ranges of one arena of ``capacity`` bytes (no compaction, no lock).

    Holes are kept sorted by address and coalesced on free. A range's size is ``nbytes`` rounded
    up to ``align``; the arena's tail past the last whole ``align`` is never handed out."""

    def __init__(self, capacity: int, align: int = ALIGN) -> None:
        if not isinstance(capacity, int) or capacity < 0:
            raise ArenaError(f"arena capacity must be an int >= 0, got {capacity!r}")
        if not isinstance(align, int) or align < 1:
            raise ArenaError(f"arena alignment must be an int >= 1, got {align!r}")
        self.capacity = capacity
        self.align = align
        usable = capacity // align * align
        self._holes: list[tuple[int, int]] = [(0, usable)] if usable else []  # (offset, size)
        self._ranges: dict[int, int] = {}  # offset -> size
        self.used = 0

    def size_of(self, nbytes: int) -> int:
        return -(-nbytes // self.align) * self.align

    def fits(self, nbytes: int) -> bool:
        return self._best(self.size_of(nbytes)) is not None

    @property
    def largest_hole(self) -> int:
        return max((size for _, size in self._holes), default=0)

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a range of ``nbytes``, or None when no hole fits."""
        if nbytes <= 0:
            raise ArenaError(f"a range needs nbytes > 0, got {nbytes}")
        size = self.size_of(nbytes)
        i = self._best(size)
        if i is None:
            return None
        offset, hole = self._holes[i]
        if hole == size:
            del self._holes[i]
        else:
            self._holes[i] = (offset + size, hole - size)
        self._ranges[offset] = size
        self.used += size
        return offset

    def free(self, offset: int) -> int:
        """Return the range at ``offset`` to the holes (coalesced); its size. KeyError if none."""
        size = self._ranges.pop(offset)
        self.used -= size
        i = bisect.bisect_left(self._holes, (offset, 0))
        start, end = offset, offset + size
        if i < len(self._holes) and self._holes[i][0] == end:
            end += self._holes.pop(i)[1]
        if i > 0 and sum(self._holes[i - 1]) == start:
            start = self._holes.pop(i - 1)[0]
            i -= 1
        self._holes.insert(i, (start, end - start))
        return size

    def holes(self) -> list[tuple[int, int]]:
        return list(self._holes)

    def copy(self) -> ArenaAllocator:
        other = ArenaAllocator.__new__(ArenaAllocator)
        other.capacity, other.align, other.used = self.capacity, self.align, self.used
        other._holes, other._ranges = list(self._holes), dict(self._ranges)
        return other

    def _best(self, size: int) -> int | None:
        best: int | None = None
        for i, (_, hole) in enumerate(self._holes):
            if hole >= size and (best is None or hole < self._holes[best][1]):
                best = i
        return best


# ------------------------------------------------------------------------------------------ table
def raise_priority(priority: float, touched_at: float, half_life_s: float) -> float:
    """The priority after one more touch at ``touched_at``: ``H log2(2^(p/H) + 2^(t/H))``,
    computed without overflow (the larger term factored out)."""
    hi, lo = max(priority, touched_at), min(priority, touched_at)
    return hi + half_life_s * math.log2(1.0 + 2.0 ** ((lo - hi) / half_life_s))


@dataclass
class ArenaLease:
    lease_id: str
    nbytes: int
    offset: int
    size: int  # nbytes rounded up to the arena's alignment
    created_at: float
    deadline: float
    hard_end: float  # created_at + max_lease_lifetime_s: no renewal goes past it
    priority: float
    tenant: str | None = None
    #: reader -> pinned until (each bounded by the arena's ``max_pin_s``).
    pins: dict[str, float] = field(default_factory=dict)
    release_pending: bool = False  # released while pinned: ends when the pins do
    gen: int = 0  # tells this lease's heap entries from those of an earlier lease of the same id

    def pinned(self, now: float) -> bool:
        return any(until > now for until in self.pins.values())

    def pinned_until(self) -> float:
        return max(self.pins.values(), default=-math.inf)


@dataclass
class HostArena:
    """The lease budget of one arena of ``capacity`` bytes (one per worker, its shard's bytes)."""

    capacity: int
    max_lease_lifetime_s: float = 4 * 3600.0
    max_ttl: float = 3600.0
    #: A lease within this long of its deadline is not renewed (the worker may free it any moment).
    renew_guard: float = 0.0
    priority_half_life_s: float = 30.0
    #: Share of ``capacity`` one tenant tag may hold before its leases go first under pressure.
    tenant_quota_fraction: float = 0.5
    #: The longest a read pin holds, whatever its reader asks.
    max_pin_s: float = 30.0
    align: int = ALIGN
    _alloc: ArenaAllocator = field(init=False)
    _leases: dict[str, ArenaLease] = field(default_factory=dict, init=False)
    _heap: list[tuple[float, int, str]] = field(default_factory=list, init=False)
    _gen: int = field(default=0, init=False)
    _evictions: dict[EvictReason, int] = field(init=False)
    _evicted_bytes: dict[EvictReason, int] = field(init=False)
    _refused: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        for name in ("max_lease_lifetime_s", "max_ttl", "priority_half_life_s", "max_pin_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise ArenaError(f"{name} must be a finite number > 0, got {value!r}")
        if not (isinstance(self.renew_guard, (int, float)) and 0 <= self.renew_guard < math.inf):
            raise ArenaError(f"renew_guard must be a finite number >= 0, got {self.renew_guard!r}")
        if not 0 < self.tenant_quota_fraction <= 1:
            raise ArenaError(f"tenant_quota_fraction must be in (0, 1], got {self.tenant_quota_fraction!r}")
        self._alloc = ArenaAllocator(self.capacity, self.align)
        self._evictions = dict.fromkeys(EvictReason, 0)
        self._evicted_bytes = dict.fromkeys(EvictReason, 0)

    # ---------------------------------------------------------------- queries
    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._leases

    def __iter__(self) -> Iterator[ArenaLease]:
        return iter(list(self._leases.values()))

    def get(self, lease_id: str) -> ArenaLease | None:
        return self._leases.get(lease_id)

    @property
    def bytes_used(self) -> int:
        return self._alloc.used

    def holes(self) -> list[tuple[int, int]]:
        """The free ranges, (offset, size) by address."""
        return self._alloc.holes()

    def by_tenant(self) -> dict[str | None, tuple[int, int]]:
        """(leases, bytes) per tenant tag (None: the untagged leases)."""
        out: dict[str | None, tuple[int, int]] = {}
        for lease in self._leases.values():
            n, b = out.get(lease.tenant, (0, 0))
            out[lease.tenant] = (n + 1, b + lease.size)
        return out

    def counters(self) -> ArenaCounters:
        return ArenaCounters(
            bytes_used=self._alloc.used,
            bytes_capacity=self.capacity,
            evictions=dict(self._evictions),
            evicted_bytes=dict(self._evicted_bytes),
            refused=self._refused,
        )

    def live(self, lease_id: str, now: float) -> bool:
        """Whether the lease's bytes may be served now (held, not due, no release pending)."""
        lease = self._leases.get(lease_id)
        return lease is not None and not lease.release_pending and now < lease.deadline

    # -------------------------------------------------------------- mutations
    def admit(
        self, lease_id: str, nbytes: int, ttl: float, now: float, *, tenant: str | None = None
    ) -> AdmitResult:
        """Give ``lease_id`` a range of ``nbytes`` until ``now + ttl`` (a request finished on D).

        Sweeps first (due leases go before live ones), then evicts under pressure; a refusal
        evicts nothing but the due leases."""
        _check_time(now)
        _check_ttl(ttl)
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ArenaError(f"a lease needs nbytes > 0, got {nbytes!r}")
        if lease_id in self._leases:
            raise DuplicateLease(f"lease {lease_id!r} is already in the arena")
        evicted = self.sweep(now)
        size = self._alloc.size_of(nbytes)
        if not self._alloc.fits(nbytes):
            if size > self.capacity // self.align * self.align:
                return self._refuse(evicted, Refusal.TOO_LARGE)
            plan = self._pressure_plan(size, now, tenant)
            if plan is None:
                return self._refuse(evicted, Refusal.PINNED)
            for victim in plan:
                evicted.append(self._evict(victim, EvictReason.PRESSURE))
        offset = self._alloc.alloc(nbytes)
        assert offset is not None, "the eviction plan was checked on a copy of the holes"
        self._gen += 1
        hard_end = now + self.max_lease_lifetime_s
        lease = ArenaLease(
            lease_id,
            nbytes,
            offset,
            size,
            created_at=now,
            deadline=min(now + min(ttl, self.max_ttl), hard_end),
            hard_end=hard_end,
            priority=now,
            tenant=tenant,
            gen=self._gen,
        )
        self._leases[lease_id] = lease
        self._push(lease.deadline, lease)
        return AdmitResult(offset, tuple(evicted))

    def renew(self, lease_id: str, ttl: float, now: float, *, tenant: str | None = None) -> float | None:
        """A heartbeat: extend to ``now + ttl`` (never shorter, never past the hard end) and raise
        the priority; the deadline, or None if the lease is unknown, due or being released."""
        _check_time(now)
        _check_ttl(ttl)
        lease = self._leases.get(lease_id)
        if lease is None or lease.release_pending or now + self.renew_guard >= lease.deadline:
            return None
        new = min(max(lease.deadline, now + min(ttl, self.max_ttl)), lease.hard_end)
        if new != lease.deadline:
            lease.deadline = new
            self._push(new, lease)
        lease.priority = raise_priority(lease.priority, now, self.priority_half_life_s)
        if tenant is not None:
            lease.tenant = tenant
        return lease.deadline

    def pin(self, lease_id: str, reader: str, now: float, hold_s: float) -> float | None:
        """Pin a live lease for ``reader`` (a read of its range) for at most ``max_pin_s``; the pin's
        end, or None (unknown, due or being released: do not read). Pinning counts as a touch."""
        _check_time(now)
        if not (hold_s > 0 and math.isfinite(hold_s)):
            raise ArenaError(f"a pin needs a finite hold_s > 0, got {hold_s!r}")
        if not self.live(lease_id, now):
            return None
        lease = self._leases[lease_id]
        until = max(lease.pins.get(reader, -math.inf), now + min(hold_s, self.max_pin_s))
        lease.pins[reader] = until
        lease.priority = raise_priority(lease.priority, now, self.priority_half_life_s)
        return until

    def unpin(self, lease_id: str, reader: str, now: float) -> bool:
        """The read is over (False: no such pin). A lease due meanwhile ends at the next sweep."""
        _check_time(now)
        lease = self._leases.get(lease_id)
        if lease is None or lease.pins.pop(reader, None) is None:
            return False
        if not lease.pinned(now):
            self._push(now, lease)  # a deferred end is due as soon as the last pin goes
        return True

    def release(self, lease_id: str, now: float) -> bool:
        """Free the lease's range (the conversation is done); False if unknown. A pinned lease
        ends when its pins do (the next sweep after that carries it out)."""
        _check_time(now)
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        if lease.pinned(now):
            lease.release_pending = True
            self._push(lease.pinned_until(), lease)
            return True
        self._evict(lease, EvictReason.RELEASE)
        return True

    def sweep(self, now: float) -> list[Eviction]:
        """End every lease that is due at ``now`` (deadline, hard end, or a release deferred by a
        pin) and not pinned; O(log n) per heap entry, whatever order deadlines were set in."""
        _check_time(now)
        out: list[Eviction] = []
        while self._heap and self._heap[0][0] <= now:
            _, gen, lease_id = heapq.heappop(self._heap)
            lease = self._leases.get(lease_id)
            if lease is None or lease.gen != gen:
                continue  # the lease is gone (or an earlier one of the same id)
            if not lease.release_pending and now < lease.deadline:
                continue  # renewed since: its newer entry is in the heap
            if lease.pinned(now):
                self._push(lease.pinned_until(), lease)
                continue
            if lease.release_pending:
                reason = EvictReason.RELEASE
            elif lease.deadline >= lease.hard_end:
                reason = EvictReason.LIFETIME
            else:
                reason = EvictReason.EXPIRY
            out.append(self._evict(lease, reason))
        if len(self._heap) > 2 * len(self._leases) + 64:
            self._compact_heap()
        return out

    # --------------------------------------------------------------- internal
    def _push(self, due: float, lease: ArenaLease) -> None:
        heapq.heappush(self._heap, (due, lease.gen, lease.lease_id))

    def _compact_heap(self) -> None:
        """Drop stale entries: one per lease, at its current due time."""
        entries = []
        for lease in self._leases.values():
            due = lease.deadline
            if lease.release_pending:
                due = -math.inf
            entries.append((max(due, lease.pinned_until()), lease.gen, lease.lease_id))
        heapq.heapify(entries)
        self._heap = entries

    def _evict(self, lease: ArenaLease, reason: EvictReason) -> Eviction:
        del self._leases[lease.lease_id]
        self._alloc.free(lease.offset)
        self._evictions[reason] += 1
        self._evicted_bytes[reason] += lease.size
        return Eviction(lease.lease_id, reason, lease.nbytes, lease.tenant)

    def _refuse(self, evicted: list[Eviction], why: Refusal) -> AdmitResult:
        self._refused += 1
        return AdmitResult(None, tuple(evicted), why)

    def _over_quota(self, adding: tuple[str | None, int]) -> set[str]:
        """Ids of the leases that put their tenant over its quota: per tenant tag past
        ``tenant_quota_fraction`` of the capacity (counting ``adding``, the (tag, bytes) of the
        lease being admitted), its lowest-priority leases down to the quota."""
        quota = self.tenant_quota_fraction * self.capacity
        by_tenant: dict[str, list[ArenaLease]] = {}
        for lease in self._leases.values():
            if lease.tenant is not None:
                by_tenant.setdefault(lease.tenant, []).append(lease)
        over: set[str] = set()
        for tag, leases in by_tenant.items():
            excess = sum(x.size for x in leases) - quota + (adding[1] if tag == adding[0] else 0)
            for lease in sorted(leases, key=_priority_order):
                if excess <= 0:
                    break
                over.add(lease.lease_id)
                excess -= lease.size
        return over

    def _pressure_plan(self, size: int, now: float, tenant: str | None) -> list[ArenaLease] | None:
        """The unpinned leases to evict, in eviction order (over-quota first, then the rest; lowest
        priority first within each), up to the first one after which a hole fits ``size``; None
        when evicting every unpinned lease would not make one."""
        over = self._over_quota((tenant, size))
        order = sorted(
            (x for x in self._leases.values() if not x.pinned(now)),
            key=lambda x: (x.lease_id not in over, *_priority_order(x)),
        )
        scratch = self._alloc.copy()
        for i, lease in enumerate(order):
            scratch.free(lease.offset)
            if scratch.largest_hole >= size:
                # the hole the allocator will pick; victims outside it would be evicted for nothing
                start, length = min((h for h in scratch.holes() if h[1] >= size), key=lambda h: h[1])
                return [x for x in order[: i + 1] if start <= x.offset < start + length]
        return None


def _priority_order(lease: ArenaLease) -> tuple[float, float, str]:
    """Eviction order: lowest priority first; then the nearer deadline; then the id (a total order,
    so that no tie falls back on insertion order)."""
    return (lease.priority, lease.deadline, lease.lease_id)


def _check_time(now: float) -> None:
    if not (isinstance(now, (int, float)) and math.isfinite(now)):
        raise ArenaError(f"now must be a finite number, got {now!r}")


def _check_ttl(ttl: float) -> None:
    if not (isinstance(ttl, (int, float)) and ttl > 0 and math.isfinite(ttl)):
        raise ArenaError(f"ttl must be a finite number > 0, got {ttl!r}")
