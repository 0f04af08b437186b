"""Identity, headers, statuses and the lease API: client <-> router."""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Final

from kvlease.protocol._common import (
    PROTOCOL_VERSION,
    RENEW_MAX_IDS,
    InvalidConversationId,
    ProtocolError,
    _is_number,
)

# --------------------------------------------------------------------------------------------------
# Client -> router
# --------------------------------------------------------------------------------------------------

#: Conversation identity, first found wins (headers are matched case-insensitively).
HEADER_CONVERSATION_ID: Final = "X-Conversation-Id"
BODY_CONVERSATION_ID: Final = "conversation_id"  # vLLM multi-turn proxy compatibility; stripped
HEADER_SESSION_ID: Final = "X-Session-Id"
BODY_PROMPT_CACHE_KEY: Final = "prompt_cache_key"

#: Per-turn opt-out of KV reuse (sent by the SDK on a stripped trace or an edited history).
HEADER_REUSE: Final = "X-KVLease-Reuse"
REUSE_OFF: Final = "off"

#: Optional tenant header (the router is configured to trust it, else the bearer token is used).
DEFAULT_TENANT_HEADER: Final = "X-KVLease-Tenant"
#: The client's bearer token: the default tenant, forwarded to the vLLM servers as it came.
HEADER_AUTHORIZATION: Final = "Authorization"
#: Azure-style API key header; the SDK copies it (like ``Authorization``) to renew and release.
HEADER_API_KEY: Final = "api-key"

#: Conversation ids: 1-128 characters of [A-Za-z0-9._:-].
CONVERSATION_ID_MAX_LEN: Final = 128
CONVERSATION_ID_PATTERN: Final = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
#: The bytes of :data:`CONVERSATION_ID_PATTERN`'s alphabet (:func:`_valid_ids` checks in bulk).
_ID_BYTES: Final = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-"

#: Fields a server may use for an assistant message's reasoning text (vLLM's reasoning parsers), in
#: lookup order: when a message carries both non-empty, ``reasoning`` (vLLM's current name) wins.
#: The first is also the name a client writes back when it does not know which one the server used.
REASONING_FIELDS: Final = ("reasoning", "reasoning_content")

#: The last event of an OpenAI-style SSE stream, and its ``data:`` payload.
SSE_DONE_DATA: Final = "[DONE]"
SSE_DONE: Final = f"data: {SSE_DONE_DATA}\n\n"

# --------------------------------------------------------------------------------------------------
# Router -> client
# --------------------------------------------------------------------------------------------------

HEADER_STATUS: Final = "X-KVLease-Status"
HEADER_REUSED_TOKENS: Final = "X-KVLease-Reused-Tokens"
HEADER_TTL: Final = "X-KVLease-TTL"
#: Whether the prefill node verifies tokens before it pulls, on every completion response of a
#: router. ``tokens``: the kvlease connector pulls only the token-verified common prefix of the new
#: prompt and what the decode node holds, so a history that changed part-way is still safe to offer
#: (everything before the first changed token is reused). ``none``: stock vLLM pulls by length, so a
#: client must opt out of reuse (:data:`HEADER_REUSE`) when its history is not an exact extension.
#: A server that sends no such header is treated as ``none``.
HEADER_VERIFIED: Final = "X-KVLease-Verified"
VERIFIED_TOKENS: Final = "tokens"
VERIFIED_NONE: Final = "none"

#: Every kvlease response header, for code that copies or strips them.
RESPONSE_HEADERS: Final = (HEADER_STATUS, HEADER_REUSED_TOKENS, HEADER_TTL, HEADER_VERIFIED)


