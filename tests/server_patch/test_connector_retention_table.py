"""The decode node's lease table (sans-IO, table-driven)."""

from __future__ import annotations

import ast
import itertools

import pytest

from kvlease_stack._vllm_src import SUPPORTED, vllm_source
from kvlease_vllm._retention import RELEASING_GRACE_S, AddResult, RetentionTable


def table(cap: int = 100, guard: float = 2.0, max_ttl: float = 3600.0) -> RetentionTable:
    return RetentionTable(cap, max_ttl=max_ttl, renew_guard=guard)


# (deadline, now, ttl) -> expected new deadline (None: refused)
@pytest.mark.parametrize(
    ("deadline", "now", "ttl", "expected"),
    [
        (120.0, 100.0, 60.0, 160.0),  # extends
        (200.0, 100.0, 60.0, 200.0),  # never shortens
        (101.0, 100.0, 60.0, None),  # inside the renew guard: the worker may free it any moment
        (100.0, 100.0, 60.0, None),  # at the deadline
        (90.0, 100.0, 60.0, None),  # past the deadline
        (120.0, 100.0, 0.0, None),  # ttl must be positive
        (120.0, 100.0, 99999.0, 3700.0),  # capped by max_ttl
    ],
)
def test_renew(deadline: float, now: float, ttl: float, expected: float | None) -> None:
    t = table()
    t.add("a", 4, deadline, now=0.0)
    assert t.renew("a", ttl, now) == expected
    updates = t.take_updates()
    if expected is not None and expected != deadline:
        assert updates == {"a": expected}
    else:
        assert updates == {}


def test_deadlines_are_monotone_over_many_renewals() -> None:
    t = table()
    t.add("a", 1, 20.0, now=0.0)
    seen = [20.0]
    for now, ttl in [(5, 20), (6, 1), (10, 30), (12, 5), (30, 20), (39, 3)]:
        got = t.renew("a", ttl, float(now))
        assert got is not None
        seen.append(got)
    assert seen == sorted(seen)


def test_unknown_and_released_leases_are_never_renewed() -> None:
    t = table()
    assert t.renew("nope", 10, 0.0) is None
    t.add("a", 3, 50.0, now=0.0)
    assert t.release("a", now=1.0)
    assert t.renew("a", 10, 2.0) is None
    assert not t.release("a", now=2.0)
    assert t.take_updates() == {"a": 1.0}  # release = a deadline of "now" for the workers
    assert t.retained_blocks == 0
    assert t.releasing_blocks == 3
    assert t.forget("a")  # the workers confirmed the free
    assert t.releasing_blocks == 0
    assert t.renew("a", 10, 3.0) is None


def test_forget_after_read_drops_lease_and_pending_update() -> None:
    t = table()
    t.add("a", 5, 50.0, now=0.0)
    t.renew("a", 100, 1.0)
    assert t.forget("a")
    assert t.take_updates() == {}
    assert t.retained_blocks == 0 and len(t) == 0
    assert not t.forget("a")


@pytest.mark.parametrize(
    ("existing", "new_blocks", "retained", "released"),
    [
        # existing: (id, blocks, deadline, pinned_until)
        ([("a", 40, 30.0, None), ("b", 40, 20.0, None)], 20, True, ()),  # fits exactly
        ([("a", 40, 30.0, None), ("b", 40, 20.0, None)], 30, True, ("b",)),  # oldest deadline first
        ([("a", 40, 10.0, None), ("b", 40, 20.0, None)], 30, True, ("a",)),
        ([("a", 40, 30.0, None), ("b", 40, 20.0, None)], 70, True, ("b", "a")),
        ([("a", 40, 30.0, None), ("b", 40, 20.0, 999.0)], 30, True, ("a",)),  # pinned: never early
        ([("a", 40, 30.0, 999.0), ("b", 40, 20.0, 999.0)], 30, False, ()),  # all pinned: not retained
        ([], 101, False, ()),  # larger than the cap alone
        ([], 100, True, ()),
    ],
)
def test_cap_releases_oldest_deadline_first(
    existing: list[tuple[str, int, float, float | None]],
    new_blocks: int,
    retained: bool,
    released: tuple[str, ...],
) -> None:
    t = table(cap=100)
    for lid, blocks, deadline, pinned in existing:
        t.add(lid, blocks, deadline, now=0.0)
        if pinned is not None:
            t.renew(lid, pinned, now=0.0, pin=True)
    t.take_updates()
    before = t.retained_blocks
    result = t.add("new", new_blocks, 50.0, now=1.0)
    assert result.retained is retained
    assert result.released == released
    assert t.retained_blocks <= t.capacity_blocks
    if retained:
        assert "new" in t
    else:
        assert "new" not in t and t.retained_blocks == before
    assert set(t.take_updates()) == set(released)


