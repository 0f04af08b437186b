"""Token-exact prefix verification of a decode node's block handle (pure, no vLLM).

D publishes chained hashes of the full blocks it retains (:func:`kvlease.protocol.block_hashes`
over prompt + generated tokens, salted with ``cache_salt``) and of its partial last block
(:func:`kvlease.protocol.tail_hash`). P hashes its own prompt the same way; equal hashes at block
``i`` mean equal tokens in blocks ``0..i``. P pulls only that common prefix — whole blocks, plus
the partial last block when everything before it and the partial block itself match, as upstream
pulls it by length — trimming the handle to it, and recomputes the rest, so a stripped ``<think>``,
an edited earlier message or a different BPE split of resent text can never feed it foreign KV.

Handles come from clients through the router: every field is checked here and a bad handle is
rejected with a reason, never an exception into the engine.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

from kvlease.protocol import (
    KV,
    PARALLEL_FIELDS,
    LeaseHandleExt,
    ProtocolError,
    ReuseStatus,
    TransferParams,
    block_hashes,
    common_prefix_blocks,
    handle_mac,
    mac_ok,
    tail_hash,
)

__all__ = [
    "HandleRejected",
    "Reason",
    "RemoteHandle",
    "handle_ext",
    "handle_mac",
    "parse_handle",
    "reuse_status",
    "strip_remote",
    "trim_params",
    "verified_tokens",
]


class Reason(str, enum.Enum):
    """Why P pulled or did not (the ``reason`` label of the decision counter)."""

    PULL = "pull"
    INVALID_HANDLE = "invalid_handle"  # missing/hostile fields, foreign host, huge sizes
    UNVERIFIABLE = "unverifiable"  # no kvlease object: plain upstream handle, never pulled blind
    BLOCK_SIZE = "block_size_mismatch"
    MISMATCH = "mismatch"  # no whole block in common with D's sequence
    LOCAL_HIT = ReuseStatus.LOCAL_HIT.value  # P's own prefix cache already covers the verified prefix
    BELOW_THRESHOLD = "below_threshold"
    COST = "cost"  # predicted transfer slower than recompute
    LEASE_GONE = "lease_gone"  # D no longer holds the lease (expired, released, read)
    CLAIM_FAILED = "claim_failed"  # D's control endpoint did not answer
    FAILED = "failed"  # the read itself failed; recomputed
    BIDIRECTIONAL_OFF = "bidirectional_off"  # this node's bidirectional_kv_xfer is off
    CONTEXT_PARALLEL = "context_parallel"  # decode/prefill context parallel > 1: not supported yet
    HYBRID_PARTIAL = "hybrid_partial"  # several KV cache groups and only part of D's sequence verified
    UNCOVERED = "uncovered_inputs"  # LoRA / multimodal / prompt embeddings the handle does not prove
    #: vLLM's scheduler kept none of the offered tokens: prompt logprobs (the request skips every
    #: prefix cache), or its own caps after the decision (a local sub-block tail, a connector's cap)
    SCHEDULER_DROPPED = "scheduler_dropped"
    #: the read P's allocation implies does not lie within the verified prefix (never pulled)
    SPAN = "span_mismatch"
    #: D placed the lease in its host arena and this node cannot read it with a staged pull
    PLACEMENT = "placement"


_REUSE_STATUS = {
    Reason.PULL: ReuseStatus.HIT,
    Reason.MISMATCH: ReuseStatus.MISMATCH,
    Reason.LEASE_GONE: ReuseStatus.EXPIRED,
    Reason.FAILED: ReuseStatus.ERROR,
    Reason.CLAIM_FAILED: ReuseStatus.ERROR,
    Reason.LOCAL_HIT: ReuseStatus.LOCAL_HIT,  # nothing left to pull: not a miss
}


def reuse_status(reason: Reason | None) -> ReuseStatus:
    """The status P reports to the router for a decision (``None``: pulled); every other decline is
    a ``miss``. The connector and the fake P/D both report through this table."""
    return _REUSE_STATUS.get(reason or Reason.PULL, ReuseStatus.MISS)


class HandleRejected(ValueError):
    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class RemoteHandle:
    """A checked pull handle from a decode node (P side): what P needs of it, never ``None``.

    ``params`` is the whole typed handle it was checked from (:class:`~kvlease.protocol.TransferParams`,
    the one parse of vLLM's dict); :func:`trim_params` makes the trimmed handle from it.
    """

    ext: LeaseHandleExt
    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    params: TransferParams | None = None


def _reject(detail: str, reason: Reason = Reason.INVALID_HANDLE) -> HandleRejected:
    return HandleRejected(reason, detail)


def parse_handle(
    params: Mapping[str, Any],
    *,
    num_groups: int,
    host_allowed: Callable[[str], bool],
    max_parallel: int,
    secret: str | None = None,
) -> RemoteHandle:
    """Check a pull handle (``do_remote_decode`` with ``remote_block_ids``) or raise HandleRejected.

    The wire dict is parsed once, by :meth:`TransferParams.from_json` (the strictness every reader
    of a handle shares); on top, P requires a complete pull target and applies its own policy:
    allowed hosts, its KV cache groups, its parallelism limit. With ``secret`` (the shared control
    secret) the handle must carry D's MAC: nothing a client edits (block ids, engine, host, sizes)
    is ever used. ``params`` is never modified.
    """
    if params.get(KV.KVLEASE) is None:
        raise _reject("no kvlease object: the handle cannot be verified", Reason.UNVERIFIABLE)
    if secret is not None and not mac_ok(secret, params):  # over the dict as received
        raise _reject("the handle's MAC is missing or wrong (edited after D issued it)")
    try:
        handle = TransferParams.from_json(params)
    except ProtocolError as e:
        raise _reject(f"bad handle: {e}") from None
    ext = handle.kvlease
    assert ext is not None  # present, and parsed
    if handle.engine_id is None:
        raise _reject("remote_engine_id must be a non-empty string")
    if handle.request_id is None:
        raise _reject("remote_request_id must be a non-empty string")
    host = handle.host
    if host is None or not host_allowed(host):
        raise _reject(f"remote_host {host!r} is not an allowed host")
    if handle.port is None:
        raise _reject("remote_port must be an integer in [1, 65535]")
    for name in PARALLEL_FIELDS:
        v = getattr(handle, name)
        if v is not None and v > max_parallel:
            raise _reject(f"{name} must be an integer in [1, {max_parallel}], got {v!r}")
    if ext.control is not None:
        ctl_host = urlsplit(ext.control).hostname  # a well-formed http(s) URL: checked by the parse
        if not ctl_host or not host_allowed(ctl_host):
            raise _reject(f"kvlease.control {ext.control!r} is not an allowed URL")
    if handle.num_tokens is None:
        raise _reject("remote_num_tokens must be a non-negative integer")
    if handle.block_ids is None or not handle.grouped or len(handle.block_ids) != num_groups:
        raise _reject(f"remote_block_ids must be a list of {num_groups} block lists")
    return RemoteHandle(
        ext,
        handle.engine_id,
        handle.request_id,
        host,
        handle.port,
        handle.block_ids,
        handle.num_tokens,
        handle,
    )


def handle_ext(
    *,
    token_ids: Sequence[int],
    num_tokens: int,
    block_size: int,
    salt: str | None,
    lease_id: str,
    engine_id: str,
    control: str | None,
    lora: str | None = None,
    mm: str | None = None,
) -> LeaseHandleExt:
    """D side: the ``kvlease`` object for a retained sequence of ``num_tokens`` computed tokens.

    ``lora`` / ``mm``: the request's LoRA adapter and multimodal digest (:mod:`kvlease_vllm._guards`),
    what vLLM's own block hashes cover beyond tokens and salt.
    """
    toks = token_ids[:num_tokens]
    hashes = tuple(block_hashes(toks, block_size, salt))
    full = len(hashes) * block_size
    tail = tail_hash(toks[full:], hashes[-1] if hashes else None, salt) if len(toks) > full else None
    return LeaseHandleExt(
        block_size=block_size,
        num_tokens=len(toks),
        hashes=hashes,
        tail=tail,
        lease_id=lease_id,
        engine_id=engine_id,
        control=control,
        lora=lora,
        mm=mm,
    )


def verified_tokens(
    handle: RemoteHandle, prompt_token_ids: Sequence[int], salt: str | None, local_block_size: int
) -> int:
    """Leading tokens of P's prompt that D holds, token for token (0 when block sizes differ).

    Whole blocks whose chained hashes agree; when all of D's full blocks agree and D's partial last
    block (``tail``) matches too, all ``num_tokens`` D computed. At least one prompt token is always
    left to compute, and the count never exceeds the blocks and tokens the handle names.
    """
    bs = handle.ext.block_size
    if bs != local_block_size:
        raise HandleRejected(Reason.BLOCK_SIZE, f"D's block size {bs} != P's {local_block_size}")
    n_prompt = len(prompt_token_ids)
    # Full-attention groups name every block; the sliding-window (or Mamba) groups of a hybrid KV
    # cache name only their in-window tail, so the longest list bounds what D holds. Which prefixes
    # of a hybrid handle can be pulled is ``_guards.hybrid_partial_reason``'s call.
    named = max((len(g) for g in handle.block_ids), default=0)
    ext = handle.ext
    limit = min((n_prompt - 1) // bs if n_prompt else 0, len(ext.hashes), handle.num_tokens // bs, named)
    if limit <= 0 and ext.tail is None:
        return 0
    n = int(common_prefix_blocks(block_hashes(prompt_token_ids[: limit * bs], bs, salt), ext.hashes[:limit]))
    full = len(ext.hashes)
    if (
        ext.tail is not None
        and n == full == ext.num_tokens // bs
        and n_prompt > ext.num_tokens
        and handle.num_tokens >= ext.num_tokens
        and named > full
        and tail_hash(prompt_token_ids[full * bs : ext.num_tokens], ext.hashes[-1] if full else None, salt)
        == ext.tail
    ):
        return ext.num_tokens
    return n * bs


def trim_params(handle: RemoteHandle, tokens: int, *, deadline: float | None = None) -> TransferParams:
    """A new handle: ``handle`` cut to its first ``tokens`` verified tokens (vLLM's dict untouched).

    Every group's list ends at D's last block (the longest names every block from the first; a
    sliding-window group names only its tail), so each is cut by the same number of blocks from its
    end: upstream pairs P's blocks with the end of each list, and a sliding-window group then hands
    P the KV of the window before ``tokens`` (``_guards.hybrid_partial_reason`` checks D holds it).

    ``deadline``: D's absolute deadline after P's claim, for upstream's expired-read guard (None:
    the deadline D issued stays).
    """
    params = handle.params
    if params is None:  # built by hand (tests): the fields P checked are all there is
        params = TransferParams(
            do_remote_decode=True,
            do_remote_prefill=False,
            engine_id=handle.engine_id,
            block_ids=handle.block_ids,
            request_id=handle.request_id,
            host=handle.host,
            port=handle.port,
            num_tokens=handle.num_tokens,
            kvlease=handle.ext,
        )
    out = params.trimmed(tokens, handle.ext.block_size, deadline=deadline)
    groups = handle.block_ids
    cut = max((len(g) for g in groups), default=0) - -(-tokens // handle.ext.block_size)
    if cut <= 0:
        return out
    return replace(out, block_ids=tuple(g[: max(len(g) - cut, 0)] for g in groups))


def strip_remote(params: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``params`` that names no remote blocks (P then never contacts the decode node).

    Works on the wire dict, not the typed handle: a declined handle may be one that did not parse.
    """
    return {**params, KV.REMOTE_BLOCK_IDS: None, KV.REMOTE_NUM_TOKENS: 0}
