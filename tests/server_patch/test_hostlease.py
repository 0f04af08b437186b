"""D's scheduler-side orders for host placement (``kvlease_vllm._hostlease``, issue 30).

Pure: no torch, no vLLM. ``HostLeases`` over a real :class:`HostArena` counted in bytes with no
rounding (``align=1``); the scheduler outputs of :func:`allocated_blocks` are shaped like vLLM
0.32/0.33's (``scheduled_new_reqs[i].block_ids``: a tuple of lists, one per KV cache group;
``scheduled_cached_reqs.new_block_ids``: a list of Optional tuples of lists).
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

from kvlease_vllm._arena import EvictReason, HostArena, Refusal
from kvlease_vllm._hostlease import ANONYMOUS, Demotion, HostLeases, allocated_blocks

BLOCK = 10  # bytes of one block in one worker's shard


def leases(cap: int = 100, *, device_ok: bool = True, **kw: Any) -> HostLeases:
    kw.setdefault("align", 1)
    return HostLeases(HostArena(cap, **kw), block_bytes=BLOCK, device_ok=device_ok)


def ids(evictions: Any) -> list[tuple[str, EvictReason]]:
    return [(e.lease_id, e.reason) for e in evictions]


# ---- admit and the Demotion order ---------------------------------------------------------------
@pytest.mark.parametrize("device_ok", [True, False])
def test_admit_orders_a_demotion_of_the_lease_blocks(device_ok: bool) -> None:
    hl = leases(device_ok=device_ok)
    result, order = hl.admit("a", [7, 3, 5], ttl=60.0, now=0.0, tenant="t")
    assert result.admitted and result.offset == 0 and result.evicted == ()
    assert order == Demotion("a", 0, 3 * BLOCK, (7, 3, 5), device_ok)
    assert hl.demotions == 1 and hl.demotion_bytes == 3 * BLOCK
    assert hl.arena.get("a").tenant == "t"  # type: ignore[union-attr]
    assert hl.take_orders() == ((), (order,))
    assert hl.take_orders() == ((), ())  # taken once


def test_demotion_block_ids_are_plain_ints_in_the_handle_order() -> None:
    class Id(int):
        pass

    hl = leases()
    _, order = hl.admit("a", (Id(9), Id(2)), 60.0, 0.0, None)
    assert order is not None and order.block_ids == (9, 2)
    assert all(type(b) is int for b in order.block_ids)


def test_second_lease_gets_the_next_range() -> None:
    hl = leases()
    _, a = hl.admit("a", [1, 2], 60.0, 0.0, None)
    _, b = hl.admit("b", [3, 4, 5], 60.0, 1.0, None)
    assert (a.offset, b.offset) == (0, 2 * BLOCK)  # type: ignore[union-attr]
    assert hl.take_orders() == ((), (a, b))
    assert hl.arena.bytes_used == 5 * BLOCK


def test_a_lease_without_blocks_is_not_placed() -> None:
    hl = leases()
    result, order = hl.admit("a", [], 60.0, 0.0, None)
    assert order is None and not result.admitted
    assert "a" not in hl.arena and hl.take_orders() == ((), ()) and hl.demotions == 0


def test_a_lease_larger_than_the_arena_is_refused_and_nothing_is_ordered() -> None:
    hl = leases(cap=50)
    hl.admit("keep", [1], 60.0, 0.0, None)
    hl.take_orders()
    result, order = hl.admit("big", list(range(6)), 60.0, 1.0, None)
    assert order is None and result.refusal is Refusal.TOO_LARGE
    assert hl.take_orders() == ((), ()) and "keep" in hl.arena
    assert hl.demotions == 1 and hl.demotion_bytes == BLOCK


# ---- evictions become drops; drops come before the demotion that reuses the range --------------
def test_a_pressure_eviction_is_dropped_in_the_same_orders_as_the_demotion_reusing_its_range() -> None:
    hl = leases(cap=100)
    _, a = hl.admit("a", list(range(10)), 60.0, 0.0, None)
    assert hl.take_orders() == ((), (a,))
    result, b = hl.admit("b", list(range(10, 15)), 60.0, 1.0, None)
    assert ids(result.evicted) == [("a", EvictReason.PRESSURE)]
    assert b is not None and b.offset == a.offset  # type: ignore[union-attr]
    drops, demotes = hl.take_orders()
    assert drops == ("a",) and demotes == (b,)


def test_an_expired_lease_is_dropped_at_the_sweep_and_its_range_reused_only_later() -> None:
    hl = leases(cap=100)
    _, a = hl.admit("a", list(range(10)), 5.0, 0.0, None)
    hl.take_orders()
    assert ids(hl.sweep(4.0)) == []
    assert ids(hl.sweep(5.0)) == [("a", EvictReason.EXPIRY)]
    assert hl.take_orders() == (("a",), ())  # the drop goes out before any reuse
    _, b = hl.admit("b", list(range(10)), 5.0, 6.0, None)
    assert b.offset == a.offset  # type: ignore[union-attr]
    assert hl.take_orders() == ((), (b,))


def test_an_admission_sweeps_due_leases_into_drops() -> None:
    hl = leases(cap=100)
    hl.admit("a", [1], 5.0, 0.0, None)
    hl.take_orders()
    result, b = hl.admit("b", [2], 5.0, 10.0, None)
    assert ids(result.evicted) == [("a", EvictReason.EXPIRY)]
    assert hl.take_orders() == (("a",), (b,))


def test_release_of_an_unpinned_lease_is_an_eviction_and_a_drop() -> None:
    """An explicit release frees the range at once: it must reach the workers as a drop (the
    module's rule: every eviction is a drop order sent no later than the demotion that reuses
    its range) and be reported as an eviction (``kvlease_evictions_total{reason="release"}``)."""
    hl = leases(cap=100)
    hl.admit("a", list(range(10)), 60.0, 0.0, None)
    hl.take_orders()
    evicted = hl.release("a", 1.0)
    assert "a" not in hl.arena and hl.arena.bytes_used == 0
    assert ids(evicted) == [("a", EvictReason.RELEASE)]
    assert hl.take_orders()[0] == ("a",)


def test_release_of_a_pinned_lease_waits_for_the_pin_then_drops_it() -> None:
    hl = leases(cap=100, max_pin_s=10.0)
    hl.admit("a", [1, 2], 60.0, 0.0, None)
    hl.take_orders()
    hl.renew("a", 5.0, 1.0, pin=True, claimant="p1", tenant=None)
    assert hl.release("a", 2.0) == []
    assert "a" in hl.arena and hl.take_orders() == ((), ())
    assert hl.sweep(5.9) == []  # the pin holds until 6.0
    assert ids(hl.sweep(6.0)) == [("a", EvictReason.RELEASE)]
    assert hl.take_orders() == (("a",), ())


def test_unpin_lets_a_deferred_release_go_at_the_next_sweep() -> None:
    hl = leases(cap=100)
    hl.admit("a", [1], 60.0, 0.0, None)
    hl.renew("a", 20.0, 1.0, pin=True, claimant="p1", tenant=None)
    hl.release("a", 2.0)
    hl.unpin("a", "p1", 3.0)
    assert ids(hl.sweep(3.0)) == [("a", EvictReason.RELEASE)]


# ---- renew, pin ---------------------------------------------------------------------------------
def test_renew_extends_and_raises_priority() -> None:
    hl = leases(cap=100)
    hl.admit("a", [1], 10.0, 0.0, None)
    hl.admit("b", [2], 10.0, 1.0, None)
    before = hl.arena.get("a").priority  # type: ignore[union-attr]
    hl.renew("a", 30.0, 5.0, pin=False, claimant=None, tenant="t")
    lease = hl.arena.get("a")
    assert lease is not None and lease.deadline == 35.0 and lease.tenant == "t"
    assert lease.priority > before and lease.priority > hl.arena.get("b").priority  # type: ignore[union-attr]
    assert lease.pins == {}


def test_a_claim_pins_under_the_claimant_or_the_anonymous_reader() -> None:
    hl = leases(cap=100, max_pin_s=30.0)
    hl.admit("a", [1], 60.0, 0.0, None)
    hl.renew("a", 5.0, 1.0, pin=True, claimant="p1", tenant=None)
    hl.renew("a", 5.0, 2.0, pin=True, claimant=None, tenant=None)
    assert hl.arena.get("a").pins == {"p1": 6.0, ANONYMOUS: 7.0}  # type: ignore[union-attr]
    hl.unpin("a", "p1", 3.0)
    assert hl.arena.get("a").pins == {ANONYMOUS: 7.0}  # type: ignore[union-attr]


def test_a_pinned_lease_is_not_evicted_under_pressure() -> None:
    hl = leases(cap=100)
    hl.admit("a", list(range(10)), 60.0, 0.0, None)
    hl.renew("a", 5.0, 1.0, pin=True, claimant="p1", tenant=None)
    result, order = hl.admit("b", [1], 60.0, 2.0, None)
    assert order is None and result.refusal is Refusal.PINNED and "a" in hl.arena
    hl.unpin("a", "p1", 3.0)
    result, order = hl.admit("b", [1], 60.0, 3.0, None)
    assert order is not None and ids(result.evicted) == [("a", EvictReason.PRESSURE)]


def test_renew_or_unpin_of_a_lease_not_in_the_arena_does_nothing() -> None:
    hl = leases()
    hl.renew("nope", 5.0, 0.0, pin=True, claimant="p1", tenant=None)
    hl.unpin("nope", "p1", 0.0)
    assert len(hl.arena) == 0 and hl.take_orders() == ((), ())


# ---- forget --------------------------------------------------------------------------------------
def test_forget_frees_the_range_even_when_pinned() -> None:
    hl = leases(cap=100)
    hl.admit("a", list(range(10)), 60.0, 0.0, None)
    hl.renew("a", 20.0, 1.0, pin=True, claimant="p1", tenant=None)
    hl.forget(["a", "unknown"], 2.0)
    assert "a" not in hl.arena and hl.arena.bytes_used == 0
    _, b = hl.admit("b", list(range(10)), 60.0, 3.0, None)
    assert b is not None and b.offset == 0


def test_forget_sweeps_the_other_due_leases_into_drops() -> None:
    hl = leases(cap=100)
    hl.admit("a", [1], 60.0, 0.0, None)
    hl.admit("b", [2], 5.0, 0.0, None)
    hl.take_orders()
    # the forgotten lease's own range is a drop too (it is reused by the next admission)
    assert ids(hl.forget(["a"], 10.0)) == [("a", EvictReason.RELEASE), ("b", EvictReason.EXPIRY)]
    assert hl.take_orders() == (("a", "b"), ())


def test_lifetime_ends_a_heartbeated_lease() -> None:
    hl = leases(cap=100, max_lease_lifetime_s=50.0)
    hl.admit("a", [1], 20.0, 0.0, None)
    for t in (10.0, 20.0, 30.0, 40.0):
        hl.renew("a", 20.0, t, pin=False, claimant=None, tenant=None)
    assert hl.arena.get("a").deadline == 50.0  # type: ignore[union-attr]
    assert ids(hl.sweep(50.0)) == [("a", EvictReason.LIFETIME)]
    assert hl.take_orders()[0] == ("a",)


# ---- a worker that applies the orders never overwrites a live lease -----------------------------
@pytest.mark.parametrize("seed", range(8))
def test_orders_never_put_a_demotion_over_a_live_lease(seed: int) -> None:
    """A model of a worker: per step it applies the drops, then the demotions. A demotion's range
    may only overlap leases that already left the arena, and every lease in the arena that was
    demoted sits, on the worker, where the arena says. (Releases are left out: see
    ``test_release_of_an_unpinned_lease_is_an_eviction_and_a_drop``.)"""
    rng = random.Random(seed)
    hl = leases(cap=400, max_lease_lifetime_s=200.0, max_pin_s=8.0)
    worker: dict[str, tuple[int, int]] = {}  # lease -> (offset, nbytes)
    now, n = 0.0, 0
    for _ in range(300):
        now += rng.choice((0.0, 0.5, 2.0))
        live = [x.lease_id for x in hl.arena]
        op = rng.random()
        if op < 0.4:
            n += 1
            hl.admit(f"l{n}", list(range(rng.randint(1, 12))), rng.uniform(2.0, 30.0), now, None)
        elif op < 0.6 and live:
            pin = rng.random() < 0.3
            hl.renew(rng.choice(live), rng.uniform(1.0, 20.0), now, pin=pin, claimant="p", tenant=None)
        elif op < 0.7 and live:
            hl.unpin(rng.choice(live), "p", now)
        elif op < 0.8 and live:
            gone = rng.sample(live, k=min(len(live), 2))
            for lid in gone:  # the workers ended these before the scheduler forgets them
                worker.pop(lid, None)
            hl.forget(gone, now)
        else:
            hl.sweep(now)
        drops, demotes = hl.take_orders()
        for lid in drops:
            worker.pop(lid, None)
        for order in demotes:
            end = order.offset + order.nbytes
            for lid, (off, nb) in list(worker.items()):
                if off < end and order.offset < off + nb:
                    assert lid not in hl.arena, f"{order.lease_id} demoted over live lease {lid}"
                    del worker[lid]
            worker[order.lease_id] = (order.offset, order.nbytes)
        for lease in hl.arena:
            assert worker.get(lease.lease_id) == (lease.offset, lease.nbytes)


# ---- allocated_blocks ---------------------------------------------------------------------------
def _new(*groups: list[int]) -> SimpleNamespace:
    return SimpleNamespace(req_id="r", block_ids=tuple(groups))


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        (SimpleNamespace(), ()),
        (SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=None), ()),
        # one group per request (0.32 and 0.33 alike: a tuple of lists)
        (SimpleNamespace(scheduled_new_reqs=[_new([4, 5, 6]), _new([9])],
                         scheduled_cached_reqs=SimpleNamespace(new_block_ids=[])), (4, 5, 6, 9)),
        # two KV cache groups (hybrid model)
        (SimpleNamespace(scheduled_new_reqs=[_new([1, 2], [30, 31])],
                         scheduled_cached_reqs=SimpleNamespace(new_block_ids=[None])), (1, 2, 30, 31)),
        # running requests: None (no new block this step) or a tuple of lists per group
        (SimpleNamespace(scheduled_new_reqs=[],
                         scheduled_cached_reqs=SimpleNamespace(new_block_ids=[None, ([7],), ([], [8, 9])])),
         (7, 8, 9)),
        (SimpleNamespace(scheduled_new_reqs=[_new([3]), SimpleNamespace(block_ids=None)],
                         scheduled_cached_reqs=SimpleNamespace(new_block_ids=[([11, 12],), None])),
         (3, 11, 12)),
    ],
)  # fmt: skip
def test_allocated_blocks(output: Any, expected: tuple[int, ...]) -> None:
    assert allocated_blocks(output) == expected
