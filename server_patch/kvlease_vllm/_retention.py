"""The lease table of a decode node: which finished requests' KV blocks are retained, until when.

Sans-IO: every method takes ``now`` (the scheduler's ``time.perf_counter()``, the clock vLLM stamps
``remote_blocks_expiry_time`` with) and returns decisions; nothing here sleeps, reads a clock or
does IO, and nothing is thread-safe (the control endpoint wraps it in a lock).

Rules:
- Deadlines are monotone: a renewal never shortens a lease (``max(old, now + ttl)``).
- A released or forgotten lease is gone: renewing it answers "unknown" (never resurrected).
- A lease within ``renew_guard`` of its deadline is not renewed (the worker may free it any moment,
  and a renewal that arrives after the free would make the router trust freed blocks).
- Retained blocks are capped: adding past the cap releases the oldest-deadline leases first
  (pinned leases, claimed by a prefill node that is about to read them, are never released early);
  if that is not enough the new lease is not retained.
- Per-tenant quota: a lease carries an opaque tenant tag from its creation (the router's tag on D's
  request; a renewal or claim that names a tag sets it too). Past ``tenant_quota_fraction`` of the
  cap, counting the lease being added, a tenant's oldest leases (down to the quota) are released
  early before anyone else's, so one tenant filling the cap pushes out its own leases, not others',
  whether or not it ever renews. Untagged leases (stock requests, an older router) count for no one.
- Every deadline change is queued for the workers (:meth:`take_updates`), which run the expiry
  sweep; a release is a deadline of "now".
- Claims are exclusive: while one claimant's pin holds, another claim is refused (the same
  claimant may claim again while its read waits). A release of a pinned lease is deferred until
  the pin ends (:meth:`sweep` carries it out); a deferred lease renews as "unknown".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

#: Released leases whose free the worker never confirms are forgotten after this long.
RELEASING_GRACE_S: Final = 120.0


@dataclass
class Lease:
    lease_id: str
    blocks: int
    deadline: float
    pinned_until: float = -math.inf
    claimant: str | None = None
    release_pending: bool = False  # released while pinned: freed when the pin ends
    #: Opaque tag of the tenant (the router's, on D's request; renewals and claims name it too).
    tenant: str | None = None
    #: No renewal goes past it (``max_lifetime`` after the lease was added).
    hard_end: float = math.inf
    #: False once its device blocks were given back (host placement): pressure relief skips it.
    held: bool = True

    def pinned(self, now: float) -> bool:
        return self.pinned_until > now


@dataclass(frozen=True)
class AddResult:
    retained: bool
    #: Other leases released early to make room (oldest deadline first).
    released: tuple[str, ...] = ()


@dataclass
class RetentionTable:
    capacity_blocks: int
    max_ttl: float = 3600.0
    renew_guard: float = 2.0
    #: Share of ``capacity_blocks`` one tenant tag may hold before its leases (its oldest, down to
    #: the quota) are the first released early under pressure.
    tenant_quota_fraction: float = 0.5
    #: A lease's whole life, whatever its renewals (``kvlease.max_lease_lifetime_s``).
    max_lifetime: float = math.inf
    _leases: dict[str, Lease] = field(default_factory=dict)
    #: lease id -> (blocks, released at): released, free not yet confirmed by the workers.
    _releasing: dict[str, tuple[int, float]] = field(default_factory=dict)
    _updates: dict[str, float] = field(default_factory=dict)
    _retained: int = 0

    def __post_init__(self) -> None:
        if self.capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")

    # ---------------------------------------------------------------- queries
    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._leases

    def __iter__(self) -> Iterator[Lease]:
        return iter(list(self._leases.values()))

    @property
    def retained_blocks(self) -> int:
        return self._retained

    @property
    def releasing_blocks(self) -> int:
        return sum(b for b, _ in self._releasing.values())

    def get(self, lease_id: str) -> Lease | None:
        return self._leases.get(lease_id)

    def by_tenant(self) -> dict[str | None, tuple[int, int]]:
        """(leases, blocks) per tenant tag (None: the untagged leases)."""
        out: dict[str | None, tuple[int, int]] = {}
        for lease in self._leases.values():
            n, b = out.get(lease.tenant, (0, 0))
            out[lease.tenant] = (n + 1, b + lease.blocks)
        return out

    def expires_in(self, lease_id: str, now: float) -> float | None:
        lease = self._leases.get(lease_id)
        if lease is None or lease.deadline <= now:
            return None
        return lease.deadline - now

    # -------------------------------------------------------------- mutations
    def add(
        self, lease_id: str, blocks: int, deadline: float, now: float, *, tenant: str | None = None
    ) -> AddResult:
        """Retain ``blocks`` for ``lease_id`` until ``deadline`` (a request finished on D), counted
        under ``tenant`` (the opaque tag of D's request, None: untagged)."""
        if blocks < 0:
            raise ValueError("blocks must be >= 0")
        if lease_id in self._leases or lease_id in self._releasing:
            raise ValueError(f"lease {lease_id!r} already exists")
        need = self._retained + blocks - self.capacity_blocks
        released: list[str] = []
        if need > 0:
            if blocks > self.capacity_blocks or self._releasable_blocks(now) < need:
                return AddResult(False)
            released = self._release_oldest(need, now, adding=(tenant, blocks))
        hard_end = now + self.max_lifetime
        self._leases[lease_id] = Lease(
            lease_id, blocks, min(deadline, hard_end), tenant=tenant, hard_end=hard_end
        )
        self._retained += blocks
        return AddResult(True, tuple(released))

    def renew(
        self,
        lease_id: str,
        ttl: float,
        now: float,
        *,
        pin: bool = False,
        claimant: str | None = None,
        tenant: str | None = None,
    ) -> float | None:
        """Extend to ``now + ttl`` (never shorter); return the deadline, or None if unknown.

        ``pin`` (a prefill node's claim before its read) also protects the lease from early release
        for ``ttl`` seconds. A claim is refused (None) while another claimant's pin holds; an
        anonymous claim (``claimant`` None) never matches a held pin.
        """
        lease = self._leases.get(lease_id)
        if lease is None or not ttl > 0 or now + self.renew_guard >= lease.deadline or lease.release_pending:
            return None
        if pin and lease.pinned(now) and (claimant is None or lease.claimant != claimant):
            return None  # exclusive: someone else is reading it
        ttl = min(ttl, self.max_ttl)
        new = min(max(lease.deadline, now + ttl), lease.hard_end)
        if new != lease.deadline:
            lease.deadline = new
            self._updates[lease_id] = new
        if pin:
            lease.pinned_until = max(lease.pinned_until, now + ttl)
            lease.claimant = claimant
        if tenant is not None:
            lease.tenant = tenant
        return lease.deadline

    def release(self, lease_id: str, now: float) -> bool:
        """Free the lease's blocks now (explicit release or early release); False if unknown.

        A pinned lease (a prefill node is reading it) is not freed under the read: the release is
        deferred until the pin ends (True: it will be released).
        """
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        if lease.pinned(now):
            lease.release_pending = True
            return True
        del self._leases[lease_id]
        self._retained -= lease.blocks
        self._releasing[lease_id] = (lease.blocks, now)
        self._updates[lease_id] = now
        return True

    def unpin(self, lease_id: str, claimant: str, now: float) -> bool:
        """``claimant`` will not read the lease after all: its pin ends now (the lease stays, a
        deferred release then goes ahead at the next :meth:`sweep`); False if it holds no pin."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.claimant != claimant or not lease.pinned(now):
            return False
        lease.pinned_until, lease.claimant = -math.inf, None
        return True

    def unhold(self, lease_id: str) -> int:
        """D no longer holds the lease's device blocks (written through to the host arena and given
        back to vLLM): they leave the cap and pressure relief; the lease stays. Blocks let go."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return 0
        blocks, lease.blocks, lease.held = lease.blocks, 0, False
        self._retained -= blocks
        return blocks

    def forget(self, lease_id: str) -> bool:
        """The workers freed the blocks (read by a prefill node, expired or released)."""
        self._updates.pop(lease_id, None)
        if self._releasing.pop(lease_id, None) is not None:
            return True
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._retained -= lease.blocks
        return True

    def relieve(self, blocks_needed: int, now: float, *, limit: int | None = None) -> list[str]:
        """Release unpinned leases, oldest deadline first, until ``blocks_needed`` are freed.

        ``limit``: release at most that many (emergency relief frees one lease per allocation
        failure, the oldest unpinned one).
        """
        if blocks_needed <= 0:
            return []
        return self._release_oldest(blocks_needed, now, limit=limit)

    def sweep(self, now: float) -> list[str]:
        """Drop entries the workers should long have freed (bounded memory); return their ids."""
        for lease in [x for x in self._leases.values() if x.release_pending and not x.pinned(now)]:
            self.release(lease.lease_id, now)  # the deferred release, now that the pin ended
        gone = [lid for lid, (_, at) in self._releasing.items() if now - at > RELEASING_GRACE_S]
        for lid in gone:
            del self._releasing[lid]
        stale = [lid for lid, lease in self._leases.items() if now - lease.deadline > RELEASING_GRACE_S]
        for lid in stale:
            self.forget(lid)
        return gone + stale

    def take_updates(self) -> dict[str, float]:
        """Deadline changes since the last call (for the workers' expiry sweep)."""
        out, self._updates = self._updates, {}
        return out

    # --------------------------------------------------------------- internal
    def _releasable_blocks(self, now: float) -> int:
        return sum(lease.blocks for lease in self._leases.values() if not lease.pinned(now))

    def _over_quota(self, adding: tuple[str | None, int] = (None, 0)) -> set[str]:
        """Ids of the leases that put their tenant over its quota: per tenant tag past
        ``tenant_quota_fraction`` of the capacity, its oldest leases down to the quota.
        ``adding``: the (tag, blocks) of the lease being added, which counts towards its tenant's
        share (it is the newest, so its tenant's older leases are the ones that go)."""
        quota = self.tenant_quota_fraction * self.capacity_blocks
        by_tenant: dict[str, list[Lease]] = {}
        for lease in self._leases.values():
            if lease.tenant is not None:
                by_tenant.setdefault(lease.tenant, []).append(lease)
        over: set[str] = set()
        for tag, leases in by_tenant.items():
            excess = sum(lease.blocks for lease in leases) - quota + (adding[1] if tag == adding[0] else 0)
            for lease in sorted(leases, key=lambda lease: (lease.deadline, lease.lease_id)):
                if excess <= 0:
                    break
                over.add(lease.lease_id)
                excess -= lease.blocks
        return over

    def _release_oldest(
        self, need: int, now: float, limit: int | None = None, adding: tuple[str | None, int] = (None, 0)
    ) -> list[str]:
        """Unpinned leases in early-release order: those over their tenant's quota first, then
        the rest; oldest deadline first within each."""
        over = self._over_quota(adding)
        order = sorted(  # a lease in the host arena holds no device block
            (lease for lease in self._leases.values() if lease.held and not lease.pinned(now)),
            key=lambda lease: (lease.lease_id not in over, lease.deadline, lease.lease_id),
        )
        released: list[str] = []
        freed = 0
        for lease in order:
            if freed >= need or (limit is not None and len(released) >= limit):
                break
            self.release(lease.lease_id, now)
            freed += lease.blocks
            released.append(lease.lease_id)
        return released


