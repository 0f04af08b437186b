"""The HTTP family, decided once: ``httpx2`` under openai 3.x, ``httpx`` under openai 2.x.

openai's own default client (``openai.DefaultHttpxClient``) tells which family the installed openai
is built on; every other kvlease module imports :data:`hx` from here and never names a family.
Type checking sees ``httpx2`` (the two families share one API).
"""

from __future__ import annotations

import importlib
import operator
from collections.abc import Callable, Collection
from types import ModuleType
from typing import TYPE_CHECKING, Any

import openai

__all__ = ["FAMILY", "header_values", "hx", "inner_http_client", "is_async_client"]


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


def _items_of(headers: Any) -> list[tuple[bytes, bytes, bytes]]:
    """``(raw name, lower-case name, value)`` of every header, in order."""
    return [(key, key.lower(), value) for key, value in headers.raw]


#: the headers' own list of ``(raw name, lower-case name, value)`` (httpx and httpx2 keep one):
#: an attribute read in C, so reading a few headers of a request is one pass and no extra call
_lowered_list: Callable[[Any], list[tuple[bytes, bytes, bytes]]] = operator.attrgetter("_list")


def _has_lowered_list() -> bool:
    probe = hx.Headers([("X-A", "1"), ("x-a", "2")])
    try:
        return _lowered_list(probe) == [(b"X-A", b"x-a", b"1"), (b"x-a", b"x-a", b"2")]
    except AttributeError:  # pragma: no cover - another httpx layout
        return False


#: the headers' own list of lower-cased names when this family keeps one, else the public ``raw``
#: list, lower-cased here
_header_items = _lowered_list if _has_lowered_list() else _items_of


def header_values(headers: hx.Headers, names: Collection[bytes]) -> dict[bytes, str]:
    """The headers among ``names`` (lower-case) that ``headers`` has, keyed by those names: what
    ``headers.get(name)`` returns for each (repeated headers joined with ``", "``), in one pass."""
    out: dict[bytes, str] = {}
    for _, key, value in _header_items(headers):
        if key in names:
            try:
                text = value.decode("ascii")
            except UnicodeDecodeError:
                text = value.decode(headers.encoding)
            out[key] = out[key] + ", " + text if key in out else text
    return out
