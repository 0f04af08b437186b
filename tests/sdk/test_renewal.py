"""The lease table (sans-IO): when renewals are due, batching, idle release, unknown ids, failures."""

from __future__ import annotations

import json

import pytest

from kvlease import LeaseError, protocol
from kvlease._renewal import LeaseWire, RenewalSchedule, RenewBatch, TransientLeaseError

R1, R2 = "http://r1:8000", "http://r2:8000"
AUTH = {"authorization": "Bearer k"}


def _table(max_idle: float = 1000.0) -> RenewalSchedule:
    return RenewalSchedule(max_idle=max_idle)


def test_nothing_due_before_sixty_percent_of_ttl() -> None:
    t = _table()
    t.activate("a", R1, 100.0, AUTH, now=0.0, explicit=True)
    assert t.next_wakeup() == pytest.approx(60.0)
    assert t.due(59.9) == ([], [])
    batches, idle = t.due(60.0)
    assert [b.conversation_ids for b in batches] == [("a",)] and idle == []
    assert batches[0].headers == AUTH


@pytest.mark.parametrize("closed_by", ["forget", "idle"])
def test_a_new_lease_after_all_closed_is_not_renewed_at_once(closed_by: str) -> None:
    """Every lease on a router closed (released, or dropped as idle), then a new conversation
    there: its first renewal is a fraction of its TTL away, not the stale due time the closed
    leases left (which woke the keeper for a pointless renew on every new conversation)."""
    t = RenewalSchedule(max_idle=50.0)
    t.activate("a", R1, 100.0, AUTH, now=0.0, explicit=True)
    if closed_by == "forget":
        t.forget("a")
    else:
        assert t.due(60.0)[1] and not t.due(200.0)[0]  # renewed at 60, then idle at 200
    assert t.next_wakeup() is None
    due = t.activate("b", R1, 100.0, AUTH, now=500.0, explicit=True)
    assert due == pytest.approx(560.0) and t.next_wakeup() == pytest.approx(560.0)
    assert t.due(500.1) == ([], [])
    t.activate("c", R1, 30.0, AUTH, now=510.0, explicit=True)  # with one open: the shorter one wins
    assert t.next_wakeup() == pytest.approx(528.0)


def test_one_batch_per_router_for_many_conversations() -> None:
    t = _table()
    for i in range(10_050):
        t.activate(f"c{i}", R1 if i % 2 else R2, 50.0, AUTH, now=float(i % 7), explicit=False)
    batches, _ = t.due(100.0)
    assert sorted(b.root for b in batches) == [R1, R2]
    assert sum(len(b.conversation_ids) for b in batches) == 10_050
    assert all(len(b.conversation_ids) <= protocol.RENEW_MAX_IDS for b in batches)


def test_more_than_max_ids_split_into_several_requests() -> None:
    t = _table()
    n = protocol.RENEW_MAX_IDS + 5
    for i in range(n):
        t.activate(f"c{i}", R1, 50.0, {}, now=0.0, explicit=False)
    batches, _ = t.due(30.0)
    assert [len(b.conversation_ids) for b in batches] == [protocol.RENEW_MAX_IDS, 5]


@pytest.mark.parametrize(
    ("ttls", "expected_due"),
    [((100.0,), 60.0), ((100.0, 10.0), 6.0), ((10.0, 100.0), 6.0)],
)
def test_shortest_ttl_sets_the_period(ttls: tuple[float, ...], expected_due: float) -> None:
    t = _table()
    for i, ttl in enumerate(ttls):
        t.activate(f"c{i}", R1, ttl, {}, now=0.0, explicit=True)
    assert t.next_wakeup() == pytest.approx(expected_due)


def test_renew_answer_moves_the_deadline_and_drops_unknown_ids() -> None:
    t = _table()
    t.activate("a", R1, 100.0, {}, now=0.0, explicit=True)
    t.activate("b", R1, 100.0, {}, now=0.0, explicit=True)
    (batch,), _ = t.due(60.0)
    unknown = t.renewed(batch, protocol.RenewResponse({"a": 100.0, "b": None}, ttl=100.0), now=61.0)
    assert unknown == ["b"] and "b" not in t and "a" in t
    assert t.next_wakeup() == pytest.approx(121.0)
    # a lease the router shortened brings the next renewal forward
    (batch,), _ = t.due(121.0)
    t.renewed(batch, protocol.RenewResponse({"a": 20.0}, ttl=100.0), now=122.0)
    assert t.next_wakeup() == pytest.approx(122.0 + 12.0)


