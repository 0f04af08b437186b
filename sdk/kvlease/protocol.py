"""The kvlease wire contract: the single source of truth.

Every header, body field, status value, path and JSON shape that crosses a process boundary between
the SDK, the router and the vLLM connector is spelled here and nowhere else. This module has no
dependencies beyond the standard library, so the connector (inside vLLM) and the router import it
without pulling in the SDK's HTTP stack.

Shapes are frozen dataclasses with ``to_json()`` / ``from_json()``; untrusted ``dict[str, Any]`` is
parsed once, here, at the edge, and anything malformed raises :class:`ProtocolError` (a
``ValueError``) with a message that names the field.
"""

from __future__ import annotations

import enum
import hashlib
import math
import re
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeGuard

PROTOCOL_VERSION: Final = 1

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

#: Conversation ids: 1-128 characters of [A-Za-z0-9._:-].
CONVERSATION_ID_MAX_LEN: Final = 128
CONVERSATION_ID_PATTERN: Final = re.compile(r"[A-Za-z0-9._:\-]{1,128}")

# --------------------------------------------------------------------------------------------------
# Router -> client
# --------------------------------------------------------------------------------------------------

HEADER_STATUS: Final = "X-KVLease-Status"
HEADER_REUSED_TOKENS: Final = "X-KVLease-Reused-Tokens"
HEADER_TTL: Final = "X-KVLease-TTL"

#: Every kvlease response header, for code that copies or strips them.
RESPONSE_HEADERS: Final = (HEADER_STATUS, HEADER_REUSED_TOKENS, HEADER_TTL)


class ReuseStatus(str, enum.Enum):
    """What happened to KV reuse on one turn (value of ``X-KVLease-Status``)."""

    HIT = "hit"  # P pulled D's blocks (some or all of the prompt was not recomputed)
    MISS = "miss"  # a handle was expected but none was usable (evicted, declined, no capture)
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

#: Upper bound of ids in one renew request.
RENEW_MAX_IDS: Final = 10_000

LEASE_UNKNOWN: Final = "unknown"


class ProtocolError(ValueError):
    """A message of the wire contract is malformed; the text names the field."""


class InvalidConversationId(ProtocolError):
    """A conversation id is empty, longer than 128 characters or has characters outside [A-Za-z0-9._:-]."""


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
        return cls(tuple(validate_conversation_id(i) for i in ids))


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
        out: dict[str, Any] = {}
        for cid, exp in self.leases.items():
            out[cid] = {"status": LEASE_UNKNOWN} if exp is None else {"expires_in": round(exp, 3)}
        body: dict[str, Any] = {"leases": out}
        if self.ttl is not None:
            body["ttl"] = self.ttl
        return body

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


# --------------------------------------------------------------------------------------------------
# Router -> vLLM: vLLM's own P/D protocol (kv_transfer_params) plus the kvlease sub-object
# --------------------------------------------------------------------------------------------------

KV_TRANSFER_PARAMS: Final = "kv_transfer_params"
CACHE_SALT: Final = "cache_salt"


class KV:
    """Field names inside vLLM's ``kv_transfer_params`` (NixlConnector, vLLM 0.32)."""

    DO_REMOTE_DECODE: Final = "do_remote_decode"
    DO_REMOTE_PREFILL: Final = "do_remote_prefill"
    REMOTE_ENGINE_ID: Final = "remote_engine_id"
    REMOTE_BLOCK_IDS: Final = "remote_block_ids"
    REMOTE_REQUEST_ID: Final = "remote_request_id"
    REMOTE_HOST: Final = "remote_host"
    REMOTE_PORT: Final = "remote_port"
    REMOTE_NUM_TOKENS: Final = "remote_num_tokens"
    REMOTE_BLOCKS_EXPIRY_TIME: Final = "remote_blocks_expiry_time"
    TP_SIZE: Final = "tp_size"
    KVLEASE: Final = "kvlease"  # the sub-object the kvlease connector adds and reads


