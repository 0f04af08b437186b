"""Router <-> vLLM: vLLM's ``kv_transfer_params`` and the kvlease sub-object (hashes, MAC)."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, replace
from dataclasses import fields as _fields
from typing import Any, ClassVar, Final, TypeGuard, TypeVar
from urllib.parse import urlsplit

from kvlease.protocol._common import PROTOCOL_VERSION, ProtocolError, _int_value, _is_number
from kvlease.protocol._hashes import _HASH_DOMAIN as _HASH_DOMAIN
from kvlease.protocol._hashes import _TAIL_TAG as _TAIL_TAG
from kvlease.protocol._hashes import BLOCK_HASH_BYTES as BLOCK_HASH_BYTES
from kvlease.protocol._hashes import _hash_seed as _hash_seed
from kvlease.protocol._hashes import block_hashes as block_hashes
from kvlease.protocol._hashes import common_prefix_blocks as common_prefix_blocks
from kvlease.protocol._hashes import mm_digest as mm_digest
from kvlease.protocol._hashes import tail_hash as tail_hash

# --------------------------------------------------------------------------------------------------
# Router -> vLLM: vLLM's own P/D protocol (kv_transfer_params) plus the kvlease sub-object
# --------------------------------------------------------------------------------------------------

KV_TRANSFER_PARAMS: Final = "kv_transfer_params"
CACHE_SALT: Final = "cache_salt"


class KV:
    """Field names inside vLLM's ``kv_transfer_params`` (NixlConnector, vLLM 0.32 and 0.33)."""

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
    DCP_SIZE: Final = "dcp_size"
    PP_SIZE: Final = "pp_size"
    REMOTE_BLOCK_SIZE: Final = "remote_block_size"  # D's block size (upstream reads it on P)
    #: vLLM 0.33 (NIXL connector version 15): D's KV registration generation (bumped on re-register).
    REMOTE_REGISTRATION_GENERATION: Final = "remote_registration_generation"
    KVLEASE: Final = "kvlease"  # the sub-object the kvlease connector adds and reads
    #: The router's opaque tenant tag on P's and D's requests (kvlease mode only; never in a handle,
    #: outside the MAC): D tags the lease it creates, P its claim. Read by ``tenant_tag_of``.
    TENANT: Final = "kvlease_tenant"
    #: P's post-read check of an ordinary P->D transfer, in *P's* response params (a kvlease P only,
    #: outside the ``kvlease`` object, so a router passes it on to D verbatim): :class:`SendCheck`.
    SEND_CHECK: Final = "kvlease_send_check"


#: Keys of the ``kvlease`` sub-object of *P's* response params: what P's verified pull did on this
#: turn, so the router can report it. ``reused_tokens``: prompt tokens taken from D's blocks (0 if
#: none); ``reuse``: a :class:`ReuseStatus` value (``hit``, ``miss``, ``mismatch``, ``expired``).
PREFILL_REUSED_TOKENS: Final = "reused_tokens"
PREFILL_REUSE_STATUS: Final = "reuse"


#: Key of an HMAC-SHA256 (hex) that D adds to its ``kvlease`` object when its control secret is set:
#: over the handle's routing fields and the rest of the ``kvlease`` object, keyed by the shared
#: control secret. P refuses a handle whose MAC is missing or wrong (a client edited it).
LEASE_HANDLE_MAC: Final = "mac"
#: Keys of the LoRA adapter and the multimodal digest in the ``kvlease`` object (see LeaseHandleExt).
LEASE_HANDLE_LORA: Final = "lora"
LEASE_HANDLE_MM: Final = "mm"
#: Key of D's staging endpoint in the ``kvlease`` object: the TCP port of each of D's tensor-parallel
#: ranks' staging listener (on the handle's ``remote_host``), absent when D cannot stage (an older
#: kvlease, stock vLLM, staging off). Covered by the MAC: it tells P's worker where to connect.
LEASE_HANDLE_STAGING: Final = "staging"
#: Key of the lease's placement in the ``kvlease`` object: ``"host"`` when D gave the lease's device
#: blocks back to vLLM after writing them through to its host arena, so the lease can only be read
#: by a staged pull (D promotes it, or reads a device copy it proves intact). Absent: ``device``,
#: D holds the blocks. Covered by the MAC.
LEASE_HANDLE_PLACEMENT: Final = "placement"
PLACEMENT_HOST: Final = "host"
PLACEMENT_DEVICE: Final = "device"
#: A host-placed handle says ``"v": 2``: a reader that does not know placements (kvlease before it)
#: refuses the handle as a whole and recomputes, rather than read the released device blocks
#: block by block.
HOST_PLACEMENT_VERSION: Final = 2
_HEX_LEN: Final = 2 * BLOCK_HASH_BYTES  # a block hash, tail hash or mm digest, in hex


