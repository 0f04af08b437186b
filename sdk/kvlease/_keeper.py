"""The lease keeper: IO shells (one thread, or one asyncio task, per wrapped client) over
:class:`~kvlease._renewal.RenewalSchedule`.

``_KeeperBase`` holds what both shells do without IO: a renewal round (:meth:`_round_steps` yields
the releases and renewals the schedule decided, :meth:`_settle` applies an answer or a failure), the
lease requests with their counters and error mapping, the one tenacity policy, the wait before the
next round. The shells add the thread or task, the HTTP calls and the sleep, and differ in ``await``.

Renewals are retried with tenacity (attempts | delay, exponential backoff with jitter, only
:class:`TransientLeaseError`); the sleep between attempts is interruptible by ``close()`` and can be
injected. Nothing here raises into agent code: failures are logged and the lease simply runs out, so
the next turn recomputes. Lease requests carry the authorization (and tenant) headers of the
conversation's last chat request and go through the user's own HTTP client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)

from kvlease import protocol
from kvlease._errors import LeaseError
from kvlease._http import hx
from kvlease._renewal import (
    LeaseWire,
    ReleaseOrder,
    RenewalSchedule,
    RenewBatch,
    RetryPolicy,
    TransientLeaseError,
)

__all__ = ["AsyncLeaseKeeper", "LeaseKeeper"]

log = logging.getLogger("kvlease.keeper")


class _Stopped(Exception):
    """The keeper was closed while waiting between retries."""


def _log_retry(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome is not None else None
    log.info("kvlease: renew attempt %d failed (%s); retrying", state.attempt_number, exc)


class _KeeperBase:
    """What :class:`LeaseKeeper` and :class:`AsyncLeaseKeeper` share (see the module docstring)."""

    def __init__(
        self,
        *,
        max_idle: float,
        heartbeat: bool,
        retry: RetryPolicy | None,
        clock: Callable[[], float],
        on_drop: Callable[[str], None] | None,
    ) -> None:
        self.table = RenewalSchedule(max_idle=max_idle)
        self.heartbeat = heartbeat
        self.retry = retry or RetryPolicy()
        self.clock = clock
        self.on_drop = on_drop
        self.lock = threading.Lock()
        self.closed = False
        # when the renewal loop wakes up next, as it computed under the lock before waiting (None:
        # not waiting on a time): a lease due no earlier needs no wakeup, so a turn does not wake it
        self._sleeping_until: float | None = None
        #: Counters: renew requests sent (attempts included), renew rounds that failed, releases sent.
        self.renew_requests = 0
        self.renew_failures = 0
        self.release_requests = 0

    def __len__(self) -> int:
        return len(self.table)

    def __contains__(self, conversation_id: object) -> bool:
        return conversation_id in self.table

    def _retry_policy(self) -> dict[str, Any]:
        """The tenacity policy of one renew request (the shells add their ``sleep``)."""
        p = self.retry
        try:  # tenacity >= 9.2 names the first wait "multiplier" (and deprecates "initial")
            wait = wait_exponential_jitter(multiplier=p.initial_wait_s, max=p.max_wait_s, jitter=p.jitter_s)
        except TypeError:  # pragma: no cover - older tenacity
            wait = wait_exponential_jitter(initial=p.initial_wait_s, max=p.max_wait_s, jitter=p.jitter_s)

        def wait_or_retry_after(state: RetryCallState) -> float:
            """The backoff, or longer when the router said when to come back (503/429
            ``Retry-After``), bounded by ``max_wait_s``."""
            base = float(wait(state))
            exc = state.outcome.exception() if state.outcome is not None else None
            asked = getattr(exc, "retry_after", None)
            return max(base, min(float(asked), p.max_wait_s)) if asked else base

        return {
            "stop": stop_after_attempt(p.attempts) | stop_after_delay(p.max_delay_s),
            "wait": wait_or_retry_after,
            "retry": retry_if_exception_type(TransientLeaseError),
            "before_sleep": _log_retry,
            "reraise": True,
        }

    def _needs_wakeup(self, due: float) -> bool:
        """Under the lock: does a lease due at ``due`` come before the loop's own wakeup?"""
        return self._sleeping_until is None or due < self._sleeping_until

    def _wait_timeout(self) -> float | None:
        """Before the loop waits: how long until the next renewal is due (``None``: none is)."""
        with self.lock:
            wake = self._sleeping_until = self.table.next_wakeup()
        return None if wake is None else max(0.0, wake - self.clock())

    def _awake(self) -> None:
        with self.lock:
            self._sleeping_until = -math.inf  # awake: reads the table before it waits again

    @contextlib.contextmanager
    def _contained(self) -> Iterator[None]:
        """Around a round: a close stops it quietly, a failure is logged; nothing reaches agent code."""
        try:
            yield
        except _Stopped:
            pass
        except Exception:  # never let the keeper die or raise
            log.exception("kvlease: renewal round failed")

    def _forget(self, conversation_id: str) -> ReleaseOrder | None:
        with self.lock:
            return self.table.forget(conversation_id)

    def _closing(self) -> list[ReleaseOrder] | None:
        """What ``close()`` releases; ``None`` when already closed."""
        with self.lock:
            if self.closed:
                return None
            self.closed = True
            return self.table.forget_all()

    # ------------------------------------------------------------------ the round, without IO
    def _round_steps(self, now: float, *, force: bool) -> Iterator[ReleaseOrder | RenewBatch]:
        """One renewal round: the shell releases each order it is given and renews each batch
        (with retries), then hands the answer or the error to :meth:`_settle`."""
        with self.lock:
            batches, idle = self.table.due(now, force=force)
        for order in idle:
            log.info(
                "kvlease: conversation %s idle for more than %.0f s: released",
                order.conversation_id,
                self.table.max_idle,
            )
            yield order
            self._dropped(order.conversation_id)
        yield from batches

    def _settle(self, batch: RenewBatch, outcome: protocol.RenewResponse | LeaseError) -> None:
        if not isinstance(outcome, LeaseError):
            self._record(lambda: self.table.renewed(batch, outcome, self.clock()), "unknown to the router")
            return
        self.renew_failures += 1
        log.warning(
            "kvlease: renewing %d conversation(s) on %s failed: %s",
            len(batch.conversation_ids),
            batch.root,
            outcome,
        )
        permanent = not outcome.transient
        self._record(lambda: self.table.failed(batch, self.clock(), permanent=permanent), "renew failed")

    @contextlib.contextmanager
    def _renewing(self, batch: RenewBatch) -> Iterator[tuple[str, bytes, dict[str, str]]]:
        """Around one renew request: counts it; an HTTP error is a :class:`TransientLeaseError`."""
        request = LeaseWire.renew_request(batch)
        self.renew_requests += 1
        try:
            yield request
        except hx.HTTPError as e:
            raise TransientLeaseError(f"renew request failed: {e!r}") from e

    @contextlib.contextmanager
    def _releasing(self, order: ReleaseOrder) -> Iterator[tuple[str, dict[str, str]]]:
        """Around one release: counts it; a failure is logged (the lease runs out by itself)."""
        request = LeaseWire.release_request(order)
        self.release_requests += 1
        try:
            yield request
        except (hx.HTTPError, LeaseError) as e:
            log.warning("kvlease: releasing conversation %s failed: %s", order.conversation_id, e)
        except RuntimeError as e:  # the HTTP client's connections belong to another event loop
            log.info("kvlease: releasing conversation %s here failed: %s", order.conversation_id, e)

    def _record(self, table_op: Callable[[], list[str]], what: str) -> None:
        with self.lock:
            dropped = table_op()
        for cid in dropped:
            log.info("kvlease: %s: conversation %s is no longer renewed", what, cid)
            self._dropped(cid)

    def _dropped(self, conversation_id: str) -> None:
        if self.on_drop is not None:
            try:
                self.on_drop(conversation_id)
            except Exception:  # pragma: no cover - a callback of the client
                log.exception("kvlease: on_drop callback failed")


