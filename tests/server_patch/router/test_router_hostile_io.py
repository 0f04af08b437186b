"""Issue 15, the router's IO side: slow clients, bad encodings, hostile upstreams, identity, logs.

Each test names the finding it covers; each failed on the code before the fix.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import time
import zlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from _router_cluster import (
    Cluster,
    ClusterFactory,
    closed_within,
    guarded_site,
    one_route_upstream,
    trickle_head,
)
from aiohttp import web

from kvlease.protocol import HEADER_SESSION_ID, KV_TRANSFER_PARAMS, ErrorBody
from kvlease_router._guard import GUARD_KEY
from kvlease_router._identity import conversation_id_from, fallback_id
from kvlease_router._logs import ClientErrorFilter, RateLimit
from kvlease_stack.testing import FakePair

CHAT = "/v1/chat/completions"
GOOD = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
ESCAPED = b'"kv\\u005ftransfer_params"'


async def _post(c: Cluster, data: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    h = {"Content-Type": "application/json", **(headers or {})}
    async with c.client.post(c.url + CHAT, data=data, headers=h) as r:
        return r.status, await r.read()


def _is_error_body(raw: bytes) -> None:
    ErrorBody.from_json(orjson.loads(raw))  # the OpenAI error shape the openai client parses


# ---- item 6: no 5xx from client input --------------------------------------------------------------


@pytest.mark.parametrize(
    ("coding", "data", "allowed"),
    [
        ("gzip", orjson.dumps(GOOD), {400}),  # labelled gzip, plain bytes
        ("deflate", orjson.dumps(GOOD), {400}),
        ("br", orjson.dumps(GOOD), {400, 415}),
        ("zstd-or-so", orjson.dumps(GOOD), {415}),
        ("gzip, identity", orjson.dumps(GOOD), {400, 415}),
        ("gzip", gzip.compress(orjson.dumps(GOOD)), {200}),  # really gzip: decoded, served
        ("deflate", zlib.compress(orjson.dumps(GOOD)), {200}),
        ("gzip", gzip.compress(b"{not json"), {400}),
    ],
)
async def test_content_encodings_are_4xx_not_500(
    cluster: Cluster, coding: str, data: bytes, allowed: set[int]
) -> None:
    status, raw = await _post(cluster, data, {"Content-Encoding": coding})
    assert status in allowed, (status, raw[:200])
    if status >= 400 and coding != "br":  # without brotli, aiohttp's parser refuses br itself
        _is_error_body(raw)


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m"},  # no messages
        {"model": "m", "messages": {"role": "user"}},
        {"model": 7, "messages": [{"role": "user", "content": "x"}]},
        {"model": ["m"], "messages": []},
        {**GOOD, "stream": 1},
        {**GOOD, "stream": None},
    ],
)
async def test_openai_shape_the_router_reads_is_400_before_any_upstream_call(
    cluster: Cluster, body: dict[str, Any]
) -> None:
    before = len(cluster.pair.prefill.requests)
    status, raw = await _post(cluster, orjson.dumps(body), {"X-Conversation-Id": "shape"})
    assert status == 400, raw[:200]
    _is_error_body(raw)
    assert len(cluster.pair.prefill.requests) == before  # P never saw it


async def _closing_mid_body(request: web.Request) -> web.StreamResponse:
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "5000"})
    await resp.prepare(request)
    await resp.write(b'{"id": "x", "choices": [')
    assert request.transport is not None
    request.transport.close()
    return resp


async def _garbage(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=b"\x00\xffnot json at all", content_type="application/json")


async def _too_big(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=b'{"x": "' + b"a" * 300_000 + b'"}', content_type="application/json")


@pytest.mark.parametrize(
    "handler", [_closing_mid_body, _garbage, _too_big], ids=["cut", "garbage", "too-big"]
)
async def test_a_broken_decode_answer_is_a_502_in_the_openai_error_shape(
    make_cluster: ClusterFactory, handler: Any
) -> None:
    cluster = await make_cluster(max_upstream_bytes=100_000)
    async with one_route_upstream(CHAT, handler) as url:
        cluster.router.upstreams.decode.nodes[0].url = url
        status, raw = await _post(cluster, orjson.dumps(GOOD), {"X-Conversation-Id": "broken"})
    assert status == 502, raw[:200]
    _is_error_body(raw)


# ---- item 7: hostile upstreams ----------------------------------------------------------------------


async def _escaped_json(request: web.Request) -> web.Response:
    await request.read()
    body = b'{"id": "x", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}], '
    body += ESCAPED + b': {"remote_engine_id": "secret-engine", "remote_block_ids": [1, 2]}}'
    return web.Response(body=body, content_type="application/json")


async def _escaped_sse(request: web.Request) -> web.StreamResponse:
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n')
    await resp.write(b'data: {"choices": [], ' + ESCAPED + b': {"remote_engine_id": "secret-engine"}}\n\n')
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_an_escaped_handle_key_never_reaches_the_client(
    make_cluster: ClusterFactory, stream: bool
) -> None:
    cluster = await make_cluster()
    async with one_route_upstream(CHAT, _escaped_sse if stream else _escaped_json) as url:
        cluster.router.upstreams.decode.nodes[0].url = url
        status, raw = await _post(
            cluster, orjson.dumps({**GOOD, "stream": stream}), {"X-Conversation-Id": "esc"}
        )
    assert status == 200, raw[:200]
    assert b"secret-engine" not in raw and b"transfer" not in raw and b"\\u005f" not in raw
    assert b"hi" in raw


async def _endless_event(request: web.Request) -> web.StreamResponse:
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    chunk = b"x" * 65536
    try:
        for _ in range(256):  # 16 MiB without an event separator
            await resp.write(chunk)
    except ConnectionError:
        pass
    return resp


async def test_an_sse_event_without_a_separator_is_capped_and_scanned_in_linear_time(
    make_cluster: ClusterFactory,
) -> None:
    cluster = await make_cluster(max_sse_event_bytes=4 * 1024 * 1024)
    async with one_route_upstream(CHAT, _endless_event) as url:
        cluster.router.upstreams.decode.nodes[0].url = url
        t0 = time.process_time()
        status, raw = await _post(cluster, orjson.dumps({**GOOD, "stream": True}))
        cpu = time.process_time() - t0
    assert status == 200 and b"xxxx" not in raw  # the oversized event never went out
    assert cpu < 2.0, cpu  # the old relay re-scanned the whole pending buffer on every read


def test_a_line_with_an_escape_is_parsed_like_one_with_the_key() -> None:
    from kvlease_router._relay import suspicious

    assert suspicious(ESCAPED) and suspicious(KV_TRANSFER_PARAMS.encode()) and not suspicious(b"data: {}")


async def test_p_params_reach_d_only_through_the_handle_parser(make_cluster: ClusterFactory) -> None:
    """P answers with params that the connector's parser refuses: D gets none (it prefills)."""
    cluster = await make_cluster()

    async def hostile_p(request: web.Request) -> web.Response:
        await request.read()
        out = {"choices": [], KV_TRANSFER_PARAMS: {"remote_block_ids": "all", "remote_port": 99_999_999}}
        return web.Response(body=orjson.dumps(out), content_type="application/json")

    async with one_route_upstream(CHAT, hostile_p) as url:
        cluster.router.upstreams.prefill.nodes[0].url = url
        status, raw = await _post(cluster, orjson.dumps(GOOD))
    assert status == 200, raw[:200]
    d_req = cluster.pair.decode.requests[-1]
    assert d_req.get(KV_TRANSFER_PARAMS) is None


