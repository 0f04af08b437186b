"""The sans-IO lease core (``_lease_core``): ``plan_renew``, ``settle_renew``, ``plan_release``."""

from __future__ import annotations

from typing import Any

import pytest

from kvlease_router._lease_core import LeaseSettings, ReleasePlan, plan_release, plan_renew, settle_renew
from kvlease_router._store import ConversationRecord

NOW = 1000.0
CONFIGURED = {"http://dc1": "http://dc1", "http://dc2": "http://dc2"}
DECODE_CONTROL = {"http://d1": "http://dc1"}


def _resolve(url: str | None, decode: str | None) -> str | None:
    if url in CONFIGURED:
        return CONFIGURED[url]
    return DECODE_CONTROL.get(decode) if decode else None


KV = LeaseSettings(True, ttl=300.0, ttl_margin=5.0, expired_grace=60.0, configured_control=_resolve)
STOCK = LeaseSettings(False, ttl=300.0, ttl_margin=5.0, expired_grace=60.0, configured_control=_resolve)


def _rec(**kw: Any) -> ConversationRecord:
    base: dict[str, Any] = dict(
        decode="http://d1",
        params={"b": [1]},
        lease_id="l",
        control="http://dc1",
        tokens=8,
        expires_at=NOW + 10,
    )
    base.update(kw)
    return ConversationRecord(**base)


@pytest.mark.parametrize(
    ("settings", "rec", "lease", "call", "drop"),
    [
        (KV, None, None, None, False),  # unknown id
        (KV, _rec(params=None), None, None, False),  # no handle
        (KV, _rec(expires_at=NOW), None, None, False),  # the router's lease ended
        (KV, _rec(), None, "http://dc1", False),  # to renew on its D
        (KV, _rec(control="http://dc2"), None, "http://dc2", False),  # its own configured endpoint
        (KV, _rec(control="http://evil", decode="http://d1"), None, "http://dc1", False),  # by decode
        (KV, _rec(control="http://evil", decode="http://evil"), None, None, True),  # nowhere: dropped
        (KV, _rec(lease_id=None), None, None, True),  # a handle without a lease
        (STOCK, _rec(), 10.0, None, False),  # stock vLLM: remaining time, no renewal
        (STOCK, _rec(expires_at=NOW - 1), None, None, False),
    ],
)
def test_plan_renew_per_id(
    settings: LeaseSettings, rec: ConversationRecord | None, lease: float | None, call: str | None, drop: bool
) -> None:
    p = plan_renew(["c"], [rec], NOW, settings)
    assert p.leases == {"c": lease}
    assert p.calls == ({call: [0]} if call else {})
    assert p.lease_ids == ({call: ["l"]} if call else {})
    assert p.drops == ([0] if drop else [])


def test_plan_renew_groups_by_node_in_id_order() -> None:
    recs = [_rec(lease_id="a"), None, _rec(lease_id="b", control="http://dc2"), _rec(lease_id="c")]
    p = plan_renew(["w", "x", "y", "z"], recs, NOW, KV)
    assert list(p.leases) == ["w", "x", "y", "z"]
    assert p.calls == {"http://dc1": [0, 3], "http://dc2": [2]}
    assert p.lease_ids == {"http://dc1": ["a", "c"], "http://dc2": ["b"]}


@pytest.mark.parametrize(
    "odd",
    [
        None,
        _rec(params=None),
        _rec(expires_at=NOW),
        _rec(lease_id=""),
        _rec(control="http://dc2"),
        _rec(decode="http://d2"),  # same control URL, another decode URL: resolved apart
        _rec(control="http://evil", decode="http://evil"),
    ],
)
@pytest.mark.parametrize("at", [0, 20, 49])
def test_a_keepers_renew_decides_each_id_as_alone(odd: ConversationRecord | None, at: int) -> None:
    """A renew of many ids on one D (a keeper's) with one id that is not like the others anywhere
    in it: every id is decided as it would be alone (the per-id table above)."""
    n = 50
    recs: list[ConversationRecord | None] = [_rec(lease_id=f"l{i}") for i in range(n)]
    recs[at] = odd
    ids = [f"c{i}" for i in range(n)]
    p = plan_renew(ids, recs, NOW, KV)
    alone = plan_renew(["c"], [odd], NOW, KV)
    good = [i for i in range(n) if i != at]
    want_calls: dict[str, list[int]] = {"http://dc1": good}
    for node in alone.calls:
        want_calls.setdefault(node, []).append(at)
        want_calls[node].sort()
    assert p.calls == want_calls
    assert p.lease_ids == {c: [recs[i].lease_id for i in idx] for c, idx in want_calls.items()}  # type: ignore[union-attr]
    assert p.drops == ([at] if alone.drops else [])
    assert p.leases == dict.fromkeys(ids)
    full = plan_renew(ids, [_rec(lease_id=f"l{i}") for i in range(n)], NOW, KV)
    assert full.calls == {"http://dc1": list(range(n))} and full.drops == []
    assert full.lease_ids == {"http://dc1": [f"l{i}" for i in range(n)]}


