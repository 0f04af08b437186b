"""Relaying D's answer to the client: JSON and SSE, with every handle stripped by parsing.

A handle is found by parsing, never trusted to a byte search alone: a JSON key may be spelled with
escapes (``"kv\\u005ftransfer_params"``), so any event or body that contains the key *or* a ``\\u``
escape is parsed, stripped at every depth and re-serialized (a line that cannot be parsed is
dropped). Upstream answers and pending SSE events are capped (``max_upstream_bytes``,
``max_sse_event_bytes``), SSE is scanned in linear time (each byte is searched for an event
separator once), and a stuck client write is bounded by ``stream_write_timeout``; a client that
stopped reading (its TCP acknowledges nothing for ``stream_stall_timeout``) loses its stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from typing import Any, Protocol

import aiohttp
import orjson
from aiohttp import web

from kvlease.protocol import ERROR_UPSTREAM, SSE_DONE, ErrorBody
from kvlease_router._clients import StallWatch
from kvlease_router._reuse import NEEDLE, strip_params
from kvlease_router._runtime import JSON_CT, RouterRuntime, error_response, log
from kvlease_router._upstreams import Node

__all__ = [
    "TurnIO",
    "UpstreamTooLarge",
    "passthrough",
    "read_capped",
    "relay_json",
    "relay_stream",
    "rewrite_events",
]

_DONE = SSE_DONE.encode()
_ESCAPE = b"\\u"
_BACKSLASH = b"\\"
_SEP = b"\n\n"
#: asyncio's default write-buffer high-water mark (64 KiB): below it a write does not wait.
_NO_WAIT = 64 * 1024
#: What a client gets instead of an upstream body that quoted a handle (or that could not be read).
UPSTREAM_ERROR = orjson.dumps(ErrorBody("upstream error", ERROR_UPSTREAM).to_json())


class UpstreamTooLarge(Exception):
    pass


class TurnIO(Protocol):
    """What a relay needs from the turn (``_flow._Turn``)."""

    @property
    def chat(self) -> bool: ...

    def response_headers(self, router: RouterRuntime) -> dict[str, str]: ...
    async def capture(self, node: Node, params: object, returned: object, streamed: bool) -> None: ...
    async def forget(self) -> None: ...
    def finish(self, node: Node, t0: float) -> None: ...


def suspicious(raw: bytes) -> bool:
    """Whether ``raw`` may carry a handle: the key, or a ``\\u`` escape that may spell it.

    ``find``, not ``in``: CPython's ``bytes.__contains__`` first tries its argument as an integer
    and raises (and clears) a TypeError for a bytes one, which costs more than the search itself."""
    return raw.find(NEEDLE) >= 0 or _escape_at(raw, 0) >= 0


def _escape_at(raw: bytes, start: int) -> int:
    """The first ``\\u`` in ``raw`` from ``start`` (-1: none). A backslash is found first, by one
    ``memchr`` (JSON text rarely has one): searching for the two bytes themselves costs ~1 ns a
    byte (CPython's two-byte search), several times more than the key's search."""
    at = raw.find(_BACKSLASH, start)
    return at if at < 0 else raw.find(_ESCAPE, at)


async def read_capped(resp: aiohttp.ClientResponse, cap: int) -> bytes:
    """The whole body, or :class:`UpstreamTooLarge` past ``cap`` bytes (never buffered beyond it)."""
    length = resp.content_length
    if length is not None and length > cap:
        raise UpstreamTooLarge(f"answer of {length} bytes exceeds {cap}")
    parts: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > cap:
            raise UpstreamTooLarge(f"answer exceeds {cap} bytes")
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def passthrough(
    router: RouterRuntime, turn: TurnIO, status: int, body: bytes, content_type: str | None
) -> web.Response:
    """An upstream 4xx for the client: its body with handles removed, else a generic error."""
    content_type = content_type or JSON_CT
    if suspicious(body):
        try:
            obj = orjson.loads(body)
            strip_params(obj)
            body = orjson.dumps(obj)
        except (orjson.JSONDecodeError, orjson.JSONEncodeError):
            body, content_type = UPSTREAM_ERROR, JSON_CT
        if body.find(NEEDLE) >= 0:  # the handle quoted inside a message (validation errors)
            body, content_type = UPSTREAM_ERROR, JSON_CT
    resp = web.Response(status=status, body=body, content_type=content_type)
    resp.headers.update(turn.response_headers(router))
    return resp


async def relay_json(
    router: RouterRuntime, turn: TurnIO, node: Node, upstream: aiohttp.ClientResponse, t0: float
) -> web.Response:
    """D's non-streamed answer: parsed once, the handle taken out, a 502 if it is not a JSON object."""
    try:
        raw = await read_capped(upstream, router.settings.max_upstream_bytes)
        obj = orjson.loads(raw)
    except (aiohttp.ClientError, asyncio.TimeoutError, UpstreamTooLarge, orjson.JSONDecodeError) as e:
        return await _broken(router, turn, node, t0, e)
    if not isinstance(obj, dict):
        return await _broken(router, turn, node, t0, ValueError("answer is not a JSON object"))
    params = None
    if suspicious(raw):
        params = strip_params(obj)
        raw = orjson.dumps(obj)
    choices = obj.get("choices")
    first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], Mapping) else {}
    returned = first.get("message") if turn.chat else first.get("text")
    await turn.capture(node, params, returned, False)
    turn.finish(node, t0)
    resp = web.Response(status=upstream.status, body=raw, content_type=upstream.content_type or JSON_CT)
    resp.headers.update(turn.response_headers(router))
    return resp