@dataclass(frozen=True)
class LeaseHandleExt:
    """The ``kvlease`` sub-object of D's ``kv_transfer_params``.

    JSON: ``{"v": 1, "block_size": 16, "num_tokens": 1234, "hashes": ["<32 hex>", ...],
    "tail": "<32 hex>" | null, "lease_id": "<D's request id>", "engine_id": "...",
    "control": "http://host:port" | null, "lora": "<adapter>", "mm": "<32 hex>", "staging": [port, ...],
    "mac": "<64 hex>"}`` (``mac`` only when D has a secret; ``lora`` / ``mm`` only when D's request had
    a LoRA adapter / multimodal features; ``staging`` only when D's workers can stage a pull, one port
    per tensor-parallel rank, see :class:`StagingRequest`).
    ``hashes`` cover the full blocks of D's retained sequence (prompt + generated tokens); ``tail``
    (optional, :func:`tail_hash`) its partial last block, when ``num_tokens`` is not a multiple of
    ``block_size``. A reader that does not know ``tail`` simply pulls whole blocks only. ``lora``:
    the LoRA adapter D computed the KV with (``name#id``); ``mm``: :func:`mm_digest` of D's
    multimodal features (what vLLM's own block hashes cover beyond tokens and salt). ``mac``:
    :func:`handle_mac` over the whole handle (see :data:`LEASE_HANDLE_MAC`).
    """

    block_size: int
    num_tokens: int
    hashes: tuple[str, ...]
    lease_id: str
    engine_id: str | None = None
    control: str | None = None
    version: int = PROTOCOL_VERSION
    tail: str | None = None
    mac: str | None = None
    lora: str | None = None
    mm: str | None = None
    staging: tuple[int, ...] | None = None
    #: ``device`` (D holds the blocks) or ``host`` (see :data:`LEASE_HANDLE_PLACEMENT`).
    placement: str = PLACEMENT_DEVICE

    MAX_BLOCKS: ClassVar[int] = 1 << 20
    MAX_STAGING_RANKS: ClassVar[int] = 4096

    def to_json(self) -> dict[str, Any]:
        host = self.placement == PLACEMENT_HOST
        out: dict[str, Any] = {
            "v": HOST_PLACEMENT_VERSION if host else self.version,
            "block_size": self.block_size,
            "num_tokens": self.num_tokens,
            "hashes": list(self.hashes),
            "tail": self.tail,
            "lease_id": self.lease_id,
            "engine_id": self.engine_id,
            "control": self.control,
        }
        if self.lora is not None:
            out[LEASE_HANDLE_LORA] = self.lora
        if self.mm is not None:
            out[LEASE_HANDLE_MM] = self.mm
        if self.staging is not None:
            out[LEASE_HANDLE_STAGING] = list(self.staging)
        if host:
            out[LEASE_HANDLE_PLACEMENT] = PLACEMENT_HOST
        if self.mac is not None:
            out[LEASE_HANDLE_MAC] = self.mac
        return out

    @classmethod
    def from_json(cls, data: object) -> LeaseHandleExt:
        # The field-at-a-time checks, in their order and with their messages; a value of the exact
        # builtin type a JSON decoder gives takes the cheap test first (every handle passes here:
        # the router parses D's on each turn, P verifies it).
        if type(data) is not dict and not isinstance(data, Mapping):
            raise ProtocolError("kvlease must be an object")
        get = data.get
        version = get("v")
        if version != PROTOCOL_VERSION and version != HOST_PLACEMENT_VERSION:
            raise ProtocolError(
                f"kvlease.v is {version!r}; this build speaks {PROTOCOL_VERSION} and {HOST_PLACEMENT_VERSION}"
            )
        placement = get(LEASE_HANDLE_PLACEMENT, PLACEMENT_DEVICE)
        if (version == HOST_PLACEMENT_VERSION) != (placement == PLACEMENT_HOST) or placement not in (
            PLACEMENT_HOST,
            PLACEMENT_DEVICE,
        ):
            raise ProtocolError(
                f'kvlease.placement "host" goes with "v": {HOST_PLACEMENT_VERSION}, and only it'
            )
        bs = get("block_size")
        if type(bs) is not int or not 1 <= bs <= 1 << 16:
            bs = _int_value(bs, "block_size", 1, 1 << 16)
        nt = get("num_tokens")
        if type(nt) is not int or not 0 <= nt <= 1 << 31:
            nt = _int_value(nt, "num_tokens", 0, 1 << 31)
        hashes = get("hashes")
        if not isinstance(hashes, list) or len(hashes) > cls.MAX_BLOCKS:
            raise ProtocolError("kvlease.hashes must be a list of hex strings")
        for h in hashes:
            if not isinstance(h, str) or len(h) != _HEX_LEN:
                raise ProtocolError("kvlease.hashes must be a list of 32-character hex strings")
        if len(hashes) > nt // bs:
            raise ProtocolError("kvlease.hashes covers more blocks than num_tokens")
        tail = get("tail")
        if tail is not None and (not isinstance(tail, str) or len(tail) != _HEX_LEN or nt % bs == 0):
            raise ProtocolError("kvlease.tail must be null or a 32-character hex string (partial block only)")
        lease_id = get("lease_id")
        if not isinstance(lease_id, str) or not lease_id or len(lease_id) > 512:
            raise ProtocolError("kvlease.lease_id must be a non-empty string")
        engine_id = get("engine_id")
        control = get("control")
        if isinstance(control, str):
            if type(control) is not str or control not in _GOOD_CONTROLS:
                _check_control_url(control)
        else:
            control = None
        mac = get(LEASE_HANDLE_MAC)
        if mac is not None and not isinstance(mac, str):
            raise ProtocolError("kvlease.mac must be a hex string")
        lora = get(LEASE_HANDLE_LORA)
        if lora is not None and (not isinstance(lora, str) or not lora or len(lora) > _MAX_ID_LEN):
            raise ProtocolError("kvlease.lora must be a non-empty string")
        mm = get(LEASE_HANDLE_MM)
        if mm is not None and (not isinstance(mm, str) or len(mm) != _HEX_LEN):
            raise ProtocolError("kvlease.mm must be a 32-character hex string")
        staging = get(LEASE_HANDLE_STAGING)
        if staging is not None:
            if (
                not isinstance(staging, list)
                or not 0 < len(staging) <= cls.MAX_STAGING_RANKS
                or not all(_is_int(p) and 0 < p < 65536 for p in staging)
            ):
                raise ProtocolError("kvlease.staging must be a non-empty list of TCP ports")
            staging = tuple(staging)
        attrs: dict[str, Any] = {
            "block_size": bs,
            "num_tokens": nt,
            "hashes": tuple(hashes),
            "lease_id": lease_id,
            "engine_id": engine_id if isinstance(engine_id, str) else None,
            "control": control,
            "version": PROTOCOL_VERSION,
            "tail": tail,
            "mac": mac,
            "lora": lora,
            "mm": mm,
            "staging": staging,
            "placement": placement,
        }
        return _built(cls, attrs) if cls is LeaseHandleExt else cls(**attrs)


