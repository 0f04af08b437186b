"""Per-turn reuse decisions and handle parsing (sans-IO: state, ``now`` and JSON in, decisions out).

Status meanings (value of :data:`kvlease.protocol.HEADER_STATUS`), exactly:

* ``no-id``: the request carried no conversation id; nothing is looked up or stored.
* ``disabled``: the client turned reuse off (:data:`kvlease.protocol.HEADER_REUSE`), or reuse is off cluster-wide; no handle
  is sent to P (the new handle from D is still captured for the next turn).
* ``first``: no state for this (tenant, id): nothing to reuse yet.
* ``expired``: state exists but the router's lease ended (no renewal in time); no handle sent.
* ``mismatch``: stock vLLM only, before P: the request does not extend the previous messages plus
  the returned answer exactly. With the kvlease connector: P's verified pull found no common block.
* ``miss``: a handle was expected but none was usable: the last decode returned none (e.g. a stream
  without the kvlease plugin), D is unhealthy, or P reported no reuse (declined, failed read).
* ``local_hit``: a handle was sent and P had nothing left to pull: its own prefix cache already
  covered the verified prefix (P's report says ``local_hit``). Not a miss: P recomputed nothing
  that D could have supplied.
* ``hit``: a handle was sent and P reused D's blocks. :data:`kvlease.protocol.HEADER_REUSED_TOKENS` is P's report:
  the kvlease connector's ``reused_tokens``; else ``usage.prompt_tokens_details.cached_tokens`` (stock
  vLLM with ``--enable-prompt-tokens-details``; it also counts P's local prefix-cache hits); else,
  when P reports nothing, the tokens D held (an upper bound: stock vLLM pulls by length).
* ``error``: the reuse path failed (state store unreachable, or P failed with the handle and the turn
  was retried without it); the turn was recomputed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvlease.protocol import (
    KV,
    KV_TRANSFER_PARAMS,
    PrefillReport,
    ProtocolError,
    ReuseStatus,
    TransferParams,
    pull_request_params,
)
from kvlease_router._store import ConversationRecord

__all__ = ["Captured", "Offer", "capture_handle", "decide_offer", "judge_prefill", "strip_params"]

NEEDLE = KV_TRANSFER_PARAMS.encode()


@dataclass(frozen=True)
class Offer:
    status: ReuseStatus  # final unless ``handle`` is set (then P's answer decides)
    handle: dict[str, Any] | None = None


def decide_offer(
    state: ConversationRecord | None,
    now: float,
    *,
    opted_out: bool,
    reuse_enabled: bool,
    decode_healthy: bool,
    continuity_ok: bool | None,
) -> Offer:
    """Whether to send D's handle to P this turn. ``continuity_ok`` is ``None`` with the kvlease
    connector (P verifies tokens itself), else the stock-vLLM message check."""
    if opted_out or not reuse_enabled:
        return Offer(ReuseStatus.DISABLED)
    if state is None:
        return Offer(ReuseStatus.FIRST)
    if state.expires_at <= now:
        return Offer(ReuseStatus.EXPIRED)
    if state.params is None or not decode_healthy:
        return Offer(ReuseStatus.MISS)
    if continuity_ok is False:
        return Offer(ReuseStatus.MISMATCH)
    return Offer(ReuseStatus.HIT, pull_request_params(state.params))


def _nonneg_int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def judge_prefill(p_body: Mapping[str, Any], offered_tokens: int) -> tuple[ReuseStatus, int]:
    """Status and reused tokens of a turn whose handle was sent to P, from P's JSON answer."""
    params = p_body.get(KV_TRANSFER_PARAMS)
    report = _report(params.get(KV.KVLEASE)) if isinstance(params, Mapping) else None
    if report is not None:
        if report.reused_tokens > 0:
            return ReuseStatus.HIT, report.reused_tokens
        said = ReuseStatus.parse(report.reuse)
        if said in _DECLINED:
            return said, 0
        return ReuseStatus.MISS, 0
    usage = p_body.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, Mapping) else None
    if isinstance(details, Mapping):
        cached = _nonneg_int(details.get("cached_tokens"))
        if cached is not None:
            return (ReuseStatus.HIT, cached) if cached > 0 else (ReuseStatus.MISS, 0)
    prompt_tokens = _nonneg_int(usage.get("prompt_tokens")) if isinstance(usage, Mapping) else None
    estimate = offered_tokens if prompt_tokens is None else min(offered_tokens, max(prompt_tokens - 1, 0))
    return ReuseStatus.HIT, estimate


#: The statuses P's report may say for a turn it pulled nothing for (anything else reads as a miss).
_DECLINED = frozenset({ReuseStatus.MISMATCH, ReuseStatus.EXPIRED, ReuseStatus.LOCAL_HIT, ReuseStatus.ERROR})


def _report(raw: object) -> PrefillReport | None:
    try:
        return PrefillReport.from_json(raw)
    except ProtocolError:
        return None  # no report (stock vLLM), or not one: P's usage decides


@dataclass(frozen=True)
class Captured:
    #: The handle to store: :meth:`TransferParams.to_json` of the parsed one (what P will get).
    params: dict[str, Any]
    lease_id: str | None
    control: str | None
    tokens: int


def capture_handle(params: object, *, kvlease_mode: bool, node_control: str | None) -> Captured | None:
    """D's returned ``kv_transfer_params`` as a reusable handle, or ``None`` if it is not one.

    Parsed once, here, by the connector's parser (:meth:`TransferParams.from_json`: the checks P
    applies to every field that is present); the router needs blocks and an engine, and with the kvlease connector the
    ``kvlease`` object (its hashes, lease id and control endpoint).
    """
    if not isinstance(params, dict):
        return None
    try:
        handle = TransferParams.from_json(params)
    except ProtocolError:
        return None  # P would refuse it: not worth storing or offering
    if not handle.block_ids or handle.engine_id is None:
        return None
    tokens = handle.num_tokens or 0
    if not kvlease_mode:
        return Captured(handle.to_json(), handle.request_id, None, tokens)
    ext = handle.kvlease
    if ext is None:
        return None  # without verified hashes the handle is not safe to offer
    return Captured(handle.to_json(), ext.lease_id, ext.control or node_control, ext.num_tokens or tokens)


def strip_params(obj: Any) -> Any:
    """Remove every ``kv_transfer_params`` key (any depth); return the last non-null value removed."""
    found: Any = None
    stack = [obj]
    while stack:
        cur = stack.pop()
        if isinstance(cur, dict):
            if KV_TRANSFER_PARAMS in cur:
                value = cur.pop(KV_TRANSFER_PARAMS)
                if value is not None:
                    found = value
            stack.extend([v for v in cur.values() if isinstance(v, (dict, list))])
        elif isinstance(cur, list):
            stack.extend([v for v in cur if isinstance(v, (dict, list))])
    return found