def test_idle_conversations_are_released_not_renewed() -> None:
    t = _table(max_idle=30.0)
    t.activate("old", R1, 50.0, AUTH, now=0.0, explicit=True)
    t.activate("new", R1, 50.0, AUTH, now=20.0, explicit=False)
    batches, idle = t.due(31.0)
    assert [o.conversation_id for o in idle] == ["old"] and idle[0].explicit and idle[0].headers == AUTH
    assert [b.conversation_ids for b in batches] == [("new",)]
    assert "old" not in t and len(t) == 1
    assert t.is_idle("new", 51.0) and not t.is_idle("new", 49.0)


def test_failures_retry_soon_or_drop_the_router() -> None:
    t = _table()
    t.activate("a", R1, 100.0, {}, now=0.0, explicit=True)
    (batch,), _ = t.due(60.0)
    assert t.failed(batch, 61.0, permanent=False) == []
    assert t.next_wakeup() == pytest.approx(61.0 + 0.25 * 60.0)
    assert t.failed(batch, 62.0, permanent=True) == ["a"]
    assert len(t) == 0 and t.next_wakeup() is None


def test_forget_and_move_between_routers() -> None:
    t = _table()
    t.activate("a", R1, 100.0, AUTH, now=0.0, explicit=True)
    t.activate("a", R2, 100.0, AUTH, now=1.0, explicit=True)
    batches, _ = t.due(200.0)
    assert [(b.root, b.conversation_ids) for b in batches] == [(R2, ("a",))]
    order = t.forget("a")
    assert order is not None and order.root == R2
    assert t.forget("a") is None and t.forget_all() == []


def test_wire_shapes_and_error_mapping() -> None:
    url, body, headers = LeaseWire.renew_request(RenewBatch(R1, AUTH, ("a", "b")))
    assert url == R1 + protocol.RENEW_PATH
    assert json.loads(body) == {"conversation_ids": ["a", "b"]}
    assert headers["authorization"] == "Bearer k"
    ok = LeaseWire.renew_answer(200, json.dumps({"leases": {"a": {"expires_in": 5}}}).encode())
    assert ok.leases == {"a": 5.0}
    with pytest.raises(TransientLeaseError):
        LeaseWire.renew_answer(503, b"busy")
    with pytest.raises(LeaseError) as e:
        LeaseWire.renew_answer(404, b"no route")
    assert not e.value.transient and e.value.status_code == 404
    with pytest.raises(LeaseError, match="malformed"):
        LeaseWire.renew_answer(200, b"[]")
    LeaseWire.release_answer(404, b"")  # already gone is fine
    with pytest.raises(TransientLeaseError):
        LeaseWire.release_answer(500, b"")


def test_unextended_answers_do_not_accelerate_renewals() -> None:
    """A router that answers with the remaining time but never extends (a capped lease lifetime)
    must not pull the keeper into ever faster renewals: one renew per period, never below 1 s."""
    t = _table()
    t.activate("capped", R1, 30.0, {}, now=0.0, explicit=True)
    deadline = 30.0  # the router never moves it
    now, renewals = 0.0, 0
    while (wake := t.next_wakeup()) is not None and wake < deadline:
        now = wake
        batches, _ = t.due(now)
        for b in batches:
            renewals += 1
            t.renewed(b, protocol.RenewResponse(leases={"capped": deadline - now}, ttl=30.0), now)
    # the first renew at 18 s learns the lease was not extended; the next period is the full 0.6*TTL
    assert renewals == 1


def test_short_remaining_times_are_floored_at_a_tenth_of_the_ttl() -> None:
    t = _table()
    t.activate("a", R1, 30.0, {}, now=0.0, explicit=True)
    (b,), _ = t.due(18.0)
    t.renewed(b, protocol.RenewResponse(leases={"a": 12.0}, ttl=30.0), 18.0)  # deadline stays at 30
    assert t.next_wakeup() == pytest.approx(18.0 + 18.0)  # so a does not set the period
    t.activate("b", R1, 30.0, {}, now=19.0, explicit=True)
    (b,), _ = t.due(36.0)
    t.renewed(b, protocol.RenewResponse(leases={"b": 0.5}, ttl=30.0), 36.0)  # a unknown; b shortened
    assert t.next_wakeup() == pytest.approx(36.0 + 3.0)  # 0.3 s floored at 10 % of the TTL
    t2 = _table()
    t2.activate("c", R1, 30.0, {}, now=0.0, explicit=True)
    (b,), _ = t2.due(18.0)
    t2.renewed(b, protocol.RenewResponse(leases={"c": 2.0}, ttl=30.0), 18.0)  # moved to 20
    assert t2.next_wakeup() == pytest.approx(21.0)  # 10 % of the TTL, not 1.2 s
    with pytest.raises(ValueError, match="min_fraction"):
        RenewalSchedule(max_idle=10.0, min_fraction=0.0)
