"""The decode node's host arena (sans-IO, table-driven) and its copy kernels' packing.

The core tests need neither torch nor vLLM (they run in every venv); the round trip of the copy
kernels runs where torch is importable, and on the real vLLM venv in
``tests/integration/test_arena_copy.py``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import pytest

from kvlease_vllm._arena import (
    ALIGN,
    ArenaAllocator,
    ArenaError,
    DuplicateLease,
    EvictReason,
    HostArena,
    Refusal,
    raise_priority,
)
from kvlease_vllm._arena_copy import ArenaCopyError, Piece, lease_bytes, pack_plan

PRESSURE, LIFETIME, EXPIRY, RELEASE = (
    EvictReason.PRESSURE,
    EvictReason.LIFETIME,
    EvictReason.EXPIRY,
    EvictReason.RELEASE,
)


def arena(cap: int = 100, **kw: Any) -> HostArena:
    """An arena counted in bytes with no rounding (``align=1``), so sizes read as written."""
    kw.setdefault("align", 1)
    return HostArena(cap, **kw)


def reasons(evictions: Any) -> list[tuple[str, EvictReason]]:
    return [(e.lease_id, e.reason) for e in evictions]


# ---- the allocator ------------------------------------------------------------------------------
# ops: ("a", nbytes) allocates (expected offset or None), ("f", offset) frees; then the holes
@pytest.mark.parametrize(
    ("ops", "offsets", "holes"),
    [
        ([("a", 30), ("a", 30), ("a", 30)], [0, 30, 60], [(90, 10)]),
        ([("a", 30), ("a", 80)], [0, None], [(30, 70)]),  # no hole fits: nothing is taken
        ([("a", 100), ("a", 1)], [0, None], []),
        # best fit: the 10-byte hole at 40 fits 10 exactly, not the 50-byte tail
        ([("a", 40), ("a", 10), ("a", 10), ("f", 40), ("a", 10)], [0, 40, 50, 40], [(60, 40)]),
        # ... and 8 goes into the smaller of the two holes that fit (at 0: 20; the tail: 40)
        ([("a", 20), ("a", 40), ("f", 0), ("a", 8)], [0, 20, 0], [(8, 12), (60, 40)]),
        # a tie goes to the lower address
        ([("a", 10), ("a", 10), ("a", 10), ("a", 10), ("a", 60), ("f", 0), ("f", 20), ("a", 5)],
         [0, 10, 20, 30, 40, 0], [(5, 5), (20, 10)]),
        # frees coalesce with the hole on the right, the left, and both
        ([("a", 10), ("a", 10), ("a", 10), ("f", 10), ("f", 20)], [0, 10, 20], [(10, 90)]),
        ([("a", 10), ("a", 10), ("a", 10), ("f", 0), ("f", 10)], [0, 10, 20], [(0, 20), (30, 70)]),
        ([("a", 10), ("a", 10), ("a", 10), ("f", 0), ("f", 20), ("f", 10)], [0, 10, 20], [(0, 100)]),
    ],
)  # fmt: skip
def test_allocator(
    ops: list[tuple[str, int]], offsets: list[int | None], holes: list[tuple[int, int]]
) -> None:
    a = ArenaAllocator(100, align=1)
    got = []
    for op, arg in ops:
        if op == "a":
            got.append(a.alloc(arg))
        else:
            a.free(arg)
    assert got == offsets
    assert a.holes() == holes
    assert a.used == 100 - sum(size for _, size in holes)


def test_allocator_rounds_to_the_alignment_and_never_hands_out_the_ragged_tail() -> None:
    a = ArenaAllocator(3 * ALIGN + 100)
    assert a.alloc(1) == 0
    assert a.alloc(ALIGN + 1) == ALIGN  # two pages
    assert a.used == 3 * ALIGN
    assert a.alloc(1) is None  # 100 bytes remain past the last page
    assert a.free(ALIGN) == 2 * ALIGN
    with pytest.raises(KeyError):
        a.free(ALIGN)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: ArenaAllocator(-1), "capacity"),
        (lambda: ArenaAllocator(1.5), "capacity"),  # type: ignore[arg-type]
        (lambda: ArenaAllocator(10, align=0), "alignment"),
        (lambda: ArenaAllocator(10).alloc(0), "nbytes > 0"),
    ],
)
def test_allocator_bad_input(make: Callable[[], object], match: str) -> None:
    with pytest.raises(ArenaError, match=match):
        make()


# ---- priority -----------------------------------------------------------------------------------
# (touches, half-life) -> priority
@pytest.mark.parametrize(
    ("touches", "half_life", "expected"),
    [
        ([100.0], 30.0, 100.0),  # one touch: its time
        ([100.0, 100.0], 30.0, 130.0),  # two at once: + one half-life
        ([100.0] * 4, 30.0, 160.0),  # four: + two
        ([0.0, 30.0], 30.0, 30.0 + 30.0 * math.log2(1.5)),  # the older touch counts half
        ([0.0, 3000.0], 30.0, 3000.0),  # a touch 100 half-lives old counts (almost) nothing
        ([3000.0, 0.0], 30.0, 3000.0),  # the order of touches does not matter
        ([1e12, 1e12], 1.0, 1e12 + 1.0),  # no overflow far from zero
    ],
)
def test_priority(touches: list[float], half_life: float, expected: float) -> None:
    p = touches[0]
    for t in touches[1:]:
        p = raise_priority(p, t, half_life)
    assert p == pytest.approx(expected, rel=1e-12)


# ---- pressure: eviction by priority -------------------------------------------------------------
# Leases of 20 bytes in an arena of 100, admitted at the times given, renewed at the times given;
# then a lease of `need` bytes at t=50: which go, in which order.
@pytest.mark.parametrize(
    ("admitted", "renewals", "need", "evicted"),
    [
        # no renewals: the oldest goes, whatever order the ids were admitted in
        ({"a": 1, "b": 2, "c": 3, "d": 4, "e": 5}, [], 20, ["a"]),
        ({"e": 1, "d": 2, "c": 3, "b": 4, "a": 5}, [], 20, ["e"]),
        # a heartbeat raises a lease above the ones not renewed since
        ({"a": 1, "b": 2, "c": 3, "d": 4, "e": 5}, [("a", 40)], 20, ["b"]),
        # two heartbeats beat one later one (a decaying score, not the last renewal alone)
        (
            {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5},
            [("a", 40), ("a", 41), ("b", 45)],
            80,
            ["c", "d", "e", "b"],
        ),
        # 60 contiguous: a, b, e are the lowest, but e (80-100) is not next to them; c (40-60) is
        # the next lowest and closes the hole, and e, outside it, stays
        ({"a": 1, "b": 2, "c": 3, "d": 4, "e": 5}, [("c", 40), ("d", 41)], 60, ["a", "b", "c"]),
        # priority, not adjacency: the free tail (80-100) is next to d, but a and b are lower
        ({"a": 1, "b": 2, "c": 3, "d": 4}, [], 40, ["a", "b"]),
        # ... unless the tail and the lowest lease together fit
        ({"a": 1, "b": 2, "c": 3, "d": 4}, [("a", 10), ("b", 10), ("c", 10)], 40, ["d"]),
    ],
)
def test_pressure_evicts_the_lowest_priority_first(
    admitted: dict[str, int], renewals: list[tuple[str, int]], need: int, evicted: list[str]
) -> None:
    t = arena(100, priority_half_life_s=30.0)
    for lease_id, at in admitted.items():
        assert t.admit(lease_id, 20, 1000.0, float(at)).admitted
    for lease_id, at in renewals:
        assert t.renew(lease_id, 1000.0, float(at)) is not None
    got = t.admit("new", need, 1000.0, 50.0)
    assert got.admitted
    assert reasons(got.evicted) == [(x, PRESSURE) for x in evicted]
    assert t.counters().evictions[PRESSURE] == len(evicted)


def test_pressure_keeps_evicting_in_priority_order_until_a_contiguous_hole_fits() -> None:
    # a(0-20) b(20-40) c(40-60) d(60-80) e(80-100); priorities b < d < a < c < e.
    t = arena(100)
    for lease_id, at in [("b", 1), ("d", 2), ("a", 3), ("c", 4), ("e", 5)]:
        t.admit(lease_id, 20, 1000.0, float(at))
    # place them by address: admit order gives b=0, d=20, a=40, c=60, e=80
    assert [t.get(x).offset for x in "bdace"] == [0, 20, 40, 60, 80]  # type: ignore[union-attr]
    # 40 contiguous: b (0-20) and d (20-40) are the two lowest and adjacent: two go
    assert reasons(t.admit("x", 40, 1000.0, 10.0).evicted) == [("b", PRESSURE), ("d", PRESSURE)]
    # now x(0-40) a(40-60) c(60-80) e(80-100): 30 bytes need a and c (no hole of 30 after a alone)
    t.renew("x", 1000.0, 11.0)
    t.renew("x", 1000.0, 11.0)
    got = t.admit("y", 30, 1000.0, 12.0)
    assert reasons(got.evicted) == [("a", PRESSURE), ("c", PRESSURE)]
    assert got.offset == 40


@pytest.mark.parametrize(
    ("sizes", "pinned", "need", "refusal"),
    [
        ([50, 50], ["a", "b"], 10, Refusal.PINNED),  # every byte pinned
        ([30, 40, 30], ["b"], 40, Refusal.PINNED),  # 60 free after evictions, but b splits them
        ([50, 50], [], 101, Refusal.TOO_LARGE),
        ([], [], 101, Refusal.TOO_LARGE),
    ],
)
def test_a_refused_admission_evicts_nothing(
    sizes: list[int], pinned: list[str], need: int, refusal: Refusal
) -> None:
    t = arena(100)
    for i, size in enumerate(sizes):
        t.admit("abc"[i], size, 1000.0, float(i))
    for lease_id in pinned:
        assert t.pin(lease_id, "P0", 5.0, 60.0) is not None
    got = t.admit("new", need, 1000.0, 10.0)
    assert not got.admitted and got.refusal is refusal and got.evicted == ()
    assert len(t) == len(sizes)
    assert t.counters().refused == 1


def test_a_pinned_lease_is_passed_over_and_the_next_lowest_goes() -> None:
    t = arena(100)
    for i, lease_id in enumerate("abcde"):
        t.admit(lease_id, 20, 1000.0, float(i))
    t.pin("a", "P0", 10.0, 5.0)
    assert reasons(t.admit("x", 20, 1000.0, 11.0).evicted) == [("b", PRESSURE)]
    # the pin lapsed at 15, but the read counted as a touch: a now outranks c and d
    assert reasons(t.admit("y", 20, 1000.0, 16.0).evicted) == [("c", PRESSURE)]
    assert reasons(t.admit("z", 20, 1000.0, 17.0).evicted) == [("d", PRESSURE)]


def test_admit_sweeps_due_leases_before_evicting_live_ones() -> None:
    t = arena(100)
    t.admit("old", 50, 1000.0, 0.0)  # the lowest priority, but live
    t.admit("due", 50, 5.0, 1.0)  # higher priority, expired at 6
    got = t.admit("new", 50, 100.0, 10.0)
    assert reasons(got.evicted) == [("due", EXPIRY)]
    assert "old" in t


# ---- the lifetime cap and expiry ----------------------------------------------------------------
def test_the_lifetime_cap_ends_a_heartbeated_lease_on_time() -> None:
    t = arena(100, max_lease_lifetime_s=100.0)
    t.admit("a", 10, 30.0, 0.0)
    deadlines = [t.renew("a", 30.0, float(now)) for now in range(10, 100, 10)]
    assert deadlines == [40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 100.0, 100.0, 100.0]
    assert t.sweep(99.999) == []
    assert reasons(t.sweep(100.0)) == [("a", LIFETIME)]
    assert t.renew("a", 30.0, 100.0) is None
    assert t.counters().evictions[LIFETIME] == 1


@pytest.mark.parametrize(
    ("ttl", "lifetime", "sweep_at", "reason"),
    [
        (30.0, 100.0, 30.0, EXPIRY),  # not renewed: its deadline ends it
        (500.0, 100.0, 100.0, LIFETIME),  # a ttl past the hard end: the cap ends it
        (100.0, 100.0, 100.0, LIFETIME),  # deadline at the hard end: the cap is what ended it
    ],
)
def test_expiry_or_lifetime(ttl: float, lifetime: float, sweep_at: float, reason: EvictReason) -> None:
    t = arena(100, max_lease_lifetime_s=lifetime, max_ttl=1000.0)
    t.admit("a", 10, ttl, 0.0)
    assert t.sweep(sweep_at - 1e-6) == []
    assert reasons(t.sweep(sweep_at)) == [("a", reason)]


def test_renewals_that_reorder_expiries_expire_each_lease_at_its_own_deadline() -> None:
    """vLLM issue #58222: a reaper that stops at the first unexpired entry in insertion order
    strands the leases behind a renewed one."""
    t = arena(100)
    t.admit("a", 10, 10.0, 0.0)  # deadline 10, the first in
    t.admit("b", 10, 20.0, 0.0)
    t.admit("c", 10, 30.0, 0.0)
    assert t.renew("a", 50.0, 5.0) == 55.0  # now the last to expire
    assert t.sweep(9.0) == []
    assert reasons(t.sweep(25.0)) == [("b", EXPIRY)]
    assert reasons(t.sweep(35.0)) == [("c", EXPIRY)]
    assert t.sweep(54.0) == []
    assert reasons(t.sweep(55.0)) == [("a", EXPIRY)]
    assert t.bytes_used == 0


@pytest.mark.parametrize("seed", range(8))
def test_the_sweep_agrees_with_a_full_scan_under_random_renewals(seed: int) -> None:
    rng = random.Random(seed)
    t = arena(10_000, max_lease_lifetime_s=300.0, max_pin_s=7.0)
    now, n = 0.0, 0
    for _ in range(600):
        now += rng.uniform(0.0, 2.0)
        op = rng.random()
        ids = sorted(x.lease_id for x in t)
        if op < 0.3:
            n += 1
            t.admit(f"l{n}", rng.randint(1, 50), rng.uniform(1.0, 60.0), now, tenant=rng.choice("AB"))
        elif op < 0.75 and ids:
            t.renew(rng.choice(ids), rng.uniform(1.0, 60.0), now)
        elif op < 0.85 and ids:
            t.pin(rng.choice(ids), rng.choice(["P0", "P1"]), now, rng.uniform(1.0, 20.0))
        elif op < 0.9 and ids:
            lease = t.get(rng.choice(ids))
            assert lease is not None
            if lease.pins:
                t.unpin(lease.lease_id, next(iter(lease.pins)), now)
        elif op < 0.93 and ids:
            t.release(rng.choice(ids), now)
        # a full scan: what must go now
        due = {x.lease_id for x in t if (x.release_pending or now >= x.deadline) and not x.pinned(now)}
        swept = {e.lease_id for e in t.sweep(now)}
        assert swept == due
        assert all(now < x.deadline or x.pinned(now) for x in t if not x.release_pending)
        assert t.bytes_used == sum(x.size for x in t)


# ---- per-tenant quota ---------------------------------------------------------------------------
def test_a_tenant_filling_the_arena_pushes_out_its_own_leases_even_the_renewed_ones() -> None:
    t = arena(100, tenant_quota_fraction=0.5)
    t.admit("b-1", 20, 1000.0, 0.0, tenant="B")  # B's leases: the lowest priority of all
    t.admit("b-2", 20, 1000.0, 0.0, tenant="B")
    for i in range(3):
        assert t.admit(f"a-{i}", 20, 1000.0, 1.0 + i, tenant="A").evicted == ()
        t.renew(f"a-{i}", 1000.0, 5.0 + i)
    got = t.admit("a-3", 20, 1000.0, 10.0, tenant="A")  # A would hold 80 of 100 (quota 50)
    assert reasons(got.evicted) == [("a-0", PRESSURE)]  # A's lowest, not B's older ones
    assert t.by_tenant() == {"A": (3, 60), "B": (2, 40)}


@pytest.mark.parametrize(
    ("leases", "new", "evicted"),
    [
        # under quota everywhere: plain priority order
        ([("x", "A", 30), ("y", "B", 30), ("z", "C", 40)], ("n", "D", 30), ["x"]),
        # the lease being admitted counts: B at 30 + 30 > 50 -> B's own y goes before x
        ([("x", "A", 30), ("y", "B", 30), ("z", "A", 20)], ("n", "B", 30), ["y"]),
        # ... and without it, B would be under its quota
        ([("x", "A", 30), ("y", "B", 30), ("z", "A", 20)], ("n", None, 30), ["x"]),
        # untagged leases count for no one: plain order even if "untagged" is most of the arena
        ([("x", None, 30), ("y", None, 30), ("z", None, 40)], ("n", None, 30), ["x"]),
        # over quota but not enough: A's excess first, then the rest by priority
        ([("x", "B", 20), ("y", "A", 30), ("z", "A", 50)], ("n", "C", 70), ["y", "x", "z"]),
    ],
)
def test_tenant_quota_order(
    leases: list[tuple[str, str | None, int]], new: tuple[str, str | None, int], evicted: list[str]
) -> None:
    t = arena(100, tenant_quota_fraction=0.5)
    for i, (lease_id, tenant, size) in enumerate(leases):
        t.admit(lease_id, size, 1000.0, float(i), tenant=tenant)
    got = t.admit(new[0], new[2], 1000.0, 10.0, tenant=new[1])
    assert got.admitted
    assert [e.lease_id for e in got.evicted] == evicted


# ---- read pins and release ----------------------------------------------------------------------
def test_a_pin_defers_expiry_and_release_for_at_most_max_pin_s() -> None:
    t = arena(100, max_pin_s=10.0)
    t.admit("a", 10, 5.0, 0.0)
    assert t.pin("a", "P0", 4.0, 3600.0) == 14.0  # asked for an hour, bounded by max_pin_s
    assert t.sweep(6.0) == []  # past its deadline, but under a read
    assert not t.live("a", 6.0)  # ... and no new read may start
    assert t.pin("a", "P1", 6.0, 1.0) is None
    assert reasons(t.sweep(14.0)) == [("a", EXPIRY)]  # the pin lapsed


def test_release_during_a_read_waits_for_the_last_reader() -> None:
    t = arena(100)
    t.admit("a", 10, 100.0, 0.0)
    t.pin("a", "P0", 1.0, 20.0)
    t.pin("a", "P1", 1.0, 20.0)  # two readers
    assert t.release("a", 2.0)
    assert t.renew("a", 100.0, 2.0) is None  # being released: never renewed again
    assert t.unpin("a", "P0", 3.0)
    assert t.sweep(3.0) == []  # P1 still reads
    assert not t.unpin("a", "P0", 3.0)
    assert t.unpin("a", "P1", 4.0)
    assert reasons(t.sweep(4.0)) == [("a", RELEASE)]
    assert not t.release("a", 5.0)


def test_release_frees_at_once_when_unpinned_and_counts() -> None:
    t = arena(100)
    t.admit("a", 10, 100.0, 0.0, tenant="T")
    assert t.release("a", 1.0)
    assert t.bytes_used == 0 and t.holes() == [(0, 100)]
    c = t.counters()
    assert c.evictions[RELEASE] == 1 and c.evicted_bytes[RELEASE] == 10
    # the same id may come back as a new lease; the old one's heap entries do not touch it
    t.admit("a", 10, 100.0, 2.0)
    assert t.sweep(100.5) == []
    assert reasons(t.sweep(102.0)) == [("a", EXPIRY)]


def test_counters_carry_the_issues_metric_names() -> None:
    t = arena(1 << 20, align=ALIGN)
    t.admit("a", 1, 10.0, 0.0)
    t.sweep(10.0)
    t.admit("b", 5000, 10.0, 11.0)
    assert t.counters().metrics() == {
        "kvlease_host_bytes_used": 2.0 * ALIGN,
        "kvlease_host_bytes_capacity": float(1 << 20),
        'kvlease_evictions_total{reason="pressure"}': 0.0,
        'kvlease_evictions_total{reason="lifetime"}': 0.0,
        'kvlease_evictions_total{reason="expiry"}': 1.0,
        'kvlease_evictions_total{reason="release"}': 0.0,
    }


# ---- bad input ----------------------------------------------------------------------------------
def _with_a(call: Callable[[HostArena], object]) -> Callable[[], object]:
    def run() -> object:
        t = arena(100)
        t.admit("a", 10, 10.0, 0.0)
        return call(t)

    return run


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: HostArena(-1), ArenaError, "capacity"),
        (lambda: HostArena(100, max_lease_lifetime_s=0.0), ArenaError, "max_lease_lifetime_s"),
        (lambda: HostArena(100, max_ttl=math.inf), ArenaError, "max_ttl"),
        (lambda: HostArena(100, priority_half_life_s=-1.0), ArenaError, "priority_half_life_s"),
        (lambda: HostArena(100, max_pin_s=0), ArenaError, "max_pin_s"),
        (lambda: HostArena(100, renew_guard=-1.0), ArenaError, "renew_guard"),
        (lambda: HostArena(100, tenant_quota_fraction=0.0), ArenaError, "tenant_quota_fraction"),
        (lambda: HostArena(100, tenant_quota_fraction=1.5), ArenaError, "tenant_quota_fraction"),
        (lambda: HostArena(100, align=0), ArenaError, "alignment"),
        (_with_a(lambda t: t.admit("a", 10, 10.0, 1.0)), DuplicateLease, "already"),
        (_with_a(lambda t: t.admit("b", 0, 10.0, 1.0)), ArenaError, "nbytes"),
        (_with_a(lambda t: t.admit("b", 2.5, 10.0, 1.0)), ArenaError, "nbytes"),
        (_with_a(lambda t: t.admit("b", 1, 0.0, 1.0)), ArenaError, "ttl"),
        (_with_a(lambda t: t.admit("b", 1, math.nan, 1.0)), ArenaError, "ttl"),
        (_with_a(lambda t: t.admit("b", 1, 1.0, math.inf)), ArenaError, "now"),
        (_with_a(lambda t: t.renew("a", -5.0, 1.0)), ArenaError, "ttl"),
        (_with_a(lambda t: t.pin("a", "P", 1.0, 0.0)), ArenaError, "hold_s"),
        (_with_a(lambda t: t.sweep(math.nan)), ArenaError, "now"),
    ],
)
def test_bad_input(make: Callable[[], object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        make()


def test_unknown_leases_answer_none_or_false() -> None:
    t = arena(100)
    assert t.renew("x", 10.0, 0.0) is None
    assert t.pin("x", "P", 0.0, 1.0) is None
    assert not t.unpin("x", "P", 0.0)
    assert not t.release("x", 0.0)
    assert not t.live("x", 0.0)


def test_the_renew_guard_refuses_a_renewal_at_the_edge() -> None:
    t = arena(100, renew_guard=2.0)
    t.admit("a", 10, 10.0, 0.0)
    assert t.renew("a", 10.0, 8.5) is None
    assert t.renew("a", 10.0, 7.5) == 17.5


# ---- the copy kernels' packing (pure) -----------------------------------------------------------
@pytest.mark.parametrize(
    ("row_bytes", "blocks", "chunk", "expected"),
    [
        # everything fits in one chunk: one piece per region, region-major
        ([4, 4], 3, 100, [[Piece(0, 0, 3, 0), Piece(1, 0, 3, 12)]]),
        # a region split across chunks
        ([4, 4], 3, 8, [[Piece(0, 0, 2, 0)], [Piece(0, 2, 1, 8), Piece(1, 0, 1, 12)], [Piece(1, 1, 2, 16)]]),
        # rows of different widths: a chunk never splits a row
        ([2, 6], 2, 8, [[Piece(0, 0, 2, 0)], [Piece(1, 0, 1, 4)], [Piece(1, 1, 1, 10)]]),
        ([4], 0, 8, []),
    ],
)
def test_pack_plan(row_bytes: list[int], blocks: int, chunk: int, expected: list[list[Piece]]) -> None:
    plan = pack_plan(row_bytes, blocks, chunk)
    assert plan == expected
    flat = [p for c in plan for p in c]
    # contiguous and complete: each piece starts where the last ended, the total is the lease's
    ends = [p.at + p.rows * row_bytes[p.region] for p in flat]
    assert [p.at for p in flat] == [0, *ends][: len(flat)]
    assert (ends[-1] if ends else 0) == lease_bytes(row_bytes, blocks)
    for c in plan:
        assert ends[flat.index(c[-1])] - c[0].at <= chunk


@pytest.mark.parametrize(("row_bytes", "chunk"), [([4, 16], 8), ([0, 4], 8)])
def test_pack_plan_bad_input(row_bytes: list[int], chunk: int) -> None:
    with pytest.raises(ArenaCopyError):
        pack_plan(row_bytes, 2, chunk)


# ---- the copy kernels on CPU tensors ---------------------------------------------------------------
# 0: direct; else chunks through scratch (whole, or two halves taking turns from 1 KiB up)
@pytest.mark.parametrize("scratch_bytes", [0, 64, 200, 2048])
def test_demote_promote_scatter_round_trip_on_cpu(scratch_bytes: int) -> None:
    import torch  # the dev extra pins the CPU build

    from kvlease_vllm import _arena_copy as cp

    g = torch.Generator().manual_seed(0)
    # two uint8 regions as _kvl_map_regions builds them (strided rows) and one bf16 region
    storage = torch.randint(0, 255, (40 * 96,), dtype=torch.uint8, generator=g)
    regions = [
        storage.as_strided((40, 64), (96, 1), 0),
        storage[64:].as_strided((40, 32), (96, 1), 0),
        torch.randn(40, 16, generator=g).to(torch.bfloat16),
    ]
    ids = [7, 3, 31, 0, 12]
    row_bytes = [64, 32, 32]
    n = lease_bytes(row_bytes, len(ids))
    t = HostArena(1 << 16, align=64)
    offset = t.admit("a", n, 60.0, 0.0).offset
    assert offset is not None
    host = torch.zeros(1 << 16, dtype=torch.uint8)
    scratch = torch.empty(scratch_bytes, dtype=torch.uint8) if scratch_bytes else None
    assert cp.demote(regions, ids, host, offset, scratch=scratch).done()
    # region-major packing, as the staged gather's
    pos = offset
    for r, w in zip(regions, row_bytes):
        want = r[ids].contiguous().view(torch.uint8).reshape(-1)
        assert torch.equal(host[pos : pos + len(ids) * w], want)
        pos += len(ids) * w
    staging = torch.zeros(n + 128, dtype=torch.uint8)
    cp.promote(host, offset, n, staging, 128).wait()
    out = torch.zeros_like(storage)
    dst = [
        out.as_strided((40, 64), (96, 1), 0),
        out[64:].as_strided((40, 32), (96, 1), 0),
        torch.zeros_like(regions[2]),
    ]
    back = [7 + 1, 3 + 1, 31 + 1, 0 + 1, 12 + 1]
    cp.scatter(staging, 128, dst, back, scratch=scratch).wait()
    for r, d in zip(regions, dst):
        assert torch.equal(d[back], r[ids])
        assert int(d[2].float().abs().sum()) == 0  # untouched blocks stay untouched
    with pytest.raises(ArenaCopyError, match="out of range"):
        cp.demote(regions, [40], host, 0)
    with pytest.raises(ArenaCopyError, match="outside"):
        cp.demote(regions, ids, host, (1 << 16) - 10)
    with pytest.raises(ArenaCopyError, match="1-D uint8"):
        cp.promote(host.view(torch.int32), 0, 4, staging, 0)
    with pytest.raises(ArenaCopyError, match="smaller than a block row"):
        cp.demote(regions, ids, host, 0, scratch=torch.empty(32, dtype=torch.uint8))
