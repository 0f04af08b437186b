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
import hmac
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard
from urllib.parse import urlsplit

from kvlease.protocol import (
    KV,
    LEASE_HANDLE_MAC,
    LeaseHandleExt,
    ProtocolError,
    block_hashes,
    common_prefix_blocks,
    tail_hash,
)


class Reason(str, enum.Enum):
    """Why P pulled or did not (the ``reason`` label of the decision counter)."""

    PULL = "pull"
    INVALID_HANDLE = "invalid_handle"  # missing/hostile fields, foreign host, huge sizes
    UNVERIFIABLE = "unverifiable"  # no kvlease object: plain upstream handle, never pulled blind
    BLOCK_SIZE = "block_size_mismatch"
    MISMATCH = "mismatch"  # no whole block in common with D's sequence
    LOCAL_HIT = "local_hit"  # P's own prefix cache already covers the verified prefix
    BELOW_THRESHOLD = "below_threshold"
    COST = "cost"  # predicted transfer slower than recompute
    LEASE_GONE = "lease_gone"  # D no longer holds the lease (expired, released, read)
    CLAIM_FAILED = "claim_failed"  # D's control endpoint did not answer
    FAILED = "failed"  # the read itself failed; recomputed


class HandleRejected(ValueError):
    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class RemoteHandle:
    """A parsed, checked ``kv_transfer_params`` from a decode node (P side)."""

    ext: LeaseHandleExt
    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int


_PARALLEL_FIELDS = (KV.TP_SIZE, "dcp_size", "pp_size")
_MAX_BLOCK_ID = 1 << 31


def _reject(detail: str, reason: Reason = Reason.INVALID_HANDLE) -> HandleRejected:
    return HandleRejected(reason, detail)


def _int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


_MAC_FIELDS = (
    KV.REMOTE_ENGINE_ID,
    KV.REMOTE_REQUEST_ID,
    KV.REMOTE_HOST,
    KV.REMOTE_PORT,
    KV.REMOTE_BLOCK_IDS,
    KV.REMOTE_NUM_TOKENS,
    *_PARALLEL_FIELDS,
)


def handle_mac(secret: str, params: Mapping[str, Any]) -> str:
    """HMAC-SHA256 over a handle's routing fields and its ``kvlease`` object (minus the MAC)."""
    ext = params.get(KV.KVLEASE)
    body = {k: params.get(k) for k in _MAC_FIELDS}
    body[KV.KVLEASE] = (
        {k: v for k, v in ext.items() if k != LEASE_HANDLE_MAC} if isinstance(ext, Mapping) else ext
    )
    msg = json.dumps(body, sort_keys=True, separators=(",", ":"), default=list).encode()
    return hmac.new(secret.encode(), msg, "sha256").hexdigest()


