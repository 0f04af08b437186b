"""The handle parsers (``TransferParams``, ``LeaseHandleExt``, ``PrefillReport``) accept and refuse
exactly what the field-at-a-time parser they replaced did, with the same messages, the same parsed
values and the same wire dicts (key order included).

The old parser is kept below, verbatim but for names, as the reference (``_ref_*``); it builds the
dataclasses through their ``__init__`` (and ``__post_init__``), which the new parser skips."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlease.protocol import (
    KV,
    LEASE_HANDLE_LORA,
    LEASE_HANDLE_MAC,
    LEASE_HANDLE_MM,
    PARALLEL_FIELDS,
    PROTOCOL_VERSION,
    LeaseHandleExt,
    PrefillReport,
    ProtocolError,
    RenewResponse,
    _handle,
    block_hashes,
    handle_mac,
    tail_hash,
)
from kvlease.protocol._handle import (
    HOST_PLACEMENT_VERSION,
    LEASE_HANDLE_PLACEMENT,
    LEASE_HANDLE_STAGING,
    TransferParams,
    _ids_ok,
)

# ---- the reference: the parser before the fast paths ----------------------------------------------

_MAX_BLOCK_ID = 1 << 31
_MAX_PARALLEL = 1 << 16
_MAX_ID_LEN = 512
_ATTR = dict(_handle._ATTR)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_field(data: Mapping[str, Any], name: str, lo: int, hi: int) -> int:
    v = data.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ProtocolError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _ref_check_control_url(control: str) -> None:
    from urllib.parse import urlsplit

    try:
        url = urlsplit(control)
        host, _ = url.hostname, url.port
    except ValueError:
        raise ProtocolError("kvlease.control is not a URL") from None
    if url.scheme not in ("http", "https") or not host:
        raise ProtocolError(f"kvlease.control {control!r} is not an http(s) URL")


def _ref_ext_from_json(data: object) -> LeaseHandleExt:
    cls = LeaseHandleExt
    if not isinstance(data, Mapping):
        raise ProtocolError("kvlease must be an object")
    version = data.get("v")
    if version not in (PROTOCOL_VERSION, HOST_PLACEMENT_VERSION):
        raise ProtocolError(
            f"kvlease.v is {version!r}; this build speaks {PROTOCOL_VERSION} and {HOST_PLACEMENT_VERSION}"
        )
    placement = data.get(LEASE_HANDLE_PLACEMENT, "device")
    if placement not in ("host", "device") or (version == HOST_PLACEMENT_VERSION) != (placement == "host"):
        raise ProtocolError(f'kvlease.placement "host" goes with "v": {HOST_PLACEMENT_VERSION}, and only it')
    bs = _int_field(data, "block_size", 1, 1 << 16)
    nt = _int_field(data, "num_tokens", 0, 1 << 31)
    hashes = data.get("hashes")
    if not isinstance(hashes, list) or len(hashes) > cls.MAX_BLOCKS:
        raise ProtocolError("kvlease.hashes must be a list of hex strings")
    for h in hashes:
        if not isinstance(h, str) or len(h) != 32:
            raise ProtocolError("kvlease.hashes must be a list of 32-character hex strings")
    if len(hashes) > nt // bs:
        raise ProtocolError("kvlease.hashes covers more blocks than num_tokens")
    tail = data.get("tail")
    if tail is not None and (not isinstance(tail, str) or len(tail) != 32 or nt % bs == 0):
        raise ProtocolError("kvlease.tail must be null or a 32-character hex string (partial block only)")
    lease_id = data.get("lease_id")
    if not isinstance(lease_id, str) or not lease_id or len(lease_id) > 512:
        raise ProtocolError("kvlease.lease_id must be a non-empty string")
    engine_id = data.get("engine_id")
    control = data.get("control")
    if isinstance(control, str):
        _ref_check_control_url(control)
    mac = data.get(LEASE_HANDLE_MAC)
    if mac is not None and not isinstance(mac, str):
        raise ProtocolError("kvlease.mac must be a hex string")
    lora = data.get(LEASE_HANDLE_LORA)
    if lora is not None and (not isinstance(lora, str) or not lora or len(lora) > _MAX_ID_LEN):
        raise ProtocolError("kvlease.lora must be a non-empty string")
    mm = data.get(LEASE_HANDLE_MM)
    if mm is not None and (not isinstance(mm, str) or len(mm) != 32):
        raise ProtocolError("kvlease.mm must be a 32-character hex string")
    staging = data.get(LEASE_HANDLE_STAGING)
    if staging is not None and (
        not isinstance(staging, list)
        or not 0 < len(staging) <= cls.MAX_STAGING_RANKS
        or not all(_is_int(p) and 0 < p < 65536 for p in staging)
    ):
        raise ProtocolError("kvlease.staging must be a non-empty list of TCP ports")
    return cls(
        block_size=bs,
        num_tokens=nt,
        hashes=tuple(hashes),
        lease_id=lease_id,
        engine_id=engine_id if isinstance(engine_id, str) else None,
        control=control if isinstance(control, str) else None,
        version=PROTOCOL_VERSION,
        tail=tail,
        mac=mac,
        lora=lora,
        mm=mm,
        staging=tuple(staging) if staging is not None else None,
        placement=placement,
    )


def _ref_report_from_json(data: object) -> PrefillReport:
    if not isinstance(data, Mapping):
        raise ProtocolError("P's kvlease report must be an object")
    tokens = data.get("reused_tokens")
    if not _is_int(tokens) or tokens < 0:  # type: ignore[operator]
        raise ProtocolError("reused_tokens must be a non-negative integer")
    reuse = data.get("reuse")
    return PrefillReport(tokens, reuse if isinstance(reuse, str) else None)  # type: ignore[arg-type]


def _ref_block_ids(raw: object) -> tuple[tuple[tuple[int, ...], ...], bool]:
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


def _ref_from_json(data: object) -> TransferParams:
    if not isinstance(data, Mapping):
        raise ProtocolError("kv_transfer_params must be an object")
    fields: dict[str, Any] = {}
    nulls: set[str] = set()
    extra: list[tuple[str, Any]] = []
    for key, value in data.items():
        attr = _ATTR.get(key)
        if attr is None:
            extra.append((key, value))
        elif value is None:
            nulls.add(key)
        else:
            fields[attr] = value
    for name in (KV.DO_REMOTE_DECODE, KV.DO_REMOTE_PREFILL):
        if not isinstance(fields.get(name, False), bool):
            raise ProtocolError(f"{name} must be true or false")
    for key in (KV.REMOTE_ENGINE_ID, KV.REMOTE_REQUEST_ID):
        v = fields.get(_ATTR[key])
        if v is not None and (not isinstance(v, str) or not v or len(v) > _MAX_ID_LEN):
            raise ProtocolError(f"{key} must be a non-empty string")
    host = fields.get("host")
    if host is not None and (not isinstance(host, str) or not host):
        raise ProtocolError(f"{KV.REMOTE_HOST} must be a non-empty string, got {host!r}")
    port = fields.get("port")
    if port is not None and (not _is_int(port) or not 0 < port < 65536):
        raise ProtocolError(f"{KV.REMOTE_PORT} must be an integer in [1, 65535], got {port!r}")
    for key in PARALLEL_FIELDS:
        v = fields.get(key)
        if key in nulls or (v is not None and (not _is_int(v) or not 1 <= v <= _MAX_PARALLEL)):
            raise ProtocolError(f"{key} must be an integer in [1, {_MAX_PARALLEL}], got {v!r}")
    rbs = fields.get("remote_block_size")
    if KV.REMOTE_BLOCK_SIZE in nulls or (rbs is not None and (not _is_int(rbs) or not 1 <= rbs <= 1 << 16)):
        raise ProtocolError(f"{KV.REMOTE_BLOCK_SIZE} must be an integer in [1, 65536], got {rbs!r}")
    gen = fields.get("registration_generation")
    if gen is not None and (not _is_int(gen) or not 0 <= gen < 1 << 63):
        raise ProtocolError(f"{KV.REMOTE_REGISTRATION_GENERATION} must be a non-negative integer")
    nt = fields.get("num_tokens")
    if nt is not None and (not _is_int(nt) or not 0 <= nt <= 1 << 31):
        raise ProtocolError(f"{KV.REMOTE_NUM_TOKENS} must be a non-negative integer")
    expiry = fields.get("expiry")
    if expiry is not None and not (
        isinstance(expiry, (int, float)) and not isinstance(expiry, bool) and math.isfinite(expiry)
    ):
        raise ProtocolError(f"{KV.REMOTE_BLOCKS_EXPIRY_TIME} must be a number or null")
    if "block_ids" in fields:
        fields["block_ids"], fields["grouped"] = _ref_block_ids(fields["block_ids"])
    if "kvlease" in fields:
        ext = fields["kvlease"] = _ref_ext_from_json(fields["kvlease"])
        if ext.engine_id is not None and fields.get("engine_id", ext.engine_id) != ext.engine_id:
            raise ProtocolError(f"{KV.REMOTE_ENGINE_ID} does not match kvlease.engine_id")
        if fields.get("request_id", ext.lease_id) != ext.lease_id:
            raise ProtocolError(f"{KV.REMOTE_REQUEST_ID} does not match kvlease.lease_id")
        if rbs is not None and rbs != ext.block_size:
            raise ProtocolError(f"{KV.REMOTE_BLOCK_SIZE} {rbs} does not match kvlease.block_size")
    return TransferParams(**fields, nulls=frozenset(nulls), extra=tuple(extra))


def _ref_ext_to_json(ext: LeaseHandleExt) -> dict[str, Any]:
    out: dict[str, Any] = {
        "v": HOST_PLACEMENT_VERSION if ext.placement == "host" else ext.version,
        "block_size": ext.block_size,
        "num_tokens": ext.num_tokens,
        "hashes": list(ext.hashes),
        "tail": ext.tail,
        "lease_id": ext.lease_id,
        "engine_id": ext.engine_id,
        "control": ext.control,
    }
    for key, value in ((LEASE_HANDLE_LORA, ext.lora), (LEASE_HANDLE_MM, ext.mm)):
        if value is not None:
            out[key] = value
    if ext.staging is not None:
        out[LEASE_HANDLE_STAGING] = list(ext.staging)
    if ext.placement == "host":
        out[LEASE_HANDLE_PLACEMENT] = "host"
    if ext.mac is not None:
        out[LEASE_HANDLE_MAC] = ext.mac
    return out


def _ref_to_json(tp: TransferParams) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, attr in _ATTR.items():
        value = getattr(tp, attr)
        if value is None:
            if key in tp.nulls:
                out[key] = None
            continue
        if key == KV.REMOTE_BLOCK_IDS:
            value = [list(g) for g in value] if tp.grouped or not value else list(value[0])
        elif key == KV.KVLEASE:
            value = _ref_ext_to_json(value)
        out[key] = value
    out.update(tp.extra)
    return out


# ---- comparing outcomes -----------------------------------------------------------------------


def _shape(v: object) -> object:
    """``v`` with its exact types and key order (repr tells a tuple from a list, 1 from True)."""
    return repr(v)


def _outcome(parse: Any, to_json: Any, data: object) -> object:
    try:
        parsed = parse(data)
    except Exception as e:
        return ("raised", type(e), str(e))
    wire = to_json(parsed)
    return ("parsed", _shape(parsed), _shape(wire), wire == wire)


def _same(data: object) -> None:
    new = _outcome(TransferParams.from_json, TransferParams.to_json, data)
    old = _outcome(_ref_from_json, _ref_to_json, data)
    if old[:2] == ("raised", OverflowError):  # the one change: an int too large for a float is
        assert new == ("raised", ProtocolError, f"{KV.REMOTE_BLOCKS_EXPIRY_TIME} must be a number or null")
        return  # a ProtocolError now, like any other value that is not a finite number
    assert new == old
    if new[0] == "parsed":
        ours, ref = TransferParams.from_json(data), _ref_from_json(data)
        assert ours == ref and ours.to_json() == ref.to_json()
        assert replace(ours, port=7) == replace(ref, port=7)
        assert ours.to_json() is not ours.to_json()  # a fresh dict every call
        if ours.kvlease is not None:
            assert ours.kvlease.to_json() == _ref_ext_to_json(ref.kvlease)  # type: ignore[arg-type]


def _same_ext(data: object) -> None:
    new = _outcome(LeaseHandleExt.from_json, LeaseHandleExt.to_json, data)
    assert new == _outcome(_ref_ext_from_json, _ref_ext_to_json, data)


def _same_report(data: object) -> None:
    new = _outcome(PrefillReport.from_json, PrefillReport.to_json, data)
    assert new == _outcome(_ref_report_from_json, PrefillReport.to_json, data)


# ---- inputs -------------------------------------------------------------------------------------


class _Int(int):
    pass


class _Str(str):
    pass


class _List(list):  # type: ignore[type-arg]
    pass


def _d_handle(n_blocks: int = 8, bs: int = 16, tail: int = 5) -> dict[str, Any]:
    toks = list(range(n_blocks * bs + tail))
    hashes = block_hashes(toks, bs, "salt")
    p: dict[str, Any] = {
        KV.DO_REMOTE_DECODE: True,
        KV.DO_REMOTE_PREFILL: False,
        KV.REMOTE_BLOCK_IDS: [list(range(100, 100 + n_blocks + 1))],
        KV.REMOTE_NUM_TOKENS: len(toks),
        KV.REMOTE_BLOCKS_EXPIRY_TIME: 1234.5,
        KV.REMOTE_ENGINE_ID: "engine-d",
        KV.REMOTE_REQUEST_ID: "req-d-1",
        KV.REMOTE_HOST: "10.0.0.7",
        KV.REMOTE_PORT: 5601,
        KV.TP_SIZE: 1,
        "vendor": {"x": [1, 2]},
    }
    p[KV.KVLEASE] = {
        "v": 1,
        "block_size": bs,
        "num_tokens": len(toks),
        "hashes": hashes,
        "tail": tail_hash(toks[-tail:], hashes[-1] if hashes else None, "salt") if tail else None,
        "lease_id": "req-d-1",
        "engine_id": "engine-d",
        "control": "http://10.0.0.7:8200",
    }
    p[KV.KVLEASE][LEASE_HANDLE_MAC] = handle_mac("secret", p)
    return json.loads(json.dumps(p))


def _p_handle(n_blocks: int = 8) -> dict[str, Any]:
    return {
        KV.DO_REMOTE_PREFILL: True,
        KV.DO_REMOTE_DECODE: False,
        KV.REMOTE_BLOCK_IDS: [list(range(n_blocks))],
        KV.REMOTE_NUM_TOKENS: n_blocks * 16 - 3,
        KV.REMOTE_BLOCKS_EXPIRY_TIME: None,
        KV.REMOTE_ENGINE_ID: "engine-p",
        KV.REMOTE_REQUEST_ID: "req-p-1",
        KV.REMOTE_HOST: "10.0.0.6",
        KV.REMOTE_PORT: 5600,
        KV.TP_SIZE: 1,
    }


HEX = "0123456789abcdef" * 2
EDGE_INTS = [0, 1, -1, 2, 5600, 65535, 65536, (1 << 16) + 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32]
EDGE_INTS += [(1 << 63) - 1, 1 << 63, -(1 << 63), 10**30, -(10**30)]
ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers(-5, 300), st.integers())
scalars = st.one_of(
    ints,
    st.booleans(),
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), -0.0, 1e308, 10**400]),
    st.sampled_from([HEX, HEX.upper(), "z" * 32, "g" * 32, HEX[:31], HEX + "0", "", " " * 32, "\x00" * 32]),
    st.sampled_from(["http://h:1", "https://x.y", "ftp://h", "http://", "http://h:99999", "http://[::1]:80"]),
    st.sampled_from(
        ["http://h:abc", "not a url", "http://[zz", "//h:1", "HTTP://H:8", "engine-d", "req-d-1"]
    ),
    st.text(max_size=6),
    st.builds(_Int, st.integers(-2, 70000)),
    st.builds(_Str, st.sampled_from([HEX, "http://h:1", "x", ""])),
)
garbage = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=3).map(tuple),
        st.lists(inner, max_size=3).map(_List),
        st.dictionaries(st.text(max_size=4), inner, max_size=3),
    ),
    max_leaves=8,
)
id_items = st.one_of(
    ints, st.booleans(), st.floats(), st.none(), st.builds(_Int, st.integers(0, 9)), st.text(max_size=1)
)
id_list = st.one_of(st.lists(st.integers(0, (1 << 31) - 1), max_size=40), st.lists(id_items, max_size=8))
block_id_values = st.one_of(
    id_list,
    st.lists(id_list, max_size=3),
    st.lists(st.one_of(id_list, id_items), max_size=3),
    id_list.map(tuple),
    id_list.map(_List),
    st.lists(id_list.map(_List), max_size=2),
    garbage,
)
hash_items = st.one_of(
    st.sampled_from([HEX, "f" * 32, "z" * 32, HEX[:31], HEX + "a", "\x00" * 32]),
    st.builds(_Str, st.sampled_from([HEX, "ab"])),
    scalars,
)
hash_values = st.one_of(st.lists(st.just(HEX), max_size=12), st.lists(hash_items, max_size=6), garbage)
ALL_KEYS = [*_ATTR, "vendor", "kvlease_tenant", ""]
EXT_KEYS = ["v", "block_size", "num_tokens", "hashes", "tail", "lease_id", "engine_id", "control"]
EXT_KEYS += [
    LEASE_HANDLE_MAC,
    LEASE_HANDLE_LORA,
    LEASE_HANDLE_MM,
    LEASE_HANDLE_STAGING,
    LEASE_HANDLE_PLACEMENT,
    "other",
]


def _value_for(key: str) -> st.SearchStrategy[Any]:
    if key == KV.REMOTE_BLOCK_IDS:
        return block_id_values
    if key == "hashes":
        return hash_values
    if key == LEASE_HANDLE_STAGING:
        return st.one_of(st.lists(st.integers(-1, 70000), max_size=5), garbage)
    if key == LEASE_HANDLE_PLACEMENT:
        return st.one_of(st.sampled_from(["host", "device", "HOST"]), garbage)
    if key == "v":
        return st.one_of(st.sampled_from([1, 2, 3, True, 1.0]), garbage)
    return garbage


def _mutated(base: dict[str, Any], keys: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    edit = st.tuples(st.sampled_from(keys), st.booleans()).flatmap(
        lambda kd: st.tuples(st.just(kd[0]), st.just(kd[1]), _value_for(kd[0]))
    )

    def apply(edits: list[tuple[str, bool, Any]]) -> dict[str, Any]:
        out = json.loads(json.dumps(base))
        for key, delete, value in edits:
            if delete:
                out.pop(key, None)
            else:
                out[key] = value
        return out

    return st.lists(edit, max_size=4).map(apply)


def _with_ext(ext_edits: dict[str, Any]) -> dict[str, Any]:
    out = _d_handle()
    out[KV.KVLEASE] = ext_edits
    return out


BASE_D, BASE_P = _d_handle(), _p_handle()
handles = st.one_of(
    _mutated(BASE_D, ALL_KEYS),
    _mutated(BASE_P, ALL_KEYS),
    _mutated(BASE_D[KV.KVLEASE], EXT_KEYS).map(_with_ext),
    st.dictionaries(st.sampled_from(ALL_KEYS), garbage, max_size=6),
    garbage,
)
SETTINGS = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(handles)
def test_transfer_params_same_as_the_reference(data: object) -> None:
    _same(data)
    if isinstance(data, dict):
        _same(MappingProxyType(data))  # a Mapping that is not a dict


@SETTINGS
@given(_mutated(BASE_D[KV.KVLEASE], EXT_KEYS))
def test_lease_handle_ext_same_as_the_reference(data: dict[str, Any]) -> None:
    _same_ext(data)
    _same_ext(MappingProxyType(data))


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(st.dictionaries(st.sampled_from(["reused_tokens", "reuse", "x"]), garbage, max_size=3), garbage)
)
def test_prefill_report_same_as_the_reference(data: object) -> None:
    _same_report(data)


@settings(max_examples=600, deadline=None)
@given(id_list)
def test_fast_id_check_only_passes_what_the_reference_takes(ids: list[Any]) -> None:
    if ids and _ids_ok(ids):
        assert all(type(b) is int and 0 <= b < 1 << 31 for b in ids)
    elif ids and all(type(b) is int and 0 <= b < 1 << 31 for b in ids):
        pytest.fail(f"{ids!r} should take the fast path")


@pytest.mark.parametrize("n_blocks", [0, 1, 80, 300, 2000])
@pytest.mark.parametrize("tail", [0, 5])
def test_realistic_handles(n_blocks: int, tail: int) -> None:
    _same(_d_handle(n_blocks, tail=tail))
    _same(_p_handle(max(n_blocks, 1)))
    _same_ext(_d_handle(n_blocks, tail=tail)[KV.KVLEASE])


@pytest.mark.parametrize(
    "key, value",
    [
        (KV.REMOTE_BLOCK_IDS, [[0] * (LeaseHandleExt.MAX_BLOCKS + 1)]),
        (KV.REMOTE_BLOCK_IDS, [0] * (LeaseHandleExt.MAX_BLOCKS + 1)),
        (KV.REMOTE_BLOCK_IDS, [[0]] * (LeaseHandleExt.MAX_BLOCKS + 1)),
        (KV.REMOTE_BLOCK_IDS, [[1 << 31]]),
        (KV.REMOTE_BLOCK_IDS, [[(1 << 32) + 5]]),
        (KV.REMOTE_BLOCK_IDS, [[-(1 << 31)]]),
        (KV.REMOTE_BLOCK_IDS, [[True, 1]]),
        (KV.REMOTE_BLOCK_IDS, [[_Int(3)], [4]]),
        (KV.REMOTE_BLOCK_IDS, [[1.0]]),
        (KV.REMOTE_BLOCKS_EXPIRY_TIME, 10**400),  # was an OverflowError: now a ProtocolError
        (KV.REMOTE_BLOCKS_EXPIRY_TIME, float("nan")),
        (KV.REMOTE_BLOCKS_EXPIRY_TIME, True),
        (KV.REMOTE_PORT, True),
        (KV.REMOTE_PORT, _Int(80)),
        (KV.TP_SIZE, None),
        (KV.REMOTE_BLOCK_SIZE, None),
        (KV.REMOTE_BLOCK_SIZE, 16),
        (KV.REMOTE_BLOCK_SIZE, 32),
    ],
)
def test_edges(key: str, value: object) -> None:
    _same({**BASE_D, key: value})
    _same({**BASE_P, key: value})


@pytest.mark.parametrize(
    "key, value",
    [
        ("hashes", [HEX] * (LeaseHandleExt.MAX_BLOCKS + 1)),
        ("hashes", [_Str(HEX)]),
        ("hashes", _List([HEX])),
        ("hashes", [HEX, 5]),
        ("v", True),
        ("v", 1.0),
        ("block_size", True),
        ("block_size", _Int(16)),
        ("num_tokens", 1 << 31),
        ("control", _Str("http://h:1")),
        ("control", _Str("ftp://h")),
        ("control", 5),
        ("staging", [True]),
        ("staging", [1, 65535]),
        ("staging", [0]),
        ("staging", [1] * 4097),
        ("staging", []),
    ],
)
def test_ext_edges(key: str, value: object) -> None:
    ext = {**BASE_D[KV.KVLEASE], key: value}
    _same_ext(ext)
    _same({**BASE_D, KV.KVLEASE: ext})


def test_the_control_url_cache_is_bounded_and_changes_nothing() -> None:
    ext = BASE_D[KV.KVLEASE]
    for i in range(3 * _handle._GOOD_CONTROLS_MAX):
        for control in (f"http://h{i}:{i % 65536}", f"http://h{i}:99999{i}", f"ftp://h{i}"):
            _same_ext({**ext, "control": control})
            _same_ext({**ext, "control": control})  # the second time from the cache, if good
    assert len(_handle._GOOD_CONTROLS) <= _handle._GOOD_CONTROLS_MAX
    assert all(type(c) is str for c in _handle._GOOD_CONTROLS)


def test_an_int_too_large_for_a_float_is_a_protocol_error_everywhere() -> None:
    """``json`` reads any length of digits; ``math.isfinite`` raises ``OverflowError`` on such an
    int. Every number check of the protocol answers "not a number" instead (a ProtocolError or the
    field ignored, as for NaN), never an exception of its own."""
    huge = 10**400
    with pytest.raises(ProtocolError, match="must be a number or null"):
        TransferParams.from_json({**BASE_D, KV.REMOTE_BLOCKS_EXPIRY_TIME: huge})
    assert RenewResponse.from_json({"ttl": huge, "leases": {"c": {"expires_in": huge}}}) == RenewResponse(
        {"c": None}, None
    )
