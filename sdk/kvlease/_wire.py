"""What a tracked request and its response carry on the wire, for the tracker (pure, no IO).

The conversation id spliced into a request body without re-serializing it, where a router's lease
API lives, the request headers a lease request copies, and the kvlease response headers read as
the bytes they arrive as.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Final

from kvlease import protocol
from kvlease._http import header_text, hx
from kvlease.protocol import ReuseStatus

__all__ = [
    "AUTH_HEADERS",
    "BODY_NAME",
    "CHAT_SUFFIX",
    "CID_KEY",
    "COMPLETIONS_SUFFIX",
    "REUSED_KEY",
    "STATUS_KEY",
    "TTL_KEY",
    "VERIFIED_KEY",
    "VERIFIED_VALUE",
    "auth_headers",
    "inject_conversation_id",
    "parse_float",
    "parse_int",
    "reuse_status",
    "router_root",
]

#: Headers that make a lease request authorized like the chat request (copied to renew/release).
AUTH_HEADERS: Final = tuple(
    h.lower()
    for h in (protocol.HEADER_AUTHORIZATION, protocol.HEADER_API_KEY, protocol.DEFAULT_TENANT_HEADER)
)
#: The request header the transport tracks a request by, lower-case.
CID_KEY: Final = protocol.HEADER_CONVERSATION_ID.lower().encode("ascii")
_AUTH_KEYS: Final = tuple((name.encode("ascii"), name) for name in AUTH_HEADERS)
#: The kvlease response headers ``Tracker.response`` reads, lower-case.
STATUS_KEY: Final = protocol.HEADER_STATUS.lower().encode("ascii")
REUSED_KEY: Final = protocol.HEADER_REUSED_TOKENS.lower().encode("ascii")
TTL_KEY: Final = protocol.HEADER_TTL.lower().encode("ascii")
VERIFIED_KEY: Final = protocol.HEADER_VERIFIED.lower().encode("ascii")
VERIFIED_VALUE: Final = protocol.VERIFIED_TOKENS.encode("ascii")
BODY_NAME: Final = protocol.BODY_CONVERSATION_ID
_BODY_KEY: Final = b'"' + BODY_NAME.encode() + b'"'
CHAT_SUFFIX: Final = "/chat/completions"
COMPLETIONS_SUFFIX: Final = "/completions"


def inject_conversation_id(body: bytes, conversation_id: str, *, has_key: bool | None = None) -> bytes:
    """``body`` (a JSON object) with ``conversation_id`` added first, without re-serializing it.

    The id is validated (``[A-Za-z0-9._:-]``), so it needs no escaping. A body that already names the
    key, or is not a JSON object, is returned unchanged. ``has_key``: whether the parsed body's top
    level has the key, when the caller parsed it (else the bytes are searched for it, which also
    finds it nested: the body is then left as it is).
    """
    if has_key or (has_key is None and _BODY_KEY in body):
        return body
    start = body.find(b"{")
    if start < 0 or (start and body[:start].strip()):
        return body
    head = b"{" + _BODY_KEY + b':"' + conversation_id.encode("ascii") + b'"'
    rest = memoryview(body)[start + 1 :]  # the body is copied once, into the result
    i = start + 1
    while i < len(body) and body[i] in _SPACE:
        i += 1
    return b"".join((head, rest) if body.startswith(b"}", i) else (head, b",", rest))


_SPACE: Final = frozenset(b" \t\n\r\x0b\x0c")  # what bytes.strip() strips


@functools.lru_cache(maxsize=256)
def router_root(origin: str, path: str) -> str:
    """Where a router's lease API lives, from a completion request's origin and path.

    ``http://h:8000`` + ``/v1/chat/completions`` -> ``http://h:8000`` (lease paths start with ``/v1``);
    a gateway prefix before ``/v1`` is kept.
    """
    for full in (protocol.CHAT_COMPLETIONS_PATH, protocol.COMPLETIONS_PATH):
        if path.endswith(full):
            return origin + path[: -len(full)]
    for suffix in (CHAT_SUFFIX, COMPLETIONS_SUFFIX):
        if path.endswith(suffix):
            return origin + path[: -len(suffix)]
    return origin


def auth_headers(found: Mapping[bytes, bytes], headers: hx.Headers) -> dict[str, str]:
    """The :data:`AUTH_HEADERS` of a request, by name, from its :func:`~kvlease._http.header_bytes`."""
    auth: dict[str, str] = {}
    for key, name in _AUTH_KEYS:
        v = found.get(key)
        if v is not None:
            auth[name] = header_text(v, headers)
    return auth


_STATUSES: dict[bytes, ReuseStatus | None] = {}


def reuse_status(value: bytes) -> ReuseStatus | None:
    """A :data:`~kvlease.protocol.HEADER_STATUS` value as it arrived (``None``: not a status)."""
    try:
        return _STATUSES[value]
    except KeyError:
        status = ReuseStatus.parse(value.decode("latin-1"))
        if len(_STATUSES) < 64:  # a server sends a handful of distinct values
            _STATUSES[value] = status
        return status


def parse_int(v: str | bytes | None) -> int | None:
    if v is None:
        return None
    try:
        return int(v.strip())
    except ValueError:
        return None


def parse_float(v: str | bytes | None) -> float | None:
    if v is None:
        return None
    try:
        f = float(v.strip())
    except ValueError:
        return None
    return f if math.isfinite(f) else None  # (no NaN, no infinity)