async def _broken(
    router: RouterRuntime, turn: TurnIO, node: Node, t0: float, e: BaseException
) -> web.Response:
    router.metrics.upstream_errors["decode"].inc()
    log.warning("decode answer from %s unusable: %s", node.url, type(e).__name__)
    await turn.forget()
    turn.finish(node, t0)
    resp = error_response(502, "decode node gave no usable answer", ERROR_UPSTREAM)
    resp.headers.update(turn.response_headers(router))
    return resp


def rewrite_events(block: bytes) -> tuple[bytes, Any]:
    """Strip ``kv_transfer_params`` from complete SSE events; return (bytes, captured params).

    Only the lines that may carry it (:func:`suspicious`) are parsed and re-serialized; the rest is
    copied as is. A suspicious line that is not a parsable ``data:`` payload is dropped (rather than
    leaked), with its newline. The result is exactly ``b"\\n".join`` of the block's lines with
    those rewritten or dropped; the suspicious lines are found by searching the block for the key
    and for ``\\u`` (each byte is searched once per needle), not by testing every line."""
    found: Any = None
    out: list[bytes] = []
    size = len(block)
    start = 0  # the first line not yet copied to ``out`` starts here
    key_at, esc_at = block.find(NEEDLE), _escape_at(block, 0)
    while key_at >= 0 or esc_at >= 0:
        at = key_at if esc_at < 0 or 0 <= key_at < esc_at else esc_at
        nl = block.rfind(b"\n", start, at)
        line_start = start if nl < 0 else nl + 1
        line_end = block.find(b"\n", at)
        if line_end < 0:
            line_end = size
        if line_start > start:  # the lines before it, copied whole (less their last newline)
            out.append(block[start : line_start - 1])
        line = block[line_start:line_end]
        if line.startswith(b"data:"):
            try:
                obj = orjson.loads(line[5:])
                got = strip_params(obj)
                out.append(b"data: " + orjson.dumps(obj))
            except (orjson.JSONDecodeError, orjson.JSONEncodeError):
                got = None
            if got is not None:
                found = got
        start = line_end + 1
        if start > size:  # it was the last line
            return b"\n".join(out), found
        if key_at < start:
            key_at = block.find(NEEDLE, start)
        if esc_at < start:
            esc_at = _escape_at(block, start)
    out.append(block[start:])
    return b"\n".join(out), found


class _EventStream(web.StreamResponse):
    """A streamed response whose status line and headers go out with its first body bytes (one
    write, one wake-up of the client) instead of on ``prepare`` (aiohttp's ``web.Response`` does
    the same)."""

    _send_headers_immediately = False


class _StuckClient(Exception):
    pass


