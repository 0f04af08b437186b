"""Staged pulls, the pure parts (``kvlease_vllm._staging``, the staging wire shapes of
``kvlease.protocol._handle``, the config keys and the cost model's staged path).

The vLLM side (``kvlease_vllm._worker``) runs on the real CPU stack in
``tests/integration/test_connector_staging.py`` and over a stand-in for vLLM's NIXL worker in
``test_worker_staged``; its override signatures are pinned against vLLM 0.32 and 0.33 in
``test_vllm_sources``.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import pytest

from kvlease._errors import ConfigError
from kvlease.protocol import KV, LEASE_HANDLE_MAC, ProtocolError, handle_mac
from kvlease.protocol._handle import LEASE_HANDLE_STAGING, LeaseHandleExt
from kvlease.protocol._staging import (
    STAGING_MAX_FRAME,
    STAGING_OP_RELEASE,
    STAGING_OP_STAGE,
    StagingRefusal,
    StagingReply,
    StagingRequest,
    staging_decode,
    staging_frame,
    staging_frame_length,
)
from kvlease_vllm import _staging
from kvlease_vllm._config import KVLeaseConfig, normalize_extra_config, parse_kvlease_config
from kvlease_vllm._cost import CostModel


# ------------------------------------------------------------------------------ planning
def test_joint_runs_need_both_sides_adjacent() -> None:
    assert _staging.joint_runs([1, 2, 3], [7, 8, 9]) == 1
    assert _staging.joint_runs([1, 2, 3], [7, 8, 20]) == 2
    assert _staging.joint_runs([1, 5, 6], [7, 8, 9]) == 2
    assert _staging.joint_runs([4, 3, 2], [1, 2, 3]) == 3
    assert _staging.joint_runs([], []) == 0


def test_merged_descriptors_pair_from_the_tail_like_upstream() -> None:
    # D's list also covers P's cached prefix: only its last len(P) ids are read
    assert _staging.merged_descriptors([[10, 11]], [[1, 2, 3, 4]], regions=8) == 8
    assert _staging.merged_descriptors([[10, 12]], [[3, 4]], regions=8) == 16
    assert _staging.merged_descriptors([[]], [[1, 2]], regions=8) == 0
    # two groups share the regions evenly
    assert _staging.merged_descriptors([[1, 2], [5]], [[1, 2], [9]], regions=8) == 4 + 4


def _choose(mode: str, **kw: Any) -> _staging.PathChoice:
    args: dict[str, Any] = dict(
        advertised=True,
        tokens=1024,
        capacity_tokens=8192,
        descriptors=10_000,
        min_descriptors=2048,
        per_block_s=0.03,
        staged_s=0.006,
    )
    args.update(kw)
    return _staging.choose_path(mode, **args)


@pytest.mark.parametrize(
    ("mode", "kw", "staged", "why"),
    [
        ("off", {}, False, "staging off"),
        ("auto", {"advertised": False}, False, "does not advertise"),
        ("always", {"advertised": False}, False, "does not advertise"),
        ("always", {"tokens": 9000}, False, "exceed the staging buffer"),
        ("always", {"descriptors": 1, "staged_s": 1.0}, True, "staging always"),
        ("auto", {"descriptors": 100}, False, "below staging_min_descriptors"),
        ("auto", {"staged_s": 0.05}, False, "no faster"),
        ("auto", {}, True, "descriptors: staged"),
    ],
)
def test_choose_path(mode: str, kw: dict[str, Any], staged: bool, why: str) -> None:
    choice = _choose(mode, **kw)
    assert choice.staged is staged
    assert why in choice.why
    assert choice.describe().startswith("staged" if staged else "per-block")


def _cost(**kw: Any) -> CostModel:
    args: dict[str, Any] = dict(
        bytes_per_token=262144.0,
        default_bandwidth_bps=750e9,
        default_prefill_tokens_per_s=4000.0,
        fixed_latency_s=0.005,
        descriptors_per_token=8.0,  # 64 layers x K/V / 16-token blocks
        per_descriptor_s=3.2e-6,
        staged_bandwidth_bps=4.9e11,
    )
    args.update(kw)
    return CostModel(**args)


def test_plan_pull_stages_a_fragmented_large_pull_on_auto() -> None:
    cfg = KVLeaseConfig(staging="auto", staging_max_tokens=32768)
    cost = _cost()
    n = 1536  # 24k tokens in 16-token blocks, scattered ids on both sides
    local = [[2 * i for i in range(n)]]
    remote = [[3 * i for i in range(n)]]
    choice = _staging.plan_pull(cfg, cost, (5000,), local, remote, 128, 24576)
    assert choice.staged, choice.why
    # the same pull, contiguous on both sides: NIXL merges it to 128 descriptors; not worth staging
    seq = [list(range(n))]
    assert not _staging.plan_pull(cfg, cost, (5000,), seq, seq, 128, 24576).staged
    # no ports in the handle (older kvlease, stock vLLM): never
    assert not _staging.plan_pull(cfg, cost, None, local, remote, 128, 24576).staged


def test_expect_staged() -> None:
    on = KVLeaseConfig(staging="auto", staging_max_tokens=100)
    assert _staging.expect_staged(on, True, 100)
    assert not _staging.expect_staged(on, True, 101)
    assert not _staging.expect_staged(on, False, 10)
    assert not _staging.expect_staged(KVLeaseConfig(staging="off"), True, 10)


def _layout(**kw: Any) -> str | None:
    args: dict[str, Any] = dict(
        source_ranks=1,
        tp_ratio=1,
        block_sizes=(16, 16),
        kernel_blocks_per_block=(1, 1),
        remote_dcp=1,
        groups=(1, 1),
        regions_grouped_alike=True,
        plain_layout=True,
    )
    args.update(kw)
    return _staging.layout_refusal(**args)


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({}, None),
        ({"source_ranks": 2}, "more than one source rank"),
        ({"tp_ratio": 2}, "heterogeneous TP"),
        ({"tp_ratio": -2}, "heterogeneous TP"),
        ({"block_sizes": (16, 32)}, "block sizes differ"),
        ({"kernel_blocks_per_block": (2, 2)}, "kernel blocks"),
        ({"remote_dcp": 2}, "decode context parallel"),
        ({"groups": (2, 2)}, "more than one KV cache group"),
        ({"regions_grouped_alike": False}, "region groups differ"),
        ({"plain_layout": False}, "post-processed layout"),
    ],
)
def test_layout_refusal_falls_back_on_what_it_cannot_prove(kw: dict[str, Any], why: str | None) -> None:
    got = _layout(**kw)
    assert got == why if why is None else why in (got or "")


# ------------------------------------------------------------------------------ the buffer
def test_range_allocator_first_fit_and_free() -> None:
    a = _staging.RangeAllocator(4 * 4096, align=4096)
    s1, o1 = a.alloc(100, now=0.0, hold_s=10.0) or (0, -1)
    s2, o2 = a.alloc(5000, now=0.0, hold_s=10.0) or (0, -1)  # takes two aligned pages
    assert (o1, o2) == (0, 4096)
    assert a.alloc(4097, now=0.0, hold_s=10.0) is None  # one page left
    s3, o3 = a.alloc(4096, now=0.0, hold_s=10.0) or (0, -1)
    assert o3 == 3 * 4096
    assert a.alloc(1, now=0.0, hold_s=10.0) is None  # full: the caller falls back (busy)
    assert a.free(s1) and not a.free(s1)
    assert a.alloc(4096, now=0.0, hold_s=10.0) == (s3 + 1, 0)  # the freed gap is reused
    assert a.in_use() == 3 and s2 > 0


def test_range_allocator_refuses_too_large_and_reclaims_expired_ranges() -> None:
    a = _staging.RangeAllocator(10_000, align=4096)
    assert a.alloc(10_001, now=0.0, hold_s=1.0) is None
    assert a.alloc(0, now=0.0, hold_s=1.0) is None
    assert a.alloc(10_000, now=0.0, hold_s=1.0) is not None  # an unaligned tail still fits
    assert a.alloc(1, now=0.5, hold_s=1.0) is None
    # a P that vanished does not keep D's buffer past the hold time
    assert a.alloc(10_000, now=1.0, hold_s=1.0) is not None


def test_range_allocator_never_reissues_a_range_until_freed() -> None:
    a = _staging.RangeAllocator(4 * 4096, align=4096)
    slot, offset = a.alloc(4 * 4096, now=0.0, hold_s=float("inf")) or (0, -1)
    for now in (1.0, 3600.0, 1e9, 1e15):  # however long the READ takes
        assert a.alloc(1, now=now, hold_s=float("inf")) is None
    assert a.free(slot)
    assert a.alloc(4096, now=1e15, hold_s=float("inf")) == (slot + 1, offset)


@pytest.mark.parametrize("nbytes", [4096, 1 << 30, 10 << 30, 60 << 30])
@pytest.mark.parametrize("timeout_s", [0.1, 2.0, 60.0])
@pytest.mark.parametrize("answer_after_s", [0.0, 0.5, 59.0])
def test_d_never_reissues_a_range_p_may_still_use(
    nbytes: int, timeout_s: float, answer_after_s: float
) -> None:
    """The whole staged range's life on one clock: P sends at 0 with its READ deadline, D allocates
    when the request arrives, then another request asks D for the same bytes at every later time.
    Whenever D hands the range out again, P's READ of it, seen done then or later, is declined."""
    deadline = _staging.read_deadline_s(timeout_s, nbytes)
    assert deadline >= _staging.READ_MIN_S and deadline >= nbytes / _staging.READ_FLOOR_BPS
    hold = _staging.range_hold_s(round(deadline * 1e3) / 1e3)  # as D reads it off the wire
    a = _staging.RangeAllocator(nbytes, align=4096)
    assert a.alloc(nbytes, now=answer_after_s, hold_s=hold) is not None
    reissued_at = None
    for t in sorted({deadline * f for f in (0.5, 0.999, 1.0, 1.0001, 1.001, 1.5, 10.0)} | {1e6}):
        if a.alloc(nbytes, now=answer_after_s + t, hold_s=hold) is not None:
            reissued_at = answer_after_s + t
            break
    assert reissued_at is not None, "a P that vanished keeps D's range forever"
    for seen in (reissued_at, reissued_at + 1.0):
        assert _staging.read_verdict("DONE", seen, deadline) == _staging.LATE
        assert _staging.read_verdict("PROC", seen, deadline) == _staging.LATE


