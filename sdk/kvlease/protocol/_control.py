"""Router / prefill node -> the kvlease connector's control endpoint on each vLLM server."""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from kvlease.protocol._common import PROTOCOL_VERSION, ProtocolError, _id_list, _int_field, _is_number
from kvlease.protocol._handle import KV

# --------------------------------------------------------------------------------------------------
# Router -> kvlease connector control endpoint (opened by the scheduler-side connector)
# --------------------------------------------------------------------------------------------------

CONTROL_INFO_PATH: Final = "/info"
CONTROL_RENEW_PATH: Final = "/renew"
CONTROL_RELEASE_PATH: Final = "/release"
CONTROL_METRICS_PATH: Final = "/metrics"
#: P: D's post-read check of ordinary P->D sends (:class:`SendCheckRequest`).
CONTROL_SEND_CHECK_PATH: Final = "/sendcheck"
#: Shared-secret auth on the control endpoint: ``Authorization: Bearer <secret>``.
CONTROL_AUTH_HEADER: Final = "Authorization"
CONTROL_SECRET_ENV: Final = "KVLEASE_CONTROL_SECRET"
#: Longest opaque tenant tag a control renew, or a request's ``kv_transfer_params``, may carry.
TENANT_TAG_MAX_LEN: Final = 64
#: Most tenant tags D's lease status (``GET /info``) names: those holding the most blocks.
LEASE_STATUS_MAX_TENANTS: Final = 16


def _tenant_ok(tag: object) -> bool:
    return isinstance(tag, str) and 0 < len(tag) <= TENANT_TAG_MAX_LEN


def tenant_tag_of(params: object) -> str | None:
    """The router's tenant tag in a request's ``kv_transfer_params`` (:attr:`KV.TENANT`), or None.

    The one reader on P and D. Lenient by design: anything but a string of 1 to
    :data:`TENANT_TAG_MAX_LEN` characters (or params that are not an object) is ignored and the
    lease is untagged; a bad tag never fails the request."""
    tag = params.get(KV.TENANT) if isinstance(params, Mapping) else None
    return tag if _tenant_ok(tag) else None


class Role(str, enum.Enum):
    PREFILL = "prefill"  # kv_producer
    DECODE = "decode"  # kv_consumer
    BOTH = "both"


@dataclass(frozen=True)
class TenantLeases:
    """One tenant tag's share of D's retention table (``tenant`` None: the untagged leases)."""

    tenant: str | None
    leases: int
    blocks: int

    def to_json(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "leases": self.leases, "blocks": self.blocks}

    @classmethod
    def from_json(cls, data: object) -> TenantLeases:
        if not isinstance(data, Mapping):
            raise ProtocolError("a tenant's leases must be an object")
        tenant = data.get("tenant")
        if tenant is not None and not _tenant_ok(tenant):
            raise ProtocolError(f"tenant must be null or a string of 1-{TENANT_TAG_MAX_LEN} characters")
        return cls(tenant, _int_field(data, "leases", 0, 1 << 31), _int_field(data, "blocks", 0, 1 << 40))


