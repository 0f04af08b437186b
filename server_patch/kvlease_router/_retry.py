"""The one retry policy of upstream calls (P and D), as a tenacity policy.

What the next attempt is comes from the pure rule :func:`kvlease_router._turn.next_attempt`; this
module only runs it. The first attempt runs bare (tenacity's bookkeeping costs ~0.1 ms a call, on
every turn); its failure, when the rule allows another attempt, is handed to the policy as the
policy's own first attempt, so ``stop`` and ``wait`` count it. All three of stop, wait and retry
are set explicitly, and ``sleep`` is injectable (tests need no real time).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Generic, TypeVar

from aiohttp import web
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
)

from kvlease_router._turn import Attempt, Failure, next_attempt

__all__ = ["RETRY_POLICY", "AttemptFailed", "UpstreamRetry", "run_attempts", "upstream_policy"]

T = TypeVar("T")

#: Upper bounds of one upstream call's attempts (the rule itself stops well before: P makes at most
#: 6 attempts, D at most 4).
MAX_ATTEMPTS = 8
MAX_RETRY_DELAY_S = 30.0


#: The app's policy (``create_app(..., retry_policy=...)``; tests pass one with a fake ``sleep``).
RETRY_POLICY: web.AppKey[AsyncRetrying] = web.AppKey("kvlease_retry_policy", AsyncRetrying)


class AttemptFailed(Exception):
    """One attempt failed: how (``failure``), and what to raise when no attempt is left."""

    def __init__(self, failure: Failure, final: BaseException, node: str) -> None:
        super().__init__(str(final))
        self.failure, self.final, self.node = failure, final, node


class UpstreamRetry(Exception):
    """Raised into the policy: try again with ``attempt``."""

    def __init__(self, attempt: Attempt, failed: AttemptFailed) -> None:
        super().__init__(attempt.step.value if attempt.step else "retry")
        self.attempt, self.failed = attempt, failed


def _wait(state: RetryCallState) -> float:
    """A resend to the same node waits a moment (a full listen backlog); other steps do not."""
    outcome = state.outcome
    exc = outcome.exception() if outcome is not None else None
    return exc.attempt.wait if isinstance(exc, UpstreamRetry) else 0.0


def upstream_policy(sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> AsyncRetrying:
    return AsyncRetrying(
        stop=stop_after_attempt(MAX_ATTEMPTS) | stop_after_delay(MAX_RETRY_DELAY_S),
        wait=_wait,
        retry=retry_if_exception_type(UpstreamRetry),
        sleep=sleep,
        reraise=True,
    )


class _Run(Generic[T]):
    __slots__ = ("attempt", "fn", "on_step", "pending")

    def __init__(self, fn: Callable[[Attempt], Awaitable[T]], on_step: Callable[[Attempt], None]) -> None:
        self.fn, self.on_step = fn, on_step
        self.attempt: Attempt | None = None
        self.pending: UpstreamRetry | None = None

    def advance(self, a: Attempt, failed: AttemptFailed) -> UpstreamRetry:
        nxt = next_attempt(replace(a, node=failed.node), failed.failure)
        if nxt is None:
            raise failed.final
        self.attempt = nxt
        self.on_step(nxt)
        return UpstreamRetry(nxt, failed)

    async def __call__(self) -> T:
        if self.pending is not None:  # the bare first attempt's failure: the policy waits, then retries
            e, self.pending = self.pending, None
            raise e
        a = self.attempt
        assert a is not None
        try:
            return await self.fn(a)
        except AttemptFailed as failed:
            raise self.advance(a, failed) from failed


async def run_attempts(
    policy: AsyncRetrying,
    first: Attempt,
    fn: Callable[[Attempt], Awaitable[T]],
    on_step: Callable[[Attempt], None] = lambda a: None,
) -> T:
    """``fn(attempt)`` until it returns; on :class:`AttemptFailed` the rule picks the next attempt
    (``on_step`` sees it: metrics, logs) or the call fails with the attempt's ``final`` exception."""
    try:
        return await fn(first)
    except AttemptFailed as failed:
        run: _Run[T] = _Run(fn, on_step)
        run.pending = run.advance(first, failed)
    try:
        return await policy.copy()(run)
    except UpstreamRetry as e:  # the policy's own bounds ran out: the last failure stands
        raise e.failed.final from None
