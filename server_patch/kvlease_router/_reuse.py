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
    PREFILL_REUSE_STATUS,
    PREFILL_REUSED_TOKENS,
    LeaseHandleExt,
    ProtocolError,
    ReuseStatus,
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
    handle = dict(state.params)
    handle[KV.DO_REMOTE_DECODE] = True
    handle[KV.DO_REMOTE_PREFILL] = False
    return Offer(ReuseStatus.HIT, handle)


def _nonneg_int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def judge_prefill(p_body: Mapping[str, Any], offered_tokens: int) -> tuple[ReuseStatus, int]:
    """Status and reused tokens of a turn whose handle was sent to P, from P's JSON answer."""
    params = p_body.get(KV_TRANSFER_PARAMS)
    report = params.get(KV.KVLEASE) if isinstance(params, Mapping) else None
    if isinstance(report, Mapping):
        reused = _nonneg_int(report.get(PREFILL_REUSED_TOKENS))
        if reused is not None:
            if reused > 0:
                return ReuseStatus.HIT, reused
            said = ReuseStatus.parse(
                report.get(PREFILL_REUSE_STATUS)
                if isinstance(report.get(PREFILL_REUSE_STATUS), str)
                else None
            )
            if said in (ReuseStatus.MISMATCH, ReuseStatus.EXPIRED, ReuseStatus.MISS, ReuseStatus.ERROR):
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


@dataclass(frozen=True)
class Captured:
    params: dict[str, Any]
    lease_id: str | None
    control: str | None
    tokens: int


def capture_handle(params: object, *, kvlease_mode: bool, node_control: str | None) -> Captured | None:
    """D's returned ``kv_transfer_params`` as a reusable handle, or ``None`` if it is not one."""
    if not isinstance(params, dict):
        return None
    blocks = params.get(KV.REMOTE_BLOCK_IDS)
    if not blocks or not isinstance(params.get(KV.REMOTE_ENGINE_ID), str):
        return None
    request_id = params.get(KV.REMOTE_REQUEST_ID)
    tokens = _nonneg_int(params.get(KV.REMOTE_NUM_TOKENS)) or 0
    if not kvlease_mode:
        return Captured(params, request_id if isinstance(request_id, str) else None, None, tokens)
    try:
        ext = LeaseHandleExt.from_json(params.get(KV.KVLEASE))
    except ProtocolError:
        return None  # without verified hashes the handle is not safe to offer
    return Captured(params, ext.lease_id, ext.control or node_control, ext.num_tokens or tokens)


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
