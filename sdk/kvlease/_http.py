"""The HTTP family, decided once: ``httpx2`` under openai 3.x, ``httpx`` under openai 2.x.

openai's own default client (``openai.DefaultHttpxClient``) tells which family the installed openai
is built on; every other kvlease module imports :data:`hx` from here and never names a family.
Type checking sees ``httpx2`` (the two families share one API).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

import openai

__all__ = ["FAMILY", "hx", "inner_http_client", "is_async_client"]


def _family() -> ModuleType:
    for cls in openai.DefaultHttpxClient.__mro__:
        root = cls.__module__.split(".")[0]
        if root in ("httpx2", "httpx"):
            return importlib.import_module(root)
    raise ImportError(  # pragma: no cover - only with an openai kvlease does not support
        "kvlease could not tell which HTTP library openai uses (expected httpx or httpx2)"
    )


if TYPE_CHECKING:
    import httpx2 as hx
else:
    hx = _family()

#: "httpx2" or "httpx".
FAMILY: str = hx.__name__


def inner_http_client(client: Any) -> Any:
    """The HTTP client an ``openai.OpenAI`` / ``AsyncOpenAI`` sends through.

    openai has no public accessor for it; this is the one place kvlease reads it (``_client``), so
    that the user's own HTTP settings (proxies, TLS, limits, event hooks) stay in force.
    """
    inner = getattr(client, "_client", None)
    if not isinstance(inner, (hx.Client, hx.AsyncClient)):
        raise TypeError(
            f"kvlease.wrap needs an openai client whose HTTP client is a {FAMILY} client "
            f"(the family this openai {openai.__version__} is built on); got {type(inner).__name__}"
        )
    return inner


def is_async_client(client: Any) -> bool:
    return isinstance(client, openai.AsyncOpenAI)
