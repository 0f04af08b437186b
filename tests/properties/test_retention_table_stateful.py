"""Lease table invariants under random operation sequences (hypothesis stateful testing).

Drives the decode node's :class:`RetentionTable` (connector) and the router's :class:`MemoryStore` with
random operations on an advancing clock, and checks after every step: no renewal after release,
deadlines monotone under renew, the retention cap respected, pinned leases never released early.
"""

from __future__ import annotations

import math
from collections.abc import Coroutine
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvlease_router import ConversationRecord, MemoryStore
from kvlease_vllm._retention import RELEASING_GRACE_S, RetentionTable

IDS = st.sampled_from([f"l{i}" for i in range(8)])
STATEFUL = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


class RetentionTableMachine(RuleBasedStateMachine):
    @initialize(
        capacity=st.integers(0, 40),
        max_ttl=st.floats(1.0, 100.0),
        guard=st.sampled_from([0.0, 0.5, 2.0]),
    )
    def setup(self, capacity: int, max_ttl: float, guard: float) -> None:
        self.table = RetentionTable(capacity, max_ttl=max_ttl, renew_guard=guard)
        self.now = 1000.0
        self.gone: set[str] = set()  # released or forgotten: must never come back through renew
        self.deadline: dict[str, float] = {}  # last deadline seen per live lease
        self.deferred: set[str] = set()  # released while pinned: freed once the pin ends

    # ---- clock
    @rule(dt=st.floats(0.0, 30.0))
    def advance(self, dt: float) -> None:
        self.now += dt

    # ---- operations
    @rule(lid=IDS, blocks=st.integers(0, 15), ttl=st.floats(0.1, 60.0))
    def add(self, lid: str, blocks: int, ttl: float) -> None:
        if lid in self.table or lid in self.gone:
            return  # ids are single use (vLLM request ids); a duplicate is a caller bug, tested elsewhere
        pinned = {lease.lease_id for lease in self.table if lease.pinned(self.now)}
        before = {lease.lease_id: lease.deadline for lease in self.table}
        result = self.table.add(lid, blocks, self.now + ttl, self.now)
        assert not set(result.released) & pinned, "a pinned lease was released early"
        # early release takes the oldest deadlines first
        released_deadlines = [before[r] for r in result.released]
        assert released_deadlines == sorted(released_deadlines)
        kept = [d for r, d in before.items() if r not in result.released and r not in pinned]
        if result.released and kept:
            assert max(released_deadlines) <= min(kept)
        self.gone |= set(result.released)
        for r in result.released:
            self.deadline.pop(r, None)
        if result.retained:
            self.deadline[lid] = self.now + ttl
        else:
            assert lid not in self.table

    @rule(lid=IDS, ttl=st.floats(-1.0, 200.0), pin=st.booleans())
    def renew(self, lid: str, ttl: float, pin: bool) -> None:
        old = self.table.get(lid)
        old_deadline = old.deadline if old else None
        got = self.table.renew(lid, ttl, self.now, pin=pin)
        if lid in self.gone or old is None:
            assert got is None, "a released or unknown lease was renewed"
            assert lid not in self.table
            return
        assert old_deadline is not None
        if got is None:  # refused: unknown, bad ttl, or within the guard of its deadline
            assert self.table.get(lid) is None or self.table.get(lid).deadline == old_deadline  # type: ignore[union-attr]
            return
        assert got >= old_deadline, "a renewal shortened a lease"
        assert got <= max(old_deadline, self.now + self.table.max_ttl) + 1e-9
        self.deadline[lid] = got

    @rule(lid=IDS)
    def release(self, lid: str) -> None:
        lease = self.table.get(lid)
        assert self.table.release(lid, self.now) == (lease is not None)
        if lease is None:
            return
        assert self.table.renew(lid, 10.0, self.now) is None, "a released lease was renewed"
        if lid in self.table:  # a prefill node is reading it: freed when its pin ends
            assert lease.pinned(self.now) and lease.release_pending
            self.deferred.add(lid)
        else:
            self.gone.add(lid)
            self.deadline.pop(lid, None)

    @rule(lid=IDS)
    def forget(self, lid: str) -> None:
        if self.table.forget(lid):
            self.gone.add(lid)
            self.deadline.pop(lid, None)

    @rule(need=st.integers(-5, 50))
    def relieve(self, need: int) -> None:
        pinned = {lease.lease_id for lease in self.table if lease.pinned(self.now)}
        released = self.table.relieve(need, self.now)
        assert not set(released) & pinned
        if need <= 0:
            assert released == []
        self.gone |= set(released)
        for r in released:
            self.deadline.pop(r, None)

    @rule()
    def sweep(self) -> None:
        for lid in self.table.sweep(self.now):
            self.gone.add(lid)
            self.deadline.pop(lid, None)

    @rule()
    def take_updates(self) -> None:
        updates = self.table.take_updates()
        assert all(math.isfinite(v) for v in updates.values())
        assert self.table.take_updates() == {}

    # ---- invariants
    @invariant()
    def cap_respected_and_accounting_exact(self) -> None:
        leases = list(self.table)
        assert self.table.retained_blocks == sum(lease.blocks for lease in leases)
        assert self.table.retained_blocks <= self.table.capacity_blocks

    @invariant()
    def released_never_resurrected(self) -> None:
        assert not {lease.lease_id for lease in self.table} & self.gone

    @invariant()
    def deadlines_monotone(self) -> None:
        for lease in self.table:
            assert lease.deadline >= self.deadline[lease.lease_id]
            self.deadline[lease.lease_id] = lease.deadline

    @invariant()
    def deferred_releases_settle(self) -> None:
        """A lease released under a pin is never renewed, and a sweep after its pin frees it."""
        for lid in list(self.deferred):
            lease = self.table.get(lid)
            if lease is not None and not lease.pinned(self.now):
                self.table.sweep(self.now)
                assert lid not in self.table, "a deferred release outlived its pin"
            if lid not in self.table:
                self.deferred.discard(lid)
                self.gone.add(lid)
                self.deadline.pop(lid, None)

    @invariant()
    def sweep_bounds_memory(self) -> None:
        """Leases long past their deadline are dropped by the next sweep (the worker missed them)."""
        if any(self.now - lease.deadline > RELEASING_GRACE_S for lease in self.table):
            self.sweep()
            assert all(self.now - lease.deadline <= RELEASING_GRACE_S for lease in self.table)


