"""The turn path's fast paths keep every guard: handle stripping found by a block search (escapes
included, keys split across SSE reads), the header timer only for heads that do not come whole,
the "request answered" hook without an app middleware (404s included), the body read without a
timer only when the body is already buffered, and the immutable first attempts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from _router_cluster import ClusterFactory, closed_within, guarded_site, one_route_upstream, trickle_head
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlease.protocol import KV_TRANSFER_PARAMS
from kvlease_router import MemoryStore, NodeSpec, RouterSettings, create_app
from kvlease_router._relay import rewrite_events, suspicious
from kvlease_router._retry import RETRY_POLICY
from kvlease_router._reuse import strip_params
from kvlease_router._turn import Attempt, first_attempt

CHAT = "/v1/chat/completions"
GOOD = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
NEEDLE = KV_TRANSFER_PARAMS.encode()
ESCAPED = b'"kv\\u005ftransfer_params"'


# ---- rewrite_events and suspicious: the block search is the line-by-line rule -----------------------


def _line_suspicious(line: bytes) -> bool:
    return NEEDLE in line or b"\\u" in line


def _rewrite_by_lines(block: bytes) -> tuple[bytes, Any]:
    """The rule, line by line: a line with the key or a ``\\u`` escape is parsed and rewritten (or
    dropped when it is not a parsable ``data:`` payload); every other line is copied."""
    found: Any = None
    out = []
    for line in block.split(b"\n"):
        if not _line_suspicious(line):
            out.append(line)
            continue
        if not line.startswith(b"data:"):
            continue
        try:
            obj = orjson.loads(line[5:])
            got = strip_params(obj)
            line = b"data: " + orjson.dumps(obj)
        except (orjson.JSONDecodeError, orjson.JSONEncodeError):
            continue
        if got is not None:
            found = got
        out.append(line)
    return b"\n".join(out), found


_LINES = [
    b"data: " + orjson.dumps({"choices": [{"delta": {"content": "a"}}]}),
    b"data: " + orjson.dumps({"choices": [], KV_TRANSFER_PARAMS: {"remote_engine_id": "e"}}),
    b'data: {"choices": [], ' + ESCAPED + b': {"remote_engine_id": "esc"}}',
    b'data: {"choices": [{"delta": {"content": "caf\\u00e9"}}]}',  # an escape, no key: parsed, kept
    b'data: {"choices": [{"delta": {"content": "a\\nb \\"q\\" \\\\"}}]}',  # backslashes, no \u
    b'data: {"x": "\\\\u"}',  # an escaped backslash before a u: still searched as \u
    b"data: {not json " + NEEDLE + b"}",
    b"data: {not json \\u0041",
    b"event: \\u006b",
    b": comment " + NEEDLE,
    b"\\",
    b"data: [DONE]",
    b"",
    b"id: 7",
]


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(_LINES), max_size=12), st.sampled_from([b"", b"\n", b"\n\n"]))
def test_rewrite_events_is_the_line_by_line_rule_escapes_included(lines: list[bytes], end: bytes) -> None:
    block = b"\n".join(lines) + end
    assert rewrite_events(block) == _rewrite_by_lines(block)
    got, _ = rewrite_events(block)
    assert NEEDLE not in got and b"\\u005f" not in got


_PARTS = [b"kv_", b"transfer_params", NEEDLE, b"\\", b"u", b"\\u", b"x", b"\n"]


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(_PARTS), max_size=20))
def test_suspicious_is_the_key_or_a_u_escape_anywhere(parts: list[bytes]) -> None:
    raw = b"".join(parts)
    assert suspicious(raw) == (NEEDLE in raw or b"\\u" in raw)


def test_a_block_without_the_key_or_an_escape_is_returned_as_is() -> None:
    block = b'data: {"a": "b\\n"}\n\ndata: [DONE]\n\n'
    assert rewrite_events(block) == (block, None)


# ---- the SSE relay: a key (plain or escaped) split across upstream reads never leaks ---------------

_EVENT = b'data: {"choices": [], ' + ESCAPED + b': {"remote_engine_id": "secret-engine"}}\n\n'
_PLAIN = b'data: {"choices": [], "kv_transfer_params": {"remote_engine_id": "secret-engine"}}\n\n'


def _split_stream(event: bytes, at: int) -> Any:
    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n')
        for part in (event[:at], event[at:]):
            await resp.write(part)
            await asyncio.sleep(0.02)  # separate reads at the router, most likely (not relied on)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    return handler


@pytest.mark.parametrize(
    ("event", "at"),
    [
        (_EVENT, _EVENT.index(b"\\u")),  # split just before the backslash
        (_EVENT, _EVENT.index(b"\\u") + 1),  # between the backslash and the u
        (_EVENT, _EVENT.index(b"005f")),  # inside the escape
        (_EVENT, len(_EVENT) - 1),  # the separator itself split
        (_PLAIN, _PLAIN.index(b"transfer")),  # the plain key split
    ],
    ids=["before-backslash", "after-backslash", "in-escape", "in-separator", "plain-key"],
)
async def test_a_key_split_across_sse_reads_never_reaches_the_client(
    make_cluster: ClusterFactory, event: bytes, at: int
) -> None:
    cluster = await make_cluster()
    async with one_route_upstream(CHAT, _split_stream(event, at)) as url:
        cluster.router.upstreams.decode.nodes[0].url = url
        h = {"Content-Type": "application/json", "X-Conversation-Id": "split"}
        async with cluster.client.post(
            cluster.url + CHAT, data=orjson.dumps({**GOOD, "stream": True}), headers=h
        ) as r:
            status, raw = r.status, await r.read()
    assert status == 200, raw[:200]
    assert b"secret-engine" not in raw and b"transfer" not in raw and b"\\u005f" not in raw
    assert b"hi" in raw and raw.endswith(b"data: [DONE]\n\n")


# ---- the guard: header timer, "request answered" hook, body read ---------------------------------


@pytest.fixture
async def guarded_long_idle() -> AsyncIterator[tuple[str, int, Any]]:
    """The guarded server with a short header timeout and a long idle timeout (so a closed
    connection below is the header timeout's doing, not the idle one's)."""
    async with guarded_site(header_timeout=0.5, body_timeout=0.5, idle_timeout=30.0) as (port, _, app):
        yield "127.0.0.1", port, app


async def _response(reader: asyncio.StreamReader) -> bytes:
    """One HTTP/1.1 response with a Content-Length body (bounded wait)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    body = await asyncio.wait_for(reader.readexactly(length), 5.0)
    return head + body