#: Control URLs that passed :func:`_check_control_url` (a few per deployment: one per decode node),
#: so the URL of every handle is not split again; bounded, emptied when full.
_GOOD_CONTROLS: Final[dict[str, None]] = {}
_GOOD_CONTROLS_MAX: Final = 256


def _check_control_url(control: str) -> None:
    try:
        url = urlsplit(control)
        host, _ = url.hostname, url.port  # .port raises on a bad port
    except ValueError:
        raise ProtocolError("kvlease.control is not a URL") from None
    if url.scheme not in ("http", "https") or not host:
        raise ProtocolError(f"kvlease.control {control!r} is not an http(s) URL")
    if type(control) is str:
        if len(_GOOD_CONTROLS) >= _GOOD_CONTROLS_MAX:
            _GOOD_CONTROLS.clear()
        _GOOD_CONTROLS[control] = None


_T = TypeVar("_T")


def _built(cls: type[_T], attrs: dict[str, Any]) -> _T:
    """An instance of the frozen dataclass ``cls`` (TransferParams or LeaseHandleExt itself, not a
    subclass) with every field's default and then ``attrs``, set without the generated ``__init__``
    (one ``object.__setattr__`` call per field): the parsers give it checked values only, which
    ``__post_init__`` would leave as they are. Equal, in every field, to ``cls(**attrs)``."""
    obj = object.__new__(cls)
    d = obj.__dict__
    d.update(_DEFAULTS[cls])
    d.update(attrs)
    return obj