TestRetentionTable = RetentionTableMachine.TestCase
TestRetentionTable.settings = STATEFUL


# ---- the router's in-memory store -------------------------------------------------------------


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    """MemoryStore's coroutines never await anything: drive them to completion without a loop."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise AssertionError("MemoryStore awaited something")


KEYS = st.sampled_from([f"k{i}" for i in range(6)])


class MemoryStoreMachine(RuleBasedStateMachine):
    @initialize(max_entries=st.integers(1, 5))
    def setup(self, max_entries: int) -> None:
        self.now = 0.0
        self.max_entries = max_entries
        self.store = MemoryStore(max_entries, clock=lambda: self.now)
        self.last: dict[str, tuple[ConversationRecord, float]] = {}  # last put and its end
        self.n = 0

    @rule(dt=st.floats(0.0, 20.0))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(key=KEYS, keep_for=st.floats(-1.0, 30.0))
    def put(self, key: str, keep_for: float) -> None:
        self.n += 1
        state = ConversationRecord("d", None, None, None, self.n, self.now + keep_for)
        _run(self.store.put(key, state, keep_for))
        if keep_for > 0:
            self.last[key] = (state, self.now + keep_for)
        else:
            self.last.pop(key, None)

    @rule(key=KEYS)
    def get(self, key: str) -> None:
        got = _run(self.store.get(key))
        if got is None:
            return  # expired, evicted or never put
        state, end = self.last[key]
        # the store keeps its own copy of what was put (renewals move its deadline in place), so
        # compare by value: every put carries its own ``tokens`` (n), so a stale or foreign
        # record never compares equal
        assert got == state, "a stale or foreign state came back"
        assert self.now < end, "an entry outlived its keep_for"

    @rule(key=KEYS)
    def delete(self, key: str) -> None:
        got = _run(self.store.delete(key))
        if got is not None:
            assert got == self.last[key][0] and self.now < self.last[key][1]
        self.last.pop(key, None)
        assert _run(self.store.get(key)) is None

    @invariant()
    def bounded(self) -> None:
        assert len(self.store) <= self.max_entries


TestMemoryStore = MemoryStoreMachine.TestCase
TestMemoryStore.settings = STATEFUL
