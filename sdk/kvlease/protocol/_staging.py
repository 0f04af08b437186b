"""P's worker <-> D's worker: the staging side channel of staged pulls (sans-IO)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from kvlease.protocol._common import ProtocolError, _int_field
from kvlease.protocol._handle import LeaseHandleExt, _is_int

#
# P asks D's staging listener (the port in ``kvlease.staging``) to gather a leased request's blocks
# into D's registered staging buffer; D answers where they lie; P reads them with ONE NIXL READ,
# scatters them into its own blocks and releases D's range. A frame is a 4-byte big-endian length
# and a JSON object.

STAGING_OP_STAGE: Final = "stage"
STAGING_OP_RELEASE: Final = "release"
STAGING_MAX_FRAME: Final = 64 << 20
_STAGING_MAX_REGIONS: Final = 1 << 16


#: :attr:`StagingReply.source` values (the ``source`` label of ``kvlease_pulls_total`` on P).
STAGED_FROM_DEVICE: Final = "device"
STAGED_FROM_HOST: Final = "host"


class StagingRefusal:
    """Why D did not stage (P then pulls block by block, as upstream does)."""

    BUSY: Final = "busy"  # the staging buffer has no free range of that size now
    TOO_LARGE: Final = "too_large"  # larger than D's whole staging buffer
    UNKNOWN_LEASE: Final = "unknown_lease"  # D's worker holds no such request (expired, read, released)
    LAYOUT: Final = "layout"  # P's KV regions differ from D's
    BAD_REQUEST: Final = "bad_request"
    UNAUTHORIZED: Final = "unauthorized"  # no or a wrong ``auth`` token (the control secret's)
    ERROR: Final = "error"  # the gather failed
    ALL: Final = frozenset({BUSY, TOO_LARGE, UNKNOWN_LEASE, LAYOUT, BAD_REQUEST, UNAUTHORIZED, ERROR})


@dataclass(frozen=True)
class StagingRequest:
    """``{"op": "stage", "lease_id": ..., "block_ids": [...], "region_bytes": [...],
    "read_deadline_ms": n}`` or ``{"op": "release", "lease_id": ..., "slot": n}``.

    ``lease_id``: D's request id (the handle's ``remote_request_id``); ``block_ids``: D's block ids
    to gather, in P's read order; ``region_bytes``: P's bytes per block of every registered KV region
    (D refuses unless they equal its own); ``slot``: the range D answered, to free; ``auth``: the
    token derived from the shared control secret (D refuses a request without the right one);
    ``read_deadline_ms``: P uses the staged bytes only if its READ of them is done within this many
    milliseconds of sending the request, and D keeps the range at least that long unless P releases
    it first (0: not given, as from an older P; D then refuses to stage)."""

    op: str
    lease_id: str
    block_ids: tuple[int, ...] = ()
    region_bytes: tuple[int, ...] = ()
    slot: int = -1
    auth: str = ""
    read_deadline_ms: int = 0

    def to_bytes(self) -> bytes:
        body: dict[str, Any] = {"op": self.op, "lease_id": self.lease_id, "auth": self.auth}
        if self.op == STAGING_OP_STAGE:
            body.update(block_ids=list(self.block_ids), region_bytes=list(self.region_bytes))
            if self.read_deadline_ms:
                body.update(read_deadline_ms=self.read_deadline_ms)
        else:
            body.update(slot=self.slot)
        return staging_frame(body)

    @classmethod
    def from_json(cls, data: object) -> StagingRequest:
        if not isinstance(data, Mapping):
            raise ProtocolError("staging request must be an object")
        op = data.get("op")
        lease_id = data.get("lease_id")
        if not isinstance(lease_id, str) or not lease_id or len(lease_id) > 512:
            raise ProtocolError("staging lease_id must be a non-empty string")
        auth = data.get("auth", "")
        if not isinstance(auth, str) or len(auth) > 256:
            raise ProtocolError("staging auth must be a string")
        if op == STAGING_OP_RELEASE:
            return cls(op, lease_id, slot=_int_field(data, "slot", 0, 1 << 31), auth=auth)
        if op != STAGING_OP_STAGE:
            raise ProtocolError(f"staging op must be {STAGING_OP_STAGE!r} or {STAGING_OP_RELEASE!r}")
        ids = data.get("block_ids")
        regions = data.get("region_bytes")
        if not isinstance(ids, list) or not 0 < len(ids) <= LeaseHandleExt.MAX_BLOCKS:
            raise ProtocolError("staging block_ids must be a non-empty list")
        if not all(_is_int(b) and 0 <= b < (1 << 31) for b in ids):
            raise ProtocolError("staging block_ids must be non-negative integers")
        if not isinstance(regions, list) or not 0 < len(regions) <= _STAGING_MAX_REGIONS:
            raise ProtocolError("staging region_bytes must be a non-empty list")
        if not all(_is_int(b) and 0 < b < (1 << 40) for b in regions):
            raise ProtocolError("staging region_bytes must be positive integers")
        deadline = _int_field(data, "read_deadline_ms", 0, 1 << 31) if "read_deadline_ms" in data else 0
        return cls(op, lease_id, tuple(ids), tuple(regions), auth=auth, read_deadline_ms=deadline)


@dataclass(frozen=True)
class StagingReply:
    """D's answer: ``{"ok": true, "slot": n, "address": a, "nbytes": b, "device_id": d}`` (the
    gathered bytes, region-major, at ``address`` in D's registered staging buffer) or
    ``{"ok": false, "refusal": "<StagingRefusal>", "detail": "..."}``."""

    ok: bool
    slot: int = -1
    address: int = 0
    nbytes: int = 0
    device_id: int = 0
    refusal: str | None = None
    detail: str = ""
    #: Where D's bytes came from: ``device`` (its KV blocks) or ``host`` (its host arena); an older
    #: D does not say (``device``).
    source: str = STAGED_FROM_DEVICE

    def to_bytes(self) -> bytes:
        if self.ok:
            body: dict[str, Any] = {
                "ok": True,
                "slot": self.slot,
                "address": self.address,
                "nbytes": self.nbytes,
                "device_id": self.device_id,
                "source": self.source,
            }
        else:
            body = {"ok": False, "refusal": self.refusal, "detail": self.detail[:500]}
        return staging_frame(body)

    @classmethod
    def from_json(cls, data: object) -> StagingReply:
        if not isinstance(data, Mapping) or not isinstance(data.get("ok"), bool):
            raise ProtocolError("staging reply must be an object with a boolean ok")
        if not data["ok"]:
            refusal = data.get("refusal")
            if refusal not in StagingRefusal.ALL:
                raise ProtocolError(f"staging refusal {refusal!r} is not known")
            detail = data.get("detail")
            return cls(False, refusal=refusal, detail=detail if isinstance(detail, str) else "")
        return cls(
            True,
            slot=_int_field(data, "slot", 0, 1 << 31),
            address=_int_field(data, "address", 0, (1 << 64) - 1),
            nbytes=_int_field(data, "nbytes", 0, 1 << 48),
            device_id=_int_field(data, "device_id", 0, 1 << 16),
            source=STAGED_FROM_HOST if data.get("source") == STAGED_FROM_HOST else STAGED_FROM_DEVICE,
        )


def staging_frame(body: Mapping[str, Any]) -> bytes:
    """One staging side-channel frame: a 4-byte big-endian length, then compact JSON."""
    raw = json.dumps(body, separators=(",", ":")).encode()
    if len(raw) > STAGING_MAX_FRAME:
        raise ProtocolError(f"staging frame of {len(raw)} bytes exceeds {STAGING_MAX_FRAME}")
    return len(raw).to_bytes(4, "big") + raw


def staging_frame_length(header: bytes) -> int:
    """The JSON length a frame's 4-byte header announces (:class:`ProtocolError` when too long)."""
    if len(header) != 4:
        raise ProtocolError("staging frame header must be 4 bytes")
    n = int.from_bytes(header, "big")
    if n > STAGING_MAX_FRAME:
        raise ProtocolError(f"staging frame of {n} bytes exceeds {STAGING_MAX_FRAME}")
    return n


def staging_decode(raw: bytes) -> object:
    """The JSON object of a frame's body (:class:`ProtocolError` when it is not JSON)."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"staging frame is not JSON: {e}") from None
