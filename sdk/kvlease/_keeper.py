"""The lease keeper: IO shells (one thread, or one asyncio task, per wrapped client) over
:class:`~kvlease._renewal.RenewalSchedule`.

Renewals are retried with tenacity (attempts | delay, exponential backoff with jitter, only
:class:`TransientLeaseError`); the sleep between attempts is interruptible by ``close()`` and can be
injected. Nothing here raises into agent code: failures are logged and the lease simply runs out, so
the next turn recomputes. Lease requests carry the authorization (and tenant) headers of the
conversation's last chat request and go through the user's own HTTP client.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
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

    def _stop(self) -> Any:
        return stop_after_attempt(self.retry.attempts) | stop_after_delay(self.retry.max_delay_s)

    def _wait(self) -> Any:
        p = self.retry
        try:  # tenacity >= 9.2 names the first wait "multiplier" (and deprecates "initial")
            return wait_exponential_jitter(multiplier=p.initial_wait_s, max=p.max_wait_s, jitter=p.jitter_s)
        except TypeError:  # pragma: no cover - older tenacity
            return wait_exponential_jitter(initial=p.initial_wait_s, max=p.max_wait_s, jitter=p.jitter_s)

    def _needs_wakeup(self, due: float) -> bool:
        """Under the lock: does a lease due at ``due`` come before the loop's own wakeup?"""
        return self._sleeping_until is None or due < self._sleeping_until

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

    def _apply(self, batch: RenewBatch, answer: protocol.RenewResponse) -> None:
        self._record(lambda: self.table.renewed(batch, answer, self.clock()), "unknown to the router")

    def _renew_failed(self, batch: RenewBatch, e: LeaseError) -> None:
        self.renew_failures += 1
        log.warning(
            "kvlease: renewing %d conversation(s) on %s failed: %s",
            len(batch.conversation_ids),
            batch.root,
            e,
        )
        self._record(
            lambda: self.table.failed(batch, self.clock(), permanent=not e.transient), "renew failed"
        )


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
            start = self.heartbeat and self._thread is None
            if start:
                self._thread = threading.Thread(target=self._run, name="kvlease-lease-keeper", daemon=True)
            wake = self._thread is not None and self._needs_wakeup(due)
        if start and self._thread is not None:
            self._thread.start()
        if wake:
            self._wakeup.set()

    def renew_now(self, *, force: bool = True) -> None:
        """Run one renewal round in the calling thread (every open lease when ``force``). Never raises."""
        try:
            self._round(self.clock(), force=force)
        except _Stopped:
            pass
        except Exception:  # pragma: no cover - defensive: never into agent code
            log.exception("kvlease: renewal round failed")

    def release(self, conversation_id: str) -> bool:
        """Stop renewing ``conversation_id`` and release its lease now; True if one was held."""
        with self.lock:
            order = self.table.forget(conversation_id)
        if order is None:
            return False
        self._release(order)
        return True

    def close(self, *, timeout: float = 5.0) -> None:
        """Stop the thread and release every open lease. Idempotent; never raises."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            orders = self.table.forget_all()
        self._stop_event.set()
        self._wakeup.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        for order in orders:
            self._release(order)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._stop_event.is_set():
            with self.lock:
                wake = self._sleeping_until = self.table.next_wakeup()
            timeout = None if wake is None else max(0.0, wake - self.clock())
            self._wakeup.wait(timeout)
            with self.lock:
                self._sleeping_until = -math.inf  # awake: reads the table before it waits again
            self._wakeup.clear()
            if self._stop_event.is_set():
                return
            try:
                self._round(self.clock(), force=False)
            except _Stopped:
                return
            except Exception:  # never let the keeper die or raise
                log.exception("kvlease: renewal round failed")

    def _round(self, now: float, *, force: bool) -> None:
        with self.lock:
            batches, idle = self.table.due(now, force=force)
        for order in idle:
            log.info(
                "kvlease: conversation %s idle for more than %.0f s: released",
                order.conversation_id,
                self.table.max_idle,
            )
            self._release(order)
            self._dropped(order.conversation_id)
        for batch in batches:
            try:
                answer = self._renew(batch)
            except LeaseError as e:
                self._renew_failed(batch, e)
                continue
            self._apply(batch, answer)

    def _renew(self, batch: RenewBatch) -> protocol.RenewResponse:
        retrying = Retrying(
            stop=self._stop(),
            wait=self._wait(),
            retry=retry_if_exception_type(TransientLeaseError),
            sleep=self._sleep,
            before_sleep=_log_retry,
            reraise=True,
        )
        return retrying(self._renew_once, batch)

    def _renew_once(self, batch: RenewBatch) -> protocol.RenewResponse:
        url, body, headers = LeaseWire.renew_request(batch)
        self.renew_requests += 1
        try:
            r = self.http.post(url, content=body, headers=headers, timeout=self.retry.timeout_s)
        except hx.HTTPError as e:
            raise TransientLeaseError(f"renew request failed: {e!r}") from e
        return LeaseWire.renew_answer(r.status_code, r.content)

    def _release(self, order: ReleaseOrder) -> None:
        url, headers = LeaseWire.release_request(order)
        self.release_requests += 1
        try:
            r = self.http.delete(url, headers=headers, timeout=self.retry.timeout_s)
            LeaseWire.release_answer(r.status_code, r.content)
        except (hx.HTTPError, LeaseError) as e:
            log.warning("kvlease: releasing conversation %s failed: %s", order.conversation_id, e)

    def _sleep(self, seconds: float) -> None:
        if self._sleep_hook is not None:
            self._sleep_hook(seconds)
            if self._stop_event.is_set():
                raise _Stopped
        elif self._stop_event.wait(seconds):
            raise _Stopped


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
        try:
            await self._round(self.clock(), force=force)
        except _Stopped:
            pass
        except Exception:  # pragma: no cover - defensive
            log.exception("kvlease: renewal round failed")

    async def release(self, conversation_id: str) -> bool:
        with self.lock:
            order = self.table.forget(conversation_id)
        if order is None:
            return False
        await self._release(order)
        return True

    async def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            orders = self.table.forget_all()
        if self._task is not None:
            assert self._stop_event is not None and self._wakeup is not None
            self._stop_event.set()
            self._wakeup.set()
            try:
                await asyncio.wait_for(self._task, 5.0)
            except (asyncio.TimeoutError, asyncio.CancelledError, RuntimeError):
                self._task.cancel()
        for order in orders:
            await self._release(order)

    async def _run(self) -> None:
        assert self._wakeup is not None and self._stop_event is not None
        while not self._stop_event.is_set():
            with self.lock:
                wake = self._sleeping_until = self.table.next_wakeup()
            timeout = None if wake is None else max(0.0, wake - self.clock())
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            with self.lock:
                self._sleeping_until = -math.inf  # awake: reads the table before it waits again
            self._wakeup.clear()
            if self._stop_event.is_set():
                return
            try:
                await self._round(self.clock(), force=False)
            except _Stopped:
                return
            except Exception:
                log.exception("kvlease: renewal round failed")

    async def _round(self, now: float, *, force: bool) -> None:
        with self.lock:
            batches, idle = self.table.due(now, force=force)
        for order in idle:
            log.info(
                "kvlease: conversation %s idle for more than %.0f s: released",
                order.conversation_id,
                self.table.max_idle,
            )
            await self._release(order)
            self._dropped(order.conversation_id)
        for batch in batches:
            try:
                answer = await self._renew(batch)
            except LeaseError as e:
                self._renew_failed(batch, e)
                continue
            self._apply(batch, answer)

    async def _renew(self, batch: RenewBatch) -> protocol.RenewResponse:
        retrying = AsyncRetrying(
            stop=self._stop(),
            wait=self._wait(),
            retry=retry_if_exception_type(TransientLeaseError),
            sleep=self._sleep,
            before_sleep=_log_retry,
            reraise=True,
        )
        result: protocol.RenewResponse = await retrying(self._renew_once, batch)
        return result

    async def _renew_once(self, batch: RenewBatch) -> protocol.RenewResponse:
        url, body, headers = LeaseWire.renew_request(batch)
        self.renew_requests += 1
        try:
            r = await self.http.post(url, content=body, headers=headers, timeout=self.retry.timeout_s)
        except hx.HTTPError as e:
            raise TransientLeaseError(f"renew request failed: {e!r}") from e
        return LeaseWire.renew_answer(r.status_code, r.content)

    async def _release(self, order: ReleaseOrder) -> None:
        url, headers = LeaseWire.release_request(order)
        self.release_requests += 1
        try:
            r = await self.http.delete(url, headers=headers, timeout=self.retry.timeout_s)
            LeaseWire.release_answer(r.status_code, r.content)
        except (hx.HTTPError, LeaseError) as e:
            log.warning("kvlease: releasing conversation %s failed: %s", order.conversation_id, e)

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
