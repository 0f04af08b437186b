"""``kvlease router``: run the router (aiohttp on uvloop)."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import typer

from kvlease.protocol import CONTROL_SECRET_ENV
from kvlease_router._settings import ConfigError, NodeSpec, RouterSettings, load_config_file

__all__ = ["app", "serve"]

KEY_SECRET_ENV = "KVLEASE_ROUTER_KEY_SECRET"
_REDIS_SECRET_KEY = "kvlease:router-key-secret"  # where older routers kept it in clear; deleted
_REDIS_VERIFIER_KEY = "kvlease:router-key-verifier"


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        conv = getattr(record, "conv", None)
        if conv:
            out["conv"] = conv  # already a hash prefix, never the raw id
        if record.exc_info:
            exc = record.exc_info[1]
            out["exc"] = f"{type(exc).__name__}: {exc}" if exc is not None else None
            out["traceback"] = record.exc_text or self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out)


def _nodes(urls: list[str], controls: list[str], role: str) -> tuple[NodeSpec, ...]:
    if controls and len(controls) != len(urls):
        raise ConfigError(f"give one --{role}-control per --{role} (got {len(controls)} for {len(urls)})")
    return tuple(NodeSpec(u, controls[i] if controls else None) for i, u in enumerate(urls))


async def _check_key_secret(client: Any, secret: str) -> None:
    """Replicas (and restarts) sharing one Redis must share the key secret, through configuration:
    it never sits in Redis (whoever reads Redis could forge state with it). Redis keeps only a
    verifier (an HMAC of a fixed label), so a replica given another secret refuses to start; a
    clear-text secret an older router left there is deleted."""
    verifier = hmac.digest(secret.encode("utf-8"), b"kvlease router key verifier v1", "sha256").hex()
    await client.delete(_REDIS_SECRET_KEY)
    await client.set(_REDIS_VERIFIER_KEY, verifier, nx=True)
    raw = await client.get(_REDIS_VERIFIER_KEY)
    have = raw.decode() if isinstance(raw, bytes) else str(raw)
    if not hmac.compare_digest(have, verifier):
        raise ConfigError(
            "this router's key secret differs from the one other replicas use with this Redis "
            f"({_REDIS_VERIFIER_KEY}); give every replica the same --key-secret / {KEY_SECRET_ENV}"
        )


async def serve(settings: RouterSettings, key_secret_given: bool = True) -> None:
    """Run until SIGINT/SIGTERM; prints one JSON line ``{"url": ...}`` when listening."""
    from kvlease_router._app import create_app
    from kvlease_router._guard import start_site, stop_site
    from kvlease_router._logs import install_server_log_filter
    from kvlease_router._redis_store import RedisStore, redis_client_from_url
    from kvlease_router._store import MemoryStore, StateStore

    store: StateStore
    if settings.state:
        if not key_secret_given:
            raise ConfigError(
                f"--state redis:// needs --key-secret (or {KEY_SECRET_ENV}), the same on every "
                "replica: the key secret is configuration and is never kept in Redis"
            )
        client = redis_client_from_url(
            settings.state, max(settings.store_timeout, 1.0), settings.store_connections
        )
        try:
            await _check_key_secret(client, settings.key_secret)
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError(f"redis at {settings.state} is unreachable at start-up: {e}") from e
        store = RedisStore(
            client,
            secret=settings.key_secret,
            renewals=settings.kvlease_mode,
            timeout=settings.store_timeout,
            backoff=settings.store_backoff,
            failures_before_backoff=settings.store_failures_before_backoff,
        )
    else:
        store = MemoryStore(settings.memory_max_entries)
    # served behind the slow-client guards (header/idle timeouts, per-IP bound); keep-alive
    # clients must not hold a shutdown for aiohttp's default 60 s
    install_server_log_filter()
    started = None
    try:
        started = await start_site(create_app(settings, store), settings, settings.host, settings.port)
        sockets: tuple[Any, ...] = tuple(started[1].sockets or ())
        port = sockets[0].getsockname()[1] if sockets else settings.port
        print(json.dumps({"url": f"http://{settings.host}:{port}"}), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        if started is not None:
            await stop_site(*started)
        await store.close()


def app(
    prefill: list[str] = typer.Option(None, "--prefill", help="Prefill server URL (repeat)."),
    decode: list[str] = typer.Option(None, "--decode", help="Decode server URL (repeat)."),
    prefill_control: list[str] = typer.Option(
        None, "--prefill-control", help="kvlease control URL per --prefill."
    ),
    decode_control: list[str] = typer.Option(
        None, "--decode-control", help="kvlease control URL per --decode."
    ),
    state: str | None = typer.Option(None, "--state", help="redis://host:port/db (default: in memory)."),
    config: Path | None = typer.Option(
        None, "--config", help="JSON or TOML file with RouterSettings fields."
    ),
    host: str | None = typer.Option(None, "--host"),
    port: int | None = typer.Option(None, "--port", help="0 picks a free port."),
    control_secret: str | None = typer.Option(None, "--control-secret", envvar=CONTROL_SECRET_ENV),
    key_secret: str | None = typer.Option(
        None, "--key-secret", envvar=KEY_SECRET_ENV, help="HMAC key of state keys."
    ),
    ttl: float | None = typer.Option(
        None, "--ttl", help="Router lease TTL (default: D's TTL minus the margin)."
    ),
    ttl_margin: float | None = typer.Option(None, "--ttl-margin"),
    node_ttl: float | None = typer.Option(None, "--node-ttl", help="D's decoder_kv_blocks_ttl (stock vLLM)."),
    tenant_header: str | None = typer.Option(
        None, "--tenant-header", help="Trust this header as the tenant."
    ),
    tenant_cache_salt: bool = typer.Option(
        False,
        "--tenant-cache-salt",
        help="Give each tenant its own vLLM cache_salt (no cross-tenant prefix cache).",
    ),
    no_validate: bool = typer.Option(False, "--no-validate", help="Skip start-up checks of the nodes."),
    startup_timeout: float | None = typer.Option(
        None, "--startup-timeout", help="Wait this long for the nodes."
    ),
    max_body_bytes: int | None = typer.Option(
        None, "--max-body-bytes", help="Request body limit (413 above)."
    ),
    upstream_connections: int | None = typer.Option(
        None, "--upstream-connections", help="Open connections per upstream node (default 256)."
    ),
    header_timeout: float | None = typer.Option(
        None, "--header-timeout", help="Seconds for a request head, from its first byte (10)."
    ),
    body_timeout: float | None = typer.Option(
        None, "--body-timeout", help="Seconds for a request body (30; 408 after)."
    ),
    idle_timeout: float | None = typer.Option(
        None, "--idle-timeout", help="Close a keep-alive connection idle this long (75)."
    ),
    stream_write_timeout: float | None = typer.Option(
        None, "--stream-write-timeout", help="Close a stream the client stops reading this long (30)."
    ),
    max_connections_per_ip: int | None = typer.Option(
        None, "--max-connections-per-ip", help="Open connections per client address (256; 0: no bound)."
    ),
    max_turns_per_ip: int | None = typer.Option(
        None,
        "--max-turns-per-ip",
        help="Turns in flight per client address; past it they wait (pool/16: 16; 0: no bound).",
    ),
    max_turns_per_tenant: int | None = typer.Option(
        None, "--max-turns-per-tenant", help="Turns in flight per tenant; past it they wait (0: no bound)."
    ),
    stream_stall_timeout: float | None = typer.Option(
        None,
        "--stream-stall-timeout",
        help="Close a stream whose client acknowledges nothing this long, aborting D's request (5).",
    ),
    max_upstream_bytes: int | None = typer.Option(
        None, "--max-upstream-bytes", help="Cap on a non-streamed P or D answer (64 MiB; 502 above)."
    ),
    max_sse_event_bytes: int | None = typer.Option(
        None, "--max-sse-event-bytes", help="Cap on one pending SSE event from D (8 MiB)."
    ),
    renew_ip_ids_per_s: float | None = typer.Option(
        None, "--renew-ip-ids-per-s", help="Renew budget per client address (ids/s; 5000)."
    ),
    renew_global_ids_per_s: float | None = typer.Option(
        None, "--renew-global-ids-per-s", help="Renew budget of all tenants together (ids/s; 20000)."
    ),
    client_send_buffer: int | None = typer.Option(
        None, "--client-send-buffer", help="SO_SNDBUF of client connections (256 KiB; 0: kernel's)."
    ),
    log_level: str = typer.Option("info", "--log-level"),
    log_json: bool = typer.Option(True, "--log-json/--log-text"),
) -> None:
    """Run the kvlease router in front of vLLM prefill and decode servers."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        _JsonFormatter() if log_json else logging.Formatter("%(asctime)s %(levelname)s %(message)s")
    )
    logging.basicConfig(level=log_level.upper(), handlers=[handler], force=True)
    try:
        kwargs: dict[str, Any] = load_config_file(config) if config else {}
        if prefill:
            kwargs["prefill"] = _nodes(prefill, prefill_control or [], "prefill")
        if decode:
            kwargs["decode"] = _nodes(decode, decode_control or [], "decode")
        for name, value in (
            ("state", state),
            ("host", host),
            ("port", port),
            ("control_secret", control_secret),
            ("key_secret", key_secret),
            ("ttl", ttl),
            ("ttl_margin", ttl_margin),
            ("node_ttl", node_ttl),
            ("tenant_header", tenant_header),
            ("startup_timeout", startup_timeout),
            ("max_body_bytes", max_body_bytes),
            ("upstream_connections", upstream_connections),
            ("header_timeout", header_timeout),
            ("body_timeout", body_timeout),
            ("idle_timeout", idle_timeout),
            ("stream_write_timeout", stream_write_timeout),
            ("max_connections_per_ip", max_connections_per_ip),
            ("max_turns_per_ip", max_turns_per_ip),
            ("max_turns_per_tenant", max_turns_per_tenant),
            ("stream_stall_timeout", stream_stall_timeout),
            ("max_upstream_bytes", max_upstream_bytes),
            ("max_sse_event_bytes", max_sse_event_bytes),
            ("renew_ip_ids_per_s", renew_ip_ids_per_s),
            ("renew_global_ids_per_s", renew_global_ids_per_s),
            ("client_send_buffer", client_send_buffer),
        ):
            if value is not None:
                kwargs[name] = value
        if no_validate:
            kwargs["validate"] = False
        if tenant_cache_salt:
            kwargs["tenant_cache_salt"] = True
        kwargs.setdefault("prefill", ())
        kwargs.setdefault("decode", ())
        given = "key_secret" in kwargs or bool(os.environ.get(KEY_SECRET_ENV))
        settings = RouterSettings(**kwargs)
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is optional on some platforms
            asyncio.run(serve(settings, key_secret_given=given))
        else:
            uvloop.run(serve(settings, key_secret_given=given))
    except ConfigError as e:
        typer.echo(f"kvlease router: {e}", err=True)
        raise typer.Exit(2) from None


def main() -> None:  # python -m kvlease_router.cli
    typer.run(app)


if __name__ == "__main__":
    main()
