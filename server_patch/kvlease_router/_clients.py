"""What one client may hold of the upstreams: a fair share of the pool, and no stalled stream.

* :class:`FairShare`: turns in flight per client address (``max_turns_per_ip``, by default a
  sixteenth of ``upstream_connections``) and per tenant (``max_turns_per_tenant``, off by default):
  past its share a turn waits, first come first served, for one of its own address's (or
  tenant's) turns to end, so one address cannot take every connection to D. Sans-IO but for the
  waiting (asyncio futures).
* :class:`StallWatch`: whether a stream's client still takes its bytes. A client that stopped
  reading is one whose TCP acknowledged none of the bytes waiting for it for
  ``stream_stall_timeout`` seconds (read from Linux's ``TCP_INFO``: the router's own writes do not
  wait until the kernel's send buffer is full, which takes minutes at a decode's pace). Elsewhere
  there is no watch and only ``stream_write_timeout`` applies.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import sys
from collections import deque
from typing import Any

from aiohttp import web

__all__ = ["FairShare", "StallWatch", "peer_address"]


def peer_address(request: web.BaseRequest) -> str:
    """The client address: the socket peer (the router has no trusted-proxy setting)."""
    transport = request.transport
    peer = transport.get_extra_info("peername") if transport is not None else None
    return str(peer[0]) if isinstance(peer, tuple) and peer else "?"


class _Share:
    __slots__ = ("held", "waiters")

    def __init__(self) -> None:
        self.held = 0
        self.waiters: deque[asyncio.Future[None]] = deque()


class FairShare:
    """At most ``limit`` turns in flight per key (0: no bound). ``acquire`` takes a slot of the key
    or waits for one (FIFO); ``release`` gives it to the key's first waiter, else back. Memory is
    bounded by the keys with a turn in flight or waiting."""

    __slots__ = ("_keys", "limit")

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError("limit must not be negative (0: no bound)")
        self.limit = limit
        self._keys: dict[str, _Share] = {}

    def held(self, key: str) -> int:
        share = self._keys.get(key)
        return 0 if share is None else share.held

    def waiting(self, key: str) -> int:
        share = self._keys.get(key)
        return 0 if share is None else sum(not f.done() for f in share.waiters)

    def try_acquire(self, key: str) -> bool:
        """Take a slot now if one is free (and nobody waits for one); else False."""
        if not self.limit:
            return True
        share = self._keys.get(key)
        if share is None:
            share = self._keys[key] = _Share()
        if share.held < self.limit and not share.waiters:
            share.held += 1
            return True
        return False

    async def acquire(self, key: str) -> None:
        if self.try_acquire(key):
            return
        share = self._keys[key]
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        share.waiters.append(waiter)
        try:
            await waiter  # ``release`` hands its slot over: ``held`` is unchanged
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(key)  # handed a slot after all: pass it on
            else:
                share.waiters.remove(waiter)
                self._drop_if_idle(key, share)
            raise

    def release(self, key: str) -> None:
        if not self.limit:
            return
        share = self._keys.get(key)
        if share is None:
            return
        while share.waiters:
            waiter = share.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        share.held -= 1
        self._drop_if_idle(key, share)

    def _drop_if_idle(self, key: str, share: _Share) -> None:
        if share.held <= 0 and not share.waiters:
            self._keys.pop(key, None)


#: ``struct tcp_info`` (linux/tcp.h) up to ``tcpi_notsent_bytes`` (Linux 4.6): the fields read.
_TCP_INFO_LEN = 152
_UNACKED = struct.Struct("=I")  # tcpi_unacked: segments sent, not yet acknowledged (offset 24)
_BYTES_ACKED = struct.Struct("=Q")  # tcpi_bytes_acked (offset 120)
_NOTSENT = struct.Struct("=I")  # tcpi_notsent_bytes: queued, not yet sent (offset 144)
_TCP_INFO = getattr(socket, "TCP_INFO", None) if sys.platform.startswith("linux") else None


def tcp_progress(sock: Any) -> tuple[int, bool] | None:
    """(bytes the peer acknowledged so far, whether any are waiting for it) of a TCP socket, or
    ``None`` when the kernel does not say (not Linux, not TCP, an old kernel)."""
    if _TCP_INFO is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCP_INFO_LEN)
    except (OSError, AttributeError, TypeError, ValueError):
        return None
    if not isinstance(info, bytes) or len(info) < _TCP_INFO_LEN:
        return None
    pending = _UNACKED.unpack_from(info, 24)[0] or _NOTSENT.unpack_from(info, 144)[0]
    return _BYTES_ACKED.unpack_from(info, 120)[0], bool(pending)


class StallWatch:
    """``stalled(now)``: whether the client acknowledged none of the bytes waiting for it for
    ``after`` seconds. The kernel is asked at most every ``after / 4`` seconds (a call in between
    is one comparison): cheap enough for every write of a stream."""

    __slots__ = ("_acked", "_every", "_next", "_since", "_sock", "after")

    def __init__(self, sock: Any, after: float, now: float) -> None:
        self._sock, self.after = sock, after
        self._every = after / 4
        self._next = now + self._every
        self._since = now
        self._acked = -1

    @classmethod
    def of(cls, transport: asyncio.BaseTransport | None, after: float, now: float) -> StallWatch | None:
        """A watch on a client connection, or ``None`` when its kernel does not report progress."""
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is None or tcp_progress(sock) is None:
            return None
        return cls(sock, after, now)

    @property
    def check_every(self) -> float:
        return self._every

    def stalled(self, now: float) -> bool:
        if now < self._next:
            return False
        self._next = now + self._every
        got = tcp_progress(self._sock)
        if got is None:
            return False
        acked, pending = got
        if not pending or acked != self._acked:
            self._acked, self._since = acked, now
            return False
        return now - self._since >= self.after
