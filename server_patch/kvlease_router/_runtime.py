"""The router's shared runtime: settings, store, pools, metrics and the HTTP client session.

One :class:`RouterRuntime` per app, created by ``create_app`` and filled in by its lifespan (no globals).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from tenacity import AsyncRetrying

from kvlease.protocol import (
    CONTROL_AUTH_HEADER,
    ERROR_INVALID_REQUEST,
    AsyncControlClient,
    ControlCallError,
    ErrorBody,
    ProtocolError,
)
from kvlease_router._clients import FairShare
from kvlease_router._identity import Keyer, log_ref
from kvlease_router._metrics import MissRateMonitor, RouterMetrics
from kvlease_router._ratelimit import TenantBuckets
from kvlease_router._retry import upstream_policy
from kvlease_router._settings import RouterSettings
from kvlease_router._store import ConversationRecord, StateStore, StoreError
from kvlease_router._upstreams import Upstreams
from kvlease_router._validate import ClusterPlan

__all__ = ["RequestIds", "RouterRuntime", "error_response", "log"]

log = logging.getLogger("kvlease.router")

JSON_CT = "application/json"


class RequestIds:
    """``X-Request-Id`` values for upstream calls: 128 random bits each (as ``uuid4`` has), taken
    from one ``os.urandom`` call per 256 ids rather than a system call and a UUID object per id."""

    __slots__ = ("_at", "_buf")

    def __init__(self) -> None:
        self._buf = b""
        self._at = 0

    def __call__(self) -> str:
        at = self._at
        if at >= len(self._buf):
            self._buf, at = os.urandom(4096), 0
        self._at = at + 16
        return self._buf[at : at + 16].hex()


def error_response(
    status: int, message: str, code: str = ERROR_INVALID_REQUEST, headers: dict[str, str] | None = None
) -> web.Response:
    """An OpenAI-style error body (:class:`kvlease.protocol.ErrorBody`)."""
    body = ErrorBody(message, code, status).to_json()
    return web.Response(status=status, body=orjson.dumps(body), content_type=JSON_CT, headers=headers)


@dataclass
class RouterRuntime:
    settings: RouterSettings
    store: StateStore
    upstreams: Upstreams
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    plan: ClusterPlan | None = None
    session: aiohttp.ClientSession | None = None
    started_at: float = field(default_factory=time.time)
    #: When the status last refreshed the nodes' /info (monotonic; 0: never).
    infos_refreshed_at: float = 0.0

    def __post_init__(self) -> None:
        self.keyer = Keyer(self.settings.key_secret)
        self.monitor = MissRateMonitor(self.settings.miss_window_s, self.settings.miss_window_min_turns)
        self._background: set[asyncio.Task[Any]] = set()
        self.request_id = RequestIds()
        s = self.settings
        #: The decode nodes' control endpoints, from configuration only. A control URL read from a
        #: stored record or a handle is just a key into this set: the control secret is never sent
        #: anywhere else (a forged record must not be able to collect it).
        self.control_urls = frozenset(n.control for n in s.decode if n.control)
        self._control_of_decode = {n.url: n.control for n in s.decode if n.control}
        self.renew_budget = TenantBuckets(s.renew_ids_per_s, s.renew_burst_ids)
        self.renew_ip_budget = TenantBuckets(s.renew_ip_ids_per_s, s.renew_ip_burst_ids)
        self.renew_global_budget = TenantBuckets(s.renew_global_ids_per_s, s.renew_global_burst_ids, 1)
        #: Each client address's (and tenant's) share of the upstream pool (``_clients``).
        self.ip_share = FairShare(s.turns_per_ip)
        self.tenant_share = FairShare(s.max_turns_per_tenant)
        # built once: an upstream call's timeouts are the same for every turn
        # (prefill: sock_connect bounds opening a connection; waiting for a free pooled one
        # counts against total)
        self.prefill_timeout = aiohttp.ClientTimeout(total=s.prefill_timeout, sock_connect=s.connect_timeout)
        self.decode_timeout = aiohttp.ClientTimeout(
            total=None,
            connect=s.decode_read_timeout,  # a free pooled connection, or a new one...
            sock_connect=s.connect_timeout,  # ...opened within this
            sock_read=s.decode_read_timeout,
        )
        #: The store answers without I/O (in-process): a stream's last events can wait for the
        #: capture and leave with ``[DONE]`` in one write.
        self.store_is_local = bool(getattr(self.store, "local", False))
        #: The upstream retry policy (``create_app`` puts the app's here, and under ``RETRY_POLICY``).
        self.retry_policy: AsyncRetrying = upstream_policy()
        #: (the plan they were computed from, the response headers that depend only on it).
        self.fixed_headers: tuple[ClusterPlan | None, dict[str, str]] | None = None

    # ---- derived configuration ---------------------------------------------------------------
    @property
    def ttl(self) -> float:
        assert self.plan is not None
        return self.plan.ttl

    @property
    def reuse_enabled(self) -> bool:
        return self.plan is not None and self.plan.reuse

    @property
    def keep_for(self) -> float:
        return self.ttl + self.settings.expired_grace

    def http(self) -> aiohttp.ClientSession:
        assert self.session is not None, "the router's lifespan has not started"
        return self.session

    def control_headers(self) -> dict[str, str]:
        return {CONTROL_AUTH_HEADER: f"Bearer {self.settings.control_secret}", "Content-Type": JSON_CT}

    # ---- store access that degrades ----------------------------------------------------------
    async def store_get(self, key: str) -> tuple[ConversationRecord | None, bool]:
        """(state, ok): ``ok`` is False when the store failed (the turn takes the miss path)."""
        try:
            return await self.store.get(key), True
        except StoreError as e:
            self.metrics.store_errors.inc()
            log.warning("state store get failed: %s", e, extra={"conv": log_ref(key)})
            return None, False

    async def store_put(self, key: str, state: ConversationRecord, keep_for: float | None = None) -> bool:
        try:
            await self.store.put(key, state, self.keep_for if keep_for is None else keep_for)
            return True
        except StoreError as e:
            self.metrics.store_errors.inc()
            log.warning("state store put failed: %s", e, extra={"conv": log_ref(key)})
            return False

    # ---- background work ---------------------------------------------------------------------
    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain_background(self, timeout: float = 2.0) -> None:
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout)

    def configured_control(self, url: str | None, decode: str | None = None) -> str | None:
        """``url`` if it is one of the configured decode control endpoints; else the configured
        control endpoint of the decode node ``decode`` (the D that served the turn: a D may advertise
        its endpoint under another name); else ``None`` (send nothing)."""
        if isinstance(url, str):
            url = url.rstrip("/")
            if url in self.control_urls:
                return url
        return self._control_of_decode.get(decode) if isinstance(decode, str) else None

    def control(self, url: str) -> AsyncControlClient:
        """The control API's client for one configured D endpoint, on the router's session and secret;
        ``ValueError`` for any other URL."""
        s = self.settings
        configured = self.configured_control(url)
        if configured is None:
            raise ValueError("not a configured decode control endpoint")
        return AsyncControlClient(self.http(), configured, secret=s.control_secret, timeout=s.control_timeout)

    async def release_on_decode(
        self, control: str | None, lease_ids: list[str], decode: str | None = None
    ) -> bool:
        """``POST /release`` on one D's control endpoint; False if it failed (logged, counted) or
        no configured endpoint matches (see :meth:`configured_control`; nothing is sent then)."""
        resolved = self.configured_control(control, decode)
        if resolved is None:
            log.warning("not releasing on an unconfigured control endpoint (stored state is untrusted)")
            return False
        control = resolved
        try:
            await self.control(control).release(lease_ids)
            self.metrics.releases.inc(len(lease_ids))
            return True
        except (aiohttp.ClientError, asyncio.TimeoutError, ControlCallError, ProtocolError) as e:
            self.metrics.upstream_errors["control"].inc()
            log.warning("release on %s failed: %s", control, type(e).__name__)
            return False
