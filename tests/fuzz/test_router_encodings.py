"""Every route of the router x every content coding: never a 5xx, never a logged traceback.

A body that is not what its ``Content-Encoding`` says is a 400 and an unknown coding a 415 on
every route that reads a body (chat, completions, renew: one reader for all); routes that read none
answer as usual. Real HTTP on 127.0.0.1, the router in front of the fake P/D pair.
"""

from __future__ import annotations

import asyncio
import gzip
import zlib
from collections.abc import AsyncIterator, Iterator

import orjson
import pytest
from security._cluster import Cluster, ErrorLog, router_errors, running_cluster

from kvlease.protocol import (
    CHAT_COMPLETIONS_PATH,
    COMPLETIONS_PATH,
    ERROR_INVALID_REQUEST,
    RENEW_PATH,
    ErrorBody,
)

#: The routes that read a body, and a valid body of each.
BODIES = {
    CHAT_COMPLETIONS_PATH: {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]},
    COMPLETIONS_PATH: {"model": "fake-model", "prompt": "hi"},
    RENEW_PATH: {"conversation_ids": ["enc-1", "enc-2"]},
}
#: Codings the router's server decodes (gzip and deflate are encoded here; br and zstd need
#: optional libraries, so only their lies are sent).
DECODED = ["gzip", "deflate", "br", "zstd", "GZIP", "Deflate"]
UNDECODED = ["zstd-bogus", "x-gzip", "x-unknown", "gzip, deflate", "compress", "*"]
LIE = b"plain text, not what the coding says"


@pytest.fixture
def logged_errors() -> Iterator[ErrorLog]:
    with router_errors() as errors:
        yield errors


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    async with running_cluster(health_interval=3600.0) as c:
        yield c


def _encode(coding: str, raw: bytes) -> bytes:
    c = coding.lower()
    return gzip.compress(raw) if c == "gzip" else zlib.compress(raw) if c == "deflate" else raw


def _routes(cluster: Cluster) -> list[tuple[str, str]]:
    out = []
    for r in cluster.app.router.routes():
        info = r.resource.get_info() if r.resource is not None else {}
        path = info.get("path") or info.get("formatter", "")
        out.append((r.method, path.replace("{id}", "enc-1")))
    return sorted(set(out))


async def _send(cluster: Cluster, method: str, path: str, coding: str, body: bytes) -> tuple[int, bytes]:
    """One request on its own connection, read to the server's close: (status, body). Raw: the
    router closes after a 400 or 415 (the body unread), and aiohttp's own parser refuses a request
    whose coding it lacks a library for with a bare HTTP/1.0 answer that a client may not parse."""
    host, port = cluster.url.rsplit("/", 1)[1].rsplit(":", 1)
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Encoding: {coding}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head.encode() + body)
        async with asyncio.timeout(30):
            raw = await reader.read()
    finally:
        writer.close()
    status_line, _, rest = raw.partition(b"\r\n")
    headers, _, payload = rest.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in headers.lower():
        payload = _unchunk(payload)
    return int(status_line.split()[1]), payload


def _unchunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if not size:
            break
        out += data[:size]
        data = data[size + 2 :]
    return bytes(out)


def _openai_error(raw: bytes, status: int) -> ErrorBody:
    err = ErrorBody.from_json(orjson.loads(raw))
    assert err.code == status and err.type == ERROR_INVALID_REQUEST and err.message
    return err


async def test_every_route_and_coding_is_a_4xx_at_worst(cluster: Cluster, logged_errors: ErrorLog) -> None:
    routes = _routes(cluster)
    posts = {p for m, p in routes if m == "POST"}
    assert posts == set(BODIES), "a new route that reads a body: add it to BODIES"
    seen: dict[tuple[str, str, str, str], int] = {}
    for method, path in routes:
        for coding in DECODED + UNDECODED + ["identity", ""]:
            for kind, body in (("lie", LIE), ("true", _encode(coding, orjson.dumps(BODIES.get(path, {}))))):
                status, raw = await _send(cluster, method, path, coding, body)
                seen[(method, path, coding, kind)] = status
                assert status < 500, (method, path, coding, kind, status, raw[:200])
                if path not in BODIES:
                    continue
                if coding.strip().lower() in ("gzip", "deflate") and kind == "true":
                    assert status == 200, (path, coding, status, raw[:200])
                elif coding in UNDECODED:
                    assert status == 415, (path, coding, kind, status, raw[:200])
                    assert "Content-Encoding" in _openai_error(raw, 415).message
                elif kind == "lie":  # a lie in a coding the server decodes, or plain text as JSON
                    assert status == 400, (path, coding, status, raw[:200])
                    if coding.lower() in ("gzip", "deflate", "identity", ""):  # (br and zstd without
                        _openai_error(raw, 400)  # their libraries: aiohttp's parser refuses them)
    assert len(seen) >= 8 * 14 * 2
    assert not logged_errors.records, [
        (r.name, r.getMessage()[:200], r.exc_info and repr(r.exc_info[1])) for r in logged_errors.records[:5]
    ]
    # and the router still serves a turn after all that
    r, raw = await cluster.chat([{"role": "user", "content": "still here"}])
    assert r.status == 200, raw[:200]
