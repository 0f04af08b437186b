"""P side: one request's pull, from the decision to the completed read (the connector's record),
and the re-claims of its lease on D while the read waits."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass

from kvlease.protocol import PrefillReport
from kvlease_vllm._control import ClaimResult
from kvlease_vllm._verify import Reason, RemoteHandle, reuse_status

__all__ = ["Pull", "claim_outcome", "reclaim_waiting"]


@dataclass
class Pull:
    """P side: one request's handle, from the decision to the completed read."""

    handle: RemoteHandle | None
    verified: int = 0  # verified tokens of the handle (whole blocks, maybe a partial last one)
    claim: Future[ClaimResult] | None = None
    started: float | None = None  # when (gain, True) was first returned
    tokens: int = 0
    outcome: Reason | None = None
    local: int = 0  # P's own prefix-cache tokens when the pull was decided
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
