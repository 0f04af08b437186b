"""The kvlease router: a multi-turn P/D proxy in front of vLLM prefill and decode servers.

Reading path: ``_app`` (routes, lifespan) → ``_body`` (every handler's body reader) → ``_flow``
(one turn) → ``_clients`` (each address's share of the pool, stalled readers) → ``_reuse``
(statuses, handle capture; sans-IO) → ``_store`` / ``_redis_store`` (state) → ``_upstreams`` (pools, affinity) →
``_lease_api`` (renew/release) → ``_validate`` (start-up checks) → ``_continuity`` (stock vLLM).
Run it with ``kvlease router --prefill URL --decode URL``.

Exports load lazily, so ``kvlease --help`` works without the ``[router]`` extra (aiohttp,
prometheus-client, orjson).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "ROUTER_KEY",
    "ConfigError",
    "ConversationRecord",
    "MemoryStore",
    "MissRateMonitor",
    "NodeSpec",
    "RedisStore",
    "RouterSettings",
    "StateStore",
    "StoreError",
    "Upstreams",
    "create_app",
    "load_config_file",
    "redis_client_from_url",
]

_WHERE = {
    "ROUTER_KEY": "_app",
    "create_app": "_app",
    "MissRateMonitor": "_metrics",
    "RedisStore": "_redis_store",
    "redis_client_from_url": "_redis_store",
    "ConfigError": "_settings",
    "NodeSpec": "_settings",
    "RouterSettings": "_settings",
    "load_config_file": "_settings",
    "ConversationRecord": "_store",
    "MemoryStore": "_store",
    "StateStore": "_store",
    "StoreError": "_store",
    "Upstreams": "_upstreams",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)
