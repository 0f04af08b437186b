"""Router settings: one frozen dataclass, built from CLI flags or a JSON/TOML config file."""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from kvlease._errors import ConfigError

__all__ = ["ConfigError", "NodeSpec", "RouterSettings", "load_config_file"]


@dataclass(frozen=True)
class NodeSpec:
    """One vLLM server: its OpenAI URL and, with the kvlease connector, its control endpoint URL."""

    url: str
    control: str | None = None

    def __post_init__(self) -> None:
        for name, value in (("url", self.url), ("control", self.control)):
            if value is not None and not value.startswith(("http://", "https://")):
                raise ConfigError(f"node {name} must be an http(s) URL, got {value!r}")
        object.__setattr__(self, "url", self.url.rstrip("/"))
        if self.control is not None:
            object.__setattr__(self, "control", self.control.rstrip("/"))


@dataclass(frozen=True)
class RouterSettings:
    """Everything the router needs to know; see ``docs/router.md`` for each field."""

    prefill: tuple[NodeSpec, ...]
    decode: tuple[NodeSpec, ...]
    #: Shared secret of the kvlease control endpoints (``Authorization: Bearer``).
    control_secret: str | None = None
    #: RouterRuntime lease TTL in seconds; ``None``: D's TTL minus the margin.
    ttl: float | None = None
    #: The router's lease always ends at least this many seconds before D's.
    ttl_margin: float = 5.0
    #: D's retention TTL for stock vLLM (``decoder_kv_blocks_ttl``; /v1/models does not report it).
    node_ttl: float = 480.0
    #: How long state outlives its lease, so a late turn reports ``expired`` rather than ``first``.
    expired_grace: float = 600.0
    #: Trust this request header as the tenant (else: hash of the bearer token).
    tenant_header: str | None = None
    #: Give each tenant its own vLLM ``cache_salt`` (derived from the key secret; a client's own salt
    #: is mixed in, never forwarded): no prefix-cache sharing, so no cache-timing signal, across tenants.
    tenant_cache_salt: bool = False
    #: HMAC key for tenant-scoped conversation keys. Must be shared by replicas using one Redis.
    key_secret: str = field(default_factory=lambda: secrets.token_hex(32), repr=False)
    #: ``redis://...`` for the Redis store, ``None`` for the in-memory store.
    state: str | None = None
    memory_max_entries: int = 100_000
    max_body_bytes: int = 16 * 1024 * 1024
    #: Slow and stuck clients (seconds): a request head must arrive within ``header_timeout`` of
    #: its first byte, its body within ``body_timeout``; a keep-alive connection idle for
    #: ``idle_timeout`` is closed; a stream the client stops reading for ``stream_write_timeout``
    #: is closed (and its D connection with it). At most ``max_connections_per_ip`` open
    #: connections per client address (0: no bound).
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    idle_timeout: float = 75.0
    stream_write_timeout: float = 30.0
    max_connections_per_ip: int = 256
    #: Hostile upstreams: D's (or P's) non-streamed answer, and one pending SSE event, are capped.
    max_upstream_bytes: int = 64 * 1024 * 1024
    max_sse_event_bytes: int = 8 * 1024 * 1024
    #: Open connections per upstream node (past it requests wait for a free one: backpressure
    #: instead of a connect storm); idle ones are closed after ``keepalive_timeout`` seconds.
    upstream_connections: int = 256
    keepalive_timeout: float = 15.0
    #: A fair share of those: turns in flight per client address (``None``: a sixteenth of
    #: ``upstream_connections``, 16 at 256) and per tenant (0: no bound, the default: many
    #: deployments give every client one key); past its share a turn waits for one of its own.
    max_turns_per_ip: int | None = None
    max_turns_per_tenant: int = 0
    #: A stream whose client acknowledged none of the bytes waiting for it this long (seconds) is
    #: closed, and its D request aborted (Linux; elsewhere ``stream_write_timeout`` only).
    stream_stall_timeout: float = 5.0
    #: Timeouts (seconds). ``connect_timeout`` bounds opening one TCP connection, not the wait for
    #: a free pooled one (that wait is bounded by the request's own timeout).
    connect_timeout: float = 5.0
    prefill_timeout: float = 600.0
    decode_read_timeout: float = 600.0
    control_timeout: float = 2.0
    store_timeout: float = 0.25
    #: After a store error, skip the store for this long (turns go on as misses meanwhile).
    store_backoff: float = 1.0
    #: Consecutive store timeouts before the back-off (a connection error backs off at once): one
    #: slow call under load is not an outage.
    store_failures_before_backoff: int = 3
    #: Redis connections per router process (a blocking pool: past it a call waits, up to
    #: ``store_timeout``, for a free one).
    store_connections: int = 32
    #: Per-tenant renew budget: a token bucket of conversation ids (each renew request costs its
    #: ids plus a fixed 100); past it the lease API answers 429 with ``Retry-After``.
    renew_ids_per_s: float = 2000.0
    renew_burst_ids: int = 20_000
    #: The same, per client address (the socket peer) and for all tenants together: made-up bearer
    #: tokens (a new tenant each) do not get a fresh burst each. The global default is sized from
    #: legit keepers: one sends at most ``RENEW_MAX_IDS`` (10,000) ids a renew period, about 60 %
    #: of the TTL (~285 s at the default 475 s), ~35 ids/s, so 20,000 ids/s is ~570 full keepers.
    renew_ip_ids_per_s: float = 5000.0
    renew_ip_burst_ids: int = 50_000
    renew_global_ids_per_s: float = 20_000.0
    renew_global_burst_ids: int = 200_000
    #: ``SO_SNDBUF`` of client connections (bytes; 0: the kernel's, which may absorb a whole
    #: answer, so a client that stops reading is never noticed by ``stream_write_timeout``).
    client_send_buffer: int = 256 * 1024
    #: Active health probe period; an unreachable node is avoided for ``unhealthy_for`` seconds.
    health_interval: float = 5.0
    unhealthy_for: float = 5.0
    #: Miss-rate warning: all turns with ids in this window missed (and at least ``min`` turns).
    miss_window_s: float = 300.0
    miss_window_min_turns: int = 20
    #: Validate the nodes (``/info`` or ``/v1/models``) before serving; wait this long for them.
    validate: bool = True
    startup_timeout: float = 60.0
    host: str = "127.0.0.1"
    port: int = 8000

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ConfigError("at least one prefill and one decode node are required")
        controls = {n.control is not None for n in self.prefill + self.decode}
        if len(controls) > 1:
            raise ConfigError(
                "either every node has a kvlease control endpoint or none has "
                "(mixing the kvlease connector and stock vLLM is not supported)"
            )
        if self.kvlease_mode and not self.control_secret:
            raise ConfigError(
                "the kvlease control endpoints need --control-secret (or KVLEASE_CONTROL_SECRET)"
            )
        if self.ttl is not None and self.ttl <= 0:
            raise ConfigError("ttl must be positive")
        if self.ttl_margin < 0:
            raise ConfigError("ttl_margin must not be negative")
        if self.max_body_bytes < 1024:
            raise ConfigError("max_body_bytes must be at least 1024")
        for name in ("header_timeout", "body_timeout", "idle_timeout", "stream_write_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.max_connections_per_ip < 0:
            raise ConfigError("max_connections_per_ip must not be negative (0: no bound)")
        if self.max_upstream_bytes < 1024 or self.max_sse_event_bytes < 1024:
            raise ConfigError("max_upstream_bytes and max_sse_event_bytes must be at least 1024")
        if self.upstream_connections < 1:
            raise ConfigError("upstream_connections must be at least 1")
        if (self.max_turns_per_ip or 0) < 0 or self.max_turns_per_tenant < 0:
            raise ConfigError("max_turns_per_ip and max_turns_per_tenant must not be negative (0: no bound)")
        if self.stream_stall_timeout <= 0:
            raise ConfigError("stream_stall_timeout must be positive")
        if self.keepalive_timeout <= 0:
            raise ConfigError("keepalive_timeout must be positive")
        if self.store_connections < 1:
            raise ConfigError("store_connections must be at least 1")
        if self.renew_ids_per_s <= 0 or self.renew_burst_ids < 1:
            raise ConfigError("renew_ids_per_s must be positive and renew_burst_ids at least 1")
        for rate, burst in (
            ("renew_ip_ids_per_s", "renew_ip_burst_ids"),
            ("renew_global_ids_per_s", "renew_global_burst_ids"),
        ):
            if getattr(self, rate) <= 0 or getattr(self, burst) < 1:
                raise ConfigError(f"{rate} must be positive and {burst} at least 1")
        if self.client_send_buffer < 0:
            raise ConfigError("client_send_buffer must not be negative (0: the kernel's)")
        if self.store_failures_before_backoff < 1:
            raise ConfigError("store_failures_before_backoff must be at least 1")
        if self.memory_max_entries < 1:
            raise ConfigError("memory_max_entries must be at least 1")
        if self.state is not None and not self.state.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"state must be a redis:// URL, got {self.state!r}")

    @property
    def kvlease_mode(self) -> bool:
        """True when the nodes run the kvlease connector (control endpoints configured)."""
        return self.prefill[0].control is not None

    @property
    def turns_per_ip(self) -> int:
        """The per-address share of the upstream pool (0: no bound)."""
        if self.max_turns_per_ip is not None:
            return self.max_turns_per_ip
        return max(1, self.upstream_connections // 16)

    def resolved_ttl(self, decode_ttl: float) -> float:
        """The router's lease TTL given D's TTL; raises :class:`ConfigError` when misordered."""
        limit = decode_ttl - self.ttl_margin
        if limit <= 0:
            raise ConfigError(
                f"D's TTL ({decode_ttl:g} s) is not above the safety margin ({self.ttl_margin:g} s)"
            )
        if self.ttl is None:
            return limit
        if self.ttl > limit:
            raise ConfigError(
                f"router TTL {self.ttl:g} s must be at most D's TTL {decode_ttl:g} s minus the "
                f"{self.ttl_margin:g} s margin ({limit:g} s)"
            )
        return self.ttl

    def with_overrides(self, **changes: Any) -> RouterSettings:
        return replace(self, **changes)


def _nodes(value: object, what: str) -> tuple[NodeSpec, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise ConfigError(f"{what} must be a list of URLs or {{url, control}} objects")
    out = []
    for item in value:
        if isinstance(item, str):
            out.append(NodeSpec(item))
        elif isinstance(item, Mapping) and isinstance(item.get("url"), str):
            control = item.get("control")
            if control is not None and not isinstance(control, str):
                raise ConfigError(f"{what}: control must be a URL string")
            out.append(NodeSpec(item["url"], control))
        else:
            raise ConfigError(f"{what} entries must be URLs or {{url, control}} objects, got {item!r}")
    return tuple(out)


def load_config_file(path: Path) -> dict[str, Any]:
    """Read a JSON (``.json``) or TOML config file into keyword arguments of :class:`RouterSettings`."""
    text = path.read_text(encoding="utf-8")
    data: object
    if path.suffix == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError as e:  # Python 3.10
            raise ConfigError("TOML config files need Python 3.11+; use JSON") from e
        data = tomllib.loads(text)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: invalid JSON: {e}") from e
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: the config must be an object")
    known = {f.name for f in fields(RouterSettings)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown config keys: {', '.join(unknown)}")
    out = dict(data)
    for key in ("prefill", "decode"):
        if key in out:
            out[key] = _nodes(out[key], key)
    return out