#: Keys of the ``kvlease`` sub-object of *P's* response params: what P's verified pull did on this
#: turn, so the router can report it. ``reused_tokens``: prompt tokens taken from D's blocks (0 if
#: none); ``reuse``: a :class:`ReuseStatus` value (``hit``, ``miss``, ``mismatch``, ``expired``).
PREFILL_REUSED_TOKENS: Final = "reused_tokens"
PREFILL_REUSE_STATUS: Final = "reuse"


def prefill_request_params() -> dict[str, Any]:
    """The ``kv_transfer_params`` a router sends to P on a turn with no handle to reuse."""
    return {
        KV.DO_REMOTE_DECODE: True,
        KV.DO_REMOTE_PREFILL: False,
        KV.REMOTE_ENGINE_ID: None,
        KV.REMOTE_BLOCK_IDS: None,
        KV.REMOTE_HOST: None,
        KV.REMOTE_PORT: None,
    }


#: Domain separation for block hashes; bump with PROTOCOL_VERSION if the scheme changes.
_HASH_DOMAIN: Final = b"kvlease/block-hash/v1"
BLOCK_HASH_BYTES: Final = 16


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[str]:
    """Chained hashes of the *full* blocks of ``token_ids`` (a partial last block is not hashed).

    ``h[i] = sha256(h[i-1] || int32le(tokens of block i))[:16]`` with ``h[-1] = sha256(domain ||
    salt)``. Equal hash at index ``i`` means equal tokens in blocks ``0..i`` (up to SHA-256
    collisions), so the longest common prefix of two hash lists is the longest common token prefix
    in whole blocks. ``cache_salt`` seeds the chain, so two tenants' blocks never match.
    """
    if block_size <= 0:
        raise ProtocolError("block_size must be positive")
    parent = _hash_seed(salt)
    out: list[str] = []
    n_full = len(token_ids) // block_size
    for i in range(n_full):
        chunk = array("i", token_ids[i * block_size : (i + 1) * block_size]).tobytes()
        parent = hashlib.sha256(parent + chunk).digest()[:BLOCK_HASH_BYTES]
        out.append(parent.hex())
    return out


def _hash_seed(salt: str | None) -> bytes:
    return hashlib.sha256(_HASH_DOMAIN + b"\x00" + (salt or "").encode("utf-8")).digest()[:BLOCK_HASH_BYTES]


def tail_hash(tail_token_ids: Sequence[int], parent: str | None, salt: str | None = None) -> str:
    """Hash of a *partial* last block, chained on the hash of the last full block before it.

    ``parent`` is that full block's hash (hex), or ``None`` when the sequence is shorter than one
    block (the chain's salted seed is used). A tag keeps it apart from full-block hashes, so equal
    tails mean equal tokens up to the very last one D computed: P may then pull the partial block
    too instead of recomputing up to ``block_size - 1`` tokens.
    """
    base = _hash_seed(salt) if parent is None else bytes.fromhex(parent)
    chunk = array("i", tail_token_ids).tobytes()
    return hashlib.sha256(base + _TAIL_TAG + chunk).digest()[:BLOCK_HASH_BYTES].hex()


_TAIL_TAG: Final = b"\x01tail"


def common_prefix_blocks(ours: Sequence[str], theirs: Sequence[str]) -> int:
    """Number of leading blocks whose chained hashes agree."""
    n = 0
    for a, b in zip(ours, theirs):
        if a != b:
            break
        n += 1
    return n


#: Key of an HMAC-SHA256 (hex) that D adds to its ``kvlease`` object when its control secret is set:
#: over the handle's routing fields and the rest of the ``kvlease`` object, keyed by the shared
#: control secret. P refuses a handle whose MAC is missing or wrong (a client edited it).
LEASE_HANDLE_MAC: Final = "mac"


