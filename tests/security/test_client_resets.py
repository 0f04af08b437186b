"""A client that resets (or closes) its connection mid-body is a client error like any other: one
INFO line a second per kind, no traceback, whatever the route; it could otherwise fill the log."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Iterator

import pytest

from kvlease.protocol import CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH, RENEW_PATH
from security._cluster import Cluster

#: Resets per route and way of leaving: far more than the log may show (one line a second per kind).
RESETS = 15


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def records() -> Iterator[_Records]:
    handler = _Records()
    loggers = [logging.getLogger(n) for n in ("kvlease.router", "aiohttp.server", "aiohttp.web", "asyncio")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)  # the client-error lines are INFO
    try:
        yield handler
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)


async def _leave_mid_body(cluster: Cluster, path: str, reset: bool) -> None:
    """Send a head promising 1,000 bytes and 10 of them; then reset (RST) or close (FIN)."""
    host, port = cluster.url.rsplit("/", 1)[1].rsplit(":", 1)
    _, writer = await asyncio.open_connection(host, int(port))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Authorization: Bearer resetter\r\nContent-Length: 1000\r\n\r\n"
    )
    writer.write(head.encode() + b'{"model": ')
    await writer.drain()
    await asyncio.sleep(0.02)  # the router is reading the body now
    if reset:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
    else:
        writer.close()
        await writer.wait_closed()


async def test_a_reset_mid_body_is_one_info_line_without_traceback(
    cluster: Cluster, records: _Records
) -> None:
    errors_before = cluster.router.metrics.client_errors._value.get()
    n = 0
    for path in (CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH, RENEW_PATH):
        for reset in (True, False):
            for _ in range(RESETS):
                await _leave_mid_body(cluster, path, reset)
                n += 1
    # every one is counted: the router saw each (bounded wait: they are handled in the background)
    metric = cluster.router.metrics.client_errors._value
    for _ in range(500):
        if metric.get() - errors_before >= n:
            break
        await asyncio.sleep(0.02)
    assert metric.get() - errors_before == n
    bad = [r for r in records.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not bad, [(r.name, r.levelname, r.getMessage()[:200]) for r in bad[:3]]
    lines = [r for r in records.records if "mid-body" in r.getMessage()]
    assert 1 <= len(lines) < n // 3, len(lines)  # rate-limited: one a second, not one a reset
    r, raw = await cluster.chat([{"role": "user", "content": "after the resets"}])
    assert r.status == 200, raw[:200]
