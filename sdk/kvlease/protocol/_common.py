"""Shared by every part of the contract: the protocol version, the parse errors, field readers."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeGuard

PROTOCOL_VERSION: Final = 1


class ProtocolError(ValueError):
    """A message of the wire contract is malformed; the text names the field."""


class InvalidConversationId(ProtocolError):
    """A conversation id is empty, longer than 128 characters or has characters outside [A-Za-z0-9._:-]."""


# --------------------------------------------------------------------------------------------------
# The error body (router and control endpoint)
# --------------------------------------------------------------------------------------------------

#: ``error.type`` values (OpenAI's error types, plus the router's own upstream/store failures).
ERROR_INVALID_REQUEST: Final = "invalid_request_error"
ERROR_SERVER: Final = "server_error"
ERROR_UPSTREAM: Final = "upstream_error"
ERROR_STORE_UNAVAILABLE: Final = "store_unavailable"
#: 429 of the lease API (a tenant's renew budget is spent; ``Retry-After`` says when to come back).
ERROR_RATE_LIMITED: Final = "rate_limit_exceeded"
#: ``Retry-After`` (seconds) on the router's 429 and 503 answers; the SDK keeper waits that long.
HEADER_RETRY_AFTER: Final = "Retry-After"


@dataclass(frozen=True)
class ErrorBody:
    """Every kvlease error answer, in OpenAI's error shape (so the openai client reads the message).

    JSON: ``{"error": {"message": "...", "type": "invalid_request_error", "code": 400}}``; ``code``
    (the HTTP status, where the writer gives one) is left out when ``None``.
    """

    message: str
    type: str = ERROR_INVALID_REQUEST
    code: int | str | None = None

    @classmethod
    def for_status(cls, status: int, message: str) -> ErrorBody:
        """The body of an HTTP ``status`` answer: a server error from 500 up, else a bad request."""
        return cls(message, ERROR_SERVER if status >= 500 else ERROR_INVALID_REQUEST, status)

    def to_json(self) -> dict[str, Any]:
        inner: dict[str, Any] = {"message": self.message, "type": self.type}
        if self.code is not None:
            inner["code"] = self.code
        return {"error": inner}

    @classmethod
    def from_json(cls, data: object) -> ErrorBody:
        inner = data.get("error") if isinstance(data, Mapping) else None
        if not isinstance(inner, Mapping) or not isinstance(inner.get("message"), str):
            raise ProtocolError("error body must be {'error': {'message': ...}}")
        kind, code = inner.get("type"), inner.get("code")
        return cls(
            inner["message"],
            kind if isinstance(kind, str) else ERROR_INVALID_REQUEST,
            code if isinstance(code, (int, str)) and not isinstance(code, bool) else None,
        )


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


#: Upper bound of ids in one renew request (the lease API and the control endpoint).
RENEW_MAX_IDS: Final = 10_000


def _is_number(v: object) -> TypeGuard[int | float]:
    """A finite int or float, not a bool. An int too large for a float (``json`` reads any length
    of digits) is not one: ``math.isfinite`` would raise ``OverflowError`` on it."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _int_field(data: Mapping[str, Any], name: str, lo: int, hi: int) -> int:
    return _int_value(data.get(name), name, lo, hi)


def _int_value(v: object, name: str, lo: int, hi: int) -> int:
    """``v`` (the value of field ``name``) if it is an integer in ``[lo, hi]``, else ProtocolError."""
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ProtocolError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _id_list(data: object, name: str, limit: int = RENEW_MAX_IDS) -> tuple[str, ...]:
    if not isinstance(data, Mapping):
        raise ProtocolError("body must be a JSON object")
    ids = data.get(name)
    if not isinstance(ids, list) or len(ids) > limit:
        raise ProtocolError(f"{name} must be a list of at most {limit} strings")
    if not all(isinstance(i, str) and 0 < len(i) <= 512 for i in ids):
        raise ProtocolError(f"{name} must contain non-empty strings of at most 512 characters")
    return tuple(ids)


def header_lookup(headers: Iterable[tuple[str, str]], name: str) -> str | None:
    """Case-insensitive first value of ``name`` among ``(key, value)`` pairs."""
    low = name.lower()
    for k, v in headers:
        if k.lower() == low:
            return v
    return None
