"""One turn: identity → state → P (``max_tokens=1``, handle if usable) → D → client → capture → store."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from kvlease.protocol import (
    BODY_CONVERSATION_ID,
    CACHE_SALT,
    ERROR_UPSTREAM,
    HEADER_AUTHORIZATION,
    HEADER_REUSE,
    HEADER_REUSED_TOKENS,
    HEADER_STATUS,
    HEADER_TTL,
    KV_TRANSFER_PARAMS,
    REUSE_OFF,
    SSE_DONE,
    ErrorBody,
    ReuseStatus,
    prefill_request_params,
)
from kvlease_router._continuity import (
    Continuity,
    chat_continuity,
    chat_extends,
    completion_continuity,
    completion_extends,
)
from kvlease_router._identity import IdentityError, conversation_id_from, log_ref, tenant_from
from kvlease_router._reuse import NEEDLE, capture_handle, decide_offer, judge_prefill, strip_params
from kvlease_router._runtime import JSON_CT, RouterRuntime, error_response, log
from kvlease_router._store import ConversationRecord
from kvlease_router._upstreams import Node

__all__ = ["handle_turn"]

_DONE = SSE_DONE.encode()
_FORWARD_HEADERS = (HEADER_AUTHORIZATION,)
#: What a client gets instead of an upstream body that quoted a handle (or that could not be read).
_UPSTREAM_ERROR = orjson.dumps(ErrorBody("upstream error", ERROR_UPSTREAM).to_json())
_MALFORMED_UPSTREAM = orjson.dumps(ErrorBody("malformed upstream answer", ERROR_UPSTREAM).to_json())


class _Upstream4xx(Exception):
    def __init__(self, status: int, body: bytes, content_type: str | None) -> None:
        self.status, self.body, self.content_type = status, body, content_type


class _UpstreamDown(Exception):
    pass


@dataclass
class _Turn:
    chat: bool
    body: dict[str, Any]
    key: str | None
    state: ConversationRecord | None
    status: ReuseStatus = ReuseStatus.NO_ID
    reused: int = 0


def _bad(message: str, router: RouterRuntime) -> web.Response:
    router.metrics.client_errors.inc()
    return error_response(400, message)


async def handle_turn(request: web.Request, router: RouterRuntime, chat: bool) -> web.StreamResponse:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        router.metrics.client_errors.inc()
        return error_response(413, f"request body exceeds {router.settings.max_body_bytes} bytes")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return _bad(f"request body is not valid JSON: {e}", router)
    if not isinstance(body, dict):
        return _bad("request body must be a JSON object", router)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        return _bad("'stream' must be a boolean", router)
    try:
        ident = conversation_id_from(request.headers, body)
    except IdentityError as e:
        return _bad(str(e), router)
    body.pop(BODY_CONVERSATION_ID, None)
    body.pop(KV_TRANSFER_PARAMS, None)  # never trust a client's handle
    xargs = body.get("vllm_xargs")  # vLLM reads kv_transfer_params from extra_args too
    if isinstance(xargs, dict):
        xargs.pop(KV_TRANSFER_PARAMS, None)

    # the tenant (a hash of the bearer token) only when something needs it
    salted = router.settings.tenant_cache_salt
    tenant = (
        tenant_from(request.headers, router.settings.tenant_header) if salted or ident is not None else ""
    )
    if salted:
        client_salt = body.get(CACHE_SALT)
        if client_salt is not None and not isinstance(client_salt, str):
            return _bad("'cache_salt' must be a string", router)
        body[CACHE_SALT] = router.keyer.cache_salt(tenant, client_salt or "")

    now = time.time()
    turn = _Turn(chat, body, None, None)
    store_ok = True
    if ident is not None:
        turn.key = router.keyer.key(tenant, ident.conversation_id)
    opted_out = (request.headers.get(HEADER_REUSE) or "").strip().lower() == REUSE_OFF
    if turn.key is not None:
        turn.state, store_ok = await router.store_get(turn.key)
        decode_node = router.upstreams.decode.by_url(turn.state.decode if turn.state else None)
        healthy = decode_node is not None and decode_node.healthy(time.monotonic())
        continuity_ok = None
        if not router.settings.kvlease_mode and turn.state is not None and turn.state.continuity:
            held = Continuity(turn.state.continuity, turn.state.prefix_len)
            continuity_ok = (
                chat_extends(body.get("messages"), held)
                if chat
                else completion_extends(body.get("prompt"), held)
            )
        elif not router.settings.kvlease_mode:
            continuity_ok = False
        offer = decide_offer(
            turn.state,
            now,
            opted_out=opted_out,
            reuse_enabled=router.reuse_enabled,
            decode_healthy=healthy,
            continuity_ok=continuity_ok,
        )
        if not store_ok and not opted_out:
            offer = type(offer)(ReuseStatus.ERROR)
        turn.status = offer.status
    else:
        offer = None
        turn.status = ReuseStatus.NO_ID

    router.metrics.in_flight.inc()
    try:
        return await _run(request, router, turn, offer.handle if offer else None, stream)
    finally:
        router.metrics.in_flight.dec()


def _headers(router: RouterRuntime, request: web.Request) -> dict[str, str]:
    out = {"Content-Type": JSON_CT, "X-Request-Id": router.request_id()}
    for name in _FORWARD_HEADERS:
        v = request.headers.get(name)
        if v is not None:
            out[name] = v
    return out


def _prefill_body(turn: _Turn, handle: dict[str, Any] | None) -> bytes:
    p = dict(turn.body)
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p["stream"] = False
    for k in ("stream_options", "min_tokens"):
        p.pop(k, None)
    p[KV_TRANSFER_PARAMS] = handle if handle is not None else prefill_request_params()
    return orjson.dumps(p)


#: Failures where the node did not take the request (refused, or a pooled keep-alive connection it
#: had closed): worth one more try on the same node before calling it down.
_NOT_TAKEN = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError)


async def _send(
    router: RouterRuntime, url: str, data: bytes, headers: dict[str, str], timeout: aiohttp.ClientTimeout
) -> aiohttp.ClientResponse:
    """POST with one quick retry when the connection failed before an answer (a full listen
    backlog, a keep-alive connection closed under us). A duplicate is harmless: P and D compute the
    same answer again, and a repeated pull of blocks P already freed recomputes."""
    try:
        return await router.http().post(url, data=data, headers=headers, timeout=timeout)
    except _NOT_TAKEN as e:
        log.info("upstream %s: %s; retrying once", url, type(e).__name__)
        router.metrics.upstream_retries.inc()
        await asyncio.sleep(0.05)
        return await router.http().post(url, data=data, headers=headers, timeout=timeout)


def _encoded(resp: aiohttp.ClientResponse) -> bool:
    """The answer has a content coding (the router asks for ``identity``, and relays bytes as they
    come: it could not find, nor strip, a handle inside compressed ones)."""
    coding = resp.headers.get("Content-Encoding")
    return coding is not None and coding.strip().lower() not in ("", "identity")


async def _post_json(
    router: RouterRuntime, node: Node, path: str, data: bytes, headers: dict[str, str]
) -> dict[str, Any]:
    try:
        async with await _send(router, node.url + path, data, headers, router.prefill_timeout) as resp:
            if _encoded(resp):  # asked for identity; compressed bytes cannot be scanned
                raise _UpstreamDown(f"{node.role} {node.url}: compressed answer")
            raw = await resp.read()
            if resp.status >= 400:
                raise _Upstream4xx(resp.status, raw, resp.content_type)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        router.upstreams.mark_down(node, time.monotonic())
        raise _UpstreamDown(f"{node.role} {node.url}: {type(e).__name__}") from e
    if node.down_until:
        router.upstreams.mark_up(node)  # it answered: it is back
    try:
        out = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise _UpstreamDown(f"{node.role} {node.url}: answer is not JSON") from None
    if not isinstance(out, dict):
        raise _UpstreamDown(f"{node.role} {node.url}: answer is not a JSON object")
    return out


async def _prefill(
    router: RouterRuntime, request: web.Request, turn: _Turn, handle: dict[str, Any] | None
) -> dict[str, Any]:
    """P's answer; retries once without the handle if P fails with it, once on another P if down."""
    pool = router.upstreams.prefill
    path = request.path
    headers = _headers(router, request)
    tried: list[Node] = []
    attempts = 0
    while True:
        node = pool.pick(time.monotonic(), exclude=tried)
        t0 = time.perf_counter()
        try:
            with pool.using(node):
                out = await _post_json(router, node, path, _prefill_body(turn, handle), headers)
            router.metrics.prefill_seconds.observe(time.perf_counter() - t0)
            return out
        except (_Upstream4xx, _UpstreamDown) as e:
            attempts += 1
            router.metrics.upstream_errors["prefill"].inc()
            if handle is not None:
                router.metrics.handle_retries.inc()
                log.warning("prefill failed with a handle (%s); retrying without it", _describe(e))
                handle = None
                turn.status = ReuseStatus.ERROR
                continue
            if isinstance(e, _UpstreamDown) and attempts < 2 and len(pool.nodes) > len(tried) + 1:
                tried.append(node)
                continue
            raise