async def relay_stream(
    request: web.Request,
    router: RouterRuntime,
    turn: TurnIO,
    node: Node,
    upstream: aiohttp.ClientResponse,
    t0: float,
) -> web.StreamResponse:
    s = router.settings
    headers = turn.response_headers(router)  # a fresh dict: one multidict built from it, no edits
    headers["Content-Type"] = "text/event-stream"
    headers["Cache-Control"] = "no-cache"
    resp = _EventStream(status=200, headers=headers)
    transport = request.transport  # its send buffer is bounded (``_guard``): a stuck reader waits
    await resp.prepare(request)
    write_timeout, event_cap = s.stream_write_timeout, s.max_sse_event_bytes
    loop = asyncio.get_running_loop()
    # a client that stopped reading is noticed by its TCP acknowledgements, long before the
    # router's writes would wait (``_clients.StallWatch``; None where the kernel does not say)
    watch = StallWatch.of(transport, s.stream_stall_timeout, loop.time())
    step = watch.check_every if watch is not None else write_timeout

    async def settle(writing: Awaitable[None]) -> None:
        """A write that waits: at most ``write_timeout``, and no longer than the client stays
        stalled (the watch is asked between waits)."""
        task = asyncio.ensure_future(writing)
        deadline = loop.time() + write_timeout
        try:
            while True:
                done, _ = await asyncio.wait((task,), timeout=step)
                if done:
                    task.result()
                    return
                now = loop.time()
                if now >= deadline:
                    raise _StuckClient(write_timeout)
                if watch is not None and watch.stalled(now):
                    raise _StuckClient(watch.after)
        finally:
            if not task.done():
                task.cancel()

    async def write(data: bytes) -> None:
        if watch is not None and watch.stalled(loop.time()):  # one comparison between checks
            raise _StuckClient(watch.after)
        # below the transport's high-water mark a write never waits: no timer on the hot path
        if transport is not None and transport.get_write_buffer_size() + len(data) < _NO_WAIT:
            await resp.write(data)
            return
        await settle(resp.write(data))

    params: Any = None
    pending = bytearray()
    #: The events that came with ``[DONE]``: with a local store they leave with it, in the final
    #: write after the capture (they arrived together, so nothing is delayed but by the store put).
    held = b""
    hold = router.store_is_local
    done_seen = False
    try:
        async for chunk in upstream.content.iter_any():
            # linear: search only the new bytes (and the one before them) for a separator
            at = chunk.rfind(_SEP)
            if at >= 0:
                cut = at + 2
            elif pending and pending[-1:] == b"\n" and chunk[:1] == b"\n":
                cut = 1
            else:
                pending += chunk
                if len(pending) > event_cap:
                    raise UpstreamTooLarge(f"an SSE event exceeds {event_cap} bytes")
                continue
            if pending:
                complete = bytes(pending) + chunk[:cut]
                pending = bytearray(chunk[cut:])
            elif cut == len(chunk):
                complete = chunk
            else:
                complete, pending = chunk[:cut], bytearray(chunk[cut:])
            if len(pending) > event_cap:
                raise UpstreamTooLarge(f"an SSE event exceeds {event_cap} bytes")
            if suspicious(complete):
                complete, got = rewrite_events(complete)
                if got is not None:
                    params = got
            if complete.endswith(_DONE):
                complete = complete[: -len(_DONE)]
                done_seen = True
                if hold:
                    held += complete
                    continue
            if held:
                complete, held = held + complete, b""
            if complete:
                await write(complete)
        if pending:
            tail = bytes(pending)
            if suspicious(tail):
                tail, got = rewrite_events(tail)
                params = got if got is not None else params
            held += tail
        if held and not hold:
            await write(held)
            held = b""
    except (ConnectionResetError, _StuckClient) as e:
        upstream.close()  # client went away or stopped reading: drop the upstream connection
        if isinstance(e, _StuckClient):  # (closing it aborts D's request)
            _cut(router, request, e)
        await turn.forget()  # the old handle was spent; D aborted the new one
        turn.finish(node, t0)
        return resp
    except asyncio.CancelledError:
        upstream.close()
        turn.finish(node, t0)
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError, UpstreamTooLarge) as e:
        upstream.close()
        router.metrics.upstream_errors["decode"].inc()
        log.warning("decode stream from %s broke: %s", node.url, type(e).__name__)
        await turn.forget()
        turn.finish(node, t0)
        try:
            await settle(resp.write_eof(held))
        except ConnectionResetError:
            pass
        except _StuckClient as stuck:
            _cut(router, request, stuck)
        return resp
    # the state is stored before the client sees [DONE], so its next turn finds the new handle
    await turn.capture(node, params, None, True)
    upstream.release()  # D's answer is all read: its connection goes back to the pool now
    try:
        await settle(resp.write_eof(held + _DONE if done_seen else held))  # events, [DONE], end
    except ConnectionResetError:
        pass
    except _StuckClient as e:
        _cut(router, request, e)
    finally:
        turn.finish(node, t0)
    return resp


def _cut(router: RouterRuntime, request: web.Request, e: _StuckClient) -> None:
    """Close the connection of a client that stopped reading (logged like a client error)."""
    router.metrics.stalled_streams.inc()
    router.metrics.log_client("stalled-stream", f"client stopped reading for {e.args[0]:g} s")
    if request.transport is not None:
        request.transport.abort()