@dataclass(frozen=True)
class PrefillReport:
    """The ``kvlease`` sub-object of *P's* response params: what P's verified pull did this turn.

    JSON: ``{"reused_tokens": 64, "reuse": "hit"}`` (:data:`PREFILL_REUSED_TOKENS`,
    :data:`PREFILL_REUSE_STATUS`). ``reuse`` is kept as sent (a ``ReuseStatus`` value, or anything
    else, which a reader treats as a miss); a report without a non-negative integer
    ``reused_tokens`` is not one.
    """

    reused_tokens: int
    reuse: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {PREFILL_REUSED_TOKENS: self.reused_tokens}
        if self.reuse is not None:
            out[PREFILL_REUSE_STATUS] = self.reuse
        return out

    @classmethod
    def from_json(cls, data: object) -> PrefillReport:
        if type(data) is not dict and not isinstance(data, Mapping):
            raise ProtocolError("P's kvlease report must be an object")
        tokens = data.get(PREFILL_REUSED_TOKENS)
        if (type(tokens) is not int and not _is_int(tokens)) or tokens < 0:
            raise ProtocolError(f"{PREFILL_REUSED_TOKENS} must be a non-negative integer")
        reuse = data.get(PREFILL_REUSE_STATUS)
        return cls(tokens, reuse if isinstance(reuse, str) else None)


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


# --------------------------------------------------------------------------------------------------
# The handle: vLLM's kv_transfer_params, typed
# --------------------------------------------------------------------------------------------------

#: Parallelism fields of a handle (checked, and covered by the MAC).
PARALLEL_FIELDS: Final = (KV.TP_SIZE, KV.DCP_SIZE, KV.PP_SIZE)
_MAX_BLOCK_ID: Final = 1 << 31
_MAX_PARALLEL: Final = 1 << 16
_MAX_ID_LEN: Final = 512