class ReuseStatus(str, enum.Enum):
    """What happened to KV reuse on one turn (value of ``X-KVLease-Status``)."""

    HIT = "hit"  # P pulled D's blocks (some or all of the prompt was not recomputed)
    MISS = "miss"  # a handle was expected but none was usable (evicted, declined, no capture)
    #: nothing left to pull: P's own prefix cache already covered the verified prefix (P recomputed
    #: nothing it could have pulled). An SDK that predates it reads the value as no status.
    LOCAL_HIT = "local_hit"
    FIRST = "first"  # first turn of a conversation: nothing to reuse yet
    EXPIRED = "expired"  # the lease on D ran out before this turn
    MISMATCH = "mismatch"  # the new prompt does not extend what D holds
    DISABLED = "disabled"  # reuse switched off (client opt-out, router config)
    NO_ID = "no-id"  # the request carried no conversation id
    ERROR = "error"  # the reuse path failed; the turn was recomputed

    @classmethod
    def parse(cls, value: str | None) -> ReuseStatus | None:
        """The status for a header value, or ``None`` for absent/unknown values (plain vLLM)."""
        if value is None:
            return None
        try:
            return cls(value.strip().lower())
        except ValueError:
            return None


# --------------------------------------------------------------------------------------------------
# Lease API on the router (same auth as chat)
# --------------------------------------------------------------------------------------------------

CHAT_COMPLETIONS_PATH: Final = "/v1/chat/completions"
COMPLETIONS_PATH: Final = "/v1/completions"
RENEW_PATH: Final = "/v1/kvlease/renew"
CONVERSATIONS_PATH: Final = "/v1/kvlease/conversations"  # DELETE {CONVERSATIONS_PATH}/{id}
STATUS_PATH: Final = "/v1/kvlease/status"
METRICS_PATH: Final = "/metrics"
HEALTH_PATH: Final = "/health"

LEASE_UNKNOWN: Final = "unknown"


def validate_conversation_id(value: object) -> str:
    """Return ``value`` if it is a valid conversation id, else raise :class:`InvalidConversationId`."""
    if not isinstance(value, str):
        raise InvalidConversationId(f"conversation id must be a string, not {type(value).__name__}")
    if not value:
        raise InvalidConversationId("conversation id must not be empty")
    if len(value) > CONVERSATION_ID_MAX_LEN:
        raise InvalidConversationId(
            f"conversation id is {len(value)} characters long; at most {CONVERSATION_ID_MAX_LEN} allowed"
        )
    if CONVERSATION_ID_PATTERN.fullmatch(value) is None:
        raise InvalidConversationId("conversation id may contain only letters, digits and . _ : -")
    return value


def _valid_ids(ids: Sequence[object]) -> bool:
    """Whether every item is a valid conversation id (as :func:`validate_conversation_id` would
    say of each), checked in a few C passes over all of them (a renew carries up to 10,000): the
    join refuses anything but strings, the ASCII encoding anything outside ASCII, deleting the id
    alphabet leaves exactly the separators only where nothing else was there (an id holding a
    newline leaves one more), and the lengths are 1..128."""
    if not ids:
        return True
    try:
        raw = "\n".join(ids).encode("ascii")  # type: ignore[arg-type]
    except (TypeError, UnicodeEncodeError):
        return False
    if raw.translate(None, _ID_BYTES) != b"\n" * (len(ids) - 1):
        return False
    lengths = list(map(len, ids))  # type: ignore[arg-type]
    return min(lengths) >= 1 and max(lengths) <= CONVERSATION_ID_MAX_LEN


def _json_plain(strings: Iterable[object]) -> bool:
    """Whether every item is a string JSON writes as it is (printable ASCII, no quote, no
    backslash), checked in C passes over all of them at once."""
    try:
        joined = "".join(strings)  # type: ignore[arg-type]
    except TypeError:
        return False
    return joined.isascii() and joined.isprintable() and '"' not in joined and "\\" not in joined


def conversation_path(conversation_id: str) -> str:
    """Path of the release endpoint for one conversation."""
    return f"{CONVERSATIONS_PATH}/{validate_conversation_id(conversation_id)}"


