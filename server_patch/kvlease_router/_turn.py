"""The turn core (sans-IO): what a turn does, and what it leaves behind.

``plan(facts, state, now, settings) -> TurnPlan`` decides, from what the request and the cluster
say (:class:`TurnFacts`) and the stored :class:`ConversationRecord`, whether P gets D's handle and
what the turn's status is so far. ``record(plan, outcome) -> ConversationRecord | None`` gives the
state the conversation's next turn finds, from what D answered (:class:`TurnOutcome`).
``next_attempt`` is the one retry rule of upstream calls (P and D): after a failed attempt, what the
next one is, or that there is none. None of them reads a clock, sleeps or does IO; ``_flow.py``
does the IO around them. Table-driven tests: ``tests/server_patch/router/test_router_turn.py``.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, replace
from typing import Any

from kvlease.protocol import KV, ProtocolError, ReuseStatus, TransferParams
from kvlease_router._continuity import (
    Continuity,
    chat_continuity,
    chat_extends,
    completion_continuity,
    completion_extends,
)
from kvlease_router._reuse import capture_handle, decide_offer
from kvlease_router._settings import RouterSettings
from kvlease_router._store import ConversationRecord

__all__ = [
    "Attempt",
    "Failure",
    "TurnFacts",
    "TurnOutcome",
    "TurnPlan",
    "first_attempt",
    "next_attempt",
    "plan",
    "record",
    "releases_unused",
    "upstream_params",
    "with_tenant",
]


@dataclass(frozen=True)
class TurnFacts:
    """What the request and the cluster say about this turn (read by the IO layer)."""

    chat: bool
    #: The tenant-scoped state key (``None``: the request named no conversation).
    key: str | None
    #: ``messages`` (chat) or ``prompt`` (completions), for the stock-vLLM continuity check.
    prompt: object = None
    opted_out: bool = False
    #: False when the state store failed on the lookup.
    store_ok: bool = True
    reuse_enabled: bool = True
    #: Whether the D that holds the conversation's blocks is known and healthy now.
    decode_healthy: bool = False
    #: The router's lease TTL (the cluster plan's), for the record this turn leaves.
    ttl: float = 0.0
    #: The tenant's opaque tag (``Keyer.tenant_tag``), for P's and D's requests in kvlease mode.
    tenant_tag: str | None = None


@dataclass(frozen=True)
class TurnPlan:
    """The decisions of one turn before any upstream call."""

    chat: bool
    key: str | None
    state: ConversationRecord | None
    status: ReuseStatus
    #: What P gets: D's handle (a pull), or ``None`` (the plain ``do_remote_decode`` request).
    handle: dict[str, Any] | None
    kvlease_mode: bool
    ttl: float
    prompt: object = None
    #: The tenant tag P's and D's ``kv_transfer_params`` carry (:attr:`KV.TENANT`): D tags the lease
    #: it creates, P its claim (D's per-tenant retention quota). Only with the kvlease connector:
    #: stock vLLM gets exactly what it got before.
    tenant_tag: str | None = None

    @property
    def prefer_decode(self) -> str | None:
        """The D to send the decode to when it is healthy (the one holding the blocks)."""
        return self.state.decode if self.state else None


@dataclass(frozen=True)
class TurnOutcome:
    """What D answered: its node, its (unparsed) handle, the returned message or text."""

    decode: str
    node_control: str | None
    params: object
    returned: object
    streamed: bool
    now: float


def plan(
    facts: TurnFacts, state: ConversationRecord | None, now: float, settings: RouterSettings
) -> TurnPlan:
    """The turn's offer and status. With the kvlease connector P verifies tokens itself; with stock
    vLLM the new messages must extend the stored ones plus the returned answer exactly."""
    kvlease, ttl = settings.kvlease_mode, facts.ttl
    tag = facts.tenant_tag if kvlease else None
    if facts.key is None:
        return TurnPlan(facts.chat, None, None, ReuseStatus.NO_ID, None, kvlease, ttl, facts.prompt, tag)
    continuity_ok: bool | None = None
    if not kvlease:
        continuity_ok = False
        if state is not None and state.continuity:
            held = Continuity(state.continuity, state.prefix_len)
            continuity_ok = (
                chat_extends(facts.prompt, held) if facts.chat else completion_extends(facts.prompt, held)
            )
    offer = decide_offer(
        state,
        now,
        opted_out=facts.opted_out,
        reuse_enabled=facts.reuse_enabled,
        decode_healthy=facts.decode_healthy,
        continuity_ok=continuity_ok,
    )
    status, handle = offer.status, offer.handle
    if not facts.store_ok and not facts.opted_out:
        status, handle = ReuseStatus.ERROR, None
    return TurnPlan(facts.chat, facts.key, state, status, handle, kvlease, ttl, facts.prompt, tag)


def releases_unused(p: TurnPlan, status: ReuseStatus) -> bool:
    """D keeps blocks P did not read until the TTL: whether to give them back now (kvlease only)."""
    s = p.state
    return (
        p.kvlease_mode
        and status is not ReuseStatus.HIT
        and s is not None
        and s.params is not None
        and bool(s.control and s.lease_id)
    )


def record(p: TurnPlan, outcome: TurnOutcome) -> ConversationRecord | None:
    """The state the conversation's next turn finds (``None``: nothing is stored, no id)."""
    if p.key is None:
        return None
    kvlease = p.kvlease_mode
    cap = (
        None
        if (outcome.streamed and not kvlease)  # stock vLLM puts no handle in streams
        else capture_handle(outcome.params, kvlease_mode=kvlease, node_control=outcome.node_control)
    )
    continuity = None
    if cap is not None and not kvlease:
        continuity = (
            chat_continuity(p.prompt, outcome.returned)
            if p.chat
            else completion_continuity(p.prompt, outcome.returned)
        )
    return ConversationRecord(
        decode=outcome.decode,
        params=cap.params if cap else None,
        lease_id=cap.lease_id if cap else None,
        control=cap.control if cap else None,
        tokens=cap.tokens if cap else 0,
        expires_at=outcome.now + p.ttl,
        continuity=continuity.digest if continuity else None,
        prefix_len=continuity.prefix_len if continuity else 0,
        turns=(p.state.turns + 1) if p.state else 1,
    )