@dataclass(frozen=True)
class LeaseHandleExt:
    """The ``kvlease`` sub-object of D's ``kv_transfer_params``.

    JSON: ``{"v": 1, "block_size": 16, "num_tokens": 1234, "hashes": ["<32 hex>", ...],
    "tail": "<32 hex>" | null, "lease_id": "<D's request id>", "engine_id": "...",
    "control": "http://host:port" | null}``.
    ``hashes`` cover the full blocks of D's retained sequence (prompt + generated tokens); ``tail``
    (optional, :func:`tail_hash`) its partial last block, when ``num_tokens`` is not a multiple of
    ``block_size``. A reader that does not know ``tail`` simply pulls whole blocks only.
    """

    block_size: int
    num_tokens: int
    hashes: tuple[str, ...]
    lease_id: str
    engine_id: str | None = None
    control: str | None = None
    version: int = PROTOCOL_VERSION
    tail: str | None = None

    MAX_BLOCKS: Final = 1 << 20

    def to_json(self) -> dict[str, Any]:
        return {
            "v": self.version,
            "block_size": self.block_size,
            "num_tokens": self.num_tokens,
            "hashes": list(self.hashes),
            "tail": self.tail,
            "lease_id": self.lease_id,
            "engine_id": self.engine_id,
            "control": self.control,
        }

    @classmethod
    def from_json(cls, data: object) -> LeaseHandleExt:
        if not isinstance(data, Mapping):
            raise ProtocolError("kvlease must be an object")
        version = data.get("v")
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"kvlease.v is {version!r}; this build speaks {PROTOCOL_VERSION}")
        bs = _int_field(data, "block_size", 1, 1 << 16)
        nt = _int_field(data, "num_tokens", 0, 1 << 31)
        hashes = data.get("hashes")
        if not isinstance(hashes, list) or len(hashes) > cls.MAX_BLOCKS:
            raise ProtocolError("kvlease.hashes must be a list of hex strings")
        for h in hashes:
            if not isinstance(h, str) or len(h) != 2 * BLOCK_HASH_BYTES:
                raise ProtocolError("kvlease.hashes must be a list of 32-character hex strings")
        if len(hashes) > nt // bs:
            raise ProtocolError("kvlease.hashes covers more blocks than num_tokens")
        tail = data.get("tail")
        if tail is not None and (
            not isinstance(tail, str) or len(tail) != 2 * BLOCK_HASH_BYTES or nt % bs == 0
        ):
            raise ProtocolError("kvlease.tail must be null or a 32-character hex string (partial block only)")
        lease_id = data.get("lease_id")
        if not isinstance(lease_id, str) or not lease_id or len(lease_id) > 512:
            raise ProtocolError("kvlease.lease_id must be a non-empty string")
        engine_id = data.get("engine_id")
        control = data.get("control")
        return cls(
            block_size=bs,
            num_tokens=nt,
            hashes=tuple(hashes),
            lease_id=lease_id,
            engine_id=engine_id if isinstance(engine_id, str) else None,
            control=control if isinstance(control, str) else None,
            version=PROTOCOL_VERSION,
            tail=tail,
        )


# --------------------------------------------------------------------------------------------------
# Router -> kvlease connector control endpoint (opened by the scheduler-side connector)
# --------------------------------------------------------------------------------------------------

CONTROL_INFO_PATH: Final = "/info"
CONTROL_RENEW_PATH: Final = "/renew"
CONTROL_RELEASE_PATH: Final = "/release"
CONTROL_METRICS_PATH: Final = "/metrics"
#: Shared-secret auth on the control endpoint: ``Authorization: Bearer <secret>``.
CONTROL_AUTH_HEADER: Final = "Authorization"
CONTROL_SECRET_ENV: Final = "KVLEASE_CONTROL_SECRET"


class Role(str, enum.Enum):
    PREFILL = "prefill"  # kv_producer
    DECODE = "decode"  # kv_consumer
    BOTH = "both"