@dataclass(frozen=True)
class LeaseStatus:
    """``leases`` of ``GET /info``: the node's retention table now (D; a P's is empty).

    JSON: ``{"leases": 3, "retained_blocks": 40, "capacity_blocks": 100, "tenant_quota_blocks": 50,
    "tenant_count": 2, "untagged": {"tenant": null, "leases": 1, "blocks": 4},
    "tenants": [{"tenant": "<tag>", "leases": 2, "blocks": 36}, ...]}``. Bounded: ``tenants`` names
    at most :data:`LEASE_STATUS_MAX_TENANTS` tags, most blocks first (ties by tag);
    ``tenant_count`` is how many tags hold leases in all. Tags are the router's opaque ones.
    """

    leases: int
    retained_blocks: int
    capacity_blocks: int
    tenant_quota_blocks: int
    tenant_count: int = 0
    untagged: TenantLeases = TenantLeases(None, 0, 0)
    tenants: tuple[TenantLeases, ...] = ()

    def tenant(self, tag: str) -> TenantLeases:
        """``tag``'s share (zero when it is not among the listed tags)."""
        return next((t for t in self.tenants if t.tenant == tag), TenantLeases(tag, 0, 0))

    def to_json(self) -> dict[str, Any]:
        return {
            "leases": self.leases,
            "retained_blocks": self.retained_blocks,
            "capacity_blocks": self.capacity_blocks,
            "tenant_quota_blocks": self.tenant_quota_blocks,
            "tenant_count": self.tenant_count,
            "untagged": self.untagged.to_json(),
            "tenants": [t.to_json() for t in self.tenants],
        }

    @classmethod
    def from_json(cls, data: object) -> LeaseStatus:
        if not isinstance(data, Mapping):
            raise ProtocolError("info.leases must be an object")
        tenants = data.get("tenants")
        if not isinstance(tenants, list) or len(tenants) > LEASE_STATUS_MAX_TENANTS:
            raise ProtocolError(f"info.leases.tenants must be a list of at most {LEASE_STATUS_MAX_TENANTS}")
        return cls(
            leases=_int_field(data, "leases", 0, 1 << 31),
            retained_blocks=_int_field(data, "retained_blocks", 0, 1 << 40),
            capacity_blocks=_int_field(data, "capacity_blocks", 0, 1 << 40),
            tenant_quota_blocks=_int_field(data, "tenant_quota_blocks", 0, 1 << 40),
            tenant_count=_int_field(data, "tenant_count", 0, 1 << 31),
            untagged=TenantLeases.from_json(data.get("untagged")),
            tenants=tuple(TenantLeases.from_json(t) for t in tenants),
        )


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
    #: The NIXL package version and vLLM's NIXL connector version (14 in vLLM 0.32, 15 in 0.33):
    #: P and D must agree on both (the router refuses a mismatched pair). None: not reported.
    nixl_version: str | None = None
    connector_version: int | None = None
    #: This engine's data-parallel index (each rank runs its own control endpoint, port + index).
    data_parallel_index: int = 0
    #: The NIXL READ transport this node's configuration leads to, in words (or why it may fall back
    #: to TCP emulation), as logged at start-up. None: an older node that does not report it.
    transport: str | None = None
    #: The node's retention table now, per tenant tag (bounded). None: an older node.
    leases: LeaseStatus | None = None
    #: D: where leases live (``device``, ``auto``, ``host``; ``kvlease.placement``). None: older node.
    placement: str | None = None
    #: The tier figures now, under their metric names (``kvlease_device_blocks_held``,
    #: ``kvlease_device_blocks_cached``, ``kvlease_host_bytes_used``, ``kvlease_host_bytes_capacity``,
    #: ``kvlease_demotions_total``, ``kvlease_pulls_total{source="host"}``, ...). Empty: none reported.
    tier: dict[str, float] = field(default_factory=dict)

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
            "nixl_version": self.nixl_version,
            "connector_version": self.connector_version,
            "data_parallel_index": self.data_parallel_index,
            "transport": self.transport,
            "leases": self.leases.to_json() if self.leases is not None else None,
            "placement": self.placement,
            "tier": dict(self.tier),
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
        nixl = data.get("nixl_version")
        cv = data.get("connector_version")
        transport = data.get("transport")
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
            nixl_version=nixl if isinstance(nixl, str) and nixl else None,
            connector_version=_int_field(data, "connector_version", 0, 1 << 16) if cv is not None else None,
            data_parallel_index=(
                _int_field(data, "data_parallel_index", 0, 1 << 16)
                if data.get("data_parallel_index") is not None
                else 0
            ),
            transport=transport[:500] if isinstance(transport, str) and transport else None,
            leases=_lease_status(data.get("leases")),
            placement=_placement(data.get("placement")),
            tier=_tier(data.get("tier")),
        )


#: At most this many tier figures are kept from a node's ``/info`` (names at most 128 characters).
TIER_MAX_KEYS = 64


def _placement(value: object) -> str | None:
    return value if value in ("device", "auto", "host") else None


def _tier(data: object) -> dict[str, float]:
    """A node's tier figures are for operators: what is not a number under a short name is dropped."""
    if not isinstance(data, Mapping):
        return {}
    out: dict[str, float] = {}
    for k, v in data.items():
        if len(out) >= TIER_MAX_KEYS:
            break
        if isinstance(k, str) and len(k) <= 128 and _is_number(v):
            out[k] = float(v)
    return out


def _lease_status(data: object) -> LeaseStatus | None:
    """A node's lease status is for operators and tests: a malformed one is dropped, never a reason
    to refuse the node's ``/info``."""
    try:
        return LeaseStatus.from_json(data) if data is not None else None
    except ProtocolError:
        return None