@pytest.mark.parametrize(
    ("state", "now", "verdict"),
    [
        ("PROC", 0.0, "wait"),
        ("PROC", 9.999, "wait"),
        ("PROC", 10.0, "late"),
        ("DONE", 1.0, "scatter"),
        ("DONE", 10.0, "scatter"),
        ("DONE", 10.001, "late"),
        ("ERR", 1.0, "failed"),
        ("ERR", 11.0, "failed"),
    ],
)
def test_p_declines_a_read_not_seen_done_by_its_deadline(state: str, now: float, verdict: str) -> None:
    assert _staging.read_verdict(state, now, read_by=10.0) == verdict


def test_p_read_deadline_is_shorter_than_d_hold() -> None:
    for deadline in (0.001, 1.0, 12.0, _staging.READ_DEADLINE_MAX_S):
        assert _staging.range_hold_s(deadline) > deadline + 1.0
    # 10 GiB over UCX's TCP emulation (~0.4 GB/s) takes ~27 s: inside the deadline, not past D's hold
    assert _staging.read_deadline_s(2.0, 10 << 30) > (10 << 30) / 0.4e9


# ------------------------------------------------------------------------------ ports
def test_staging_ports_of_data_parallel_engines_do_not_overlap() -> None:
    ports = [_staging.staging_port(7300, dp, 2, r) for dp in range(3) for r in range(2)]
    assert ports == [7300, 7301, 7302, 7303, 7304, 7305]
    assert _staging.staging_port(0, 1, 2, 1) == 0  # free ports


