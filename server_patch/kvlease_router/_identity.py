"""Conversation identity and tenant scoping (sans-IO).

Identity, first found wins: header ``X-Conversation-Id``, body ``conversation_id``, header
``X-Session-Id``, body ``prompt_cache_key``. The state key is an HMAC of (tenant, id) under the
router's key secret, so the same id sent by another tenant is another conversation, and neither the
raw id nor the bearer token is ever stored or logged.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
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

__all__ = ["Identity", "IdentityError", "Keyer", "conversation_id_from", "tenant_from"]

ANONYMOUS_TENANT = "anonymous"


class IdentityError(InvalidConversationId):
    """The request names a conversation id that is not valid; the message says where it came from."""


@dataclass(frozen=True)
class Identity:
    conversation_id: str
    source: str  # which header/field it came from


def conversation_id_from(headers: Mapping[str, str], body: Mapping[str, Any]) -> Identity | None:
    """The conversation identity of a request, or ``None``; raises :class:`IdentityError` if invalid.

    ``headers`` must be case-insensitive (aiohttp's ``CIMultiDictProxy``). A present but invalid
    value is an error, not skipped: silently falling through would merge two conversations.
    """
    candidates = (
        (HEADER_CONVERSATION_ID, headers.get(HEADER_CONVERSATION_ID), "header"),
        (BODY_CONVERSATION_ID, body.get(BODY_CONVERSATION_ID), "body field"),
        (HEADER_SESSION_ID, headers.get(HEADER_SESSION_ID), "header"),
        (BODY_PROMPT_CACHE_KEY, body.get(BODY_PROMPT_CACHE_KEY), "body field"),
    )
    for name, value, kind in candidates:
        if value is None:
            continue
        try:
            return Identity(validate_conversation_id(value), name)
        except InvalidConversationId as e:
            raise IdentityError(f"{kind} {name}: {e}") from None
    return None


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

    def cache_salt(self, tenant: str, client_salt: str = "") -> str:
        """vLLM ``cache_salt`` of a tenant (and the client's own salt): prefix-cache entries and
        verified-pull hashes of one tenant never match another's, and the value reveals neither."""
        msg = b"cache_salt\x00" + tenant.encode("utf-8", "surrogatepass") + b"\x00"
        msg += client_salt.encode("utf-8", "surrogatepass")
        return hmac.digest(self._secret, msg, "sha256").hex()[:32]


def log_ref(key: str) -> str:
    """A short reference to a conversation for logs (a prefix of its HMAC key, never the raw id)."""
    return key[:12]