@pytest.mark.parametrize(
    ("need", "released"),
    [(0, []), (1, ["c"]), (10, ["c"]), (11, ["c", "a"]), (25, ["c", "a"]), (1000, ["c", "a"])],
)
def test_relieve_order_skips_pinned(need: int, released: list[str]) -> None:
    t = table(cap=1000)
    t.add("a", 10, 40.0, now=0.0)
    t.add("b", 10, 30.0, now=0.0)
    t.add("c", 10, 35.0, now=0.0)
    t.renew("b", 100.0, now=0.0, pin=True)  # b: deadline 100, pinned until 100
    assert t.relieve(need, now=1.0) == released


def test_pin_expires() -> None:
    t = table(cap=1000)
    t.add("a", 10, 500.0, now=0.0)
    t.renew("a", 5.0, now=0.0, pin=True)
    assert t.relieve(10, now=4.0) == []
    assert t.relieve(10, now=6.0) == ["a"]


def test_duplicate_add_and_negative_blocks_are_errors() -> None:
    t = table()
    t.add("a", 1, 5.0, now=0.0)
    with pytest.raises(ValueError):
        t.add("a", 1, 5.0, now=0.0)
    with pytest.raises(ValueError):
        t.add("b", -1, 5.0, now=0.0)


def test_sweep_bounds_memory() -> None:
    t = table()
    t.add("old", 2, 10.0, now=0.0)
    t.add("live", 2, 1000.0, now=0.0)
    t.add("rel", 2, 1000.0, now=0.0)
    t.release("rel", now=1.0)
    assert sorted(t.sweep(now=10.0 + RELEASING_GRACE_S + 1)) == ["old", "rel"]
    assert list(lease.lease_id for lease in t) == ["live"]
    assert t.retained_blocks == 2 and t.releasing_blocks == 0


def test_expires_in() -> None:
    t = table()
    t.add("a", 1, 30.0, now=0.0)
    assert t.expires_in("a", 10.0) == 20.0
    assert t.expires_in("a", 31.0) is None
    assert t.expires_in("zz", 0.0) is None


def test_claims_are_exclusive_and_the_claimant_may_claim_again() -> None:
    t = table()
    t.add("a", 4, 200.0, now=0.0)
    assert t.renew("a", 30.0, 100.0, pin=True, claimant="p-1") == 200.0
    assert t.renew("a", 30.0, 101.0, pin=True, claimant="p-2") is None  # another reader: refused
    assert t.renew("a", 30.0, 101.0, pin=True) is None  # an anonymous claim never matches a pin
    assert t.renew("a", 30.0, 110.0, pin=True, claimant="p-1") == 200.0  # the same read re-claims
    assert t.renew("a", 30.0, 111.0) == 200.0  # a plain renewal is not a claim
    # once the pin has ended, another reader may claim
    assert t.renew("a", 30.0, 150.0, pin=True, claimant="p-2") == 200.0


def test_release_defers_while_pinned() -> None:
    t = table()
    t.add("a", 4, 500.0, now=0.0)
    t.renew("a", 30.0, 100.0, pin=True, claimant="p-1")
    t.take_updates()
    assert t.release("a", 101.0) is True  # accepted ...
    assert "a" in t and t.retained_blocks == 4 and t.take_updates() == {}  # ... but not under the read
    assert t.renew("a", 60.0, 102.0) is None  # being released: renews as unknown
    t.sweep(120.0)  # pin still holds
    assert "a" in t
    t.sweep(131.0)  # pin over: the deferred release happens
    assert "a" not in t and t.take_updates() == {"a": 131.0} and t.releasing_blocks == 4


def test_unpin_ends_only_the_claimants_pin_and_lets_a_deferred_release_go() -> None:
    t = table()
    t.add("a", 4, 500.0, now=0.0)
    t.renew("a", 30.0, 100.0, pin=True, claimant="p-1")
    assert t.unpin("a", "p-2", 101.0) is False  # not its pin
    assert t.unpin("nope", "p-1", 101.0) is False
    assert t.release("a", 102.0) is True and "a" in t  # deferred under the pin
    assert t.unpin("a", "p-1", 103.0) is True  # P will not read it after all
    assert t.unpin("a", "p-1", 103.5) is False  # once
    t.sweep(104.0)  # the deferred release goes now, not when the pin would have ended (130)
    assert "a" not in t and t.take_updates() == {"a": 104.0}


