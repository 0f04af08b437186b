"""Slow and stuck clients: connection guards around aiohttp's request handler.

aiohttp bounds neither the time a client takes to send a request head nor the number of
connections one address holds. :func:`start_site` serves the app through a thin protocol wrapper
that adds both:

* **per-IP bound**: past ``max_connections_per_ip`` open connections from one address, a new one
  is closed at once (before aiohttp sees a byte);
* **header timeout**: from the first byte of a request head, the head must be complete (its empty
  line) within ``header_timeout`` seconds, or the connection is closed;
* **idle timeout**: aiohttp's keep-alive timeout (``idle_timeout``): a connection without a
  complete request that long is closed (aiohttp's timer also runs from the connection's start).

The body timeout (``body_timeout``, a 408) and the stream write timeout (``stream_write_timeout``)
are in the turn's IO (``_flow``, ``_relay``), where the body is read and the stream written.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from kvlease_router._runtime import log

if sys.version_info >= (3, 11):
    from asyncio import timeout
else:  # pragma: no cover - Python 3.10: aiohttp depends on async-timeout there
    from async_timeout import timeout
from kvlease_router._settings import RouterSettings

__all__ = [
    "GUARD_KEY",
    "ConnectionGuard",
    "bound_send_buffer",
    "start_site",
    "stop_site",
    "timeout",
]

_HEAD_END = b"\r\n\r\n"
_Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


class ConnectionGuard:
    """Per-address connection counts and the header timeout; one per app."""

    def __init__(self, settings: RouterSettings) -> None:
        self.max_per_ip = settings.max_connections_per_ip
        self.header_timeout = settings.header_timeout
        self.send_buffer = settings.client_send_buffer
        self.open: Counter[str] = Counter()
        self.refused = 0
        self.head_timeouts = 0
        self._by_handler: dict[int, _Guarded] = {}

    def request_done(self, protocol: object) -> None:
        """A request was answered: the next bytes on its connection start a new head."""
        g = self._by_handler.get(id(protocol))
        if g is not None:
            g.awaiting_head = True


GUARD_KEY: web.AppKey[ConnectionGuard] = web.AppKey("kvlease_guard", ConnectionGuard)


def bound_send_buffer(transport: asyncio.BaseTransport | None, size: int) -> None:
    """Bound the kernel's send buffer of a client connection (``SO_SNDBUF``, once, when it is
    accepted): else it may take a whole answer (``tcp_wmem`` up to 4 MiB), the router's writes to a
    client that stopped reading never wait, and ``stream_write_timeout`` never starts (the D stream
    is held for minutes)."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)


class _Guarded(asyncio.Protocol):
    """Forwards everything to aiohttp's handler; watches the request heads and the address."""

    __slots__ = ("_guard", "_inner", "_ip", "_tail", "_timer", "_transport", "awaiting_head")

    def __init__(self, inner: Any, guard: ConnectionGuard) -> None:
        self._inner, self._guard = inner, guard
        self._ip: str | None = None
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._tail = b""
        self.awaiting_head = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        g = self._guard
        peer = transport.get_extra_info("peername")
        ip = peer[0] if isinstance(peer, tuple) and peer else "?"
        if g.max_per_ip and g.open[ip] >= g.max_per_ip:
            g.refused += 1
            transport.abort()  # type: ignore[attr-defined]  # a TCP transport
            return
        g.open[ip] += 1
        if g.send_buffer:
            bound_send_buffer(transport, g.send_buffer)
        self._ip = ip
        self._transport = transport  # type: ignore[assignment]
        g._by_handler[id(self._inner)] = self
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._ip is None:
            return
        g = self._guard
        g.open[self._ip] -= 1
        if g.open[self._ip] <= 0:
            del g.open[self._ip]
        g._by_handler.pop(id(self._inner), None)
        self._ip = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.awaiting_head:
            # only the 3 bytes kept from the last read are joined to this one (not all of it), and
            # ``find`` rather than ``in`` (see ``_relay.suspicious``)
            tail = self._tail
            if data.find(_HEAD_END) >= 0 or (tail and (tail + data[:3]).find(_HEAD_END) >= 0):
                self.awaiting_head = False
                self._tail = b""
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
            else:
                # the head is not complete: its clock starts at its first byte. A head that comes
                # whole in one read (nearly every one) needs no timer at all.
                if self._timer is None:
                    self._timer = asyncio.get_running_loop().call_later(
                        self._guard.header_timeout, self._head_late
                    )
                self._tail = (tail + data)[-3:] if len(data) < 3 else data[-3:]
        self._inner.data_received(data)

    def _head_late(self) -> None:
        self._timer = None
        if self.awaiting_head and self._transport is not None:
            self._guard.head_timeouts += 1
            log.info("closing a connection whose request head took over %g s", self._guard.header_timeout)
            self._transport.abort()

    def eof_received(self) -> bool | None:
        keep_open: bool | None = self._inner.eof_received()
        return keep_open

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


def _marking_done(handler: _Handler, guard: ConnectionGuard) -> _Handler:
    """``handler`` (the app's request handler, under aiohttp's low-level server), telling the
    guard when each request was answered: every request that reaches the app (404s included),
    with one coroutine frame (an app middleware costs two, and aiohttp's per-request middleware
    chain)."""
    done = guard.request_done

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        try:
            return await handler(request)
        finally:
            done(request.protocol)

    return handle


async def start_site(
    app: web.Application, settings: RouterSettings, host: str, port: int, *, backlog: int = 2048
) -> tuple[web.AppRunner, asyncio.base_events.Server]:
    """Set up ``app`` (an app of :func:`create_app`) and listen on ``host:port`` behind the guards;
    returns the runner (``await runner.cleanup()`` to stop) and the listening server."""
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        shutdown_timeout=2.0,
        keepalive_timeout=settings.idle_timeout,
    )
    await runner.setup()
    guard = app[GUARD_KEY]
    factory = runner.server
    assert factory is not None
    # each connection's handler copies the server's request handler when it is made (below)
    factory.request_handler = _marking_done(factory.request_handler, guard)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _Guarded(factory(), guard), host, port, backlog=backlog, reuse_address=True
    )
    return runner, server


async def stop_site(runner: web.AppRunner, server: asyncio.base_events.Server) -> None:
    """Stop listening, then shut the app down (open connections get aiohttp's shutdown timeout)."""
    server.close()
    await runner.cleanup()
