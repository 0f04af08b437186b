"""P side: one request's pull, from the decision to the completed read (the connector's record):
the trim at the scheduler's final count, the re-claims of its lease on D while the read waits, and
the early end of the claim when the pull is dropped after it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

from kvlease.protocol import PrefillReport, TransferParams
from kvlease_vllm import _control
from kvlease_vllm._control import ClaimResult
from kvlease_vllm._verify import Reason, RemoteHandle, reuse_status, trim_params

__all__ = [
    "Pull",
    "Trim",
    "allocated_local_tokens",
    "claim_outcome",
    "final_trim",
    "reclaim_waiting",
    "submit_unclaim",
]


@dataclass
class Pull:
    """P side: one request's handle, from the decision to the completed read."""

    handle: RemoteHandle | None
    verified: int = 0  # verified tokens of the handle (whole blocks, maybe a partial last one)
    claim: Future[ClaimResult] | None = None
    started: float | None = None  # when (gain, True) was first returned
    tokens: int = 0
    outcome: Reason | None = None
    #: P's own prefix-cache tokens at the scheduler's latest ask (vLLM asks again, with a fresh
    #: local hit, every step an admission fails to allocate; the last ask is the one it admits).
    local: int = 0
    deadline: float | None = None  # D's absolute deadline after the claim (D's clock)
    claimed_at: float | None = None  # when the last claim succeeded (P's clock)
    reclaim: Future[ClaimResult] | None = None
    trimmed: bool = False  # the handle was cut to the scheduler's final count
    staged: bool = False  # planned as a staged pull (kvlease_vllm._worker)
    #: The router's tenant tag of P's request (``kvlease.protocol.tenant_tag_of``), sent with every
    #: claim so D counts the lease under it; None: untagged.
    tenant: str | None = None

    def report(self) -> PrefillReport:
        """P's reuse report for the router (``kvlease`` object of P's response params)."""
        status = reuse_status(self.outcome)
        hit = self.outcome is Reason.PULL
        return PrefillReport(self.tokens if hit else 0, status.value)


def allocated_local_tokens(blocks: Any, block_size: int) -> int | None:
    """P's own prefix-cache tokens in the scheduler's allocation for a loading request, counted as
    upstream's ``update_state_after_alloc`` counts them: hashed, non-null blocks per KV cache group
    (vLLM hashes a loading request's new blocks only once the load is done), the longest group's
    count x ``block_size``. None when ``blocks`` is not vLLM's ``KVCacheBlocks``."""
    groups = getattr(blocks, "blocks", None)
    if groups is None:
        return None
    try:
        hashed = [sum(b.block_hash is not None and not b.is_null for b in group) for group in groups]
    except (AttributeError, TypeError):
        return None
    return max(hashed, default=0) * block_size


@dataclass(frozen=True)
class Trim:
    """What P hands upstream at the scheduler's final count (:func:`final_trim`)."""

    reason: Reason  # PULL, or why not
    params: TransferParams | None  # the handle upstream's worker gets; None: none (strip it)
    detail: str = ""  # in words, for the log line ("": nothing to say)
    warn: bool = False  # the log line is a warning


def final_trim(pull: Pull, blocks: Any, num_external_tokens: int, block_size: int, *, hybrid: bool) -> Trim:
    """The handle cut to P's local prefix + the scheduler's final external count, or why not.

    Upstream pairs P's unhashed blocks with the tail of D's trimmed block list, so the handle must
    cover exactly P's local prefix + the external count, and that span must lie within the
    verified prefix. The local prefix is the last ask's (``pull.local``); P's allocation
    (``blocks``, :func:`allocated_local_tokens`), when it can be read, must agree with it.
    A span that cannot be proven comes back as D's handle with a deadline in the past: the
    scheduler already waits for this load and upstream's worker must finish it, and its
    expired-read guard declines it unread (a failed load, which P recomputes).
    """
    handle = pull.handle
    assert handle is not None
    if num_external_tokens <= 0:
        return Trim(Reason.SCHEDULER_DROPPED, None, "the scheduler kept none of the offered tokens")
    local, why = pull.local, ""
    allocated_local = allocated_local_tokens(blocks, block_size)
    if allocated_local is not None and allocated_local != local:
        why = f"P's allocation holds {allocated_local} prefix-cache tokens, the last ask said {local}"
    elif local + num_external_tokens > pull.verified:
        why = f"{local} local + {num_external_tokens} external tokens reach past the {pull.verified} verified"
    if why:
        return Trim(Reason.SPAN, trim_params(handle, pull.verified, deadline=0.0), why, warn=True)
    trimmed = trim_params(handle, local + num_external_tokens, deadline=pull.deadline)
    if num_external_tokens >= pull.tokens:
        return Trim(Reason.PULL, trimmed)
    detail = f"the scheduler lowered the pull from {pull.tokens} to {num_external_tokens} tokens"
    if hybrid:
        # the sliding-window blocks D holds were checked for the verified prefix's end only
        # (``_guards.hybrid_partial_reason``): fail the read unread, as for an unproven span
        detail += "; hybrid KV cache: D's sliding-window blocks were checked for the verified end only"
        return Trim(Reason.SPAN, trim_params(handle, pull.verified, deadline=0.0), detail, warn=True)
    return Trim(Reason.PULL, trimmed, detail)


def submit_unclaim(pool: Executor, pull: Pull, claimant: str, secret: str | None, timeout: float) -> None:
    """End ``claimant``'s pin of ``pull``'s lease on D early, in ``pool``: it will not read it
    after all (fire and forget: the pin runs out by itself anyway)."""
    handle = pull.handle
    assert handle is not None and handle.ext.control is not None
    pool.submit(_control.unclaim, handle.ext.control, handle.request_id, secret, timeout, claimant)


def claim_outcome(fut: Future[ClaimResult]) -> tuple[ClaimResult | None, str]:
    """The claim's result, or None and why it failed (in words, for the decline's log line)."""
    try:
        return fut.result(), ""
    except Exception as e:
        return None, f"D's control endpoint did not answer the claim ({type(e).__name__}: {e})"


def reclaim_waiting(
    pulls: Mapping[str, Pull], now: float, hold_s: float, submit: Callable[[Pull, str], Future[ClaimResult]]
) -> list[tuple[str, str]]:
    """Renew the claim of every read still waiting past half the claim hold (``submit(pull,
    request id)``); returns (request id, why) of each finished re-claim D refused, for the log."""
    refused: list[tuple[str, str]] = []
    for rid, pull in pulls.items():
        if pull.reclaim is not None and pull.reclaim.done():
            result, error = claim_outcome(pull.reclaim)
            pull.reclaim = None
            if result is None or result.left is None:
                refused.append((rid, error or "lease gone"))
            else:
                pull.claimed_at = now
        waiting = pull.started is not None and pull.started >= 0 and pull.claimed_at is not None
        if (
            waiting
            and pull.reclaim is None
            and pull.handle is not None
            and now - pull.claimed_at >= hold_s / 2  # type: ignore[operator]
        ):
            pull.reclaim = submit(pull, rid)
    return refused