@dataclass(frozen=True)
class ControlRenewRequest:
    """``POST /renew`` on D: ``{"request_ids": [...], "ttl": 300.0}``.

    ``"claim": true`` (sent by a prefill node right before it reads a lease) also pins the lease
    for ``ttl`` seconds: D will not release it early to make room. A claim is exclusive: while one
    claimant's pin holds, another claim of the lease is refused (answered as unknown);
    ``"claimant"`` (P's request id) lets the same reader claim again while its read waits.

    ``"tenant": "<tag>"`` (optional, router renews and P's claims): an opaque tag of the tenant the
    leases belong to (derived by the router; it reveals nothing). D counts each tag's retained blocks
    against its per-tenant quota, and a tenant's leases over quota are released first under pressure.
    A lease is already tagged when D creates it (the router's tag in D's request, :data:`KV.TENANT`);
    a renew or claim naming a tag sets it again, so leases of a tenant that never renews count too.
    """

    request_ids: tuple[str, ...]
    ttl: float
    claim: bool = False
    claimant: str | None = None
    tenant: str | None = None

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"request_ids": list(self.request_ids), "ttl": self.ttl}
        if self.claim:
            body["claim"] = True
            if self.claimant is not None:
                body["claimant"] = self.claimant
        if self.tenant is not None:
            body["tenant"] = self.tenant
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
        claimant = data.get("claimant") if isinstance(data, Mapping) else None
        if claimant is not None and (not isinstance(claimant, str) or not claimant or len(claimant) > 512):
            raise ProtocolError("claimant must be a non-empty string")
        tenant = data.get("tenant") if isinstance(data, Mapping) else None
        if tenant is not None and not _tenant_ok(tenant):
            raise ProtocolError(f"tenant must be a string of 1-{TENANT_TAG_MAX_LEN} characters")
        return cls(ids, float(ttl), claim, claimant if claim else None, tenant)


@dataclass(frozen=True)
class ControlRenewResponse:
    """``POST /renew`` answer: ``{"expires_in": {"<request id>": 299.9 | null}}`` (null: unknown).

    ``deadlines`` (optional): the absolute deadlines on D's clock (``time.perf_counter``, the clock of
    upstream's ``remote_blocks_expiry_time``), for a claimant to hand to upstream's expiry guard.
    """

    expires_in: Mapping[str, float | None]
    deadlines: Mapping[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "expires_in": {k: (None if v is None else round(v, 3)) for k, v in self.expires_in.items()}
        }
        if self.deadlines is not None:
            out["deadlines"] = dict(self.deadlines)
        return out

    @classmethod
    def from_json(cls, data: object) -> ControlRenewResponse:
        if not isinstance(data, Mapping) or not isinstance(data.get("expires_in"), Mapping):
            raise ProtocolError("renew answer must be an object with 'expires_in'")
        raw = data.get("deadlines")
        deadlines = (
            {str(k): float(v) for k, v in raw.items() if _is_number(v)} if isinstance(raw, Mapping) else None
        )
        return cls(
            {str(k): (float(v) if _is_number(v) else None) for k, v in data["expires_in"].items()}, deadlines
        )


@dataclass(frozen=True)
class ControlReleaseRequest:
    """``POST /release`` on D: ``{"request_ids": [...]}``; answer ``{"released": n}``.

    ``"claimant": "<P's request id>"`` (a prefill node that claimed a lease and will not read it
    after all): only that claimant's pin ends, early; the lease itself stays retained (answer: how
    many pins ended).
    """

    request_ids: tuple[str, ...]
    claimant: str | None = None

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"request_ids": list(self.request_ids)}
        if self.claimant is not None:
            body["claimant"] = self.claimant
        return body

    @classmethod
    def from_json(cls, data: object) -> ControlReleaseRequest:
        ids = _id_list(data, "request_ids")
        claimant = data.get("claimant") if isinstance(data, Mapping) else None
        if claimant is not None and (not isinstance(claimant, str) or not claimant or len(claimant) > 512):
            raise ProtocolError("claimant must be a non-empty string")
        return cls(ids, claimant)


@dataclass(frozen=True)
class ControlReleaseResponse:
    """``POST /release`` answer: ``{"released": 2}`` (how many of the ids D held and let go)."""

    released: int

    def to_json(self) -> dict[str, Any]:
        return {"released": self.released}

    @classmethod
    def from_json(cls, data: object) -> ControlReleaseResponse:
        if not isinstance(data, Mapping):
            raise ProtocolError("release answer must be an object with 'released'")
        return cls(_int_field(data, "released", 0, 1 << 31))


@dataclass(frozen=True)
class SendCheckRequest:
    """``POST /sendcheck`` on P (D, after its READ of P's blocks): ``{"request_ids": [...]}``, P's
    request ids (the handle's ``remote_request_id``)."""

    request_ids: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"request_ids": list(self.request_ids)}

    @classmethod
    def from_json(cls, data: object) -> SendCheckRequest:
        return cls(_id_list(data, "request_ids"))


