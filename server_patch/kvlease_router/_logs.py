"""Logging without floods: client errors at most once a second per kind, and a filter for
aiohttp's own server logger (a malformed HTTP request is a client's problem, not a traceback)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["ClientErrorFilter", "RateLimit", "install_server_log_filter"]


class RateLimit:
    """``allow(kind)`` is True at most once per ``period`` seconds per kind; ``suppressed(kind)``
    counts what was left out since the last allowed one (bounded: at most ``max_kinds`` kinds)."""

    __slots__ = ("_clock", "_last", "_max_kinds", "_period", "_skipped")

    def __init__(
        self, period: float = 1.0, clock: Callable[[], float] = time.monotonic, max_kinds: int = 256
    ) -> None:
        self._period, self._clock, self._max_kinds = period, clock, max_kinds
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def allow(self, kind: str) -> bool:
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last < self._period:
            self._skipped[kind] = self._skipped.get(kind, 0) + 1
            return False
        if last is None and len(self._last) >= self._max_kinds:
            self._last.clear()
            self._skipped.clear()
        self._last[kind] = now
        return True

    def take_suppressed(self, kind: str) -> int:
        return self._skipped.pop(kind, 0)


def _is_client_error(record: logging.LogRecord) -> str | None:
    """The kind of a client error aiohttp logs with a traceback: a bad HTTP message (4xx, or an
    error caused by one: a body that is not what its coding says, met when aiohttp reads what a
    handler left unread), or a client that reset or closed its connection while a handler used it."""
    exc = record.exc_info[1] if record.exc_info else None
    top = exc
    for _ in range(4):  # the exception and its causes (aiohttp chains the parser's error)
        if exc is None:
            return None
        if isinstance(exc, (ConnectionResetError, BrokenPipeError)):  # aiohttp's server writes
            return type(top).__name__  # raise ClientConnectionResetError too: a reset is the client's
        status = getattr(exc, "code", None) if type(exc).__module__.startswith("aiohttp") else None
        if isinstance(status, int) and 400 <= status < 500:
            return type(top).__name__
        exc = exc.__cause__
    return None


class ClientErrorFilter(logging.Filter):
    """On ``aiohttp.server``: a client's bad HTTP message or reset connection (aiohttp logs each as
    an ERROR with a traceback) becomes one INFO line without traceback, at most once a second per
    kind."""

    def __init__(self, limit: RateLimit | None = None) -> None:
        super().__init__()
        self.limit = limit or RateLimit()

    def filter(self, record: logging.LogRecord) -> bool:
        kind = _is_client_error(record)
        if kind is None:
            return True
        if not self.limit.allow(kind):
            return False
        exc = record.exc_info[1] if record.exc_info else None
        skipped = self.limit.take_suppressed(kind)
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.msg, record.args = (
            "bad request from a client (%s: %s)%s",
            (
                kind,
                str(exc)[:200],
                f"; {skipped} more suppressed" if skipped else "",
            ),
        )
        record.exc_info = record.exc_text = None
        return True


def install_server_log_filter() -> None:
    """Idempotent: one :class:`ClientErrorFilter` on aiohttp's server logger."""
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, ClientErrorFilter) for f in logger.filters):
        logger.addFilter(ClientErrorFilter())
