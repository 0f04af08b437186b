"""The lease desk with a host arena (``kvlease_vllm._desk.LeaseDesk`` + ``_hostlease.HostLeases``).

A lease placed in the host arena lives in both the retention table (deadline, claims, tenant; 0
device blocks once given back) and the arena (bytes, priority, hard end). Pure (no torch, no vLLM),
on a fake clock; the metrics are read back from ``ConnectorMetrics.render()``'s exposition text.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvlease_vllm._arena import HostArena
from kvlease_vllm._config import KVLeaseConfig
from kvlease_vllm._desk import LeaseDesk
from kvlease_vllm._hostlease import ALLOCATED_ATTR, DEMOTES_ATTR, DROPS_ATTR, HostLeases
from kvlease_vllm._metrics import STAT_DEMOTION_S, STAT_PULLS, ConnectorMetrics
from kvlease_vllm._placement import HostPlacer
from kvlease_vllm._retention import BlockRefs, RetentionTable

BLOCK = 10  # bytes of one block in one worker's shard


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def desk(
    arena_bytes: int = 200, *, capacity_blocks: int = 100, lifetime: float = 3600.0, device_ok: bool = True
) -> tuple[LeaseDesk, Clock]:
    clock = Clock()
    table = RetentionTable(capacity_blocks, renew_guard=1.0, max_lifetime=lifetime)
    arena = HostArena(arena_bytes, max_lease_lifetime_s=lifetime, max_pin_s=30.0, align=1)
    host = HostLeases(arena, block_bytes=BLOCK, device_ok=device_ok)
    return LeaseDesk(table, ConnectorMetrics(), clock=clock, host=host), clock


def place(d: LeaseDesk, lid: str, blocks: int, ttl: float = 60.0, tenant: str | None = None) -> None:
    """A finished request's lease, written through and given back (what the scheduler does)."""
    assert d.add(lid, blocks, d.clock() + ttl, tenant=tenant).retained
    order, why = d.place_host(lid, list(range(blocks)), tenant)
    assert order is not None, why
    d.unhold([lid])