@dataclass(frozen=True)
class RenewRequest:
    """``POST /v1/kvlease/renew`` body: ``{"conversation_ids": [...]}``."""

    conversation_ids: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"conversation_ids": list(self.conversation_ids)}

    @classmethod
    def from_json(cls, data: object) -> RenewRequest:
        if not isinstance(data, Mapping):
            raise ProtocolError("renew body must be a JSON object")
        ids = data.get("conversation_ids")
        if not isinstance(ids, list):
            raise ProtocolError("conversation_ids must be a list of strings")
        if len(ids) > RENEW_MAX_IDS:
            raise ProtocolError(f"at most {RENEW_MAX_IDS} conversation_ids per renew request")
        if _valid_ids(ids):  # all at once; else the first bad id says what is wrong with it
            return cls(tuple(ids))
        return cls(tuple(validate_conversation_id(i) for i in ids))


def _lease_json(expires_in: float | None) -> dict[str, Any]:
    """One id's entry in a renew answer."""
    return {"status": LEASE_UNKNOWN} if expires_in is None else {"expires_in": round(expires_in, 3)}


@dataclass(frozen=True)
class RenewResponse:
    """``POST /v1/kvlease/renew`` answer.

    JSON: ``{"ttl": 300.0, "leases": {"<id>": {"expires_in": 291.5} | {"status": "unknown"}}}``.
    ``expires_in`` is seconds from now; ``None`` in :attr:`leases` means unknown (no lease: stop
    renewing it).
    """

    leases: Mapping[str, float | None]
    ttl: float | None = None

    def to_json(self) -> dict[str, Any]:
        # one object per distinct value, shared by every id that has it (serialized alike): a renew
        # of 10,000 leases D renewed alike builds two objects, not 10,000. A set keeps the first of
        # equal values (``0.0`` and ``-0.0``), so each id gets the object of the first value equal
        # to its own; where all are alike (all renewed alike, all unknown) one ``fromkeys``.
        leases = self.leases
        values = set(leases.values())
        shared = {exp: _lease_json(exp) for exp in values}
        if len(values) == 1:
            out = dict.fromkeys(leases, shared[values.pop()])
        else:
            out = {cid: shared[exp] for cid, exp in leases.items()}
        body: dict[str, Any] = {"leases": out}
        if self.ttl is not None:
            body["ttl"] = self.ttl
        return body

    def dumps(self) -> bytes:
        """``orjson.dumps(self.to_json())``, byte for byte. Where every id has the same lease (a
        keeper's renew that D renewed alike, or all unknown) and no id needs a JSON escape, the ids
        are joined around that lease's one serialized object instead of serializing it once per id."""
        import orjson  # here: the protocol also runs inside vLLM (the connector), without orjson

        leases = self.leases
        values = set(leases.values())
        if len(values) != 1 or not _json_plain(leases):
            return orjson.dumps(self.to_json())
        text = orjson.dumps(_lease_json(values.pop())).decode("ascii")
        ids = list(leases)
        ttl = "" if self.ttl is None else ',"ttl":' + orjson.dumps(self.ttl).decode("ascii")
        body = '{"leases":{"' + ('":' + text + ',"').join(ids) + '":' + text + "}" + ttl + "}"
        return body.encode("ascii")

    @classmethod
    def from_json(cls, data: object) -> RenewResponse:
        if not isinstance(data, Mapping) or not isinstance(data.get("leases"), Mapping):
            raise ProtocolError("renew response must be an object with a 'leases' object")
        leases: dict[str, float | None] = {}
        for cid, item in data["leases"].items():
            exp = item.get("expires_in") if isinstance(item, Mapping) else None
            leases[str(cid)] = float(exp) if _is_number(exp) else None
        ttl = data.get("ttl")
        return cls(leases, float(ttl) if _is_number(ttl) else None)