def _describe(e: Exception) -> str:
    return f"HTTP {e.status}" if isinstance(e, _Upstream4xx) else str(e)


def _kvlease_headers(router: RouterRuntime, turn: _Turn) -> dict[str, str]:
    return {
        HEADER_STATUS: turn.status.value,
        HEADER_REUSED_TOKENS: str(turn.reused),
        HEADER_TTL: f"{router.ttl:g}",
    }


def _stream_headers(router: RouterRuntime, turn: _Turn) -> dict[str, str]:
    return {
        "Content-Type": "text/event-stream",
        "Cache-Control": "no-cache",
        HEADER_STATUS: turn.status.value,
        HEADER_REUSED_TOKENS: str(turn.reused),
        HEADER_TTL: f"{router.ttl:g}",
    }


async def _run(
    request: web.Request, router: RouterRuntime, turn: _Turn, handle: dict[str, Any] | None, stream: bool
) -> web.StreamResponse:
    try:
        p_out = await _prefill(router, request, turn, handle)
    except _Upstream4xx as e:
        return _passthrough(router, turn, e)
    except _UpstreamDown as e:
        return error_response(502, f"no prefill node answered: {e}", ERROR_UPSTREAM)
    except orjson.JSONEncodeError as e:  # parsed, but nested deeper than orjson writes (254 levels)
        return _bad(f"request body cannot be forwarded: {e}", router)
    if handle is not None and turn.status is ReuseStatus.HIT:  # P answered with the handle
        turn.status, turn.reused = judge_prefill(p_out, turn.state.tokens if turn.state else 0)
        if turn.reused:
            router.metrics.reused_tokens.inc(turn.reused)
    if turn.status is not ReuseStatus.HIT and turn.state is not None and turn.state.params is not None:
        _release_unused(router, turn.state)
    p_params = p_out.get(KV_TRANSFER_PARAMS)
    d_body = dict(turn.body)
    d_body[KV_TRANSFER_PARAMS] = p_params if isinstance(p_params, dict) else None
    return await _decode(request, router, turn, orjson.dumps(d_body), stream)