# ---- item 8: identity -------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["user@example.com", "tenant/42", "sess 1", "a" * 200, "ünï"])
def test_non_conforming_fallback_ids_are_hashed_not_refused(value: str) -> None:
    for headers, body in (({HEADER_SESSION_ID: value}, {}), ({}, {"prompt_cache_key": value})):
        ident = conversation_id_from(headers, body)
        assert ident is not None and ident.conversation_id == fallback_id(value)
        assert len(ident.conversation_id) <= 128
    assert fallback_id(value) != fallback_id(value + "x")


async def test_hashed_session_ids_keep_their_conversation(cluster: Cluster) -> None:
    for _ in range(2):
        status, _ = await _post(cluster, orjson.dumps(GOOD), {HEADER_SESSION_ID: "user@example.com"})
        assert status == 200


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        ({"X-Conversation-Id": "user@example.com"}, {}),  # kvlease's own header stays strict
        ({}, {"conversation_id": None}),  # null is not "absent"
        ({}, {"conversation_id": "a b"}),
    ],
)
async def test_strict_ids_and_null_are_400(
    cluster: Cluster, headers: dict[str, str], body: dict[str, Any]
) -> None:
    status, raw = await _post(cluster, orjson.dumps({**GOOD, **body}), headers)
    assert status == 400, raw[:200]
    _is_error_body(raw)


