"""Conversation identity and tenant scoping (sans-IO).

Identity, first found wins: header ``X-Conversation-Id``, body ``conversation_id``, header
``X-Session-Id``, body ``prompt_cache_key``. The state key is an HMAC of (tenant, id) under the
router's key secret, so the same id sent by another tenant is another conversation, and neither the
raw id nor the bearer token is ever stored or logged.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvlease.protocol import (
    BODY_CONVERSATION_ID,
    BODY_PROMPT_CACHE_KEY,
    HEADER_AUTHORIZATION,
    HEADER_CONVERSATION_ID,
    HEADER_SESSION_ID,
    InvalidConversationId,
    validate_conversation_id,
)

__all__ = ["Identity", "IdentityError", "Keyer", "conversation_id_from", "fallback_id", "tenant_from"]

ANONYMOUS_TENANT = "anonymous"
#: Prefix of a hashed fallback id (:func:`fallback_id`).
FALLBACK_ID_PREFIX = "sha256:"


class IdentityError(InvalidConversationId):
    """The request names a conversation id that is not valid; the message says where it came from."""


@dataclass(frozen=True)
class Identity:
    conversation_id: str
    source: str  # which header/field it came from


def conversation_id_from(headers: Mapping[str, str], body: Mapping[str, Any]) -> Identity | None:
    """The conversation identity of a request, or ``None``; raises :class:`IdentityError` if invalid.

    ``headers`` must be case-insensitive (aiohttp's ``CIMultiDictProxy``). kvlease's own names
    (``X-Conversation-Id``, body ``conversation_id``) are strict: a present but invalid value
    (``null`` included) is an error, not skipped, since silently falling through would merge two
    conversations. The fallbacks (``X-Session-Id``, ``prompt_cache_key``) are other APIs' ids with
    looser rules: a string that is not a valid id is hashed into one (:func:`fallback_id`).
    """
    value: object = headers.get(HEADER_CONVERSATION_ID)
    if value is not None:
        return _strict(value, HEADER_CONVERSATION_ID, "header")
    if BODY_CONVERSATION_ID in body:
        value = body[BODY_CONVERSATION_ID]
        if value is None:
            raise IdentityError(f"body field {BODY_CONVERSATION_ID}: must be a string, not null")
        return _strict(value, BODY_CONVERSATION_ID, "body field")
    for name, value, kind in (
        (HEADER_SESSION_ID, headers.get(HEADER_SESSION_ID), "header"),
        (BODY_PROMPT_CACHE_KEY, body.get(BODY_PROMPT_CACHE_KEY), "body field"),
    ):
        if value is None or value == "":
            continue  # absent (or empty: OpenAI's "no key")
        if not isinstance(value, str):
            raise IdentityError(f"{kind} {name}: must be a string")
        try:
            return Identity(validate_conversation_id(value), name)
        except InvalidConversationId:
            return Identity(fallback_id(value), name)
    return None


def _strict(value: object, name: str, kind: str) -> Identity:
    try:
        return Identity(validate_conversation_id(value), name)
    except InvalidConversationId as e:
        raise IdentityError(f"{kind} {name}: {e}") from None


def fallback_id(value: str) -> str:
    """A valid conversation id for a fallback id that OpenAI and vLLM accept but the id rule does
    not (``user@example.com``, ``tenant/42``, ``sess 1``, over 128 characters): its SHA-256, so
    the same value always names the same conversation and distinct values stay distinct."""
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()
    return FALLBACK_ID_PREFIX + digest


def tenant_from(headers: Mapping[str, str], tenant_header: str | None) -> str:
    """The tenant of a request: the trusted tenant header if configured and present, else a hash of
    the bearer token (``Authorization``), else ``anonymous``."""
    if tenant_header:
        value = headers.get(tenant_header)
        if value:
            return "h:" + value[:256]
    auth = headers.get(HEADER_AUTHORIZATION)
    if auth:
        return "t:" + hashlib.sha256(auth.strip().encode("utf-8", "surrogatepass")).hexdigest()
    return ANONYMOUS_TENANT


class Keyer:
    """Tenant-scoped state keys: ``HMAC-SHA256(secret, tenant || 0x00 || conversation id)``."""

    __slots__ = ("_secret",)

    def __init__(self, secret: str) -> None:
        self._secret = secret.encode("utf-8")

    def key(self, tenant: str, conversation_id: str) -> str:
        msg = tenant.encode("utf-8", "surrogatepass") + b"\x00" + conversation_id.encode("ascii")
        return hmac.digest(self._secret, msg, "sha256").hex()

    def keys(self, tenant: str, conversation_ids: Sequence[str]) -> list[str]:
        """``key(tenant, cid)`` of each id, from one HMAC state primed with the tenant (a renew
        keys thousands of ids: copies of HMAC-SHA256's inner and outer states, primed once, cost a
        third of a fresh HMAC each). Equal to :meth:`key` for every id (RFC 2104, spelled out)."""
        key = self._secret if len(self._secret) <= 64 else hashlib.sha256(self._secret).digest()
        key = key.ljust(64, b"\x00")
        inner = hashlib.sha256(
            bytes(b ^ 0x36 for b in key) + tenant.encode("utf-8", "surrogatepass") + b"\x00"
        )
        outer = hashlib.sha256(bytes(b ^ 0x5C for b in key))
        copy_inner, copy_outer = inner.copy, outer.copy
        out = []
        for cid in conversation_ids:
            h = copy_inner()
            h.update(cid.encode("ascii"))
            o = copy_outer()
            o.update(h.digest())
            out.append(o.hexdigest())
        return out

    def tenant_tag(self, tenant: str) -> str:
        """An opaque tag of a tenant for the decode nodes' retention quota (reveals nothing)."""
        msg = b"tenant_tag\x00" + tenant.encode("utf-8", "surrogatepass")
        return hmac.digest(self._secret, msg, "sha256").hex()[:24]

    def cache_salt(self, tenant: str, client_salt: str = "") -> str:
        """vLLM ``cache_salt`` of a tenant (and the client's own salt): prefix-cache entries and
        verified-pull hashes of one tenant never match another's, and the value reveals neither."""
        msg = b"cache_salt\x00" + tenant.encode("utf-8", "surrogatepass") + b"\x00"
        msg += client_salt.encode("utf-8", "surrogatepass")
        return hmac.digest(self._secret, msg, "sha256").hex()[:32]


def log_ref(key: str) -> str:
    """A short reference to a conversation for logs (a prefix of its HMAC key, never the raw id)."""
    return key[:12]
