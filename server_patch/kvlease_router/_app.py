"""The router's aiohttp application: ``create_app(settings, store, upstreams)``.

Resources (the upstream HTTP session, start-up validation, the health task) live in the app's
lifespan (``cleanup_ctx``); there are no module-level globals, so tests run several routers in one
process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from tenacity import AsyncRetrying

from kvlease import __version__
from kvlease.protocol import (
    CHAT_COMPLETIONS_PATH,
    COMPLETIONS_PATH,
    CONTROL_INFO_PATH,
    CONVERSATIONS_PATH,
    ERROR_UPSTREAM,
    HEADER_AUTHORIZATION,
    HEALTH_PATH,
    METRICS_PATH,
    MODE_KVLEASE,
    MODE_STOCK_VLLM,
    PROTOCOL_VERSION,
    RENEW_PATH,
    STATUS_PATH,
    ControlInfo,
    ProtocolError,
    RouterHealth,
    RouterStatus,
)
from kvlease_router._flow import handle_turn
from kvlease_router._guard import GUARD_KEY, ConnectionGuard
from kvlease_router._lease_api import handle_release, handle_renew
from kvlease_router._logs import install_server_log_filter
from kvlease_router._retry import RETRY_POLICY
from kvlease_router._runtime import JSON_CT, RouterRuntime, error_response, log
from kvlease_router._settings import ConfigError, RouterSettings
from kvlease_router._store import StateStore
from kvlease_router._upstreams import Node, Upstreams
from kvlease_router._validate import ClusterPlan, NodeFacts, plan_cluster

__all__ = ["ROUTER_KEY", "create_app"]

ROUTER_KEY: web.AppKey[RouterRuntime] = web.AppKey("kvlease_router", RouterRuntime)


async def _get_json(session: aiohttp.ClientSession, url: str, headers: dict[str, str], timeout: float) -> Any:
    async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        raw = await resp.read()
        if resp.status >= 400:
            raise ConfigError(f"{url} answered HTTP {resp.status}: {raw[:200]!r}")
        return orjson.loads(raw)


async def _node_facts(router: RouterRuntime, node: Node) -> NodeFacts:
    session, s = router.http(), router.settings
    if node.control is not None:
        data = await _get_json(
            session, node.control + CONTROL_INFO_PATH, router.control_headers(), s.control_timeout
        )
        try:
            info = ControlInfo.from_json(data)
        except ProtocolError as e:
            raise ConfigError(f"{node.control}{CONTROL_INFO_PATH}: {e}") from e
        node.info, node.model, node.version = info, info.model, info.vllm_version
        return NodeFacts(node.url, info.model, info.vllm_version or None, info)
    models = await _get_json(session, node.url + "/v1/models", {}, s.control_timeout)
    data = models.get("data") if isinstance(models, dict) else None
    model = data[0].get("id") if isinstance(data, list) and data and isinstance(data[0], dict) else None
    version = None
    try:
        v = await _get_json(session, node.url + "/version", {}, s.control_timeout)
        version = v.get("version") if isinstance(v, dict) else None
    except (ConfigError, aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError):
        pass
    node.model, node.version = model, version
    return NodeFacts(
        node.url, model if isinstance(model, str) else None, version if isinstance(version, str) else None
    )


async def _validate(router: RouterRuntime) -> ClusterPlan:
    s = router.settings
    if not s.validate:
        ttl = s.resolved_ttl(s.node_ttl)
        return ClusterPlan(ttl, s.node_ttl, True, None, None, None, ("start-up validation skipped",))
    deadline = time.monotonic() + s.startup_timeout
    while True:
        try:
            pf = await asyncio.gather(*(_node_facts(router, n) for n in router.upstreams.prefill.nodes))
            df = await asyncio.gather(*(_node_facts(router, n) for n in router.upstreams.decode.nodes))
            break
        except (aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError, ConfigError) as e:
            if time.monotonic() >= deadline:
                raise ConfigError(f"nodes did not answer within {s.startup_timeout:g} s: {e}") from e
            await asyncio.sleep(0.5)
    return plan_cluster(s, pf, df)


async def _health_loop(router: RouterRuntime) -> None:
    s = router.settings
    timeout = aiohttp.ClientTimeout(total=max(1.0, min(2.0, s.health_interval)))
    while True:
        await asyncio.sleep(s.health_interval)
        for node in router.upstreams.all():
            try:
                async with router.http().get(node.url + HEALTH_PATH, timeout=timeout) as resp:
                    await resp.read()
                    ok = resp.status < 500
            except asyncio.TimeoutError:
                continue  # slow is not down: a busy node keeps its conversations
            except aiohttp.ClientError:
                ok = False
            if ok:
                node.probe_failures = 0
                router.upstreams.mark_up(node)
                continue
            node.probe_failures += 1  # two in a row: one slow probe on a busy node is not an outage
            if node.probe_failures >= 2 and node.healthy(time.monotonic()):
                router.upstreams.mark_down(node, time.monotonic())
                log.warning("%s node %s failed its health probes", node.role, node.url)


def _lifespan(router: RouterRuntime) -> Callable[[web.Application], AsyncIterator[None]]:
    async def lifespan(app: web.Application) -> AsyncIterator[None]:
        s = router.settings
        connector = aiohttp.TCPConnector(
            limit=0,
            limit_per_host=s.upstream_connections,
            keepalive_timeout=s.keepalive_timeout,
            ttl_dns_cache=300,
        )
        # The router relays upstream bytes as they come (auto_decompress off) and scans them for
        # handles to strip: it must ask for them uncompressed (aiohttp would offer gzip/deflate).
        # No cookie jar: one tenant's upstream cookies must not ride on another's requests (and
        # no per-request cookie filtering).
        router.session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            headers={"Accept-Encoding": "identity"},
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        health: asyncio.Task[None] | None = None
        try:
            router.plan = await _validate(router)
            for w in router.plan.warnings:
                log.warning(w)
            log.info(
                "router ready: mode=%s ttl=%gs store=%s prefill=%d decode=%d",
                MODE_KVLEASE if router.settings.kvlease_mode else MODE_STOCK_VLLM,
                router.plan.ttl,
                router.store.name,
                len(router.upstreams.prefill.nodes),
                len(router.upstreams.decode.nodes),
            )
            health = asyncio.get_running_loop().create_task(_health_loop(router))
            yield
        finally:
            if health is not None:
                health.cancel()
                try:
                    await health
                except asyncio.CancelledError:
                    pass
            await router.drain_background()
            await router.session.close()

    return lifespan


def _status(router: RouterRuntime) -> RouterStatus:
    s, plan, now = router.settings, router.plan, time.monotonic()
    assert plan is not None
    return RouterStatus(
        kvlease_version=__version__,
        protocol_version=PROTOCOL_VERSION,
        mode=MODE_KVLEASE if s.kvlease_mode else MODE_STOCK_VLLM,
        renewals=s.kvlease_mode,
        reuse=plan.reuse,
        verified_pull=s.kvlease_mode,
        stream_capture=s.kvlease_mode,
        notes=tuple(plan.warnings),
        ttl_s=plan.ttl,
        decode_ttl_s=plan.decode_ttl,
        ttl_margin_s=s.ttl_margin,
        model=plan.model,
        vllm_version=plan.vllm_version,
        block_size=plan.block_size,
        store=router.store.name,
        tenant_header=s.tenant_header,
        uptime_s=round(time.time() - router.started_at, 3),
        prefill=tuple(_describe(n, now) for n in router.upstreams.prefill.nodes),
        decode=tuple(_describe(n, now) for n in router.upstreams.decode.nodes),
    )


def _describe(node: Node, now: float) -> dict[str, object]:
    """A node in the status: its description, the READ transport its ``/info`` reported, and its
    lease placement and tier figures (``kvlease_device_blocks_held``, ``kvlease_host_bytes_used``...)
    as of the last refresh (:func:`_refresh_infos`)."""
    info = node.info
    return {
        **node.describe(now),
        "transport": None if info is None else info.transport,
        "placement": None if info is None else info.placement,
        "tier": {} if info is None else dict(info.tier),
    }


#: The status refreshes the nodes' ``/info`` at most this often (it is an operator's endpoint).
INFO_REFRESH_S = 1.0


async def _refresh_infos(router: RouterRuntime) -> None:
    """Fetch every node's ``/info`` again (bounded by the control timeout, all at once); a node
    that does not answer keeps the facts it last gave."""
    now = time.monotonic()
    if now - router.infos_refreshed_at < INFO_REFRESH_S:
        return
    router.infos_refreshed_at = now
    nodes = list(router.upstreams.all())

    async def one(node: Node, control: str) -> None:
        try:
            data = await _get_json(
                router.http(),
                control + CONTROL_INFO_PATH,
                router.control_headers(),
                router.settings.control_timeout,
            )
            node.info = ControlInfo.from_json(data)
        except (ConfigError, ProtocolError, aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            pass  # orjson.JSONDecodeError is a ValueError

    await asyncio.gather(*(one(n, n.control) for n in nodes if n.control is not None))


def create_app(
    settings: RouterSettings,
    store: StateStore,
    upstreams: Upstreams | None = None,
    *,
    retry_policy: AsyncRetrying | None = None,
) -> web.Application:
    """The router as an aiohttp app; serve it with :func:`kvlease_router._guard.start_site`
    (which adds the slow-client guards), ``web.run_app`` or an ``AppRunner``."""
    if upstreams is None:
        upstreams = Upstreams(settings.prefill, settings.decode, settings.unhealthy_for)
    router = RouterRuntime(settings, store, upstreams)
    install_server_log_filter()  # a client's bad HTTP is one INFO line a second, not a traceback
    # no middleware: aiohttp then calls the handlers directly (the guard learns that a request was
    # answered from the server's request handler, wrapped by ``start_site``)
    app = web.Application(client_max_size=settings.max_body_bytes)
    app[ROUTER_KEY] = router
    app[GUARD_KEY] = ConnectionGuard(settings)
    if retry_policy is not None:
        router.retry_policy = retry_policy
    app[RETRY_POLICY] = router.retry_policy
    app.cleanup_ctx.append(_lifespan(router))

    def bind(
        fn: Callable[..., Awaitable[web.StreamResponse]], *args: Any
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await fn(request, router, *args)

        return handler

    async def chat(request: web.Request) -> web.StreamResponse:
        return await handle_turn(request, router, True)

    async def completions(request: web.Request) -> web.StreamResponse:
        return await handle_turn(request, router, False)

    async def status(request: web.Request) -> web.Response:
        await _refresh_infos(router)
        return web.Response(body=orjson.dumps(_status(router).to_json()), content_type=JSON_CT)

    async def health(request: web.Request) -> web.Response:
        now = time.monotonic()
        body = RouterHealth(
            prefill_healthy=any(n.healthy(now) for n in router.upstreams.prefill.nodes),
            decode_healthy=any(n.healthy(now) for n in router.upstreams.decode.nodes),
        )
        return web.Response(
            status=200 if body.ok else 503, body=orjson.dumps(body.to_json()), content_type=JSON_CT
        )

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=router.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"}
        )

    async def models(request: web.Request) -> web.StreamResponse:
        node = router.upstreams.decode.pick(time.monotonic())
        try:
            async with router.http().get(node.url + "/v1/models", headers=_auth(request)) as resp:
                raw = await resp.read()
                return web.Response(status=resp.status, body=raw, content_type=resp.content_type)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return error_response(502, f"decode node unreachable: {type(e).__name__}", ERROR_UPSTREAM)

    app.add_routes(
        [
            web.post(CHAT_COMPLETIONS_PATH, chat),
            web.post(COMPLETIONS_PATH, completions),
            web.post(RENEW_PATH, bind(handle_renew)),
            web.delete(CONVERSATIONS_PATH + "/{id}", bind(handle_release)),
            web.get(STATUS_PATH, status),
            web.get(HEALTH_PATH, health),
            web.get(METRICS_PATH, metrics),
            web.get("/v1/models", models),
        ]
    )
    return app


def _auth(request: web.Request) -> dict[str, str]:
    v = request.headers.get(HEADER_AUTHORIZATION)
    return {HEADER_AUTHORIZATION: v} if v else {}