@dataclass(frozen=True)
class ControlInfo:
    """``GET /info`` of a kvlease connector."""

    role: Role
    engine_id: str
    vllm_version: str
    kvlease_version: str
    bidirectional_kv_xfer: bool
    ttl_s: float
    recompute_threshold: int
    block_size: int
    model: str | None = None
    protocol_version: int = PROTOCOL_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "role": self.role.value,
            "engine_id": self.engine_id,
            "vllm_version": self.vllm_version,
            "kvlease_version": self.kvlease_version,
            "bidirectional_kv_xfer": self.bidirectional_kv_xfer,
            "ttl_s": self.ttl_s,
            "recompute_threshold": self.recompute_threshold,
            "block_size": self.block_size,
            "model": self.model,
            "protocol_version": self.protocol_version,
        }

    @classmethod
    def from_json(cls, data: object) -> ControlInfo:
        if not isinstance(data, Mapping):
            raise ProtocolError("info must be a JSON object")
        try:
            role = Role(data.get("role"))
        except ValueError as e:
            raise ProtocolError(f"info.role is {data.get('role')!r}") from e
        ttl = data.get("ttl_s")
        if not _is_number(ttl):
            raise ProtocolError("info.ttl_s must be a number")
        model = data.get("model")
        return cls(
            role=role,
            engine_id=str(data.get("engine_id", "")),
            vllm_version=str(data.get("vllm_version", "")),
            kvlease_version=str(data.get("kvlease_version", "")),
            bidirectional_kv_xfer=bool(data.get("bidirectional_kv_xfer")),
            ttl_s=float(ttl),
            recompute_threshold=_int_field(data, "recompute_threshold", 0, 1 << 31),
            block_size=_int_field(data, "block_size", 1, 1 << 16),
            model=model if isinstance(model, str) else None,
            protocol_version=_int_field(data, "protocol_version", 0, 1 << 16),
        )


@dataclass(frozen=True)
class ControlRenewRequest:
    """``POST /renew`` on D: ``{"request_ids": [...], "ttl": 300.0}``.

    ``"claim": true`` (sent by a prefill node right before it reads a lease) also pins the lease
    for ``ttl`` seconds: D will not release it early to make room.
    """

    request_ids: tuple[str, ...]
    ttl: float
    claim: bool = False

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"request_ids": list(self.request_ids), "ttl": self.ttl}
        if self.claim:
            body["claim"] = True
        return body

    @classmethod
    def from_json(cls, data: object) -> ControlRenewRequest:
        ids = _id_list(data, "request_ids")
        ttl = data.get("ttl") if isinstance(data, Mapping) else None
        if not _is_number(ttl) or not 0 < float(ttl) <= 86_400:
            raise ProtocolError("ttl must be a number of seconds in (0, 86400]")
        claim = data.get("claim", False) if isinstance(data, Mapping) else False
        if not isinstance(claim, bool):
            raise ProtocolError("claim must be true or false")
        return cls(ids, float(ttl), claim)


@dataclass(frozen=True)
class ControlRenewResponse:
    """``POST /renew`` answer: ``{"expires_in": {"<request id>": 299.9 | null}}`` (null: unknown)."""

    expires_in: Mapping[str, float | None]

    def to_json(self) -> dict[str, Any]:
        return {"expires_in": {k: (None if v is None else round(v, 3)) for k, v in self.expires_in.items()}}

    @classmethod
    def from_json(cls, data: object) -> ControlRenewResponse:
        if not isinstance(data, Mapping) or not isinstance(data.get("expires_in"), Mapping):
            raise ProtocolError("renew answer must be an object with 'expires_in'")
        return cls({str(k): (float(v) if _is_number(v) else None) for k, v in data["expires_in"].items()})


@dataclass(frozen=True)
class ControlReleaseRequest:
    """``POST /release`` on D: ``{"request_ids": [...]}``; answer ``{"released": n}``."""

    request_ids: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"request_ids": list(self.request_ids)}

    @classmethod
    def from_json(cls, data: object) -> ControlReleaseRequest:
        return cls(_id_list(data, "request_ids"))


# --------------------------------------------------------------------------------------------------
# Turn log (SDK -> analyzer)
# --------------------------------------------------------------------------------------------------

#: Keys of one turn-log JSON line, in order.
TURN_LOG_FIELDS: Final = (
    "conversation_id",
    "ts",
    "prompt_tokens",
    "completion_tokens",
    "ttft_s",
    "status",
    "reused_tokens",
    "gap_s",
)


@dataclass(frozen=True)
class TurnLogRecord:
    """One line of the SDK turn log (``ts`` is the turn's start, epoch seconds)."""

    conversation_id: str
    ts: float
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    status: str | None = None
    reused_tokens: int | None = None
    gap_s: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in TURN_LOG_FIELDS}
        out.update(self.extra)
        return out


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def _is_number(v: object) -> TypeGuard[int | float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int_field(data: Mapping[str, Any], name: str, lo: int, hi: int) -> int:
    v = data.get(name)
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
