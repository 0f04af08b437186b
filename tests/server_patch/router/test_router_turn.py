"""The sans-IO turn core (``_turn``): ``plan``, ``record``, ``next_attempt``, and the one retry
policy run with an injected sleep (no real time)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvlease.protocol import KV, ReuseStatus
from kvlease_router import NodeSpec, RouterSettings
from kvlease_router._retry import AttemptFailed, run_attempts, upstream_policy
from kvlease_router._store import ConversationRecord
from kvlease_router._turn import (
    RESEND_WAIT_S,
    Attempt,
    Failure,
    Step,
    TurnFacts,
    TurnOutcome,
    next_attempt,
    plan,
    record,
    releases_unused,
    upstream_params,
)

KV_SETTINGS = RouterSettings(
    prefill=(NodeSpec("http://p", "http://pc"),),
    decode=(NodeSpec("http://d", "http://dc"),),
    control_secret="s",
)
STOCK = RouterSettings(prefill=(NodeSpec("http://p"),), decode=(NodeSpec("http://d"),))
NOW = 1000.0
HANDLE = {KV.REMOTE_ENGINE_ID: "e", KV.REMOTE_BLOCK_IDS: [0, 1]}


def _state(**kw: Any) -> ConversationRecord:
    base: dict[str, Any] = dict(
        decode="http://d", params=HANDLE, lease_id="l", control="http://dc", tokens=32, expires_at=NOW + 10
    )
    base.update(kw)
    return ConversationRecord(**base)


@pytest.mark.parametrize(
    ("facts", "state", "status", "offered"),
    [
        (TurnFacts(True, None), None, ReuseStatus.NO_ID, False),
        (TurnFacts(True, "k", decode_healthy=True), None, ReuseStatus.FIRST, False),
        (TurnFacts(True, "k", decode_healthy=True), _state(), ReuseStatus.HIT, True),
        (TurnFacts(True, "k", decode_healthy=True), _state(expires_at=NOW - 1), ReuseStatus.EXPIRED, False),
        (TurnFacts(True, "k", decode_healthy=False), _state(), ReuseStatus.MISS, False),
        (TurnFacts(True, "k", decode_healthy=True), _state(params=None), ReuseStatus.MISS, False),
        (TurnFacts(True, "k", opted_out=True, decode_healthy=True), _state(), ReuseStatus.DISABLED, False),
        (
            TurnFacts(True, "k", reuse_enabled=False, decode_healthy=True),
            _state(),
            ReuseStatus.DISABLED,
            False,
        ),
        (TurnFacts(True, "k", store_ok=False, decode_healthy=True), None, ReuseStatus.ERROR, False),
        (TurnFacts(True, "k", store_ok=False, opted_out=True), None, ReuseStatus.DISABLED, False),
    ],
)
def test_plan_kvlease_mode(
    facts: TurnFacts, state: ConversationRecord | None, status: ReuseStatus, offered: bool
) -> None:
    p = plan(facts, state, NOW, KV_SETTINGS)
    assert p.status is status
    assert (p.handle is not None) is offered


def test_plan_stock_mode_checks_continuity() -> None:
    facts = TurnFacts(True, "k", prompt=[{"role": "user", "content": "x"}], decode_healthy=True)
    assert plan(facts, _state(continuity=None), NOW, STOCK).status is ReuseStatus.MISMATCH


def test_record_and_release_rules() -> None:
    p = plan(TurnFacts(True, "k", decode_healthy=True, ttl=60.0), _state(turns=2), NOW, KV_SETTINGS)
    rec = record(p, TurnOutcome("http://d", "http://dc", {"junk": 1}, None, True, NOW))
    assert rec is not None and rec.params is None and rec.turns == 3 and rec.expires_at == NOW + 60.0
    assert (
        record(
            plan(TurnFacts(True, None), None, NOW, KV_SETTINGS),
            TurnOutcome("d", None, None, None, False, NOW),
        )
        is None
    )
    assert releases_unused(p, ReuseStatus.MISS) and not releases_unused(p, ReuseStatus.HIT)


@pytest.mark.parametrize(
    "params",
    [None, "x", {KV.REMOTE_BLOCK_IDS: "all"}, {KV.REMOTE_PORT: 10**9}, {KV.TP_SIZE: 0}],
)
def test_upstream_params_refuses_what_the_connector_would(params: object) -> None:
    assert upstream_params(params) is None


def test_upstream_params_keeps_a_valid_handle_without_ps_report() -> None:
    out = upstream_params({**HANDLE, KV.KVLEASE: {"reused_tokens": 3}})
    assert out is not None and out[KV.REMOTE_ENGINE_ID] == "e" and KV.KVLEASE not in out


@pytest.mark.parametrize(("settings", "tag"), [(KV_SETTINGS, "t" * 24), (STOCK, None)])
@pytest.mark.parametrize("key", ["k", None])
def test_plan_carries_the_tenant_tag_in_kvlease_mode_only(
    settings: RouterSettings, tag: str | None, key: str | None
) -> None:
    assert plan(TurnFacts(True, key, tenant_tag="t" * 24), None, NOW, settings).tenant_tag == tag


def test_upstream_params_tags_ds_request_and_drops_a_tag_p_echoed() -> None:
    out = upstream_params({**HANDLE, KV.TENANT: "from-p"}, "router-tag")
    assert out is not None and out[KV.TENANT] == "router-tag"
    assert KV.TENANT not in (upstream_params({**HANDLE, KV.TENANT: "from-p"}) or {})
    assert upstream_params("not a handle", "router-tag") is None  # D prefills itself, leases nothing


# ---- next_attempt: the retry rule, as a table ----------------------------------------------------

P1 = Attempt(prefill=True, n_nodes=1, node="a")
P2 = Attempt(prefill=True, n_nodes=2, node="a")
D2 = Attempt(prefill=False, n_nodes=2, node="a")
D1 = Attempt(prefill=False, n_nodes=1, node="a")


@pytest.mark.parametrize(
    ("a", "failure", "step"),
    [
        (P1, Failure.NOT_TAKEN, Step.RESEND),
        (Attempt(prefill=True, n_nodes=1, node="a", resent=True), Failure.NOT_TAKEN, None),
        (P1, Failure.DOWN, None),
        (P1, Failure.REFUSED, None),
        (Attempt(prefill=True, n_nodes=1, node="a", handle=True), Failure.REFUSED, Step.DROP_HANDLE),
        (Attempt(prefill=True, n_nodes=1, node="a", handle=True), Failure.DOWN, Step.DROP_HANDLE),
        (P2, Failure.DOWN, Step.OTHER_NODE),
        (P2, Failure.REFUSED, None),
        (Attempt(prefill=True, n_nodes=3, node="b", tried=("a",), failed=1), Failure.DOWN, None),
        (D2, Failure.NOT_TAKEN, Step.RESEND),
        (D2, Failure.DOWN, Step.OTHER_NODE),
        (Attempt(prefill=False, n_nodes=2, node="b", tried=("a",)), Failure.DOWN, None),
        (D1, Failure.DOWN, None),
    ],
)
def test_next_attempt(a: Attempt, failure: Failure, step: Step | None) -> None:
    nxt = next_attempt(a, failure)
    assert (nxt.step if nxt else None) is step
    if nxt is not None:
        assert nxt.wait == (RESEND_WAIT_S if step is Step.RESEND else 0.0)
        if step is Step.DROP_HANDLE:
            assert not nxt.handle
        if step is Step.OTHER_NODE:
            assert "a" in nxt.tried


def test_the_policy_runs_the_rule_with_an_injected_sleep() -> None:
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    calls: list[Attempt] = []

    async def fn(a: Attempt) -> str:
        calls.append(a)
        if len(calls) < 3:  # not taken, not taken again (down), then the handle-less retry works
            raise AttemptFailed(Failure.NOT_TAKEN if len(calls) == 1 else Failure.DOWN, OSError("x"), "n")
        return "ok"

    first = Attempt(prefill=True, n_nodes=1, handle=True)
    steps: list[Step | None] = []
    out = asyncio.run(run_attempts(upstream_policy(sleep), first, fn, lambda a: steps.append(a.step)))
    assert out == "ok" and steps == [Step.RESEND, Step.DROP_HANDLE]
    assert slept == [RESEND_WAIT_S, 0.0]  # one policy: every wait goes through the injected sleep
    assert calls[1].resent and not calls[2].handle


def test_the_policy_gives_up_with_the_last_failure() -> None:
    async def sleep(s: float) -> None:
        return None

    async def fn(a: Attempt) -> str:
        raise AttemptFailed(Failure.DOWN, ConnectionError(f"down {a.node}"), "n")

    with pytest.raises(ConnectionError):
        asyncio.run(run_attempts(upstream_policy(sleep), Attempt(prefill=False, n_nodes=2), fn))
