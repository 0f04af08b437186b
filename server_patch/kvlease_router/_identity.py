"""Conversation identity and tenant scoping (sans-IO).

Identity, first found wins: header ``X-Conversation-Id``, body ``conversation_id``, header
``X-Session-Id``, body ``prompt_cache_key``. The state key is a keyed hash (BLAKE2b, :class:`Keyer`)
of (tenant, id) under a key derived from the router's key secret, so the same id sent by another
tenant is another conversation, and neither the raw id nor the bearer token is ever stored or logged.
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


#: Bytes of a state key's digest (128 bits: a keyed PRF's output, so two ids of 2**32 collide with
#: odds of 2**-64; the key goes to Redis with every renewed id, so its 32 hex digits are half the
#: bytes a renew sends).
KEY_BYTES = 16

#: Tenants whose tag :meth:`Keyer.tenant_tag` remembers (a pure function of secret and tenant).
_TAGS_MAX = 4096

#: Label of the state-key subkey (:class:`Keyer`); "v3": BLAKE2b-128 keys (v2 was BLAKE2b-256, v1
#: HMAC-SHA256).
_STATE_KEY_LABEL = b"kvlease router state key v3"


class Keyer:
    """Tenant-scoped state keys: ``BLAKE2b-128(key=K, tenant || 0x00 || conversation id)`` in hex,
    with ``K = HMAC-SHA256(secret, "kvlease router state key v3")``.

    Why this is sound, and why not HMAC-SHA256 per id as before (v1): BLAKE2b in keyed mode is a
    PRF and a MAC by design (RFC 7693: the key fills the first block; no length extension), so a
    key reveals neither the secret, the tenant nor the id, and nobody without the secret can
    compute one. The subkey ``K`` is used for nothing else (the other uses of the secret,
    :meth:`tenant_tag`, :meth:`cache_salt`, the store's record MAC and the Redis verifier, each
    have their own label). The message is injective: conversation ids never contain 0x00 (the id
    rule), so the last 0x00 splits tenant from id, and the same id of another tenant is another
    key. BLAKE2b's state is copied with a ``memcpy`` (CPython's own ``_blake2``, no OpenSSL
    context), so :meth:`keys` of a 10,000-id renew costs one copy, one update and one digest per
    id, where HMAC-SHA256 cost two OpenSSL context copies and two hashes. Changing the keys (v1,
    then v2: 256 bits) forgets state written by an older router (its conversations start again as
    ``first``, and a renew answers ``unknown``); mixed-version replicas do not share state.
    """

    __slots__ = ("_cache", "_cache_max", "_cached", "_key", "_secret", "_tags")

    #: Default bound of the key cache (:meth:`remember`), in entries over all tenants: five full
    #: renews' worth, under 20 MB (ids of up to 128 characters). The cache is this process's
    #: memory only (ids as a request holds them, tenants as :func:`tenant_from` names them: a
    #: token only as its hash); it is never written to the store or logged.
    CACHE_MAX = 50_000

    def __init__(self, secret: str, cache_max: int = CACHE_MAX) -> None:
        self._secret = secret.encode("utf-8")
        self._key = hmac.digest(self._secret, _STATE_KEY_LABEL, "sha256")
        #: tenant -> {conversation id: key}, :attr:`_cached` entries in all, at most ``cache_max``.
        self._cache: dict[str, dict[str, str]] = {}
        self._cache_max = max(0, cache_max)
        self._cached = 0
        #: tenant -> its tag (every kvlease-mode turn sends one): at most :data:`_TAGS_MAX`.
        self._tags: dict[str, str] = {}

    def key(self, tenant: str, conversation_id: str) -> str:
        msg = tenant.encode("utf-8", "surrogatepass") + b"\x00" + conversation_id.encode("ascii")
        return hashlib.blake2b(msg, key=self._key, digest_size=KEY_BYTES).hexdigest()

    def keys(self, tenant: str, conversation_ids: Sequence[str]) -> list[str]:
        """``key(tenant, cid)`` of each id: equal to :meth:`key` for every id."""
        return self.lookup(tenant, conversation_ids)[0]

    def lookup(self, tenant: str, conversation_ids: Sequence[str]) -> tuple[list[str], Sequence[int]]:
        """(``key(tenant, cid)`` of each id, the indexes of the ids that were not in the cache).

        Cached keys (:meth:`remember`) cost a dict lookup; the others are computed from one
        BLAKE2b state primed with the key and the tenant (a renew keys thousands of ids), in one
        loop (no Python call per id). Nothing is added to the cache here: a caller remembers only
        the ids it found state for, so the random ids of an attacker never fill it."""
        cached = self._cache.get(tenant)
        got: list[str | None] | None = None
        if cached is not None:
            got = list(map(cached.get, conversation_ids))
            if all(got):  # every one cached (a key is never empty; cheaper than ``None in``)
                return got, ()  # type: ignore[return-value]
        base = hashlib.blake2b(key=self._key, digest_size=KEY_BYTES)
        base.update(tenant.encode("utf-8", "surrogatepass") + b"\x00")
        copy = base.copy
        if got is None or not any(got):  # none cached
            keys: list[str] = []
            append = keys.append
            for cid in conversation_ids:
                h = copy()
                h.update(cid.encode("ascii"))
                append(h.hexdigest())
            return keys, range(len(keys))
        missed: list[int] = []
        for i, cid in enumerate(conversation_ids):
            if got[i] is None:
                h = copy()
                h.update(cid.encode("ascii"))
                got[i] = h.hexdigest()
                missed.append(i)
        return got, missed  # type: ignore[return-value]

    def remember(self, tenant: str, pairs: Sequence[tuple[str, str]]) -> None:
        """Cache ``(conversation id, key)`` pairs of ``tenant`` (each key from :meth:`lookup`: a
        pure function of the secret, the tenant and the id, so a cached key is always the right
        one). Bounded: past ``cache_max`` entries over all tenants the whole cache is dropped
        (O(1) bookkeeping, no per-entry recency) and refills from the next renews."""
        if not pairs or not self._cache_max:
            return
        if self._cached + len(pairs) > self._cache_max:
            self._cache.clear()
            self._cached = 0
            pairs = pairs[: self._cache_max]
        cached = self._cache.setdefault(tenant, {})
        before = len(cached)
        cached.update(pairs)
        self._cached += len(cached) - before

    @property
    def cached(self) -> int:
        """Keys in the cache (over all tenants)."""
        return self._cached

    def tenant_tag(self, tenant: str) -> str:
        """An opaque tag of a tenant for the decode nodes' retention quota (reveals nothing): sent
        with P's and D's requests in kvlease mode (D tags each lease at creation) and with renews."""
        tag = self._tags.get(tenant)
        if tag is None:
            msg = b"tenant_tag\x00" + tenant.encode("utf-8", "surrogatepass")
            tag = hmac.digest(self._secret, msg, "sha256").hex()[:24]
            if len(self._tags) >= _TAGS_MAX:  # made-up tokens cannot grow it: cleared whole
                self._tags.clear()
            self._tags[tenant] = tag
        return tag

    def cache_salt(self, tenant: str, client_salt: str = "") -> str:
        """vLLM ``cache_salt`` of a tenant (and the client's own salt): prefix-cache entries and
        verified-pull hashes of one tenant never match another's, and the value reveals neither."""
        msg = b"cache_salt\x00" + tenant.encode("utf-8", "surrogatepass") + b"\x00"
        msg += client_salt.encode("utf-8", "surrogatepass")
        return hmac.digest(self._secret, msg, "sha256").hex()[:32]


def log_ref(key: str) -> str:
    """A short reference to a conversation for logs (a prefix of its HMAC key, never the raw id)."""
    return key[:12]