@dataclass(frozen=True)
class SendCheckResponse:
    """``POST /sendcheck`` answer: ``{"intact": {"<id>": true, ...}}``. True: P held the id's blocks
    until D's read had finished (P still holds them, or D's read-done notice freed them before
    their expiry); false: P released them at or after the expiry, or does not know the id."""

    intact: dict[str, bool]

    def to_json(self) -> dict[str, Any]:
        return {"intact": dict(self.intact)}

    @classmethod
    def from_json(cls, data: object) -> SendCheckResponse:
        raw = data.get("intact") if isinstance(data, Mapping) else None
        if not isinstance(raw, Mapping) or not all(
            isinstance(k, str) and isinstance(v, bool) for k, v in raw.items()
        ):
            raise ProtocolError("send check answer must be an object with 'intact': {id: bool}")
        return cls(dict(raw))


# --------------------------------------------------------------------------------------------------
# The one client of the control API, sans IO: a request builder and the answer readers. The IO
# shells (sync on urllib, async on aiohttp) are in ``_control_client`` and only send the request.
# --------------------------------------------------------------------------------------------------

#: Most bytes of a control answer a client reads.
MAX_CONTROL_ANSWER_BYTES: Final = 1 << 20


class ControlCallError(OSError):
    """A control endpoint answered with an HTTP error status (``status``)."""

    def __init__(self, status: int) -> None:
        super().__init__(f"control endpoint answered {status}")
        self.status = status


@dataclass(frozen=True)
class ControlCall:
    """One HTTP request to a connector's control endpoint, as both IO shells send it."""

    method: str
    url: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    timeout: float  # seconds for the whole call


def _call(
    control: str, path: str, body: Mapping[str, Any], secret: str | None, timeout: float
) -> ControlCall:
    headers = [("Content-Type", "application/json")]
    if secret:
        headers.append((CONTROL_AUTH_HEADER, f"Bearer {secret}"))
    data = json.dumps(body, separators=(",", ":")).encode()
    return ControlCall("POST", control.rstrip("/") + path, tuple(headers), data, timeout)


def renew_call(
    control: str,
    lease_ids: Sequence[str],
    ttl: float,
    *,
    secret: str | None,
    timeout: float,
    claim: bool = False,
    claimant: str | None = None,
    tenant: str | None = None,
) -> ControlCall:
    """``POST /renew`` of ``lease_ids`` for ``ttl`` seconds (``claim``: also pin them, on P's read;
    ``tenant``: the opaque tenant tag of D's per-tenant retention quota)."""
    body = ControlRenewRequest(tuple(lease_ids), ttl, claim=claim, claimant=claimant, tenant=tenant).to_json()
    return _call(control, CONTROL_RENEW_PATH, body, secret, timeout)


def release_call(
    control: str, lease_ids: Sequence[str], *, secret: str | None, timeout: float, claimant: str | None = None
) -> ControlCall:
    """``POST /release`` of ``lease_ids`` (``claimant``: only end that claimant's pins)."""
    body = ControlReleaseRequest(tuple(lease_ids), claimant).to_json()
    return _call(control, CONTROL_RELEASE_PATH, body, secret, timeout)


def _answer(status: int, raw: bytes) -> object:
    if status >= 400:
        raise ControlCallError(status)
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ProtocolError("control answer is not JSON") from None


def read_renew_answer(status: int, raw: bytes) -> ControlRenewResponse:
    """The typed answer of a ``renew_call``; raises :class:`ControlCallError` / :class:`ProtocolError`."""
    return ControlRenewResponse.from_json(_answer(status, raw))


def read_release_answer(status: int, raw: bytes) -> ControlReleaseResponse:
    """The typed answer of a ``release_call``; raises :class:`ControlCallError` / :class:`ProtocolError`."""
    return ControlReleaseResponse.from_json(_answer(status, raw))


def send_check_call(
    control: str, request_ids: Sequence[str], *, secret: str | None, timeout: float
) -> ControlCall:
    """``POST /sendcheck`` of P's ``request_ids`` (D, after its reads of P)."""
    return _call(
        control, CONTROL_SEND_CHECK_PATH, SendCheckRequest(tuple(request_ids)).to_json(), secret, timeout
    )


def read_send_check_answer(status: int, raw: bytes) -> SendCheckResponse:
    return SendCheckResponse.from_json(_answer(status, raw))