def _release_unused(router: RouterRuntime, state: ConversationRecord) -> None:
    """D keeps blocks that P did not read until the TTL: give them back now (kvlease only)."""
    if router.settings.kvlease_mode and state.control and state.lease_id:
        router.spawn(router.release_on_decode(state.control, [state.lease_id]))


def _passthrough(router: RouterRuntime, turn: _Turn, e: _Upstream4xx) -> web.Response:
    body, content_type = e.body, e.content_type or JSON_CT
    if NEEDLE in body:
        try:
            obj = orjson.loads(body)
            strip_params(obj)
            body = orjson.dumps(obj)
        except orjson.JSONDecodeError:
            pass
        if NEEDLE in body:  # not JSON, or the handle quoted inside a message (validation errors)
            body, content_type = _UPSTREAM_ERROR, JSON_CT
    resp = web.Response(status=e.status, body=body, content_type=content_type)
    resp.headers.update(_kvlease_headers(router, turn))
    return resp


async def _decode(
    request: web.Request, router: RouterRuntime, turn: _Turn, d_body: bytes, stream: bool
) -> web.StreamResponse:
    pool = router.upstreams.decode
    timeout = router.decode_timeout
    headers = _headers(router, request)
    prefer = turn.state.decode if turn.state else None
    tried: list[Node] = []
    while True:
        node = pool.pick(time.monotonic(), prefer=prefer, exclude=tried)
        t0 = time.perf_counter()
        with pool.using(node):
            try:
                upstream = await _send(router, node.url + request.path, d_body, headers, timeout)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                router.upstreams.mark_down(node, time.monotonic())
                router.metrics.upstream_errors["decode"].inc()
                tried.append(node)
                if len(tried) < min(2, len(pool.nodes)):
                    continue
                await _forget_handle(router, turn, node)
                return error_response(502, f"no decode node answered: {type(e).__name__}", ERROR_UPSTREAM)
            router.metrics.decode_first_byte_seconds.observe(time.perf_counter() - t0)
            if node.down_until:
                router.upstreams.mark_up(node)
            try:
                if _encoded(upstream):  # asked for identity; compressed bytes cannot be scanned
                    upstream.close()
                    router.metrics.upstream_errors["decode"].inc()
                    await _forget_handle(router, turn, node)
                    return error_response(502, "decode node answered with a compressed body", ERROR_UPSTREAM)
                if upstream.status >= 400:
                    raw = await upstream.read()
                    router.metrics.upstream_errors["decode"].inc()
                    await _forget_handle(router, turn, node)
                    return _passthrough(
                        router, turn, _Upstream4xx(upstream.status, raw, upstream.content_type)
                    )
                if stream and upstream.content_type == "text/event-stream":
                    return await _relay_stream(request, router, turn, node, upstream, t0)
                return await _relay_json(router, turn, node, upstream, t0)
            finally:
                upstream.release()