class BlockRefs:
    """D: kvlease's own references on leased requests' blocks (``kvlease.own_block_refs``), so the
    finished request needs no delayed free and leaves vLLM's scheduler at once. ``pool`` is vLLM's
    ``BlockPool`` (``touch`` takes a reference, ``free_blocks`` drops one)."""

    def __init__(self) -> None:
        self._held: dict[str, list[int]] = {}
        #: Leases whose blocks were given back early (host placement): still ours to report.
        self._given: set[str] = set()

    def take(self, pool: Any, rid: str, groups: Iterable[Iterable[int]]) -> None:
        """One reference per block P may read (upstream hands out only those)."""
        ids = list(dict.fromkeys(int(b) for g in groups for b in g))
        pool.touch([pool.blocks[i] for i in ids])
        self._held[rid] = ids

    def drop(self, pool: Any, rids: Iterable[str]) -> list[str]:
        """Drop the references of those of ``rids`` held here (read, expired or released); returns
        them. Tail first, so the shared prefix is evicted last."""
        dropped = [rid for rid in rids if rid in self._held or rid in self._given]
        for rid in dropped:
            self._given.discard(rid)
            ids = self._held.pop(rid, None)
            if pool is not None and ids is not None:
                pool.free_blocks(pool.blocks[i] for i in reversed(ids))
        return dropped

    def give_back(self, pool: Any, rids: Iterable[str]) -> None:
        """Drop the references now (the lease lives on in the host arena); the lease's end is still
        reported as ours by :meth:`drop`."""
        for rid in rids:
            ids = self._held.pop(rid, None)
            if ids is None:
                continue
            self._given.add(rid)
            if pool is not None:
                pool.free_blocks(pool.blocks[i] for i in reversed(ids))