@dataclass(frozen=True)
class TransferParams:
    """vLLM's ``kv_transfer_params`` (the handle), parsed once at each edge and serialized from here.

    Every field kvlease reads is typed and checked by :meth:`from_json`, with one strictness for all
    readers (the router capturing D's handle, P verifying it): a field that is present must have its
    type and range, ``remote_request_id`` / ``remote_engine_id`` must agree with the ``kvlease``
    object, and a ``kvlease`` object must be a valid :class:`LeaseHandleExt`. Which fields must be
    *present* is the reader's business (P needs a full pull target; the router only blocks and an
    engine). ``None`` is "absent"; ``nulls`` names the known keys that were sent as an explicit
    ``null`` (``to_json`` writes them back), and ``extra`` keeps every other key verbatim (vLLM's
    own markers, fields of newer vLLMs), so ``to_json`` gives back what ``from_json`` read.

    ``block_ids`` are one tuple per KV cache group (vLLM's list of lists); ``grouped`` is False
    when the wire had one flat list of ids (older vLLM, the fake P/D), which ``to_json`` keeps.
    """

    do_remote_decode: bool | None = None
    do_remote_prefill: bool | None = None
    engine_id: str | None = None
    block_ids: tuple[tuple[int, ...], ...] | None = None
    grouped: bool = True
    request_id: str | None = None
    host: str | None = None
    port: int | None = None
    num_tokens: int | None = None
    expiry: float | None = None  # remote_blocks_expiry_time, on D's monotonic clock
    tp_size: int | None = None
    dcp_size: int | None = None
    pp_size: int | None = None
    remote_block_size: int | None = None
    registration_generation: int | None = None  # vLLM 0.33
    kvlease: LeaseHandleExt | None = None
    nulls: frozenset[str] = frozenset()
    extra: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        # only known keys whose value is absent can be an explicit null
        nulls = frozenset(k for k in self.nulls if k in _ATTR and getattr(self, _ATTR[k]) is None)
        if nulls != self.nulls:
            object.__setattr__(self, "nulls", nulls)

    def to_json(self) -> dict[str, Any]:
        """The wire dict (a fresh one, every call)."""
        d = self.__dict__
        nulls = self.nulls
        out: dict[str, Any] = {}
        for key, attr in _ATTR_ITEMS:
            value = d[attr]
            if value is not None:
                out[key] = value
            elif key in nulls:
                out[key] = None
        ids = self.block_ids
        if ids is not None:  # replaced in place: the key keeps its position
            out[KV.REMOTE_BLOCK_IDS] = [list(g) for g in ids] if self.grouped or not ids else list(ids[0])
        if self.kvlease is not None:
            out[KV.KVLEASE] = self.kvlease.to_json()
        out.update(self.extra)
        return out

    @classmethod
    def from_json(cls, data: object) -> TransferParams:
        # Checks in a fixed order (the first bad field names the error); a value of the exact type a
        # JSON decoder gives takes the cheap test first. Every handle passes here, on every turn.
        if type(data) is not dict and not isinstance(data, Mapping):
            raise ProtocolError(f"{KV_TRANSFER_PARAMS} must be an object")
        fields: dict[str, Any] = {}
        nulls: set[str] = set()
        extra: list[tuple[str, Any]] = []
        attr_of = _ATTR.get
        for key, value in data.items():
            attr = attr_of(key)
            if attr is None:
                extra.append((key, value))
            elif value is None:
                nulls.add(key)
            else:
                fields[attr] = value
        get = fields.get
        for name in (KV.DO_REMOTE_DECODE, KV.DO_REMOTE_PREFILL):
            if type(get(name, False)) is not bool:  # bool has no subclasses
                raise ProtocolError(f"{name} must be true or false")
        for key in (KV.REMOTE_ENGINE_ID, KV.REMOTE_REQUEST_ID):
            v = get(_ATTR[key])
            if v is not None and (not isinstance(v, str) or not v or len(v) > _MAX_ID_LEN):
                raise ProtocolError(f"{key} must be a non-empty string")
        host = get("host")
        if host is not None and (not isinstance(host, str) or not host):
            raise ProtocolError(f"{KV.REMOTE_HOST} must be a non-empty string, got {host!r}")
        port = get("port")
        if port is not None and ((type(port) is not int and not _is_int(port)) or not 0 < port < 65536):
            raise ProtocolError(f"{KV.REMOTE_PORT} must be an integer in [1, 65535], got {port!r}")
        for key in PARALLEL_FIELDS:
            v = get(key)
            if key in nulls or (
                v is not None and ((type(v) is not int and not _is_int(v)) or not 1 <= v <= _MAX_PARALLEL)
            ):
                raise ProtocolError(f"{key} must be an integer in [1, {_MAX_PARALLEL}], got {v!r}")
        rbs = get("remote_block_size")
        if KV.REMOTE_BLOCK_SIZE in nulls or (
            rbs is not None and ((type(rbs) is not int and not _is_int(rbs)) or not 1 <= rbs <= 1 << 16)
        ):
            raise ProtocolError(f"{KV.REMOTE_BLOCK_SIZE} must be an integer in [1, 65536], got {rbs!r}")
        gen = get("registration_generation")
        if gen is not None and ((type(gen) is not int and not _is_int(gen)) or not 0 <= gen < 1 << 63):
            raise ProtocolError(f"{KV.REMOTE_REGISTRATION_GENERATION} must be a non-negative integer")
        nt = get("num_tokens")
        if nt is not None and ((type(nt) is not int and not _is_int(nt)) or not 0 <= nt <= 1 << 31):
            raise ProtocolError(f"{KV.REMOTE_NUM_TOKENS} must be a non-negative integer")
        expiry = get("expiry")
        if expiry is not None and not _is_number(expiry):
            raise ProtocolError(f"{KV.REMOTE_BLOCKS_EXPIRY_TIME} must be a number or null")
        if "block_ids" in fields:
            fields["block_ids"], fields["grouped"] = _block_ids(fields["block_ids"])
        if "kvlease" in fields:
            ext = fields["kvlease"] = LeaseHandleExt.from_json(fields["kvlease"])
            if ext.engine_id is not None and get("engine_id", ext.engine_id) != ext.engine_id:
                raise ProtocolError(f"{KV.REMOTE_ENGINE_ID} does not match kvlease.engine_id")
            if get("request_id", ext.lease_id) != ext.lease_id:
                raise ProtocolError(f"{KV.REMOTE_REQUEST_ID} does not match kvlease.lease_id")
            if rbs is not None and rbs != ext.block_size:
                raise ProtocolError(f"{KV.REMOTE_BLOCK_SIZE} {rbs} does not match kvlease.block_size")
        fields["nulls"] = frozenset(nulls)
        fields["extra"] = tuple(extra)
        return _built(cls, fields) if cls is TransferParams else cls(**fields)

    # ---- new handles from this one (the wire dict is never edited in place) ------------------
    def for_pull(self) -> TransferParams:
        """This handle as a router offers it to P: flagged for a pull from D."""
        return replace(self, do_remote_decode=True, do_remote_prefill=False)

    def trimmed(self, tokens: int, block_size: int, *, deadline: float | None = None) -> TransferParams:
        """The handle cut to its first ``tokens`` (verified) tokens: the blocks that hold them.

        ``deadline``: D's absolute deadline after P's claim (D's clock, as upstream's
        ``remote_blocks_expiry_time`` is): it replaces the deadline D issued, so upstream's own
        expired-read guard stays on and sees the renewed lease.
        """
        n_blocks = -(-tokens // block_size)
        groups = tuple(g[:n_blocks] for g in self.block_ids or ())
        out = replace(self, block_ids=groups, num_tokens=tokens)
        if deadline is not None:
            out = replace(out, expiry=deadline, nulls=out.nulls - {KV.REMOTE_BLOCKS_EXPIRY_TIME})
        return out


#: Wire key -> attribute of :class:`TransferParams`, in the order ``to_json`` writes them.
_ATTR: Final[dict[str, str]] = {
    KV.DO_REMOTE_DECODE: "do_remote_decode",
    KV.DO_REMOTE_PREFILL: "do_remote_prefill",
    KV.REMOTE_ENGINE_ID: "engine_id",
    KV.REMOTE_BLOCK_IDS: "block_ids",
    KV.REMOTE_REQUEST_ID: "request_id",
    KV.REMOTE_HOST: "host",
    KV.REMOTE_PORT: "port",
    KV.REMOTE_NUM_TOKENS: "num_tokens",
    KV.REMOTE_BLOCKS_EXPIRY_TIME: "expiry",
    KV.TP_SIZE: "tp_size",
    KV.DCP_SIZE: "dcp_size",
    KV.PP_SIZE: "pp_size",
    KV.REMOTE_BLOCK_SIZE: "remote_block_size",
    KV.REMOTE_REGISTRATION_GENERATION: "registration_generation",
    KV.KVLEASE: "kvlease",
}
_ATTR_ITEMS: Final = tuple(_ATTR.items())
#: Each field's default, of the types :func:`_built` makes.
_DEFAULTS: Final[dict[type, dict[str, Any]]] = {
    c: {f.name: f.default for f in _fields(c) if f.default is not MISSING}
    for c in (LeaseHandleExt, TransferParams)
}

_INT: Final = frozenset((int,))
#: Index of the most significant byte of each item of an ``array("I")`` (4-byte items), or -1 where
#: unsigned int is not 4 bytes (or the bound not 2**31): :func:`_ids_ok` then uses ``min`` / ``max``.
_U32_TOP: Final = (
    (3 if sys.byteorder == "little" else 0) if array("I").itemsize == 4 and _MAX_BLOCK_ID == 1 << 31 else -1
)


def _ids_ok(ids: list[Any]) -> bool:
    """Every id an exact ``int`` in range (``ids`` not empty, not over the bound), in C-level passes.

    ``array("I", ids)`` takes exactly the ints in ``[0, 2**32)`` (OverflowError for any other), and
    an id under ``2**31`` (:data:`_MAX_BLOCK_ID`) is one whose top byte is ASCII (below 0x80)."""
    if len(ids) > LeaseHandleExt.MAX_BLOCKS or set(map(type, ids)) != _INT:
        return False
    if _U32_TOP < 0:
        return bool(min(ids) >= 0 and max(ids) < _MAX_BLOCK_ID)
    try:
        return array("I", ids).tobytes()[_U32_TOP::4].isascii()
    except OverflowError:
        return False


def _block_ids(raw: object) -> tuple[tuple[tuple[int, ...], ...], bool]:
    """(groups, grouped) of ``remote_block_ids``: a list of per-group lists, or one flat list.

    Every handle passes here (the router parses each turn's twice, P once), with a few hundred ids
    each: the common wire shapes (non-empty lists of exact ``int`` ids) are checked by :func:`_ids_ok`
    in C-level passes; anything else goes to :func:`_block_ids_checked`, which decides what is
    accepted and why not (the two give the same result wherever both apply: a property test)."""
    if type(raw) is list and raw and len(raw) <= LeaseHandleExt.MAX_BLOCKS:
        if type(raw[0]) is list:
            if all(type(g) is list and g and _ids_ok(g) for g in raw):
                return tuple(map(tuple, raw)), True
        elif _ids_ok(raw):
            return (tuple(raw),), False
    return _block_ids_checked(raw)


def _block_ids_checked(raw: object) -> tuple[tuple[tuple[int, ...], ...], bool]:
    """:func:`_block_ids`, one id at a time, for every shape."""
    if not isinstance(raw, (list, tuple)) or len(raw) > LeaseHandleExt.MAX_BLOCKS:
        raise ProtocolError(f"{KV.REMOTE_BLOCK_IDS} must be a list of block lists")
    if raw and all(_is_int(b) for b in raw):
        groups, grouped = [raw], False
    else:
        groups, grouped = list(raw), True
    out: list[tuple[int, ...]] = []
    for g in groups:
        if not isinstance(g, (list, tuple)) or len(g) > LeaseHandleExt.MAX_BLOCKS:
            raise ProtocolError(f"{KV.REMOTE_BLOCK_IDS} must contain lists of block ids")
        if not all(_is_int(b) and 0 <= b < _MAX_BLOCK_ID for b in g):
            raise ProtocolError(f"{KV.REMOTE_BLOCK_IDS} must contain non-negative integers")
        out.append(tuple(g))
    return tuple(out), grouped


_PREFILL_REQUEST: Final = TransferParams(
    do_remote_decode=True,
    do_remote_prefill=False,
    nulls=frozenset({KV.REMOTE_ENGINE_ID, KV.REMOTE_BLOCK_IDS, KV.REMOTE_HOST, KV.REMOTE_PORT}),
)


def prefill_request_params() -> dict[str, Any]:
    """The ``kv_transfer_params`` a router sends to P on a turn with no handle to reuse."""
    return _PREFILL_REQUEST.to_json()


def pull_request_params(captured: Mapping[str, Any]) -> dict[str, Any]:
    """The ``kv_transfer_params`` a router sends to P to reuse a handle it captured.

    ``captured`` is what the router stored: :meth:`TransferParams.to_json` of D's handle, parsed at
    capture. It is not parsed again on the hot path; :meth:`TransferParams.for_pull` is this, typed.
    """
    return {**captured, KV.DO_REMOTE_DECODE: True, KV.DO_REMOTE_PREFILL: False}