async def _forget_handle(router: RouterRuntime, turn: _Turn, node: Node) -> None:
    if turn.key is not None and turn.state is not None and turn.state.params is not None:
        await router.store_put(turn.key, turn.state.without_handle())


async def _store_capture(
    router: RouterRuntime, turn: _Turn, node: Node, params: object, returned: object, streamed: bool
) -> None:
    """Remember D's new handle (or that there is none) for the conversation's next turn."""
    if turn.key is None:
        return
    kvlease = router.settings.kvlease_mode
    cap = (
        None
        if (streamed and not kvlease)
        else capture_handle(params, kvlease_mode=kvlease, node_control=node.control)
    )
    continuity = None
    if cap is not None and not kvlease:
        c = (
            chat_continuity(turn.body.get("messages"), returned)
            if turn.chat
            else completion_continuity(turn.body.get("prompt"), returned)
        )
        continuity = c
    state = ConversationRecord(
        decode=node.url,
        params=cap.params if cap else None,
        lease_id=cap.lease_id if cap else None,
        control=cap.control if cap else None,
        tokens=cap.tokens if cap else 0,
        expires_at=time.time() + router.ttl,
        continuity=continuity.digest if continuity else None,
        prefix_len=continuity.prefix_len if continuity else 0,
        turns=(turn.state.turns + 1) if turn.state else 1,
    )
    await router.store_put(turn.key, state)


def _finish(router: RouterRuntime, turn: _Turn, node: Node, t0: float) -> None:
    router.metrics.decode_seconds.observe(time.perf_counter() - t0)
    router.metrics.turns[turn.status].inc()
    if turn.key is not None:
        warning = router.monitor.observe(time.monotonic(), turn.status)
        if warning:
            log.warning(warning)
    if log.isEnabledFor(10):
        log.debug(
            "turn status=%s reused=%d decode=%s",
            turn.status.value,
            turn.reused,
            node.url,
            extra={"conv": log_ref(turn.key) if turn.key else None},
        )


async def _relay_json(
    router: RouterRuntime, turn: _Turn, node: Node, upstream: aiohttp.ClientResponse, t0: float
) -> web.Response:
    raw = await upstream.read()
    params = None
    returned: object = None
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        obj = None
    if isinstance(obj, dict):
        params = strip_params(obj) if NEEDLE in raw else None
        choices = obj.get("choices")
        first = (
            choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], Mapping) else {}
        )
        returned = first.get("message") if turn.chat else first.get("text")
        if params is not None:
            raw = orjson.dumps(obj)
    elif NEEDLE in raw:
        raw = _MALFORMED_UPSTREAM
    await _store_capture(router, turn, node, params, returned, streamed=False)
    _finish(router, turn, node, t0)
    resp = web.Response(status=upstream.status, body=raw, content_type=upstream.content_type or JSON_CT)
    resp.headers.update(_kvlease_headers(router, turn))
    return resp


