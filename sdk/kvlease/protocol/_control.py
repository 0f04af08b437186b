"""Router / prefill node -> the kvlease connector's control endpoint on each vLLM server."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from kvlease.protocol._common import PROTOCOL_VERSION, ProtocolError, _id_list, _int_field, _is_number

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
