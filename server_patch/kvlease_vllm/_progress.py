"""NIXL's progress thread without the busy spin (issue: leases without a busy engine).

NIXL's UCX backend runs one progress thread per agent. Between rounds it waits on the UCX workers'
event descriptors with ``poll()``, for at most ``pthrDelay`` microseconds; NIXL's Python API (the
one vLLM's worker uses) hard-codes ``pthrDelay = 0``, so the thread spins. Measured on this
project's 2-core CPU test machine, two agents in one process, NIXL 1.5.1 (``KVLEASE`` benchmark
command in ``benchmarks/RESULTS.md``): idle CPU 0.45-0.50 cores at 0, 0.035-0.047 at 1 ms, 0.001 at
100 ms; a READ still completes (P polls its own transfer state) and notifications still arrive in
well under a millisecond, because ``poll()`` returns as soon as a worker's event descriptor fires.
Without a progress thread at all an idle target never progresses and a READ from it never completes,
so that is not an option for a decode node whose engine stops stepping while leases are held.

:func:`install` makes every NIXL agent created afterwards in this process use ``delay_us``
instead of 0. It wraps the binding module that ``nixl_agent.__init__`` calls, and leaves NIXL alone
(returning False) when that module does not have the expected shape, so a NIXL release that changes
its internals gets upstream's behaviour rather than an error.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from types import ModuleType
from typing import Any

__all__ = ["configure", "install", "installed_delay_us"]

_lock = threading.Lock()


class _DelayedBind:
    """Stands in for ``nixlBind`` in NIXL's ``_api`` module: everything is the real binding's,
    except that ``nixlAgent(name, config)`` sets the config's ``pthrDelay`` first."""

    def __init__(self, real: Any, delay_us: int) -> None:
        self._kvlease_real = real
        self.kvlease_delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kvlease_real, name)

    def nixlAgent(self, name: str, config: Any) -> Any:
        if getattr(config, "useProgThread", False) and getattr(config, "pthrDelay", None) == 0:
            config.pthrDelay = self.kvlease_delay_us
        return self._kvlease_real.nixlAgent(name, config)


def _api_module() -> ModuleType | None:
    """NIXL's ``_api``: the ``nixl`` meta-package injects its CUDA flavour's module under
    ``nixl._api``; a flavour's wheel installed alone (``nixl-cu13``) is imported by its own name."""
    for name in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        mod = sys.modules.get(name)
        if mod is None:
            try:
                importlib.import_module(name)
            except Exception:
                continue
            mod = sys.modules.get(name)
        if isinstance(mod, ModuleType):
            return mod
    return None


def install(delay_us: int, api: ModuleType | None = None) -> bool:
    """Use ``delay_us`` (> 0) as the progress thread's poll timeout for agents created from now on.

    ``api``: NIXL's ``_api`` module (default: the installed one). Returns whether it applied;
    ``delay_us == 0`` restores NIXL's own busy spin.
    """
    if delay_us < 0:
        raise ValueError("delay_us must be >= 0")
    mod = api if api is not None else _api_module()
    if mod is None:
        return False
    with _lock:
        bind = getattr(mod, "nixlBind", None)
        if isinstance(bind, _DelayedBind):
            if delay_us == 0:
                mod.nixlBind = bind._kvlease_real  # type: ignore[attr-defined]
            else:
                bind.kvlease_delay_us = delay_us
            return True
        if delay_us == 0:
            return True
        agent = getattr(mod, "nixl_agent", None)
        if bind is None or not callable(getattr(bind, "nixlAgent", None)) or agent is None:
            return False
        if "pthrDelay" not in getattr(getattr(agent, "__init__", None), "__code__", _NoCode).co_names:
            return False  # nixl_agent no longer sets pthrDelay itself: leave it be
        mod.nixlBind = _DelayedBind(bind, delay_us)  # type: ignore[attr-defined]
        return True


def installed_delay_us(api: ModuleType | None = None) -> int:
    """The delay :func:`install` put in place (0: NIXL's own)."""
    mod = api if api is not None else _api_module()
    bind = getattr(mod, "nixlBind", None) if mod is not None else None
    return bind.kvlease_delay_us if isinstance(bind, _DelayedBind) else 0


class _NoCode:
    co_names: tuple[str, ...] = ()


def configure(delay_us: int) -> bool:
    """:func:`install` for a vLLM worker, logging what applies (``kvlease.nixl_progress_delay_us``)."""
    log = logging.getLogger("vllm.kvlease.progress")  # under vLLM's configured logger
    applied = install(delay_us)
    if delay_us and applied:
        log.info("kvlease: NIXL's progress thread polls (timeout %d us) instead of spinning", delay_us)
    elif delay_us:
        log.warning(
            "kvlease: kvlease.nixl_progress_delay_us=%d not applied: this NIXL's Python API has an "
            "unexpected shape, so its progress thread spins as upstream's does",
            delay_us,
        )
    return applied
