"""The transports: where kvlease behaviour meets the HTTP layer (thin shells over ``_core.Tracker``).

A wrapped openai client sends through a :class:`KVClient` (or :class:`AsyncKVClient`) whose
transport is :class:`KVTransport` (or :class:`AsyncKVTransport`) over the user's own HTTP client.
Requests without ``X-Conversation-Id`` pass straight to the user's client. A tracked completion
request gets its body and headers from ``Tracker.begin``; the response headers are read as soon as
they arrive, and the response byte stream is wrapped so the body (JSON or SSE) is observed while the
caller reads it: nothing is read ahead or buffered for it. A call that reads the whole body at once
(openai's non-streamed calls) has it observed once, after the read, instead.

The user's client's ``send`` does all the HTTP work (auth, redirects, event hooks, cookies, retries
of its transport), so the wrapping client's own ``send`` would only do it a second time, for nothing:
with none of its own settings in use (the case of every openai request), :class:`KVClient` hands the
request straight to its transport, which is most of what the SDK adds to a call otherwise.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from kvlease import protocol
from kvlease._core import Pending, Tracker
from kvlease._http import header_bytes, header_text, hx
from kvlease._observe import ResponseObserver
from kvlease._wire import CID_KEY, auth_headers

__all__ = ["AsyncKVClient", "AsyncKVTransport", "KVClient", "KVTransport"]

log = logging.getLogger("kvlease")
_perf = time.perf_counter
_wall = time.time


def _begin(tracker: Tracker, request: hx.Request) -> Pending | None:
    """Hand a request carrying ``X-Conversation-Id`` to the tracker; a tracked request is changed in
    place (body with ``conversation_id``, ``Content-Length``, the reuse opt-out header): it is the
    request object openai built for this one send, and ``response.request`` then shows what was sent."""
    if request.method != "POST":
        return None
    found = header_bytes(request.headers)
    raw_cid = found.get(CID_KEY)
    if raw_cid is None:
        return None
    cid = header_text(raw_cid, request.headers)
    try:
        body = request.content
    except hx.RequestNotRead:  # a streamed upload: not a completion request kvlease understands
        return None
    origin, path = _target(request.url)
    t0, started = _perf(), _wall()
    pending = tracker.begin(cid, origin, path, auth_headers(found, request.headers), body, t0, started)
    if pending is None:
        return None
    if pending.body is not body:
        headers = request.headers
        headers["Content-Length"] = str(len(pending.body))
        # a ready byte stream, and the content read, as openai's own request has them
        request.stream = hx.ByteStream(pending.body)
        request._content = pending.body
    if pending.reuse_off:
        request.headers[protocol.HEADER_REUSE] = protocol.REUSE_OFF
    return pending


def _target(url: hx.URL) -> tuple[str, str]:
    """The origin (``scheme://host[:port]``) and the path of a request URL (a client sends to a
    handful of URLs: kept by the URL's parts that are cheapest to read)."""
    key = (url.scheme, url.host, url.port, url.raw_path)
    got = _TARGETS.get(key)
    if got is None:
        got = f"{url.scheme}://{url.netloc.decode('ascii')}", url.path
        if len(_TARGETS) < 256:
            _TARGETS[key] = got
    return got


_TARGETS: dict[tuple[str, str, int | None, bytes], tuple[str, str]] = {}


def _finish(tracker: Tracker, pending: Pending, *, complete: bool) -> None:
    try:
        tracker.finish(pending, _perf(), _wall(), complete=complete)
    except Exception:  # never break the caller's read over bookkeeping
        log.exception("kvlease: recording a turn failed")


def _finish_body(tracker: Tracker, pending: Pending, body: bytes | None) -> None:
    try:
        tracker.finish_body(pending, body, _perf(), _wall())
    except Exception:  # never break the caller's call over bookkeeping
        log.exception("kvlease: recording a turn failed")


def _feed(pending: Pending, observer: ResponseObserver, chunk: bytes) -> Callable[[bytes], None] | None:
    """Feed a chunk read before the first token to ``observer``. Returns what takes each later chunk
    (the observer's sink once the first token is known), or None while the observer still wants them;
    a chunk it cannot read detaches it from the turn and later chunks are ignored."""
    try:
        observer.feed(chunk, _perf())
    except Exception:
        log.debug("kvlease: could not read a response chunk", exc_info=True)
        pending.observer = None
        return _ignore
    sink = observer.sink
    return None if sink is None else sink.append


class _ObservedStream(hx.SyncByteStream):
    """The body of a tracked response: the inner client's stream, observed as the caller reads it."""

    __slots__ = ("_pending", "_stream", "_tracker")

    def __init__(self, stream: Any, pending: Pending, tracker: Tracker) -> None:
        self._stream = stream
        self._pending = pending
        self._tracker = tracker

    def __iter__(self) -> Iterator[bytes]:
        observer = self._pending.observer
        if observer is None:
            yield from self._stream
            return
        keep = None  # after the first token: appends to the chunks the observer reads at the end
        for chunk in self._stream:
            if keep is not None:
                keep(chunk)
            else:
                keep = _feed(self._pending, observer, chunk)
            yield chunk
        _finish(self._tracker, self._pending, complete=True)

    def close(self) -> None:
        try:
            self._stream.close()
        finally:
            if not self._pending.done:  # (a body read to its end was recorded then)
                _finish(self._tracker, self._pending, complete=False)

    @property
    def elapsed(self) -> Any:
        """The inner client's timing of the response (``response.elapsed`` reads it under httpx2)."""
        return getattr(self._stream, "elapsed", None)


class _AsyncObservedStream(hx.AsyncByteStream):
    __slots__ = ("_pending", "_stream", "_tracker")

    def __init__(self, stream: Any, pending: Pending, tracker: Tracker) -> None:
        self._stream = stream
        self._pending = pending
        self._tracker = tracker

    async def __aiter__(self) -> AsyncIterator[bytes]:
        observer = self._pending.observer
        if observer is None:
            async for chunk in self._stream:
                yield chunk
            return
        keep = None
        async for chunk in self._stream:
            if keep is not None:
                keep(chunk)
            else:
                keep = _feed(self._pending, observer, chunk)
            yield chunk
        _finish(self._tracker, self._pending, complete=True)

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            if not self._pending.done:
                _finish(self._tracker, self._pending, complete=False)

    @property
    def elapsed(self) -> Any:
        return getattr(self._stream, "elapsed", None)


def _ignore(chunk: bytes) -> None:
    return None


class KVTransport(hx.BaseTransport):
    """Sends through the user's HTTP client (``inner``), adding kvlease behaviour to tracked requests.

    Closing it does not close ``inner``: that client belongs to the caller's openai client.
    """

    def __init__(self, inner: hx.Client, tracker: Tracker) -> None:
        self.inner = inner
        self.tracker = tracker

    def handle_request(self, request: hx.Request) -> hx.Response:
        response, pending = self.send_unread(request, stream=True)
        if pending is not None:
            # the inner client's response goes on up, its body observed (the wrapping client binds
            # it to this request again, as it would any transport's response)
            response.stream = _ObservedStream(response.stream, pending, self.tracker)
        return response

    def send_unread(self, request: hx.Request, *, stream: bool = False) -> tuple[hx.Response, Pending | None]:
        """The inner client's response, its body unread, and the tracked request. ``stream``: its
        body is to be observed as it is read (:meth:`handle_request` wraps it); else the caller
        reads it whole and finishes the turn with it (:meth:`Tracker.finish_body`)."""
        pending = _begin(self.tracker, request)
        response = self.inner.send(request, stream=True)
        if pending is not None:
            self.tracker.response(pending, response.status_code, response.headers, _perf(), stream=stream)
        return response, pending


class AsyncKVTransport(hx.AsyncBaseTransport):
    """The asyncio twin of :class:`KVTransport`."""

    def __init__(self, inner: hx.AsyncClient, tracker: Tracker) -> None:
        self.inner = inner
        self.tracker = tracker

    async def handle_async_request(self, request: hx.Request) -> hx.Response:
        response, pending = await self.send_unread(request, stream=True)
        if pending is not None:
            response.stream = _AsyncObservedStream(response.stream, pending, self.tracker)
        return response

    async def send_unread(
        self, request: hx.Request, *, stream: bool = False
    ) -> tuple[hx.Response, Pending | None]:
        pending = _begin(self.tracker, request)
        response = await self.inner.send(request, stream=True)
        if pending is not None:
            self.tracker.response(pending, response.status_code, response.headers, _perf(), stream=stream)
        return response, pending


def _own_settings(client: hx.Client | hx.AsyncClient, auth: Any, follow_redirects: Any) -> bool:
    """Whether a ``send`` of the wrapping client has anything of its own to do: an ``auth`` or
    ``follow_redirects`` argument, or settings put on it (auth, event hooks, redirects)."""
    if auth is not hx.USE_CLIENT_DEFAULT or follow_redirects is not hx.USE_CLIENT_DEFAULT:
        return True
    hooks = client.event_hooks
    return client.auth is not None or client.follow_redirects or bool(hooks["request"] or hooks["response"])


def _set_timeout(client: hx.Client | hx.AsyncClient, request: hx.Request) -> None:
    """What ``send`` does first: a request built elsewhere gets this client's timeout."""
    if "timeout" not in request.extensions:
        request.extensions = {**request.extensions, "timeout": client.timeout.as_dict()}


def _cookies(
    client: hx.Client | hx.AsyncClient, inner: hx.Client | hx.AsyncClient, response: hx.Response
) -> None:
    """The response's cookies for this client's next requests: the user's client stored them, in
    the jar this client shares (unless one of the two was given another jar since)."""
    if client.cookies.jar is not inner.cookies.jar:
        client.cookies.extract_cookies(response)


def _closed() -> RuntimeError:
    return RuntimeError("Cannot send a request, as the client has been closed.")


class KVClient(hx.Client):
    """The HTTP client of a wrapped openai client: sends through :class:`KVTransport`.

    ``send`` does what ``httpx.Client.send`` does here (this client's timeout, reading the body
    unless ``stream``) without its auth, redirect and hook machinery, which the user's client runs;
    with any of those set on this client, or passed to ``send``, it is ``httpx.Client.send``. Its
    cookie jar is the user's client's: cookies the server sets (stored by the user's client) go
    out on the next request this client builds, as they would from the user's client.
    """

    def __init__(self, transport: KVTransport) -> None:
        super().__init__(transport=transport, trust_env=False, cookies=transport.inner.cookies.jar)
        self._kv = transport

    def send(
        self,
        request: hx.Request,
        *,
        stream: bool = False,
        auth: Any = hx.USE_CLIENT_DEFAULT,
        follow_redirects: Any = hx.USE_CLIENT_DEFAULT,
    ) -> hx.Response:
        if _own_settings(self, auth, follow_redirects):
            return super().send(request, stream=stream, auth=auth, follow_redirects=follow_redirects)
        if self.is_closed:
            raise _closed()
        _set_timeout(self, request)
        if stream:
            response, pending = self._kv.handle_request(request), None
        else:  # read whole here: the body is observed once, after it is read, not chunk by chunk
            response, pending = self._kv.send_unread(request)
        try:
            _cookies(self, self._kv.inner, response)
            response.default_encoding = self._default_encoding
            if not stream:
                response.read()
        except BaseException:
            response.close()
            if pending is not None:
                _finish_body(self._kv.tracker, pending, None)
            raise
        if pending is not None:
            _finish_body(self._kv.tracker, pending, response.content)
        return response


class AsyncKVClient(hx.AsyncClient):
    """The asyncio twin of :class:`KVClient`."""

    def __init__(self, transport: AsyncKVTransport) -> None:
        super().__init__(transport=transport, trust_env=False, cookies=transport.inner.cookies.jar)
        self._kv = transport

    async def send(
        self,
        request: hx.Request,
        *,
        stream: bool = False,
        auth: Any = hx.USE_CLIENT_DEFAULT,
        follow_redirects: Any = hx.USE_CLIENT_DEFAULT,
    ) -> hx.Response:
        if _own_settings(self, auth, follow_redirects):
            return await super().send(request, stream=stream, auth=auth, follow_redirects=follow_redirects)
        if self.is_closed:
            raise _closed()
        _set_timeout(self, request)
        if stream:
            response, pending = await self._kv.handle_async_request(request), None
        else:
            response, pending = await self._kv.send_unread(request)
        try:
            _cookies(self, self._kv.inner, response)
            response.default_encoding = self._default_encoding
            if not stream:
                await response.aread()
        except BaseException:
            await response.aclose()
            if pending is not None:
                _finish_body(self._kv.tracker, pending, None)
            raise
        if pending is not None:
            _finish_body(self._kv.tracker, pending, response.content)
        return response
