"""Deprecated alias of :mod:`kvlease_router` (the router is its own package since 0.2).

``import kvlease_vllm.router`` keeps working for one release and warns; import ``kvlease_router``.
"""

from __future__ import annotations

import warnings
from typing import Any

import kvlease_router

warnings.warn(
    "kvlease_vllm.router is deprecated and will be removed in the next release: import kvlease_router",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = list(kvlease_router.__all__)


def __getattr__(name: str) -> Any:
    return getattr(kvlease_router, name)


def __dir__() -> list[str]:
    return sorted(__all__)