@dataclass(frozen=True)
class ReleaseResponse:
    """``DELETE /v1/kvlease/conversations/{id}`` answer.

    JSON: ``{"conversation_id": "<id>", "known": true, "released": true}``: ``known``: the router
    had state for it; ``released``: the decode node freed its blocks now (else they lapse on their own).
    """

    conversation_id: str
    known: bool
    released: bool

    def to_json(self) -> dict[str, Any]:
        return {"conversation_id": self.conversation_id, "known": self.known, "released": self.released}

    @classmethod
    def from_json(cls, data: object) -> ReleaseResponse:
        if not isinstance(data, Mapping) or not isinstance(data.get("conversation_id"), str):
            raise ProtocolError("release answer must be an object with a 'conversation_id'")
        return cls(data["conversation_id"], data.get("known") is True, data.get("released") is True)


# --------------------------------------------------------------------------------------------------
# The router's /v1/kvlease/status and /health
# --------------------------------------------------------------------------------------------------

#: ``RouterStatus.mode``: a kvlease cluster (renewals, verified pulls), or stock vLLM nodes.
MODE_KVLEASE: Final = "kvlease"
MODE_STOCK_VLLM: Final = "stock-vllm"

#: ``RouterHealth.status`` (HTTP 200 with ``ok``, 503 with ``degraded``).
HEALTH_OK: Final = "ok"
HEALTH_DEGRADED: Final = "degraded"


@dataclass(frozen=True)
class RouterHealth:
    """``GET /health`` of the router: ``ok`` when a prefill and a decode node are healthy."""

    prefill_healthy: bool
    decode_healthy: bool

    @property
    def ok(self) -> bool:
        return self.prefill_healthy and self.decode_healthy

    def to_json(self) -> dict[str, Any]:
        return {
            "status": HEALTH_OK if self.ok else HEALTH_DEGRADED,
            "prefill_healthy": self.prefill_healthy,
            "decode_healthy": self.decode_healthy,
        }

    @classmethod
    def from_json(cls, data: object) -> RouterHealth:
        if not isinstance(data, Mapping):
            raise ProtocolError("health must be a JSON object")
        return cls(data.get("prefill_healthy") is True, data.get("decode_healthy") is True)


@dataclass(frozen=True)
class RouterStatus:
    """``GET /v1/kvlease/status``: what the router runs with (keys in this order).

    ``prefill`` / ``decode``: one description object per node (url, health, role facts, and
    ``transport``: the NIXL READ transport the node reported in its ``/info``, null if it did not).
    """

    kvlease_version: str
    protocol_version: int
    mode: str  # MODE_KVLEASE or MODE_STOCK_VLLM
    renewals: bool
    reuse: bool
    verified_pull: bool
    stream_capture: bool
    notes: tuple[str, ...]
    ttl_s: float
    decode_ttl_s: float
    ttl_margin_s: float
    model: str | None
    vllm_version: str | None
    block_size: int | None
    store: str
    tenant_header: str | None
    uptime_s: float
    prefill: tuple[Mapping[str, Any], ...] = field(default=())
    decode: tuple[Mapping[str, Any], ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["notes"] = list(self.notes)
        out["prefill"] = [dict(n) for n in self.prefill]
        out["decode"] = [dict(n) for n in self.decode]
        return out

    @classmethod
    def from_json(cls, data: object) -> RouterStatus:
        if not isinstance(data, Mapping) or not isinstance(data.get("mode"), str):
            raise ProtocolError("status must be a JSON object with a 'mode'")
        kw: dict[str, Any] = {f.name: data.get(f.name) for f in fields(cls)}
        if not isinstance(kw["protocol_version"], int):
            kw["protocol_version"] = PROTOCOL_VERSION
        for name in ("notes", "prefill", "decode"):
            items = kw[name]
            kw[name] = tuple(items) if isinstance(items, Sequence) and not isinstance(items, str) else ()
        return cls(**kw)
