"""One turn, the IO: read and check the request → plan (``_turn.plan``) → P → D → relay → record.

Every decision is in the sans-IO core (``_turn``: the offer, the retry rule, the stored record);
every retry goes through the one tenacity policy (``_retry``); the relays are in ``_relay``.
"""

from __future__ import annotations

import asyncio
import time
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
    HEADER_VERIFIED,
    KV_TRANSFER_PARAMS,
    REUSE_OFF,
    VERIFIED_NONE,
    VERIFIED_TOKENS,
    ReuseStatus,
    prefill_request_params,
)
from kvlease_router._body import read_body, reject
from kvlease_router._clients import peer_address
from kvlease_router._identity import (
    Identity,
    IdentityError,
    conversation_id_from,
    log_ref,
    tenant_from,
)
from kvlease_router._relay import UpstreamTooLarge, passthrough, read_capped, relay_json, relay_stream
from kvlease_router._retry import AttemptFailed, run_attempts
from kvlease_router._reuse import judge_prefill
from kvlease_router._runtime import JSON_CT, RouterRuntime, error_response, log
from kvlease_router._turn import (
    Attempt,
    Failure,
    Step,
    TurnFacts,
    TurnOutcome,
    TurnPlan,
    first_attempt,
    plan,
    record,
    releases_unused,
    upstream_params,
    with_tenant,
)
from kvlease_router._upstreams import Node

__all__ = ["handle_turn"]

_FORWARD_HEADERS = (HEADER_AUTHORIZATION,)
#: Failures where the node did not take the request (refused, or a pooled keep-alive connection it
#: had closed): worth one more try on the same node before calling it down. A duplicate is
#: harmless: P and D compute the same answer again, and a repeated pull of freed blocks recomputes.
_NOT_TAKEN = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError)


class _Upstream4xx(Exception):
    def __init__(self, status: int, body: bytes, content_type: str | None) -> None:
        super().__init__(f"HTTP {status}")
        self.status, self.body, self.content_type = status, body, content_type


class _UpstreamDown(Exception):
    pass


class _Turn:
    """The IO side of one turn: its plan, the status as it changes, and the relays' callbacks."""

    __slots__ = ("body", "plan", "reused", "router", "status")

    def __init__(self, router: RouterRuntime, p: TurnPlan, body: dict[str, Any]) -> None:
        self.router, self.plan, self.body = router, p, body
        self.status, self.reused = p.status, 0

    @property
    def chat(self) -> bool:
        return self.plan.chat

    def response_headers(self, router: RouterRuntime) -> dict[str, str]:
        fixed = router.fixed_headers
        if fixed is None or fixed[0] is not router.plan:  # once per cluster plan
            fixed = router.fixed_headers = (
                router.plan,
                {
                    HEADER_TTL: f"{router.ttl:g}",
                    HEADER_VERIFIED: VERIFIED_TOKENS if router.settings.kvlease_mode else VERIFIED_NONE,
                },
            )
        return {HEADER_STATUS: self.status.value, HEADER_REUSED_TOKENS: str(self.reused), **fixed[1]}

    async def capture(self, node: Node, params: object, returned: object, streamed: bool) -> None:
        """Remember D's new handle (or that there is none) for the conversation's next turn."""
        state = record(
            self.plan, TurnOutcome(node.url, node.control, params, returned, streamed, time.time())
        )
        if state is not None and self.plan.key is not None:
            await self.router.store_put(self.plan.key, state)

    async def forget(self) -> None:
        """The stored handle was spent (or D failed): keep the conversation, drop its handle."""
        p = self.plan
        if p.key is not None and p.state is not None and p.state.params is not None:
            await self.router.store_put(p.key, p.state.without_handle())

    def finish(self, node: Node, t0: float) -> None:
        router = self.router
        router.metrics.decode_seconds.observe(time.perf_counter() - t0)
        router.metrics.turns[self.status].inc()
        if self.plan.key is not None:
            warning = router.monitor.observe(time.monotonic(), self.status)
            if warning:
                log.warning(warning)
        if log.isEnabledFor(10):
            log.debug(
                "turn status=%s reused=%d decode=%s",
                self.status.value,
                self.reused,
                node.url,
                extra={"conv": log_ref(self.plan.key) if self.plan.key else None},
            )