class LeaseKeeper(_KeeperBase):
    """Renews the open conversations of a sync client from one daemon thread (started on the first
    lease). ``http`` is the client's own HTTP client; ``sleep`` replaces the wait between retries."""

    def __init__(
        self,
        http: hx.Client,
        *,
        max_idle: float = 1800.0,
        heartbeat: bool = True,
        retry: RetryPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] | None = None,
        on_drop: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(max_idle=max_idle, heartbeat=heartbeat, retry=retry, clock=clock, on_drop=on_drop)
        self.http = http
        self._sleep_hook = sleep
        self._stop_event = threading.Event()
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ called by the SDK
    def activate(
        self, conversation_id: str, root: str, ttl: float, headers: Mapping[str, str], *, explicit: bool
    ) -> None:
        with self.lock:
            if self.closed:
                return
            due = self.table.activate(conversation_id, root, ttl, headers, self.clock(), explicit=explicit)
            thread = self._thread
            if thread is None:
                if not self.heartbeat:
                    return
                thread = self._thread = threading.Thread(
                    target=self._run, name="kvlease-lease-keeper", daemon=True
                )
                thread.start()  # (under the lock: the thread takes it before it first waits)
                return
            wake = self._needs_wakeup(due)
        if wake:
            self._wakeup.set()

    def renew_now(self, *, force: bool = True) -> None:
        """Run one renewal round in the calling thread (every open lease when ``force``). Never raises."""
        with self._contained():
            self._round(self.clock(), force=force)

    def release(self, conversation_id: str) -> bool:
        """Stop renewing ``conversation_id`` and release its lease now; True if one was held."""
        order = self._forget(conversation_id)
        if order is None:
            return False
        self._release(order)
        return True

    def close(self, *, timeout: float = 5.0) -> None:
        """Stop the thread and release every open lease. Idempotent; never raises."""
        orders = self._closing()
        if orders is None:
            return
        self._stop_event.set()
        self._wakeup.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        for order in orders:
            self._release(order)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._stop_event.is_set():
            self._wakeup.wait(self._wait_timeout())
            self._awake()
            self._wakeup.clear()
            if self._stop_event.is_set():
                return
            with self._contained():
                self._round(self.clock(), force=False)

    def _round(self, now: float, *, force: bool) -> None:
        for step in self._round_steps(now, force=force):
            if isinstance(step, ReleaseOrder):
                self._release(step)
            else:
                self._settle(step, self._renew(step))

    def _renew(self, batch: RenewBatch) -> protocol.RenewResponse | LeaseError:
        try:
            answer: protocol.RenewResponse = Retrying(sleep=self._sleep, **self._retry_policy())(
                self._renew_once, batch
            )
        except LeaseError as e:
            return e
        return answer

    def _renew_once(self, batch: RenewBatch) -> protocol.RenewResponse:
        with self._renewing(batch) as (url, body, headers):
            r = self.http.post(url, content=body, headers=headers, timeout=self.retry.timeout_s)
        return LeaseWire.renew_answer(r.status_code, r.content, r.headers.get(protocol.HEADER_RETRY_AFTER))

    def _release(self, order: ReleaseOrder) -> None:
        with self._releasing(order) as (url, headers):
            r = self.http.delete(url, headers=headers, timeout=self.retry.timeout_s)
            LeaseWire.release_answer(r.status_code, r.content)

    def _sleep(self, seconds: float) -> None:
        if self._sleep_hook is not None:
            self._sleep_hook(seconds)
            if self._stop_event.is_set():
                raise _Stopped
        elif self._stop_event.wait(seconds):
            raise _Stopped