# ---- item 9: logs -----------------------------------------------------------------------------------


async def test_client_errors_are_logged_at_most_once_a_second_per_kind(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    for _ in range(50):
        await _post(cluster, b"{nope")
    lines = [r for r in caplog.records if "client error" in r.getMessage()]
    assert 1 <= len(lines) <= 2 and not any(r.exc_info for r in caplog.records if r.levelno >= logging.ERROR)


def test_aiohttp_bad_request_tracebacks_become_one_line_a_second() -> None:
    from aiohttp.http_exceptions import BadHttpMessage

    clock = [0.0]
    f = ClientErrorFilter(RateLimit(1.0, clock=lambda: clock[0]))

    def rec() -> logging.LogRecord:
        try:
            raise BadHttpMessage("bad")
        except BadHttpMessage as e:
            return logging.LogRecord(
                "aiohttp.server", logging.ERROR, "", 0, "Error handling request", (), (type(e), e, None)
            )

    kept = [f.filter(r) for r in (rec(), rec(), rec())]
    assert kept == [True, False, False]
    clock[0] = 1.5
    r = rec()
    assert f.filter(r) and r.levelno == logging.INFO and r.exc_info is None and "2 more" in r.getMessage()


def test_json_logs_keep_the_exception() -> None:
    from kvlease_router.cli import _JsonFormatter

    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        record = logging.LogRecord("x", logging.ERROR, "", 0, "failed", (), sys.exc_info())
    out = orjson.loads(_JsonFormatter().format(record))
    assert out["exc"] == "ValueError: boom" and "Traceback" in out["traceback"]


# ---- item 4: slow and stuck clients (real sockets, the guarded server) -----------------------------


@pytest.fixture
async def guarded() -> AsyncIterator[tuple[str, int, FakePair, Any]]:
    async with guarded_site(
        header_timeout=0.5,
        body_timeout=0.5,
        idle_timeout=1.0,
        stream_write_timeout=0.5,
        max_connections_per_ip=8,
    ) as (port, pair, app):
        yield "127.0.0.1", port, pair, app


async def test_a_trickling_header_is_closed(guarded: Any) -> None:
    host, port, _, _ = guarded
    reader, writer = await asyncio.open_connection(host, port)
    t0 = time.monotonic()
    await trickle_head(reader, writer, 20)  # the head never completes within 0.5 s
    assert await closed_within(reader, 2.0)
    assert time.monotonic() - t0 < 2.5
    writer.close()


async def test_a_trickling_body_gets_408(guarded: Any) -> None:
    host, port, _, _ = guarded
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
    await writer.drain()
    head = await asyncio.wait_for(reader.readline(), 3.0)
    assert b" 408 " in head
    assert await closed_within(reader, 2.0)
    writer.close()


async def test_an_idle_keepalive_connection_is_closed(guarded: Any) -> None:
    host, port, _, _ = guarded
    reader, writer = await asyncio.open_connection(host, port)
    assert await closed_within(reader, 3.0)  # idle_timeout = 1 s
    writer.close()


async def test_connections_per_ip_are_bounded(guarded: Any) -> None:
    host, port, _, app = guarded
    conns = [await asyncio.open_connection(host, port) for _ in range(8)]
    await asyncio.sleep(0.1)
    extra_r, extra_w = await asyncio.open_connection(host, port)
    assert await closed_within(extra_r, 2.0)  # the 9th is closed at once
    assert app[GUARD_KEY].refused >= 1
    for _, w in conns:
        w.close()
    extra_w.close()
    await asyncio.sleep(0.2)
    async with aiohttp.ClientSession() as s, s.post(f"http://{host}:{port}{CHAT}", json=GOOD) as r:
        assert r.status == 200  # the slots came back


async def test_a_stopped_reader_releases_its_decode_connection(guarded: Any) -> None:
    host, port, pair, _ = guarded
    pair.decode.config.default_max_tokens = 200_000  # far more than the socket buffers hold
    reader, writer = await asyncio.open_connection(host, port)
    body = orjson.dumps({**GOOD, "stream": True, "max_tokens": 200_000})
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    await asyncio.wait_for(reader.readline(), 5.0)  # the stream started; now stop reading
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        if pair.decode.stats["open_streams"] == 0:
            break
    assert pair.decode.stats["open_streams"] == 0
    writer.close()