def _shape_error(body: dict[str, Any], chat: bool) -> str | None:
    """The OpenAI fields the router reads itself, checked before any upstream call."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        return "'stream' must be a boolean"
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        return "'model' must be a string"
    if chat and not isinstance(body.get("messages"), list):
        return "'messages' must be a list"
    return None


async def _read_json(request: web.Request, router: RouterRuntime) -> dict[str, Any] | web.Response:
    raw = await read_body(request, router)
    if isinstance(raw, web.Response):
        return raw
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return reject(router, "json", f"request body is not valid JSON: {e}")
    if not isinstance(body, dict):
        return reject(router, "json", "request body must be a JSON object")
    return body


async def handle_turn(request: web.Request, router: RouterRuntime, chat: bool) -> web.StreamResponse:
    body = await _read_json(request, router)
    if isinstance(body, web.Response):
        return body
    problem = _shape_error(body, chat)
    if problem is not None:
        return reject(router, "shape", problem)
    stream: bool = body.get("stream", False)
    try:
        ident = conversation_id_from(request.headers, body)
    except IdentityError as e:
        return reject(router, "identity", str(e))
    body.pop(BODY_CONVERSATION_ID, None)
    body.pop(KV_TRANSFER_PARAMS, None)  # never trust a client's handle
    xargs = body.get("vllm_xargs")  # vLLM reads kv_transfer_params from extra_args too
    if isinstance(xargs, dict):
        xargs.pop(KV_TRANSFER_PARAMS, None)

    s = router.settings
    # the tenant (a hash of the bearer token) only when something needs it: the cache salt, the
    # state key, (kvlease mode) the tag D's lease and P's claim are counted under, or its share
    salted, kvlease, by_tenant = s.tenant_cache_salt, s.kvlease_mode, router.tenant_share.limit
    tenant = (
        tenant_from(request.headers, s.tenant_header)
        if salted or kvlease or by_tenant or ident is not None
        else ""
    )
    if salted:
        client_salt = body.get(CACHE_SALT)
        if client_salt is not None and not isinstance(client_salt, str):
            return reject(router, "shape", "'cache_salt' must be a string")
        body[CACHE_SALT] = router.keyer.cache_salt(tenant, client_salt or "")

    # the client's fair share of the upstream pool: past it the turn waits for one of its own
    ip = peer_address(request)
    await router.ip_share.acquire(ip)
    try:
        await router.tenant_share.acquire(tenant)
        try:
            transport = request.transport
            if transport is None or transport.is_closing():  # it left while its turn waited
                return reject(router, "disconnect", "client left before its turn started")
            return await _admitted(request, router, chat, body, stream, ident, tenant)
        finally:
            router.tenant_share.release(tenant)
    finally:
        router.ip_share.release(ip)


async def _admitted(
    request: web.Request,
    router: RouterRuntime,
    chat: bool,
    body: dict[str, Any],
    stream: bool,
    ident: Identity | None,
    tenant: str,
) -> web.StreamResponse:
    """The turn within its client's share: its state, its plan, and P and D."""
    s = router.settings
    key = router.keyer.key(tenant, ident.conversation_id) if ident is not None else None
    state, store_ok, healthy = None, True, False
    if key is not None:
        state, store_ok = await router.store_get(key)
        decode_node = router.upstreams.decode.by_url(state.decode if state else None)
        healthy = decode_node is not None and decode_node.healthy(time.monotonic())
    facts = TurnFacts(
        chat=chat,
        key=key,
        prompt=body.get("messages") if chat else body.get("prompt"),
        opted_out=(request.headers.get(HEADER_REUSE) or "").strip().lower() == REUSE_OFF,
        store_ok=store_ok,
        reuse_enabled=router.reuse_enabled,
        decode_healthy=healthy,
        ttl=router.ttl if key else 0.0,
        tenant_tag=router.keyer.tenant_tag(tenant) if s.kvlease_mode else None,
    )
    turn = _Turn(router, plan(facts, state, time.time(), s), body)
    router.metrics.in_flight.inc()
    try:
        return await _run(request, router, turn, stream)
    finally:
        router.metrics.in_flight.dec()


def _headers(router: RouterRuntime, request: web.Request) -> dict[str, str]:
    out = {"Content-Type": JSON_CT, "X-Request-Id": router.request_id()}
    for name in _FORWARD_HEADERS:
        v = request.headers.get(name)
        if v is not None:
            out[name] = v
    return out