def upstream_params(params: object, tenant_tag: str | None = None) -> dict[str, Any] | None:
    """P's ``kv_transfer_params`` as D gets them: parsed by the connector's handle parser and
    re-serialized (less P's ``kvlease`` report, which is the router's, and any tenant tag P
    echoed), with the router's ``tenant_tag`` (:attr:`KV.TENANT`, for the lease D creates) when
    given; or ``None`` (D then prefills itself, and leases nothing) when they are not a valid handle."""
    if not isinstance(params, dict):
        return None
    if KV.KVLEASE in params or KV.TENANT in params:  # P's report to the router, not D's pull
        params = {k: v for k, v in params.items() if k not in (KV.KVLEASE, KV.TENANT)}
    try:
        out: dict[str, Any] = TransferParams.from_json(params).to_json()
    except ProtocolError:
        return None
    return with_tenant(out, tenant_tag)


def with_tenant(params: dict[str, Any], tenant_tag: str | None) -> dict[str, Any]:
    """``params`` (a fresh dict) with the router's tenant tag, when there is one."""
    return params if tenant_tag is None else {**params, KV.TENANT: tenant_tag}


# ---- the retry rule of upstream calls -------------------------------------------------------------


class Failure(enum.Enum):
    #: The node did not take the request (refused, or a pooled keep-alive connection it had closed).
    NOT_TAKEN = "not-taken"
    #: It took it and failed (timeout, broken connection, garbage, a compressed answer).
    DOWN = "down"
    #: It answered 4xx (P only: D's 4xx goes to the client).
    REFUSED = "refused"


class Step(enum.Enum):
    RESEND = "resend"  # the same request to the same node, once, after a short pause
    DROP_HANDLE = "drop-handle"  # P failed with D's handle: again without it (status ``error``)
    OTHER_NODE = "other-node"  # another node of the role


#: Pause before a resend to the same node (a full listen backlog drains in milliseconds).
RESEND_WAIT_S = 0.05


@dataclass(frozen=True)
class Attempt:
    """Where a call stands: the node of the last attempt, the nodes given up on, whether the
    current logical attempt was already resent, whether P still gets the handle."""

    prefill: bool
    n_nodes: int
    handle: bool = False
    node: str | None = None
    tried: tuple[str, ...] = ()
    resent: bool = False
    #: Logical attempts that failed (a resend is part of its attempt).
    failed: int = 0
    step: Step | None = None

    @property
    def wait(self) -> float:
        return RESEND_WAIT_S if self.step is Step.RESEND else 0.0


@functools.lru_cache(maxsize=64)
def first_attempt(prefill: bool, n_nodes: int, handle: bool) -> Attempt:
    """The first attempt of a call (immutable: one per shape, not one per turn)."""
    return Attempt(prefill=prefill, n_nodes=n_nodes, handle=handle)


def next_attempt(a: Attempt, failure: Failure) -> Attempt | None:
    """The next attempt after ``failure`` of ``a``, or ``None`` when the call has failed.

    A request a node did not take is sent once more to it. Otherwise P retries once without the
    handle if it had one, then (when down, and another P exists) once on another P; D moves to
    another D when it has one (two nodes at most)."""
    if failure is Failure.NOT_TAKEN and not a.resent:
        return replace(a, resent=True, step=Step.RESEND)
    failed = a.failed + 1
    if a.prefill:
        if a.handle:
            return replace(a, handle=False, resent=False, failed=failed, step=Step.DROP_HANDLE)
        if failure is not Failure.REFUSED and failed < 2 and a.n_nodes > len(a.tried) + 1:
            return replace(
                a, tried=a.tried + (a.node or "",), resent=False, failed=failed, step=Step.OTHER_NODE
            )
        return None
    tried = a.tried + (a.node or "",)
    if failure is not Failure.REFUSED and len(tried) < min(2, a.n_nodes):
        return replace(a, tried=tried, resent=False, failed=failed, step=Step.OTHER_NODE)
    return None