def _rewrite_events(block: bytes) -> tuple[bytes, Any]:
    """Strip ``kv_transfer_params`` from complete SSE events; return (bytes, captured params).

    Only the lines that carry it are parsed and re-serialised; the rest is copied as is. The result
    is exactly ``b"\\n".join`` of the lines with those rewritten, or dropped when they are not a
    parsable ``data:`` payload (dropped rather than leaked)."""
    found: Any = None
    out: list[bytes] = []
    start = 0  # where the part of ``block`` not yet copied to ``out`` begins
    at = block.find(NEEDLE)
    while at >= 0:
        nl = block.rfind(b"\n", start, at)
        line_start = start if nl < 0 else nl + 1
        line_end = block.find(b"\n", at)
        last = line_end < 0
        if last:
            line_end = len(block)
        out.append(block[start:line_start])
        line = block[line_start:line_end]
        start = line_end + 1  # the line's own newline is re-added below if it is kept
        rewritten = None
        if line.startswith(b"data:"):
            try:
                obj = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                pass
            else:
                got = strip_params(obj)
                if got is not None:
                    found = got
                rewritten = b"data: " + orjson.dumps(obj)
        if rewritten is not None:
            out.append(rewritten if last else rewritten + b"\n")
        elif last:  # a dropped last line takes the newline before it with it
            while out and not out[-1]:
                out.pop()
            if out and out[-1].endswith(b"\n"):
                out[-1] = out[-1][:-1]
        if last:
            break
        at = block.find(NEEDLE, start)
    out.append(block[start:])
    return b"".join(out), found


class _EventStream(web.StreamResponse):
    """A streamed response whose status line and headers go out with its first body bytes (one
    write, one wake-up of the client) instead of on ``prepare`` (aiohttp's ``web.Response`` does
    the same)."""

    _send_headers_immediately = False


async def _relay_stream(
    request: web.Request,
    router: RouterRuntime,
    turn: _Turn,
    node: Node,
    upstream: aiohttp.ClientResponse,
    t0: float,
) -> web.StreamResponse:
    resp = _EventStream(status=200, headers=_stream_headers(router, turn))
    await resp.prepare(request)
    params: Any = None
    pending = b""
    #: The events that came with ``[DONE]``: with a local store they leave with it, in the final
    #: write after the capture (they arrived together, so nothing is delayed but by the store put).
    held = b""
    hold = router.store_is_local
    done_seen = False
    try:
        async for chunk in upstream.content.iter_any():
            data = pending + chunk if pending else chunk
            cut = data.rfind(b"\n\n") + 2
            if cut < 2:
                pending = data
                continue
            if cut == len(data):
                complete, pending = data, b""
            else:
                complete, pending = data[:cut], data[cut:]
            if NEEDLE in complete:
                complete, got = _rewrite_events(complete)
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
                await resp.write(complete)
        if pending:
            if NEEDLE in pending:
                pending, got = _rewrite_events(pending)
                params = got if got is not None else params
            held += pending
        if held and not hold:
            await resp.write(held)
            held = b""
    except ConnectionResetError:
        upstream.close()  # client went away: drop the upstream connection, do not pool it
        await _forget_handle(router, turn, node)  # the old handle was spent; D aborted the new one
        _finish(router, turn, node, t0)
        return resp
    except asyncio.CancelledError:
        upstream.close()
        _finish(router, turn, node, t0)
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        upstream.close()
        router.metrics.upstream_errors["decode"].inc()
        log.warning("decode stream from %s broke: %s", node.url, type(e).__name__)
        await _forget_handle(router, turn, node)
        _finish(router, turn, node, t0)
        try:
            await resp.write_eof(held)
        except ConnectionResetError:
            pass
        return resp
    # the state is stored before the client sees [DONE], so its next turn finds the new handle
    await _store_capture(router, turn, node, params, None, streamed=True)
    try:
        await resp.write_eof(held + _DONE if done_seen else held)  # one write: events, [DONE], end
    except ConnectionResetError:
        pass
    finally:
        _finish(router, turn, node, t0)
    return resp