def _prefill_body(body: dict[str, Any], handle: dict[str, Any] | None, tenant_tag: str | None) -> bytes:
    p = dict(body)
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p["stream"] = False
    for k in ("stream_options", "min_tokens"):
        p.pop(k, None)
    p[KV_TRANSFER_PARAMS] = with_tenant(
        handle if handle is not None else prefill_request_params(), tenant_tag
    )
    return orjson.dumps(p)


def _encoded(resp: aiohttp.ClientResponse) -> bool:
    """The answer has a content coding (the router asks for ``identity``, and relays bytes as they
    come: it could not find, nor strip, a handle inside compressed ones)."""
    coding = resp.headers.get("Content-Encoding")
    return coding is not None and coding.strip().lower() not in ("", "identity")


def _exclude(nodes: list[Node], tried: tuple[str, ...]) -> list[Node]:
    return [n for n in nodes if n.url in tried] if tried else []


def _on_step(router: RouterRuntime, turn: _Turn, role: str) -> Any:
    def on_step(a: Attempt) -> None:
        if a.step is Step.RESEND:
            log.info("%s %s did not take the request; retrying once", role, a.node)
            router.metrics.upstream_retries.inc()
        elif a.step is Step.DROP_HANDLE:
            router.metrics.handle_retries.inc()
            log.warning("prefill failed with a handle; retrying without it")
            turn.status = ReuseStatus.ERROR

    return on_step


async def _prefill(router: RouterRuntime, request: web.Request, turn: _Turn) -> dict[str, Any]:
    """P's answer, through the retry rule (``_turn.next_attempt``) and the one policy."""
    pool = router.upstreams.prefill
    url_path, headers, handle = request.path, _headers(router, request), turn.plan.handle
    cap = router.settings.max_upstream_bytes

    async def attempt(a: Attempt) -> dict[str, Any]:
        now = time.monotonic()
        node = (pool.by_url(a.node) if a.step is Step.RESEND else None) or pool.pick(
            now, exclude=_exclude(pool.nodes, a.tried)
        )
        data = _prefill_body(turn.body, handle if a.handle else None, turn.plan.tenant_tag)
        t0 = time.perf_counter()
        try:
            with pool.using(node):
                out = await _post_json(router, node, url_path, data, headers, cap)
        except aiohttp.ClientError as e:
            if isinstance(e, _NOT_TAKEN) and not a.resent:
                raise AttemptFailed(Failure.NOT_TAKEN, e, node.url) from e
            router.upstreams.mark_down(node, time.monotonic())
            router.metrics.upstream_errors["prefill"].inc()
            down = _UpstreamDown(f"{node.role} {node.url}: {type(e).__name__}")
            raise AttemptFailed(Failure.DOWN, down, node.url) from e
        except asyncio.TimeoutError as e:
            router.upstreams.mark_down(node, time.monotonic())
            router.metrics.upstream_errors["prefill"].inc()
            down = _UpstreamDown(f"{node.role} {node.url}: TimeoutError")
            raise AttemptFailed(Failure.DOWN, down, node.url) from e
        except _UpstreamDown as e:
            router.metrics.upstream_errors["prefill"].inc()
            raise AttemptFailed(Failure.DOWN, e, node.url) from e
        except _Upstream4xx as e:
            router.metrics.upstream_errors["prefill"].inc()
            raise AttemptFailed(Failure.REFUSED, e, node.url) from e
        router.metrics.prefill_seconds.observe(time.perf_counter() - t0)
        return out

    first = first_attempt(True, len(pool.nodes), handle is not None)
    return await run_attempts(router.retry_policy, first, attempt, _on_step(router, turn, "prefill"))


async def _post_json(
    router: RouterRuntime, node: Node, path: str, data: bytes, headers: dict[str, str], cap: int
) -> dict[str, Any]:
    async with router.http().post(
        node.url + path, data=data, headers=headers, timeout=router.prefill_timeout
    ) as resp:
        if _encoded(resp):  # asked for identity; compressed bytes cannot be scanned
            raise _UpstreamDown(f"{node.role} {node.url}: compressed answer")
        try:
            raw = await read_capped(resp, cap)
        except UpstreamTooLarge as e:
            raise _UpstreamDown(f"{node.role} {node.url}: {e}") from None
        if resp.status >= 400:
            raise _Upstream4xx(resp.status, raw, resp.content_type)
    if node.down_until:
        router.upstreams.mark_up(node)  # it answered: it is back
    try:
        out = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise _UpstreamDown(f"{node.role} {node.url}: answer is not JSON") from None
    if not isinstance(out, dict):
        raise _UpstreamDown(f"{node.role} {node.url}: answer is not a JSON object")
    return out


