"""The transports: where kvlease behaviour meets the HTTP layer (thin shells over ``_core.Tracker``).

A wrapped openai client sends through an HTTP client whose transport is :class:`KVTransport` (or
:class:`AsyncKVTransport`). Requests without ``X-Conversation-Id`` pass straight to the user's own
HTTP client. A tracked completion request gets its body and headers from ``Tracker.begin``; the
response headers are read as soon as they arrive, and the response byte stream is wrapped so the
body (JSON or SSE) is observed while the caller reads it: nothing is read ahead or buffered for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from kvlease import protocol
from kvlease._core import Pending, Tracker
from kvlease._http import hx

__all__ = ["AsyncKVTransport", "KVTransport"]

log = logging.getLogger("kvlease")
_perf = time.perf_counter
_wall = time.time


def _begin(tracker: Tracker, request: hx.Request) -> tuple[hx.Request, Pending | None]:
    cid = request.headers.get(protocol.HEADER_CONVERSATION_ID)
    if cid is None or request.method != "POST":
        return request, None
    try:
        body = request.content
    except hx.RequestNotRead:  # a streamed upload: not a completion request kvlease understands
        return request, None
    url = request.url
    origin = f"{url.scheme}://{url.netloc.decode('ascii')}"
    t0, started = _perf(), _wall()
    pending = tracker.begin(cid, origin, url.path, request.headers, body, t0, started)
    if pending is None:
        return request, None
    if pending.body is body and not pending.reuse_off:
        return request, pending
    headers = request.headers.copy()
    headers["Content-Length"] = str(len(pending.body))
    if pending.reuse_off:
        headers[protocol.HEADER_REUSE] = protocol.REUSE_OFF
    # a ready byte stream skips httpx's content encoding (several times cheaper than content=)
    new = hx.Request(
        request.method,
        url,
        headers=headers,
        stream=hx.ByteStream(pending.body),
        extensions=request.extensions,
    )
    new.read()  # so that new.content is the body sent, like any request openai builds
    return new, pending


def _finish(tracker: Tracker, pending: Pending, *, complete: bool) -> None:
    try:
        tracker.finish(pending, _perf(), _wall(), complete=complete)
    except Exception:  # never break the caller's read over bookkeeping
        log.exception("kvlease: recording a turn failed")


class _ObservedStream(hx.SyncByteStream):
    __slots__ = ("_pending", "_response", "_tracker")

    def __init__(self, response: hx.Response, pending: Pending, tracker: Tracker) -> None:
        self._response = response
        self._pending = pending
        self._tracker = tracker

    def __iter__(self) -> Iterator[bytes]:
        observer = self._pending.observer
        stream: Any = self._response.stream
        if observer is None:
            yield from stream
            return
        feed = observer.feed
        for chunk in stream:
            try:
                feed(chunk, _perf())
            except Exception:
                log.debug("kvlease: could not read a response chunk", exc_info=True)
                self._pending.observer = observer = None
                feed = _ignore
            yield chunk
        _finish(self._tracker, self._pending, complete=True)

    def close(self) -> None:
        try:
            self._response.close()
        finally:
            _finish(self._tracker, self._pending, complete=False)


class _AsyncObservedStream(hx.AsyncByteStream):
    __slots__ = ("_pending", "_response", "_tracker")

    def __init__(self, response: hx.Response, pending: Pending, tracker: Tracker) -> None:
        self._response = response
        self._pending = pending
        self._tracker = tracker

    async def __aiter__(self) -> AsyncIterator[bytes]:
        observer = self._pending.observer
        stream: Any = self._response.stream
        if observer is None:
            async for chunk in stream:
                yield chunk
            return
        feed = observer.feed
        async for chunk in stream:
            try:
                feed(chunk, _perf())
            except Exception:
                log.debug("kvlease: could not read a response chunk", exc_info=True)
                feed = _ignore
            yield chunk
        _finish(self._tracker, self._pending, complete=True)

    async def aclose(self) -> None:
        try:
            await self._response.aclose()
        finally:
            _finish(self._tracker, self._pending, complete=False)


def _ignore(chunk: bytes, now: float) -> None:
    return None


class KVTransport(hx.BaseTransport):
    """Sends through the user's HTTP client (``inner``), adding kvlease behaviour to tracked requests.

    Closing it does not close ``inner``: that client belongs to the caller's openai client.
    """

    def __init__(self, inner: hx.Client, tracker: Tracker) -> None:
        self.inner = inner
        self.tracker = tracker

    def handle_request(self, request: hx.Request) -> hx.Response:
        request, pending = _begin(self.tracker, request)
        response = self.inner.send(request, stream=True)
        if pending is None:
            return _rewrap(response, response.stream)
        self.tracker.response(pending, response.status_code, response.headers, _perf())
        return _rewrap(response, _ObservedStream(response, pending, self.tracker))


class AsyncKVTransport(hx.AsyncBaseTransport):
    """The asyncio twin of :class:`KVTransport`."""

    def __init__(self, inner: hx.AsyncClient, tracker: Tracker) -> None:
        self.inner = inner
        self.tracker = tracker

    async def handle_async_request(self, request: hx.Request) -> hx.Response:
        request, pending = _begin(self.tracker, request)
        response = await self.inner.send(request, stream=True)
        if pending is None:
            return _rewrap(response, response.stream)
        self.tracker.response(pending, response.status_code, response.headers, _perf())
        return _rewrap(response, _AsyncObservedStream(response, pending, self.tracker))


def _rewrap(response: hx.Response, stream: Any) -> hx.Response:
    return hx.Response(
        status_code=response.status_code,
        headers=response.headers,
        stream=stream,
        extensions=response.extensions,
    )