def test_emergency_relief_frees_one_lease_oldest_unpinned_first() -> None:
    t = table()
    for lid, deadline in (("new", 300.0), ("old", 100.0), ("mid", 200.0), ("pinned", 50.0)):
        t.add(lid, 10, deadline, now=0.0)
    t.renew("pinned", 30.0, 10.0, pin=True, claimant="p")
    assert t.relieve(1000, 11.0, limit=1) == ["old"]
    assert t.relieve(1000, 11.0, limit=1) == ["mid"]
    assert t.relieve(1000, 11.0) == ["new"]  # without a limit: until enough (pinned never)


# ---- per-tenant quota: leases are tagged at creation ------------------------------------------


def test_a_tenant_filling_the_cap_pushes_out_its_own_leases_without_any_renewal() -> None:
    t = table(cap=10)  # quota: half the cap, 5 blocks
    t.add("b-1", 2, 10.0, now=0.0, tenant="B")  # B's leases are the oldest
    t.add("b-2", 2, 11.0, now=0.0, tenant="B")
    for i, deadline in enumerate((20.0, 21.0, 22.0)):
        assert t.add(f"a-{i}", 2, deadline, now=1.0, tenant="A").released == ()
    got = t.add("a-3", 2, 23.0, now=2.0, tenant="A")  # 12 blocks asked of 10: one lease must go
    assert got == AddResult(True, ("a-0",))  # A's oldest, not B's older ones
    assert {x.lease_id for x in t if x.tenant == "B"} == {"b-1", "b-2"}
    assert t.by_tenant() == {"A": (3, 6), "B": (2, 4)}


def test_untagged_leases_go_oldest_first() -> None:
    t = table(cap=10)
    t.add("b-1", 2, 10.0, now=0.0)
    for i in range(4):
        t.add(f"a-{i}", 2, 20.0 + i, now=1.0)
    assert t.add("a-4", 2, 30.0, now=2.0).released == ("b-1",)  # no tags: the oldest deadline
    assert t.by_tenant() == {None: (5, 10)}


def test_the_lease_being_added_counts_towards_its_tenants_quota() -> None:
    t = table(cap=10)
    t.add("b-1", 5, 10.0, now=0.0, tenant="B")  # B at its quota, the oldest
    t.add("a-1", 5, 20.0, now=0.0, tenant="A")  # A at its quota
    # A asks for more: past its quota with the new lease, so its own older lease goes
    assert t.add("a-2", 5, 30.0, now=1.0, tenant="A").released == ("a-1",)
    assert t.get("b-1") is not None and t.get("a-1") is None


def test_pressure_relief_releases_the_over_quota_tenant_first() -> None:
    t = table(cap=10)
    t.add("u-1", 1, 5.0, now=0.0)  # untagged, the oldest
    t.add("b-1", 1, 10.0, now=0.0, tenant="B")
    for i in range(4):
        t.add(f"a-{i}", 2, 20.0 + i, now=0.0, tenant="A")
    assert t.relieve(3, now=1.0) == ["a-0", "a-1"]  # A holds 8 of 10 blocks, its quota is 5


def test_a_renewal_naming_a_tag_tags_an_untagged_lease() -> None:
    t = table()
    t.add("x", 3, 50.0, now=0.0)
    assert t.get("x").tenant is None  # type: ignore[union-attr]
    t.renew("x", 60.0, 1.0, tenant="A")
    assert t.by_tenant() == {"A": (1, 3)}


# ------------------------------------------------ retention never depends on insertion order
# (vLLM issue #58222: a reaper that stops at the first live entry assumes its map is sorted by
# expiry; renewals update deadlines in place, so no map of leases stays sorted.)
LEASES = [("a", 10, 40.0, "t1"), ("b", 10, 30.0, None), ("c", 20, 35.0, "t1"), ("d", 10, 45.0, "t2")]
RENEWALS = [("b", 60.0), ("d", 10.0), ("a", 5.0)]  # b outlives everyone; d and a unchanged