def parse_handle(
    params: Mapping[str, Any],
    *,
    num_groups: int,
    host_allowed: Callable[[str], bool],
    max_parallel: int,
    secret: str | None = None,
) -> RemoteHandle:
    """Check a pull handle (``do_remote_decode`` with ``remote_block_ids``) or raise HandleRejected.

    With ``secret`` (the shared control secret) the handle must carry D's MAC: nothing a client
    edits (block ids, engine, host, sizes) is ever used.
    """
    raw_ext = params.get(KV.KVLEASE)
    if raw_ext is None:
        raise _reject("no kvlease object: the handle cannot be verified", Reason.UNVERIFIABLE)
    if secret is not None:
        mac = raw_ext.get(LEASE_HANDLE_MAC) if isinstance(raw_ext, Mapping) else None
        if not isinstance(mac, str) or not hmac.compare_digest(mac, handle_mac(secret, params)):
            raise _reject("the handle's MAC is missing or wrong (edited after D issued it)")
    try:
        ext = LeaseHandleExt.from_json(raw_ext)
    except ProtocolError as e:
        raise _reject(f"bad kvlease object: {e}") from None
    engine_id = params.get(KV.REMOTE_ENGINE_ID)
    request_id = params.get(KV.REMOTE_REQUEST_ID)
    host = params.get(KV.REMOTE_HOST)
    port = params.get(KV.REMOTE_PORT)
    if not isinstance(engine_id, str) or not engine_id or len(engine_id) > 512:
        raise _reject("remote_engine_id must be a non-empty string")
    if ext.engine_id is not None and ext.engine_id != engine_id:
        raise _reject("remote_engine_id does not match kvlease.engine_id")
    if not isinstance(request_id, str) or not request_id or len(request_id) > 512:
        raise _reject("remote_request_id must be a non-empty string")
    if request_id != ext.lease_id:
        raise _reject("remote_request_id does not match kvlease.lease_id")
    if not isinstance(host, str) or not host or not host_allowed(host):
        raise _reject(f"remote_host {host!r} is not an allowed host")
    if not _int(port) or not 0 < port < 65536:
        raise _reject(f"remote_port must be an integer in [1, 65535], got {port!r}")
    for name in _PARALLEL_FIELDS:
        v = params.get(name, 1)
        if not _int(v) or not 1 <= v <= max_parallel:
            raise _reject(f"{name} must be an integer in [1, {max_parallel}], got {v!r}")
    if ext.control is not None:
        try:
            url = urlsplit(ext.control)
            ctl_host, _ = url.hostname, url.port
        except ValueError:
            raise _reject("kvlease.control is not a URL") from None
        if url.scheme not in ("http", "https") or not ctl_host or not host_allowed(ctl_host):
            raise _reject(f"kvlease.control {ext.control!r} is not an allowed URL")
    num_tokens = params.get(KV.REMOTE_NUM_TOKENS)
    if not _int(num_tokens) or not 0 <= num_tokens <= 1 << 31:
        raise _reject("remote_num_tokens must be a non-negative integer")
    raw_ids = params.get(KV.REMOTE_BLOCK_IDS)
    if not isinstance(raw_ids, (list, tuple)) or len(raw_ids) != num_groups:
        raise _reject(f"remote_block_ids must be a list of {num_groups} block lists")
    groups: list[tuple[int, ...]] = []
    for g in raw_ids:
        if not isinstance(g, (list, tuple)) or len(g) > LeaseHandleExt.MAX_BLOCKS:
            raise _reject("remote_block_ids must contain lists of block ids")
        if not all(_int(b) and 0 <= b < _MAX_BLOCK_ID for b in g):
            raise _reject("remote_block_ids must contain non-negative integers")
        groups.append(tuple(g))
    expiry = params.get(KV.REMOTE_BLOCKS_EXPIRY_TIME)
    if expiry is not None and not (isinstance(expiry, (int, float)) and not isinstance(expiry, bool)):
        raise _reject("remote_blocks_expiry_time must be a number or null")
    return RemoteHandle(ext, engine_id, request_id, host, port, tuple(groups), num_tokens)


def handle_ext(
    *,
    token_ids: Sequence[int],
    num_tokens: int,
    block_size: int,
    salt: str | None,
    lease_id: str,
    engine_id: str,
    control: str | None,
) -> LeaseHandleExt:
    """D side: the ``kvlease`` object for a retained sequence of ``num_tokens`` computed tokens."""
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
    named = min((len(g) for g in handle.block_ids), default=0)
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


def trim_params(params: dict[str, Any], handle: RemoteHandle, tokens: int) -> None:
    """Cut the handle in ``params`` (in place) to its first ``tokens`` verified tokens."""
    n_blocks = -(-tokens // handle.ext.block_size)
    params[KV.REMOTE_BLOCK_IDS] = [list(g[:n_blocks]) for g in handle.block_ids]
    params[KV.REMOTE_NUM_TOKENS] = tokens


def strip_remote(params: dict[str, Any]) -> None:
    """Make ``params`` name no remote blocks (P then never contacts the decode node)."""
    params[KV.REMOTE_BLOCK_IDS] = None
    params[KV.REMOTE_NUM_TOKENS] = 0
