"""A small HTTP/1.1 server core with bounded threads and bounded time (standard library only).

For the connector's control endpoint inside vLLM's engine process, where a thread per connection
(``ThreadingHTTPServer``) lets any peer pin threads. Here:

* one selector thread accepts connections and reads requests, non-blocking, until a request is
  whole (its head, and as much body as its ``Content-Length`` says, up to ``max_request_bytes``);
  only then does the connection go to a worker, so a slow or silent peer never holds a thread;
* a fixed pool of ``workers`` serves whole requests, one at a time, then hands the connection back;
* a request not whole within ``request_timeout`` of its first byte, or a connection idle for
  ``idle_timeout``, is closed; so are connections past ``max_connections`` (the longest idle first)
  and past a full work queue (the peer retries).
"""

from __future__ import annotations

import collections
import logging
import math
import queue
import re
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Conn", "PooledHTTPServer", "Reader", "Writer", "close_conn"]

_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*([0-9]{1,12})[ \t]*(?=\r\n|$)", re.IGNORECASE)

logger = logging.getLogger("vllm.kvlease.control")


class Reader:
    """A connection's read side for ``BaseHTTPRequestHandler`` (``readline``/``read``): every read
    ends by ``deadline`` (``TimeoutError`` past it), and bytes read ahead stay with the connection."""

    __slots__ = ("buf", "deadline", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.deadline = math.inf

    def _fill(self) -> bool:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request not received in time")
        self.sock.settimeout(left)
        data = self.sock.recv(65536)
        self.buf += data
        return bool(data)

    def readline(self, limit: int = -1) -> bytes:
        while True:
            i = self.buf.find(b"\n")
            n = i + 1 if i >= 0 else (limit if 0 < limit <= len(self.buf) else -1)
            if n < 0 and not self._fill():
                n = len(self.buf)
            if n >= 0:
                n = min(n, limit) if limit > 0 else n
                out = bytes(self.buf[:n])
                del self.buf[:n]
                return out

    def read(self, n: int) -> bytes:
        while len(self.buf) < n and self._fill():
            pass
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def close(self) -> None:  # the connection outlives one request
        pass


class Writer:
    __slots__ = ("sock", "timeout")

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock, self.timeout = sock, timeout

    def write(self, data: bytes) -> int:
        self.sock.settimeout(self.timeout)
        self.sock.sendall(data)
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class Conn:
    __slots__ = ("addr", "idle_since", "reader", "sock", "started")

    def __init__(self, sock: socket.socket, addr: Any) -> None:
        self.sock, self.addr = sock, addr
        self.reader = Reader(sock)
        self.idle_since = time.monotonic()
        self.started = math.inf  # when the first byte of the pending request came

    def complete(self, max_request_bytes: int) -> bool:
        """Is a whole request (head and ``Content-Length`` body) buffered, or as much of one as
        a worker needs to answer it (a head past the limit, a body over it: the worker refuses)?"""
        buf = self.reader.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return len(buf) >= 65536  # a head this long: the worker answers 431/400
        m = _CONTENT_LENGTH.search(bytes(buf[:end]))
        if m is None:
            return True
        length = int(m.group(1))
        return length > max_request_bytes or len(buf) >= end + 4 + length


class PooledHTTPServer:
    """Bounded threads, bounded time, bounded memory (see the module docstring). ``serve_one``
    serves one whole buffered request of a connection; it returns whether to keep the connection."""

    def __init__(
        self,
        addr: tuple[str, int],
        serve_one: Callable[[Conn], bool],
        *,
        workers: int = 8,
        queue_size: int = 64,
        max_connections: int = 256,
        request_timeout: float = 5.0,
        idle_timeout: float = 30.0,
        max_request_bytes: int = (1 << 20) + (64 << 10),
    ) -> None:
        self._serve_one = serve_one
        self.request_timeout = request_timeout
        self.idle_timeout = idle_timeout
        self.max_connections = max_connections
        self.max_request_bytes = max_request_bytes
        self.refused = 0  # connections closed because the queue or the connection set was full
        self.timed_out = 0  # connections closed because a request did not arrive in time
        family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind(addr)
            self.socket.listen(128)
            self.socket.setblocking(False)
        except OSError:
            self.socket.close()
            raise
        self.server_address = self.socket.getsockname()
        self._work: queue.Queue[Conn | None] = queue.Queue(maxsize=queue_size)
        self._back: collections.deque[Conn] = collections.deque()  # served, to re-park
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stop = threading.Event()
        self._done = threading.Event()
        self._workers = [
            threading.Thread(target=self._serve_requests, name=f"kvlease-control-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._workers:
            t.start()

    # ---- the selector thread -----------------------------------------------------------------
    def serve_forever(self, poll_interval: float = 0.5) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.socket, selectors.EVENT_READ, None)
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        parked: dict[socket.socket, Conn] = {}
        tick = min(poll_interval, self.request_timeout / 4, self.idle_timeout / 4)
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(tick):
                    if key.data is None:
                        self._accept(sel, parked)
                    elif key.data == "wake":
                        self._drain_wake()
                    else:
                        self._read(sel, parked, key.data)
                while self._back:
                    conn = self._back.popleft()
                    if conn.reader.buf and conn.complete(self.max_request_bytes):
                        self._submit(conn)  # the next request is already here (pipelined)
                    else:
                        self._park(sel, parked, conn)
                now = time.monotonic()
                for conn in list(parked.values()):
                    late = now - conn.started > self.request_timeout
                    if late or (not conn.reader.buf and now - conn.idle_since > self.idle_timeout):
                        self.timed_out += late
                        self._unpark(sel, parked, conn)
                        close_conn(conn)
        finally:
            for conn in parked.values():
                close_conn(conn)
            sel.close()
            self._done.set()

    def _accept(self, sel: selectors.BaseSelector, parked: dict[socket.socket, Conn]) -> None:
        for _ in range(64):
            try:
                sock, addr = self.socket.accept()
            except OSError:  # BlockingIOError: none left; anything else: try at the next event
                return
            self._park(sel, parked, Conn(sock, addr))

    def _read(self, sel: selectors.BaseSelector, parked: dict[socket.socket, Conn], conn: Conn) -> None:
        """The selector thread's non-blocking read: buffer what came; a whole request goes to a worker."""
        buf = conn.reader.buf
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data or len(buf) + len(data) > self.max_request_bytes + 65536:
            self._unpark(sel, parked, conn)
            close_conn(conn)
            return
        if not buf:
            conn.started = time.monotonic()
        buf += data
        if conn.complete(self.max_request_bytes):
            self._unpark(sel, parked, conn)
            self._submit(conn)

    def _park(self, sel: selectors.BaseSelector, parked: dict[socket.socket, Conn], conn: Conn) -> None:
        if len(parked) >= self.max_connections:  # make room: the longest idle goes
            oldest = min(parked.values(), key=lambda c: c.idle_since)
            self._unpark(sel, parked, oldest)
            close_conn(oldest)
            self.refused += 1
        conn.idle_since = time.monotonic()
        if not conn.reader.buf:
            conn.started = math.inf
        conn.sock.setblocking(False)
        parked[conn.sock] = conn
        sel.register(conn.sock, selectors.EVENT_READ, conn)

    @staticmethod
    def _unpark(sel: selectors.BaseSelector, parked: dict[socket.socket, Conn], conn: Conn) -> None:
        sel.unregister(conn.sock)
        del parked[conn.sock]

    def _submit(self, conn: Conn) -> None:
        try:
            self._work.put_nowait(conn)
        except queue.Full:
            self.refused += 1
            close_conn(conn)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    # ---- the workers -------------------------------------------------------------------------
    def _serve_requests(self) -> None:
        while True:
            conn = self._work.get()
            if conn is None:
                return
            keep = False
            try:
                conn.reader.deadline = time.monotonic() + self.request_timeout
                keep = self._serve_one(conn)
            except Exception:  # never let one connection kill a worker
                logger.debug("kvlease control connection failed", exc_info=True)
            conn.reader.deadline = math.inf
            conn.started = time.monotonic() if conn.reader.buf else math.inf  # pipelined: its clock runs
            if keep and not self._stop.is_set():
                self._back.append(conn)
                try:
                    self._wake_w.send(b"x")
                except OSError:
                    pass
            else:
                close_conn(conn)

    # ---- lifecycle ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._done.wait(5)

    def server_close(self) -> None:
        self._stop.set()
        while True:  # connections still queued: closed, not served
            try:
                conn = self._work.get_nowait()
            except queue.Empty:
                break
            if conn is not None:
                close_conn(conn)
        for _ in self._workers:
            try:
                self._work.put(None, timeout=1.0)
            except queue.Full:
                break
        for t in self._workers:
            t.join(timeout=self.request_timeout + 1)
        while self._back:
            close_conn(self._back.popleft())
        for sock in (self.socket, self._wake_r, self._wake_w):
            sock.close()


def close_conn(conn: Conn) -> None:
    try:
        conn.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.sock.close()