@pytest.mark.parametrize("order", list(itertools.permutations(range(len(LEASES)))))
def test_early_release_and_updates_never_depend_on_insertion_order(order: tuple[int, ...]) -> None:
    def run(order: tuple[int, ...]) -> tuple[list[str], list[str], dict[str, float], dict[str, float]]:
        t = RetentionTable(50, renew_guard=0.0, tenant_quota_fraction=0.5)
        for i in order:
            lid, blocks, deadline, tenant = LEASES[i]
            t.add(lid, blocks, deadline, now=0.0, tenant=tenant)
        for lid, ttl in RENEWALS:
            t.renew(lid, ttl, now=1.0)
        renewed = t.take_updates()
        over_cap = list(t.add("e", 10, 50.0, now=2.0, tenant="t1").released)
        relieved = t.relieve(25, now=3.0)
        return over_cap, relieved, renewed, t.take_updates()

    got = run(order)
    assert got == run(tuple(range(len(LEASES))))
    over_cap, relieved, renewed, released = got
    assert renewed == {"b": 61.0}
    assert over_cap == ["c"]  # tenant t1 past its quota with the new lease: its oldest goes first
    assert relieved == ["a", "d", "e"]  # then oldest deadline first, whatever came in first; b lives
    assert released == {"c": 2.0, "a": 3.0, "d": 3.0, "e": 3.0}


def test_renewed_deadlines_reach_the_workers_out_of_expiry_order() -> None:
    """What upstream's worker map of deadlines looks like under kvlease: deadline changes are
    written into it in place (a renewed lease keeps its slot), so a live entry can sit in front of
    an earlier-expiring one. Hence upstream's sweep must scan every entry (checked against the
    sources next)."""
    t = table()
    worker: dict[str, float] = {}  # upstream's _reqs_to_send: req_id -> deadline, in place
    t.add("a", 1, 10.0, now=0.0)
    t.add("b", 1, 20.0, now=0.0)
    worker.update({"a": 10.0, "b": 20.0})  # issued with D's handles, in finish order
    t.renew("a", 100.0, now=5.0)
    t.release("b", now=6.0)
    worker.update(t.take_updates())
    assert list(worker.items()) == [("a", 105.0), ("b", 6.0)]  # not sorted by expiry


def _sweep_problems(base_worker_source: str) -> list[str]:
    """What keeps upstream's worker sweep from handling a map not sorted by expiry ([]: nothing)."""
    tree = ast.parse(base_worker_source)
    sweep = next(
        (
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef) and n.name == "_reap_expired_send_leases"
        ),
        None,
    )
    if sweep is None:
        return ["no _reap_expired_send_leases"]
    problems = []
    if any(isinstance(n, ast.Break) for n in ast.walk(sweep)):
        problems.append("the sweep stops early")
    if not any(
        isinstance(n, ast.comprehension)
        and ast.unparse(n.iter) == "self._reqs_to_send.items()"
        and any("now >= expires" in ast.unparse(cond) for cond in n.ifs)
        for n in ast.walk(sweep)
    ):
        problems.append("the sweep does not test each entry's deadline")
    return problems


@pytest.mark.slow
@pytest.mark.parametrize("version", sorted(SUPPORTED))
def test_upstreams_expiry_sweep_scans_every_entry(version: str) -> None:
    """Every supported vLLM's worker sweep (``_reap_expired_send_leases``) checks every entry of
    ``_reqs_to_send`` and never stops at the first live one, and its worker writes the deadlines
    kvlease sends into that map in place. A vLLM whose sweep broke early would strand released and
    expired leases behind a renewed one: kvlease would then have to keep the map sorted."""
    nixl = vllm_source(version) / "vllm" / "distributed" / "kv_transfer" / "kv_connector" / "v1" / "nixl"
    assert _sweep_problems((nixl / "base_worker.py").read_text(encoding="utf-8")) == []
    pull_worker = (nixl / "pull_worker.py").read_text(encoding="utf-8")
    assert "self._reqs_to_send[req_id] = expiration_time" in pull_worker


def test_the_sweep_check_catches_an_early_break() -> None:
    """The check can fail: the pre-#58222 shape (stop at the first live entry) is reported."""
    early = (
        "class W:\n"
        "    def _reap_expired_send_leases(self, done):\n"
        "        now = 0\n"
        "        for req_id, expires in self._reqs_to_send.items():\n"
        "            if now < expires:\n"
        "                break\n"
        "            done.add(req_id)\n"
    )
    assert _sweep_problems(early) == [
        "the sweep stops early",
        "the sweep does not test each entry's deadline",
    ]
