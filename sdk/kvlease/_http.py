"""The HTTP family, decided once: ``httpx2`` under openai 3.x, ``httpx`` under openai 2.x.

openai's own default client (``openai.DefaultHttpxClient``) tells which family the installed openai
is built on; every other kvlease module imports :data:`hx` from here and never names a family.
Type checking sees ``httpx2`` (the two families share one API).
"""

from __future__ import annotations

import importlib
import operator
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import openai

__all__ = ["FAMILY", "header_bytes", "header_text", "hx", "inner_http_client", "is_async_client"]


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


_name_of = operator.itemgetter(1)
_value_of = operator.itemgetter(2)


def header_bytes(headers: hx.Headers) -> dict[bytes, bytes]:
    """Every header by its lower-case name, its value as sent (a repeated header's values joined
    with ``b", "``, in order, as ``headers.get`` joins them). Built in C: a request carries a dozen
    headers, of which the SDK reads two or three."""
    items = _header_items(headers)
    found = dict(zip(map(_name_of, items), map(_value_of, items)))
    if len(found) != len(items):  # a repeated header
        found = {}
        for _, key, value in items:
            found[key] = found[key] + b", " + value if key in found else value
    return found


def header_text(value: bytes, headers: hx.Headers) -> str:
    """A header value as ``headers.get`` decodes it."""
    try:
        return value.decode("ascii")
    except UnicodeDecodeError:
        return value.decode(headers.encoding)