async def _run(request: web.Request, router: RouterRuntime, turn: _Turn, stream: bool) -> web.StreamResponse:
    p = turn.plan
    try:
        p_out = await _prefill(router, request, turn)
    except _Upstream4xx as e:
        return passthrough(router, turn, e.status, e.body, e.content_type)
    except _UpstreamDown as e:
        return error_response(502, f"no prefill node answered: {e}", ERROR_UPSTREAM)
    except orjson.JSONEncodeError as e:  # parsed, but nested deeper than orjson writes (254 levels)
        return reject(router, "shape", f"request body cannot be forwarded: {e}")
    if p.handle is not None and turn.status is ReuseStatus.HIT:  # P answered with the handle
        turn.status, turn.reused = judge_prefill(p_out, p.state.tokens if p.state else 0)
        if turn.reused:
            router.metrics.reused_tokens.inc(turn.reused)
    if releases_unused(p, turn.status):
        assert p.state is not None and p.state.control and p.state.lease_id
        router.spawn(router.release_on_decode(p.state.control, [p.state.lease_id], decode=p.state.decode))
    d_body = dict(turn.body)
    d_body[KV_TRANSFER_PARAMS] = upstream_params(p_out.get(KV_TRANSFER_PARAMS), p.tenant_tag)
    return await _decode(request, router, turn, orjson.dumps(d_body), stream)


async def _decode(
    request: web.Request, router: RouterRuntime, turn: _Turn, d_body: bytes, stream: bool
) -> web.StreamResponse:
    pool = router.upstreams.decode
    timeout, headers, prefer = router.decode_timeout, _headers(router, request), turn.plan.prefer_decode

    async def attempt(a: Attempt) -> tuple[Node, Any, aiohttp.ClientResponse, float]:
        now = time.monotonic()
        node = (pool.by_url(a.node) if a.step is Step.RESEND else None) or pool.pick(
            now, prefer=prefer, exclude=_exclude(pool.nodes, a.tried)
        )
        using = pool.using(node)
        using.__enter__()
        t0 = time.perf_counter()
        try:
            upstream = await router.http().post(
                node.url + request.path, data=d_body, headers=headers, timeout=timeout
            )
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            using.__exit__(None, None, None)
            if isinstance(e, _NOT_TAKEN) and not a.resent:
                raise AttemptFailed(Failure.NOT_TAKEN, e, node.url) from e
            router.upstreams.mark_down(node, time.monotonic())
            router.metrics.upstream_errors["decode"].inc()
            raise AttemptFailed(Failure.DOWN, e, node.url) from e
        return node, using, upstream, t0

    first = first_attempt(False, len(pool.nodes), False)
    try:
        node, using, upstream, t0 = await run_attempts(
            router.retry_policy, first, attempt, _on_step(router, turn, "decode")
        )
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        await turn.forget()
        return error_response(502, f"no decode node answered: {type(e).__name__}", ERROR_UPSTREAM)
    try:
        router.metrics.decode_first_byte_seconds.observe(time.perf_counter() - t0)
        if node.down_until:
            router.upstreams.mark_up(node)
        if _encoded(upstream):  # asked for identity; compressed bytes cannot be scanned
            upstream.close()
            router.metrics.upstream_errors["decode"].inc()
            await turn.forget()
            return error_response(502, "decode node answered with a compressed body", ERROR_UPSTREAM)
        if upstream.status >= 400:
            router.metrics.upstream_errors["decode"].inc()
            await turn.forget()
            try:
                raw = await read_capped(upstream, router.settings.max_upstream_bytes)
            except (aiohttp.ClientError, asyncio.TimeoutError, UpstreamTooLarge) as e:
                upstream.close()
                return error_response(
                    502, f"decode node error unreadable: {type(e).__name__}", ERROR_UPSTREAM
                )
            return passthrough(router, turn, upstream.status, raw, upstream.content_type)
        if stream and upstream.content_type == "text/event-stream":
            return await relay_stream(request, router, turn, node, upstream, t0)
        return await relay_json(router, turn, node, upstream, t0)
    finally:
        upstream.release()
        using.__exit__(None, None, None)
