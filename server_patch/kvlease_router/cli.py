"""``kvlease router``: run the router (aiohttp on uvloop)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import sys
from pathlib import Path
from typing import Any

import typer

from kvlease.protocol import CONTROL_SECRET_ENV
from kvlease_router._settings import ConfigError, NodeSpec, RouterSettings, load_config_file

__all__ = ["app", "serve"]

KEY_SECRET_ENV = "KVLEASE_ROUTER_KEY_SECRET"
_REDIS_SECRET_KEY = "kvlease:router-key-secret"


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
        return json.dumps(out)


def _nodes(urls: list[str], controls: list[str], role: str) -> tuple[NodeSpec, ...]:
    if controls and len(controls) != len(urls):
        raise ConfigError(f"give one --{role}-control per --{role} (got {len(controls)} for {len(urls)})")
    return tuple(NodeSpec(u, controls[i] if controls else None) for i, u in enumerate(urls))


async def _shared_key_secret(client: Any) -> str:
    """Replicas (and restarts) sharing one Redis must derive the same keys: keep the secret there."""
    await client.set(_REDIS_SECRET_KEY, secrets.token_hex(32), nx=True)
    raw = await client.get(_REDIS_SECRET_KEY)
    return raw.decode() if isinstance(raw, bytes) else str(raw)


async def serve(settings: RouterSettings, key_secret_given: bool = True) -> None:
    """Run until SIGINT/SIGTERM; prints one JSON line ``{"url": ...}`` when listening."""
    from aiohttp import web

    from kvlease_router._app import create_app
    from kvlease_router._redis_store import RedisStore, redis_client_from_url
    from kvlease_router._store import MemoryStore, StateStore

    store: StateStore
    if settings.state:
        client = redis_client_from_url(settings.state, max(settings.store_timeout, 1.0))
        if not key_secret_given:
            try:
                settings = settings.with_overrides(key_secret=await _shared_key_secret(client))
            except Exception as e:
                raise ConfigError(f"redis at {settings.state} is unreachable at start-up: {e}") from e
        store = RedisStore(client, timeout=settings.store_timeout, backoff=settings.store_backoff)
    else:
        store = MemoryStore(settings.memory_max_entries)
    # keep-alive clients must not hold a shutdown for aiohttp's default 60 s
    runner = web.AppRunner(
        create_app(settings, store), access_log=None, handle_signals=False, shutdown_timeout=2.0
    )
    try:
        await runner.setup()
        site = web.TCPSite(runner, settings.host, settings.port, backlog=2048, reuse_address=True)
        await site.start()
        sockets = getattr(site._server, "sockets", None) or []
        port = sockets[0].getsockname()[1] if sockets else settings.port
        print(json.dumps({"url": f"http://{settings.host}:{port}"}), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()
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