def _cancel_on_its_loop(task: asyncio.Task[None]) -> None:
    """Cancel a task of another event loop: on that loop (thread-safe); a closed loop runs nothing."""
    loop = task.get_loop()
    if loop.is_closed() or task.done():
        return
    try:
        loop.call_soon_threadsafe(task.cancel)
    except RuntimeError:  # pragma: no cover - closed meanwhile
        pass


class AsyncLeaseKeeper(_KeeperBase):
    """The asyncio twin of :class:`LeaseKeeper`: one task per client, started on the first lease."""

    def __init__(
        self,
        http: hx.AsyncClient,
        *,
        max_idle: float = 1800.0,
        heartbeat: bool = True,
        retry: RetryPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] | None = None,
        on_drop: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(max_idle=max_idle, heartbeat=heartbeat, retry=retry, clock=clock, on_drop=on_drop)
        self.http = http
        self._sleep_hook = sleep
        self._task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None
        self._stop_event: asyncio.Event | None = None

    def activate(
        self, conversation_id: str, root: str, ttl: float, headers: Mapping[str, str], *, explicit: bool
    ) -> None:
        with self.lock:
            if self.closed:
                return
            due = self.table.activate(conversation_id, root, ttl, headers, self.clock(), explicit=explicit)
            wake = self._needs_wakeup(due)
        if not self.heartbeat:
            return
        if self._task is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            self._wakeup, self._stop_event = asyncio.Event(), asyncio.Event()
            self._task = loop.create_task(self._run(), name="kvlease-lease-keeper")
        if wake and self._wakeup is not None:
            self._wakeup.set()

    async def renew_now(self, *, force: bool = True) -> None:
        """Run one renewal round now (every open lease when ``force``). Never raises."""
        with self._contained():
            await self._round(self.clock(), force=force)

    async def release(self, conversation_id: str) -> bool:
        order = self._forget(conversation_id)
        if order is None:
            return False
        await self._release(order)
        return True

    async def close(self) -> None:
        orders = self._closing()
        if orders is None:
            return
        task, self._task = self._task, None
        if task is not None and task.get_loop() is asyncio.get_running_loop():
            assert self._stop_event is not None and self._wakeup is not None
            self._stop_event.set()
            self._wakeup.set()
            try:
                await asyncio.wait_for(task, 5.0)
            except (asyncio.TimeoutError, asyncio.CancelledError, RuntimeError):
                task.cancel()
        elif task is not None:  # closed from another event loop (as AsyncOpenAI.close allows)
            _cancel_on_its_loop(task)
        for order in orders:
            await self._release(order)

    async def _run(self) -> None:
        assert self._wakeup is not None and self._stop_event is not None
        while not self._stop_event.is_set():
            timeout = self._wait_timeout()
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            self._awake()
            self._wakeup.clear()
            if self._stop_event.is_set():
                return
            with self._contained():
                await self._round(self.clock(), force=False)

    async def _round(self, now: float, *, force: bool) -> None:
        for step in self._round_steps(now, force=force):
            if isinstance(step, ReleaseOrder):
                await self._release(step)
            else:
                self._settle(step, await self._renew(step))

    async def _renew(self, batch: RenewBatch) -> protocol.RenewResponse | LeaseError:
        try:
            answer: protocol.RenewResponse = await AsyncRetrying(sleep=self._sleep, **self._retry_policy())(
                self._renew_once, batch
            )
        except LeaseError as e:
            return e
        return answer

    async def _renew_once(self, batch: RenewBatch) -> protocol.RenewResponse:
        with self._renewing(batch) as (url, body, headers):
            r = await self.http.post(url, content=body, headers=headers, timeout=self.retry.timeout_s)
        return LeaseWire.renew_answer(r.status_code, r.content, r.headers.get(protocol.HEADER_RETRY_AFTER))

    async def _release(self, order: ReleaseOrder) -> None:
        with self._releasing(order) as (url, headers):
            r = await self.http.delete(url, headers=headers, timeout=self.retry.timeout_s)
            LeaseWire.release_answer(r.status_code, r.content)

    async def _sleep(self, seconds: float) -> None:
        if self._sleep_hook is not None:
            await self._sleep_hook(seconds)
        elif self._stop_event is not None:
            try:
                await asyncio.wait_for(self._stop_event.wait(), seconds)
            except asyncio.TimeoutError:
                return
        else:
            await asyncio.sleep(seconds)
        if self._stop_event is not None and self._stop_event.is_set():
            raise _Stopped