@pytest.mark.parametrize("path", ["/health", "/no-such-path"])
async def test_a_trickling_second_head_on_a_keepalive_connection_is_closed(
    guarded_long_idle: Any, path: str
) -> None:
    """The guard learns that the first request (a 404 too) was answered, so the next head is timed."""
    host, port, _ = guarded_long_idle
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    first = await _response(reader)
    assert first.startswith((b"HTTP/1.1 200", b"HTTP/1.1 404")), first[:80]
    await trickle_head(reader, writer, 30)  # the head never completes within 0.5 s
    assert await closed_within(reader, 3.0)  # well before the 30 s idle timeout
    writer.close()


async def test_a_head_in_pieces_completes_and_its_timer_ends_with_it(guarded_long_idle: Any) -> None:
    """A head split across reads is timed, and the timer stops when it completes: the connection
    outlives the header timeout and serves the next request."""
    host, port, _ = guarded_long_idle
    reader, writer = await asyncio.open_connection(host, port)
    body = orjson.dumps(GOOD)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += b"Content-Length: %d\r\n\r\n" % len(body)
    for part in (head[:20], head[20:-1], head[-1:] + body):  # the empty line itself split
        writer.write(part)
        await writer.drain()
        await asyncio.sleep(0.05)
    assert (await _response(reader)).startswith(b"HTTP/1.1 200")
    await asyncio.sleep(0.8)  # past the 0.5 s header timeout
    writer.write(head + body)  # a whole head in one write: no timer at all
    await writer.drain()
    assert (await _response(reader)).startswith(b"HTTP/1.1 200")
    writer.close()


async def test_a_body_after_its_head_is_still_bounded(guarded_long_idle: Any) -> None:
    """The body read skips its timer only when the body came with the head."""
    host, port, _ = guarded_long_idle
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
    await writer.drain()
    head = await asyncio.wait_for(reader.readline(), 3.0)
    assert b" 408 " in head
    assert await closed_within(reader, 2.0)
    writer.close()


async def test_the_app_has_no_middleware_and_the_runtime_has_its_retry_policy() -> None:
    s = RouterSettings(prefill=(NodeSpec("http://p"),), decode=(NodeSpec("http://d"),), key_secret="k")
    app = create_app(s, MemoryStore(10))
    assert list(app.middlewares) == []  # aiohttp calls the handlers directly
    from kvlease_router._app import ROUTER_KEY

    assert app[ROUTER_KEY].retry_policy is app[RETRY_POLICY]


def test_first_attempts_are_shared_and_equal_to_fresh_ones() -> None:
    a = first_attempt(True, 2, True)
    assert a is first_attempt(True, 2, True)
    assert a == Attempt(prefill=True, n_nodes=2, handle=True)
    assert first_attempt(False, 1, False) == Attempt(prefill=False, n_nodes=1)


async def test_a_buffered_body_and_a_streamed_one_get_the_same_answer(make_cluster: ClusterFactory) -> None:
    """The fast body read (everything already buffered) and the timed one (a chunked body that
    arrives after the head) read the same bytes."""
    cluster = await make_cluster()
    data = orjson.dumps({**GOOD, "max_tokens": 3})

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(data), 7):
            await asyncio.sleep(0.005)
            yield data[i : i + 7]

    h = {"Content-Type": "application/json"}
    async with cluster.client.post(cluster.url + CHAT, data=data, headers=h) as r:
        whole = (r.status, (await r.json())["choices"][0]["message"]["content"])
    async with cluster.client.post(cluster.url + CHAT, data=chunks(), headers=h) as r:
        streamed = (r.status, (await r.json())["choices"][0]["message"]["content"])
    assert whole[0] == streamed[0] == 200 and whole[1] == streamed[1]