def sample(d: LeaseDesk, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(d.metrics.render().decode()):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return None


def arena(d: LeaseDesk) -> HostArena:
    assert d.host is not None
    return d.host.arena


# ---- placing and unholding ------------------------------------------------------------------------
def test_place_host_admits_the_lease_for_its_remaining_time() -> None:
    d, clock = desk()
    d.add("a", 4, clock.now + 30.0)
    clock.now += 10.0
    order, why = d.place_host("a", [5, 6, 7, 8], "t")
    assert why == "" and order is not None
    assert (order.lease_id, order.offset, order.nbytes, order.block_ids) == ("a", 0, 40, (5, 6, 7, 8))
    lease = arena(d).get("a")
    assert lease is not None and lease.deadline == clock.now + 20.0 and lease.tenant == "t"
    assert d.in_arena("a") and not d.in_arena("b")
    assert d.take_orders() == ((), (order,))


def test_place_host_refuses_an_ended_or_unknown_lease_and_a_too_large_one() -> None:
    d, clock = desk(arena_bytes=50)
    assert d.place_host("nope", [1], None) == (None, "the lease already ended")
    d.add("big", 6, clock.now + 30.0)
    order, why = d.place_host("big", list(range(6)), None)
    assert order is None and why == "larger than the arena"
    assert d.take_orders() == ((), ())
    assert sample(d, "kvlease_demotions_total") == 0.0


def test_unhold_makes_retained_blocks_zero_and_pressure_relief_skips_the_lease() -> None:
    d, _ = desk(capacity_blocks=10)
    place(d, "host", 6)
    assert d.snapshot() == (1, 0)
    assert d.add("dev", 8, d.clock() + 30.0).retained  # the host lease takes no room in the cap
    assert d.snapshot() == (2, 8)
    assert d.relieve(20) == ["dev"]  # the 0-block lease is never released for device blocks
    assert d.relieve(20) == []
    assert d.renew(("host",), 30.0)["host"] is not None
    assert sample(d, "kvlease_device_blocks_held") == 0.0


def test_take_orders_without_an_arena_is_empty() -> None:
    d = LeaseDesk(RetentionTable(10), ConnectorMetrics(), clock=Clock())
    assert d.take_orders() == ((), ()) and not d.in_arena("a")


# ---- priority, claims -----------------------------------------------------------------------------
def _fill_and_push(renew_a: bool) -> set[str]:
    d, clock = desk(arena_bytes=200)
    place(d, "a", 10)
    clock.now += 1.0
    place(d, "b", 10)
    clock.now += 1.0
    if renew_a:
        assert d.renew(("a",), 60.0)["a"] is not None
    clock.now += 1.0
    place(d, "c", 10)
    return {x.lease_id for x in arena(d)}


def test_renew_raises_arena_priority() -> None:
    assert _fill_and_push(renew_a=False) == {"b", "c"}  # the oldest touch goes first
    assert _fill_and_push(renew_a=True) == {"a", "c"}  # a's heartbeat outranks b


def test_a_claim_pins_the_lease_against_pressure_until_unclaimed() -> None:
    d, clock = desk(arena_bytes=100)
    place(d, "a", 10)
    got = d.renew(("a",), 20.0, pin=True, claimant="p1")
    assert got["a"] is not None and "p1" in arena(d).get("a").pins  # type: ignore[union-attr]
    clock.now += 1.0
    d.add("b", 5, clock.now + 60.0)
    order, why = d.place_host("b", list(range(5)), None)
    assert order is None and why == "the arena is held by pinned leases"
    assert d.in_arena("a") and d.renew(("a",), 20.0)["a"] is not None
    assert d.unclaim(("a",), "p1") == 1
    order, _ = d.place_host("b", list(range(5)), None)
    assert order is not None and not d.in_arena("a")


def test_a_claim_refused_by_the_table_does_not_pin_the_arena() -> None:
    d, _ = desk()
    place(d, "a", 2)
    d.renew(("a",), 20.0, pin=True, claimant="p1")
    assert d.renew(("a",), 20.0, pin=True, claimant="p2") == {"a": None}
    assert set(arena(d).get("a").pins) == {"p1"}  # type: ignore[union-attr]


# ---- evictions end the lease in the table ---------------------------------------------------------
def test_an_arena_eviction_releases_the_lease_in_the_table() -> None:
    d, clock = desk(arena_bytes=100)
    place(d, "a", 10)
    d.take_updates()
    clock.now += 1.0
    place(d, "b", 10)
    assert not d.in_arena("a")
    assert d.renew(("a", "b"), 30.0)["a"] is None
    updates = d.take_updates()
    assert updates.get("a") == clock.now  # the workers end it now
    drops, _ = d.take_orders()
    assert drops == ("a",)
    assert sample(d, "kvlease_evictions_total", reason="pressure") == 1.0
    assert sample(d, "kvlease_lease_renewals_total", result="unknown") == 1.0


def test_expiry_in_the_arena_is_swept_by_take_updates() -> None:
    d, clock = desk()
    place(d, "a", 2, ttl=10.0)
    clock.now += 10.0
    updates = d.take_updates()
    assert not d.in_arena("a") and updates.get("a") == clock.now
    assert sample(d, "kvlease_evictions_total", reason="expiry") == 1.0
    assert sample(d, "kvlease_host_bytes_used") == 0.0


def test_max_lifetime_caps_renewals_in_the_table_and_the_arena() -> None:
    d, clock = desk(lifetime=50.0)
    start = clock.now
    place(d, "a", 2, ttl=20.0)
    deadlines: dict[str, float] = {}
    for _ in range(4):
        clock.now += 10.0
        d.renew(("a",), 20.0, deadlines=deadlines)
    assert deadlines["a"] == start + 50.0 == arena(d).get("a").deadline  # type: ignore[union-attr]
    assert d.take_updates()["a"] == start + 50.0
    clock.now = start + 49.5
    assert d.renew(("a",), 20.0) == {"a": None}  # within the guard of its hard end
    clock.now = start + 50.0
    assert d.take_updates() == {"a": start + 50.0}  # released at its hard end
    assert not d.in_arena("a")
    assert sample(d, "kvlease_evictions_total", reason="lifetime") == 1.0


def test_release_ends_the_lease_in_both_and_counts_a_release_eviction() -> None:
    d, _ = desk()
    place(d, "a", 3)
    assert d.release(("a",)) == 1
    assert not d.in_arena("a") and d.renew(("a",), 30.0) == {"a": None}
    assert sample(d, "kvlease_host_bytes_used") == 0.0
    assert sample(d, "kvlease_lease_releases_total", cause="request") == 1.0
    assert sample(d, "kvlease_evictions_total", reason="release") == 1.0


def test_forget_frees_arena_bytes_even_while_pinned() -> None:
    d, _ = desk()
    place(d, "a", 5)
    place(d, "b", 3)
    d.renew(("a",), 20.0, pin=True, claimant="p1")
    assert sample(d, "kvlease_host_bytes_used") == 80.0
    d.forget(["a"])
    assert not d.in_arena("a") and arena(d).bytes_used == 30
    assert sample(d, "kvlease_host_bytes_used") == 30.0
    assert d.snapshot() == (1, 0)


# ---- metrics --------------------------------------------------------------------------------------
def test_metrics_follow_the_desk() -> None:
    d, _ = desk(arena_bytes=200, capacity_blocks=50)
    assert sample(d, "kvlease_host_bytes_used") == 0.0
    d.add("dev", 7, d.clock() + 60.0)
    assert sample(d, "kvlease_device_blocks_held") == 7.0
    assert d.add("h", 4, d.clock() + 60.0).retained
    assert sample(d, "kvlease_device_blocks_held") == 11.0
    d.place_host("h", [1, 2, 3, 4], None)
    assert sample(d, "kvlease_host_bytes_used") == 40.0
    assert sample(d, "kvlease_host_bytes_capacity") == 200.0
    assert sample(d, "kvlease_demotions_total") == 1.0
    assert sample(d, "kvlease_demotion_bytes_total") == 40.0
    assert sample(d, "kvlease_device_blocks_held") == 11.0  # held until given back
    d.unhold(["h"])
    assert sample(d, "kvlease_device_blocks_held") == 7.0
    assert sample(d, "kvlease_retained_blocks") == 7.0
    assert sample(d, "kvlease_leases") == 2.0
    for reason in ("pressure", "lifetime", "expiry", "release"):
        assert sample(d, "kvlease_evictions_total", reason=reason) == 0.0


def test_worker_stats_reach_the_pull_and_demotion_metrics() -> None:
    m = ConnectorMetrics()
    m.observe_worker_stats(
        SimpleNamespace(
            data={STAT_PULLS + "host": [1, 1], STAT_PULLS + "device": [1], STAT_DEMOTION_S: [0.02]}
        )
    )
    m.observe_worker_stats(SimpleNamespace(data=None))  # not a dict: ignored
    m.observe_worker_stats(object())
    tier = m.tier()
    assert tier['kvlease_pulls_total{source="host"}'] == 2.0
    assert tier['kvlease_pulls_total{source="device"}'] == 1.0
    assert tier["kvlease_demotion_seconds_count"] == 1.0
    assert tier["kvlease_demotion_seconds_sum"] == 0.02
    assert "kvlease_leases" not in tier


# ---- HostPlacer.attach: the orders on the metadata, the blocks given back --------------------------
class Pool:
    def __init__(self, n: int) -> None:
        self.blocks = [SimpleNamespace(block_id=i, ref_cnt=0, block_hash=f"h{i}") for i in range(n)]
        self.freed: list[list[int]] = []

    def touch(self, blocks: list[Any]) -> None:
        for b in blocks:
            b.ref_cnt += 1

    def free_blocks(self, blocks: Any) -> None:
        got = list(blocks)
        for b in got:
            b.ref_cnt -= 1
        self.freed.append([b.block_id for b in got])


def test_attach_carries_the_orders_and_gives_the_blocks_back() -> None:
    d, _ = desk(arena_bytes=100)
    refs, pool = BlockRefs(), Pool(20)
    cfg = KVLeaseConfig(host_arena_bytes=100)
    placer = HostPlacer(d, refs, d.metrics, cfg)
    d.add("a", 3, d.clock() + 60.0)
    refs.take(pool, "a", [[4, 5, 6]])
    assert placer.place("a", [4, 5, 6], None) is None
    meta = SimpleNamespace()
    out = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(block_ids=([9],))], scheduled_cached_reqs=None)
    placer.attach(meta, out, pool)
    assert getattr(meta, ALLOCATED_ATTR) == (9,)
    assert [o.lease_id for o in getattr(meta, DEMOTES_ATTR)] == ["a"]
    assert not hasattr(meta, DROPS_ATTR)
    assert pool.freed == [[6, 5, 4]] and d.snapshot() == (1, 0)
    assert sample(d, "kvlease_device_blocks_cached") == 3.0  # free and still hashed
    assert sample(d, "kvlease_placements_total", placement="host") == 1.0
    assert refs.drop(pool, ["a"]) == ["a"] and pool.freed == [[6, 5, 4]]  # ours, not freed twice