def _free_port_range(n: int) -> int:
    for base in range(42000, 60000, 97):
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                s.bind(("127.0.0.1", base + i))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def test_two_engines_on_one_host_listen_apart_and_a_clash_is_refused_by_name() -> None:
    def handle(req: StagingRequest) -> StagingReply:
        return StagingReply(False, refusal=StagingRefusal.BUSY)

    token = _staging.staging_token("secret")
    base = _free_port_range(2)
    servers = []
    try:
        for dp in (0, 1):  # two engines of one host, TP 1, the same kvlease.staging_port
            port = _staging.staging_port(base, dp, 1, 0)
            servers.append(
                _staging.listen("127.0.0.1", port, handle, token=token, data_parallel_index=dp, tp_rank=0)
            )
        assert [s.port for s in servers] == [base, base + 1]
        with pytest.raises(ConfigError, match=r"kvlease\.staging_port.*data-parallel rank 0, TP rank 0"):
            _staging.listen("127.0.0.1", base, handle, token=token, data_parallel_index=0, tp_rank=0)
    finally:
        for s in servers:
            s.stop()


# ------------------------------------------------------------------------------ worker -> scheduler
@dataclass
class _Payload:
    compatibility_hash: str
    agent_metadata_bytes: bytes


def _payload(port: int | None, where: Any = ("10.0.0.1", "node-a")) -> _Payload:
    p = _Payload("h", b"m")
    if port is not None:
        setattr(p, _staging.PORT_ATTR, port)
        if where is not None:
            setattr(p, _staging.WHERE_ATTR, where)
    return p