@pytest.mark.parametrize(
    ("answer", "lease", "renewals", "drops"),
    [
        ({"l": 305.0}, 300.0, {300.0: [0]}, []),  # renewed: D's time less the margin
        ({"l": 400.0}, 300.0, {300.0: [0]}, []),  # never more than the router's TTL
        ({"l": 105.0}, 100.0, {100.0: [0]}, []),  # D capped it
        ({"l": 5.0}, None, {}, [0]),  # within the margin: gone
        ({"l": None}, None, {}, [0]),  # D no longer holds it
        ({}, None, {}, [0]),
        (None, 10.0, {}, []),  # D unreachable: remaining time, nothing written
    ],
)
def test_settle_renew_per_answer(
    answer: dict[str, float | None] | None,
    lease: float | None,
    renewals: dict[float, list[int]],
    drops: list[int],
) -> None:
    p = plan_renew(["c"], [_rec()], NOW, KV)
    r = settle_renew(p, {"http://dc1": answer}, KV)
    assert r.leases == {"c": lease}
    assert r.renewals == renewals and r.drops == drops
    assert r.renewed == sum(map(len, renewals.values()))


def test_settle_renew_mixed_answers_keep_id_order() -> None:
    recs = [_rec(lease_id=str(i), control="http://dc2" if i == 3 else "http://dc1") for i in range(4)]
    p = plan_renew(["a", "b", "c", "d"], recs, NOW, KV)
    answers = {"http://dc1": {"0": 305.0, "1": None, "2": 105.0}, "http://dc2": {"3": 305.0}}
    r = settle_renew(p, answers, KV)
    assert list(r.leases.items()) == [("a", 300.0), ("b", None), ("c", 100.0), ("d", 300.0)]
    assert r.renewals == {300.0: [0, 3], 100.0: [2]} and r.drops == [1]
    assert p.leases == {"a": None, "b": None, "c": None, "d": None}  # the plan is not changed


def test_settle_renew_alike_answers_take_the_bulk_path() -> None:
    n = 1000
    p = plan_renew([f"c{i}" for i in range(n)], [_rec(lease_id=f"l{i}") for i in range(n)], NOW, KV)
    r = settle_renew(p, {"http://dc1": {f"l{i}": 305.0 for i in range(n)}}, KV)
    assert set(r.leases.values()) == {300.0} and r.renewals == {300.0: list(range(n))} and r.drops == []


@pytest.mark.parametrize(
    ("settings", "rec", "want"),
    [
        (KV, None, ReleasePlan(False)),
        (KV, _rec(), ReleasePlan(True, "http://dc1", ("l",))),
        (KV, _rec(control="http://evil", decode="http://d1"), ReleasePlan(True, "http://dc1", ("l",))),
        (KV, _rec(control="http://evil", decode="http://evil"), ReleasePlan(True)),
        (KV, _rec(control=None), ReleasePlan(True)),
        (KV, _rec(lease_id=None), ReleasePlan(True)),
        (STOCK, _rec(), ReleasePlan(True)),
    ],
)
def test_plan_release(settings: LeaseSettings, rec: ConversationRecord | None, want: ReleasePlan) -> None:
    assert plan_release(rec, settings) == want


def test_settings_derive_keep_for_and_the_ask() -> None:
    assert KV.keep_for == 360.0 and KV.ask == 305.0