def _take(meta: dict[Any, Any]) -> tuple[tuple[int, ...] | None, dict[Any, Any]]:
    return _staging.take_ports(meta, "10.0.0.1", node="node-a")


def test_take_ports_strips_the_attribute_from_copies() -> None:
    meta = {(0, 0): _payload(7000), (0, 1): _payload(7001)}
    ports, clean = _take(meta)
    assert ports == (7000, 7001)
    assert all(not hasattr(p, a) for p in clean.values() for a in (_staging.PORT_ATTR, _staging.WHERE_ATTR))
    assert clean[(0, 1)] == _Payload("h", b"m")
    assert hasattr(meta[(0, 0)], _staging.PORT_ATTR)  # the workers' objects are not edited


@pytest.mark.parametrize(
    "meta",
    [
        {(0, 0): _payload(None)},  # a worker without staging
        {(0, 0): _payload(7000), (0, 1): _payload(None)},  # one rank without
        {(0, 0): _payload(7000), (1, 0): _payload(7001)},  # pipeline stages
        {},
    ],
)
def test_take_ports_advertises_nothing_unless_every_rank_stages(meta: dict[Any, Any]) -> None:
    ports, clean = _take(meta)
    assert ports is None and clean.keys() == meta.keys()


@pytest.mark.parametrize(
    ("where", "shown"),
    [
        (("10.0.0.1", "node-b"), "10.0.0.1 on node-b"),  # multi-node TP: rank 1 on another node
        (("10.0.0.2", "node-a"), "10.0.0.2 on node-a"),  # bound where P does not connect
        (None, "?"),  # a worker that does not say where it listens
    ],
)
def test_take_ports_advertises_nothing_when_a_rank_listens_elsewhere(
    where: Any, shown: str, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    meta = {(0, 0): _payload(7000), (0, 1): _payload(7001, where)}
    with caplog.at_level(logging.INFO, logger="vllm.kvlease.staging"):
        ports, clean = _take(meta)
    assert ports is None and not hasattr(clean[(0, 1)], _staging.WHERE_ATTR)
    assert "rank(s) 1 listen at " + shown in caplog.text


# ------------------------------------------------------------------------------ wire shapes
def _roundtrip_request(r: StagingRequest) -> StagingRequest:
    raw = r.to_bytes()
    n = staging_frame_length(raw[:4])
    assert n == len(raw) - 4
    return StagingRequest.from_json(staging_decode(raw[4:]))


def test_staging_messages_round_trip() -> None:
    stage = StagingRequest(STAGING_OP_STAGE, "req-1", (5, 3, 9), (4096, 4096))
    assert _roundtrip_request(stage) == stage and stage.read_deadline_ms == 0  # an older P's
    timed = StagingRequest(STAGING_OP_STAGE, "req-1", (5,), (4096,), read_deadline_ms=12_500)
    assert _roundtrip_request(timed) == timed
    release = StagingRequest(STAGING_OP_RELEASE, "req-1", slot=7)
    assert _roundtrip_request(release) == release
    ok = StagingReply(True, slot=3, address=1 << 40, nbytes=8192, device_id=1)
    no = StagingReply(False, refusal=StagingRefusal.BUSY, detail="full")
    for reply in (ok, no):
        raw = reply.to_bytes()
        assert StagingReply.from_json(staging_decode(raw[4:])) == reply


@pytest.mark.parametrize(
    "body",
    [
        [],
        {"op": "stage", "lease_id": "", "block_ids": [1], "region_bytes": [1]},
        {"op": "gather", "lease_id": "x"},
        {"op": "stage", "lease_id": "x", "block_ids": [], "region_bytes": [1]},
        {"op": "stage", "lease_id": "x", "block_ids": [-1], "region_bytes": [1]},
        {"op": "stage", "lease_id": "x", "block_ids": [True], "region_bytes": [1]},
        {"op": "stage", "lease_id": "x", "block_ids": [1], "region_bytes": [0]},
        {"op": "stage", "lease_id": "x", "block_ids": [1], "region_bytes": [1], "read_deadline_ms": -1},
        {"op": "stage", "lease_id": "x", "block_ids": [1], "region_bytes": [1], "read_deadline_ms": 1.5},
        {"op": "release", "lease_id": "x"},
    ],
)
def test_bad_staging_requests_are_refused(body: object) -> None:
    with pytest.raises(ProtocolError):
        StagingRequest.from_json(body)


def test_bad_staging_replies_and_frames_are_refused() -> None:
    for body in ({}, {"ok": 1}, {"ok": False, "refusal": "nope"}, {"ok": True, "slot": 1}):
        with pytest.raises(ProtocolError):
            StagingReply.from_json(body)
    with pytest.raises(ProtocolError):
        staging_frame_length((STAGING_MAX_FRAME + 1).to_bytes(4, "big"))
    with pytest.raises(ProtocolError):
        staging_decode(b"{not json")
    assert staging_frame({"a": 1})[:4] == (7).to_bytes(4, "big")


def _ext(**kw: Any) -> LeaseHandleExt:
    return LeaseHandleExt(block_size=16, num_tokens=32, hashes=("0" * 32, "1" * 32), lease_id="r", **kw)


def test_handle_staging_field_is_optional_and_checked() -> None:
    plain = _ext().to_json()
    assert LEASE_HANDLE_STAGING not in plain  # an older reader sees the handle it knows
    assert LeaseHandleExt.from_json(plain).staging is None
    with_ports = _ext(staging=(41000, 41001)).to_json()
    assert with_ports[LEASE_HANDLE_STAGING] == [41000, 41001]
    assert LeaseHandleExt.from_json(with_ports).staging == (41000, 41001)
    for bad in ([], [0], [70000], ["1"], [True], 5):
        with pytest.raises(ProtocolError):
            LeaseHandleExt.from_json({**plain, LEASE_HANDLE_STAGING: bad})


def test_handle_mac_covers_the_staging_ports() -> None:
    handle = {KV.REMOTE_HOST: "127.0.0.1", KV.REMOTE_PORT: 5600, KV.KVLEASE: _ext(staging=(41000,)).to_json()}
    mac = handle_mac("s", handle)
    handle[KV.KVLEASE][LEASE_HANDLE_MAC] = mac
    moved = {**handle, KV.KVLEASE: {**handle[KV.KVLEASE], LEASE_HANDLE_STAGING: [41999]}}
    assert handle_mac("s", moved) != mac  # a client cannot point P's worker elsewhere


# ------------------------------------------------------------------------------ side channel
def test_server_answers_and_survives_bad_requests() -> None:
    seen: list[StagingRequest] = []

    def handle(req: StagingRequest) -> StagingReply:
        seen.append(req)
        if req.lease_id == "boom":
            raise RuntimeError("gather failed")
        return StagingReply(True, slot=1, address=4096, nbytes=len(req.block_ids))

    token = _staging.staging_token("secret")
    server = _staging.StagingServer("127.0.0.1", 0, handle, token=token).start()
    try:
        req = StagingRequest(STAGING_OP_STAGE, "r1", (1, 2, 3), (64,), auth=token)
        assert _staging.ask("127.0.0.1", server.port, req, 5.0) == StagingReply(
            True, slot=1, address=4096, nbytes=3
        )
        # garbage: the listener drops the connection and keeps serving
        with socket.create_connection(("127.0.0.1", server.port), timeout=5.0) as s:
            s.sendall(b"\x00\x00\x00\x02{x")
            assert s.recv(16) == b""
        boom = _staging.ask(
            "127.0.0.1", server.port, StagingRequest(STAGING_OP_STAGE, "boom", (1,), (64,), auth=token), 5.0
        )
        assert not boom.ok and boom.refusal == StagingRefusal.ERROR and "gather failed" in boom.detail
        # without the control secret's token nothing is gathered or freed
        for auth in ("", _staging.staging_token("other"), token[:-1]):
            for bad in (
                StagingRequest(STAGING_OP_STAGE, "r2", (1,), (64,), auth=auth),
                StagingRequest(STAGING_OP_RELEASE, "r1", slot=1, auth=auth),
            ):
                got = _staging.ask("127.0.0.1", server.port, bad, 5.0)
                assert not got.ok and got.refusal == StagingRefusal.UNAUTHORIZED
        assert [r.lease_id for r in seen] == ["r1", "boom"]
    finally:
        server.stop()
    with pytest.raises(OSError):  # a D without a listener: P's worker falls back
        _staging.ask("127.0.0.1", server.port, req, 1.0)
    with pytest.raises(ValueError, match="token"):
        _staging.StagingServer("127.0.0.1", 0, handle, token="")


# ------------------------------------------------------------------------------ config and cost
def test_staging_config_keys() -> None:
    cfg = parse_kvlease_config(
        {"staging": "auto", "staging_max_tokens": 4096, "staging_timeout_s": 0.5, "staging_port": 7100}
    )
    assert (cfg.staging, cfg.staging_max_tokens, cfg.staging_timeout_s, cfg.staging_port) == (
        "auto",
        4096,
        0.5,
        7100,
    )
    assert KVLeaseConfig().staging == "auto"  # stages only where it pays


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"staging": "on"}, "kvlease.staging must be one of off, auto, always"),
        ({"staging": True}, "kvlease.staging must be one of"),
        ({"staging_max_tokens": -1}, "kvlease.staging_max_tokens"),
        ({"staging_max_tokens": 1.5}, "kvlease.staging_max_tokens"),
        ({"staging_timeout_s": 0}, "kvlease.staging_timeout_s"),
        ({"staging_min_descriptors": "8"}, "kvlease.staging_min_descriptors"),
        ({"staging_bandwidth_bps": -1.0}, "kvlease.staging_bandwidth_bps"),
        ({"staging_port": 70000}, "kvlease.staging_port"),
        ({"stageing": "auto"}, "kvlease.stageing"),
    ],
)
def test_invalid_staging_config_names_the_key(raw: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        normalize_extra_config({KV.KVLEASE: raw})


def test_cost_model_predicts_and_learns_each_path_apart() -> None:
    cost = _cost(default_prefill_tokens_per_s=100_000.0)  # a GPU prefill: 24k tokens in 0.25 s
    tokens = 24576
    # the H200 figures: per-block ~636 ms, staged ~18 ms at 24k tokens of a 32B-class layout
    assert cost.predict_pull_s(tokens) == pytest.approx(0.005 + tokens * (8 * 3.2e-6 + 262144 / 750e9))
    assert 0.015 < cost.predict_pull_s(tokens, staged=True) < 0.021
    assert cost.predict_pull_s(tokens) > 0.6
    # a pull that would be declined per-block pays when staged
    assert not cost.decide(tokens, 64).pull
    assert cost.decide(tokens, 64, staged=True).pull
    cost.observe_pull(tokens, 0.105, staged=True)
    assert cost.staged_s_per_token == pytest.approx(0.1 / tokens)
    assert cost.pull_s_per_token == cost.default_pull_s_per_token  # the per-block rate is untouched
    with pytest.raises(ValueError):
        _cost(staged_bandwidth_bps=0.0)


# ------------------------------------------------------------------------------ the scheduler's part
# KVLeaseScheduler over the fake vLLM of ``fakes.vllm_standin`` (no vLLM in this venv).
from fakes.vllm_standin import (  # noqa: E402
    BS,
    D_TOKENS,
    NEW_TURN,
    SECRET,
    _FakeNixlScheduler,
    _Request,
    d_handle,
    scheduler,
)
from fakes.vllm_standin import ask as ask_p  # noqa: E402
from test_connector_scheduler import (  # noqa: E402
    _Blocks,
    claims,  # noqa: F401  (fixture)
    connector,  # noqa: F401  (fixture)
)


@pytest.mark.parametrize(("mode", "advertised"), [("auto", True), ("always", True), ("off", False)])
def test_d_advertises_its_workers_staging_ports_under_the_mac(
    connector: Any,  # noqa: F811
    mode: str,
    advertised: bool,
) -> None:
    from kvlease.protocol import mac_ok

    conn = scheduler(connector, role="kv_consumer", control_secret=SECRET, staging=mode)
    sched = conn.connector_scheduler
    try:
        sched.staging_ports = (41000,)  # what take_ports found on the workers' payloads
        _, out = sched.request_finished(_Request("d-1", D_TOKENS), [[1]])
        assert out[KV.KVLEASE].get(LEASE_HANDLE_STAGING) == ([41000] if advertised else None)
        assert mac_ok(SECRET, out)
    finally:
        sched.shutdown()


def test_p_plans_a_staged_pull_and_hands_it_to_its_workers(
    connector: Any,  # noqa: F811
    claims: list,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging
    import types

    monkeypatch.setattr(_FakeNixlScheduler, "build_connector_meta", lambda self, out: types.SimpleNamespace())
    conn = scheduler(connector, control_secret=SECRET, staging="always")
    sched = conn.connector_scheduler
    try:
        handle = d_handle()
        handle[KV.KVLEASE] = {**handle[KV.KVLEASE], LEASE_HANDLE_STAGING: [41000]}
        handle[KV.KVLEASE][LEASE_HANDLE_MAC] = handle_mac(SECRET, handle)  # as D signs it
        staged = _Request("p-1", D_TOKENS + NEW_TURN, handle)
        plain = _Request("p-2", D_TOKENS + NEW_TURN, d_handle())  # a D without staging
        for req in (staged, plain):
            assert ask_p(sched, req) == (len(D_TOKENS), True)
            with caplog.at_level(logging.INFO):
                sched.update_state_after_alloc(req, _Blocks([7, 8, 9, 20, 21]), 5 * BS)
        assert "staged (staging always)" in caplog.text
        assert "per-block (D does not advertise staging)" in caplog.text
        meta = sched.build_connector_meta(None)
        assert getattr(meta, _staging.PLANS_ATTR) == {"p-1": (41000,)}
        assert not hasattr(sched.build_connector_meta(None), _staging.PLANS_ATTR)  # handed over once
        assert sched._pulls["p-1"].staged and not sched._pulls["p-2"].staged
    finally:
        sched.shutdown()
