"""Host placement's pure pieces (issue 30): the config keys and their refusals, the handle's
placement on the wire, the staging reply's source, the promotion plan, the cost of a pull from
the arena, the retention table's lifetime and unhold, BlockRefs.give_back, and the placement
refusals on D (HostPlacer.unplaceable) and P (host_pull_refusal). No torch, no vLLM.
"""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace
from typing import Any

import pytest

from kvlease._errors import ConfigError
from kvlease.protocol import ProtocolError
from kvlease.protocol._handle import LeaseHandleExt
from kvlease.protocol._staging import STAGED_FROM_DEVICE, STAGED_FROM_HOST, StagingRefusal, StagingReply
from kvlease_vllm._arena_copy import ArenaCopyError, promote_plan
from kvlease_vllm._config import (
    ARENA_HEADROOM_BYTES,
    KVLeaseConfig,
    check_arena_memory,
    parse_kvlease_config,
)
from kvlease_vllm._cost import CostModel
from kvlease_vllm._desk import LeaseDesk
from kvlease_vllm._metrics import ConnectorMetrics
from kvlease_vllm._placement import HostPlacer, host_leases, host_pull_refusal
from kvlease_vllm._retention import BlockRefs, RetentionTable
from kvlease_vllm._verify import Reason

GIB = 1 << 30
ARENA = {"host_arena_bytes": 1 << 20}


# ---- config --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"placement": "host"}, "kvlease.host_arena_bytes"),
        ({"placement": "auto"}, "kvlease.host_arena_bytes"),
        ({**ARENA, "staging": "off"}, "kvlease.staging"),
        ({**ARENA, "placement": "host", "staging": "off"}, "kvlease.staging"),
        ({**ARENA, "staging_max_tokens": 0}, "kvlease.staging_max_tokens"),
        ({**ARENA, "own_block_refs": False}, "kvlease.own_block_refs"),
        ({"placement": "hbm"}, "kvlease.placement"),
        ({"placement": "HOST"}, "kvlease.placement"),
        ({"placement": 1}, "kvlease.placement"),
        ({"host_arena_bytes": -1}, "kvlease.host_arena_bytes"),
        ({"host_arena_bytes": 1.5}, "kvlease.host_arena_bytes"),
        ({"host_arena_bytes": True}, "kvlease.host_arena_bytes"),
        ({"max_lease_lifetime_s": 0}, "kvlease.max_lease_lifetime_s"),
        ({"max_lease_lifetime_s": math.inf}, "kvlease.max_lease_lifetime_s"),
        ({"arena_bandwidth_bps": 0}, "kvlease.arena_bandwidth_bps"),
    ],
)
def test_placement_refusals_name_the_key(raw: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_kvlease_config(raw)


@pytest.mark.parametrize(
    ("raw", "placement"),
    [
        (None, "device"),
        ({}, "device"),
        (ARENA, "auto"),
        ({**ARENA, "placement": None}, "auto"),
        ({**ARENA, "placement": "host"}, "host"),
        ({**ARENA, "placement": "device"}, "device"),
        # device placement needs none of the arena's prerequisites
        ({"placement": "device", "staging": "off", "own_block_refs": False}, "device"),
        ({**ARENA, "placement": "device", "staging": "off"}, "device"),
    ],
)
def test_resolved_placement(raw: Any, placement: str) -> None:
    assert parse_kvlease_config(raw).resolved_placement() == placement


def test_new_keys_parse_and_default() -> None:
    cfg = parse_kvlease_config(
        {**ARENA, "placement": "host", "max_lease_lifetime_s": 600, "arena_bandwidth_bps": 2e10}
    )
    assert (cfg.host_arena_bytes, cfg.placement, cfg.max_lease_lifetime_s) == (1 << 20, "host", 600.0)
    assert cfg.arena_bandwidth_bps == 2e10 and isinstance(cfg.max_lease_lifetime_s, float)
    d = KVLeaseConfig()
    assert (d.placement, d.host_arena_bytes, d.max_lease_lifetime_s) == (None, 0, 4 * 3600.0)


def test_check_arena_memory() -> None:
    check_arena_memory(arena_bytes=3 * GIB, workers_on_host=2, available_bytes=10 * GIB)  # 6 + 4 fit
    check_arena_memory(arena_bytes=0, workers_on_host=8, available_bytes=ARENA_HEADROOM_BYTES)
    with pytest.raises(ConfigError) as e:
        check_arena_memory(arena_bytes=4 * GIB, workers_on_host=2, available_bytes=10 * GIB)
    msg = str(e.value)
    assert msg.startswith(f"kvlease.host_arena_bytes={4 * GIB} ")
    assert "2 worker(s)" in msg and f"at most {3 * GIB}" in msg and "10.0 GiB" in msg
    with pytest.raises(ConfigError, match="at most 0 "):  # nothing fits: the hint is 0
        check_arena_memory(arena_bytes=1, workers_on_host=1, available_bytes=GIB)


# ---- the handle's placement ---------------------------------------------------------------------------
def handle(**kw: Any) -> LeaseHandleExt:
    return LeaseHandleExt(block_size=16, num_tokens=40, hashes=("0" * 32, "1" * 32), lease_id="r", **kw)


def test_a_host_placed_handle_is_v2_and_round_trips() -> None:
    h = handle(placement="host", staging=(9000,))
    wire = json.loads(json.dumps(h.to_json()))
    assert wire["v"] == 2 and wire["placement"] == "host"
    back = LeaseHandleExt.from_json(wire)
    assert back == h and back.placement == "host"


def test_a_device_handle_is_v1_without_placement() -> None:
    h = handle()
    wire = h.to_json()
    assert wire["v"] == 1 and "placement" not in wire
    assert LeaseHandleExt.from_json(wire) == h
    assert LeaseHandleExt.from_json({**wire, "placement": "device"}).placement == "device"


@pytest.mark.parametrize(
    "edit",
    [
        {"v": 2},  # v2 without a placement
        {"v": 2, "placement": "device"},
        {"v": 1, "placement": "host"},  # a v1 handle must not say host
        {"v": 2, "placement": "disk"},
        {"v": 1, "placement": "disk"},
        {"v": 1, "placement": None},
        {"v": 3, "placement": "host"},
        {"v": 3},
    ],
)
def test_from_json_refuses_a_placement_that_does_not_match_the_version(edit: dict[str, Any]) -> None:
    wire = {**handle().to_json(), **edit}
    with pytest.raises(ProtocolError):
        LeaseHandleExt.from_json(wire)


# ---- the staging reply's source ------------------------------------------------------------------------
def _wire(reply: StagingReply) -> dict[str, Any]:
    raw = reply.to_bytes()
    assert int.from_bytes(raw[:4], "big") == len(raw) - 4
    return json.loads(raw[4:])


@pytest.mark.parametrize("source", [STAGED_FROM_DEVICE, STAGED_FROM_HOST])
def test_staging_reply_source_round_trip(source: str) -> None:
    reply = StagingReply(True, slot=3, address=1 << 40, nbytes=4096, device_id=1, source=source)
    body = _wire(reply)
    assert body["source"] == source
    assert StagingReply.from_json(body) == reply


@pytest.mark.parametrize("source", [None, "disk", 1, "HOST"])
def test_an_unknown_or_missing_source_reads_as_device(source: Any) -> None:
    body = _wire(StagingReply(True, slot=0, address=8, nbytes=16))
    if source is None:
        del body["source"]
    else:
        body["source"] = source
    assert StagingReply.from_json(body).source == STAGED_FROM_DEVICE


def test_a_refusal_carries_no_source() -> None:
    body = _wire(StagingReply(False, refusal=StagingRefusal.UNKNOWN_LEASE, detail="gone"))
    assert "source" not in body
    assert StagingReply.from_json(body).refusal == StagingRefusal.UNKNOWN_LEASE


# ---- promote_plan ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("rows", "blocks", "positions", "plan"),
    [
        ((4, 2), 5, [1, 2, 4], [(4, 0, 8), (16, 8, 4), (22, 12, 4), (28, 16, 2)]),
        ((4, 2), 5, [0, 1, 2, 3, 4], [(0, 0, 20), (20, 20, 10)]),  # the whole lease: one per region
        ((4,), 3, [2, 1], [(8, 0, 4), (4, 4, 4)]),  # descending: not merged
        ((4,), 3, [0, 2], [(0, 0, 4), (8, 4, 4)]),
        ((3, 5), 4, [], []),
    ],
)
def test_promote_plan(rows: tuple[int, ...], blocks: int, positions: list[int], plan: list[Any]) -> None:
    assert promote_plan(rows, blocks, positions) == plan


@pytest.mark.parametrize("positions", [[5], [-1], [0, 5]])
def test_promote_plan_refuses_positions_outside_the_lease(positions: list[int]) -> None:
    with pytest.raises(ArenaCopyError):
        promote_plan((4, 2), 5, positions)


@pytest.mark.parametrize("seed", range(20))
def test_promote_plan_reproduces_a_gather(seed: int) -> None:
    """Applied to a lease packed region-major, the plan lays out the chosen blocks as a gather."""
    rng = random.Random(seed)
    rows = [rng.randint(1, 9) for _ in range(rng.randint(1, 4))]
    n = rng.randint(1, 12)
    positions = rng.sample(range(n), rng.randint(1, n))
    if rng.random() < 0.5:
        positions.sort()
    # byte (region, block, i) of the lease, packed region-major
    packed = [(r, b, i) for r, row in enumerate(rows) for b in range(n) for i in range(row)]
    want = [(r, b, i) for r, row in enumerate(rows) for b in positions for i in range(row)]
    out: list[Any] = [None] * len(want)
    for src, dst, size in promote_plan(rows, n, positions):
        out[dst : dst + size] = packed[src : src + size]
    assert out == want


# ---- the cost of a pull from the arena ------------------------------------------------------------------
def model(host_bps: float | None) -> CostModel:
    return CostModel(
        bytes_per_token=1000.0,
        default_bandwidth_bps=1e9,
        default_prefill_tokens_per_s=5000.0,
        fixed_latency_s=0.005,
        staged_bandwidth_bps=1e10,
        host_bandwidth_bps=host_bps,
    )


@pytest.mark.parametrize("tokens", [1, 1000, 24000])
def test_a_host_pull_adds_the_promotion(tokens: int) -> None:
    m = model(2e8)
    staged = m.decide(tokens, 0, staged=True)
    host = m.decide(tokens, 0, staged=True, host=True)
    assert host.predicted_pull_s - staged.predicted_pull_s == pytest.approx(tokens * 1000.0 / 2e8)
    assert host.predicted_recompute_s == staged.predicted_recompute_s


def test_the_promotion_can_turn_a_pull_into_a_recompute() -> None:
    m = model(2e8)  # 1,000 tokens: 5 ms + 0.1 ms staged; 200 ms to recompute
    assert m.decide(1000, 0, staged=True).pull
    assert m.decide(1000, 0, staged=True, host=True).pull  # + 5 ms to promote
    assert model(4e6).decide(1000, 0, staged=True, host=True).reason is Reason.COST  # + 250 ms
    assert model(None).decide(1000, 0, staged=True, host=True) == m.decide(1000, 0, staged=True)


def test_host_bandwidth_must_be_positive() -> None:
    with pytest.raises(ValueError, match="host_bandwidth_bps"):
        model(0.0)


# ---- the retention table: lifetime and unhold -----------------------------------------------------------
def test_max_lifetime_caps_the_first_deadline_and_every_renewal() -> None:
    t = RetentionTable(100, renew_guard=0.0, max_lifetime=50.0)
    t.add("a", 4, deadline=1000.0, now=10.0)
    assert t.get("a").deadline == 60.0 and t.get("a").hard_end == 60.0  # type: ignore[union-attr]
    t.add("b", 4, deadline=30.0, now=10.0)
    assert t.renew("b", 100.0, 20.0) == 60.0
    assert t.renew("b", 1.0, 59.0) == 60.0
    assert t.renew("b", 10.0, 60.0) is None
    assert t.take_updates() == {"b": 60.0}


def test_unhold_leaves_the_lease_and_frees_its_room() -> None:
    t = RetentionTable(10)
    t.add("a", 6, deadline=100.0, now=0.0)
    assert t.unhold("a") == 6 and t.unhold("a") == 0 and t.unhold("nope") == 0
    assert "a" in t and t.retained_blocks == 0 and t.get("a").blocks == 0  # type: ignore[union-attr]
    assert t.add("b", 10, deadline=50.0, now=1.0) == t.add("c", 0, deadline=10.0, now=1.0)
    assert t.relieve(5, now=2.0) == ["c", "b"]  # a holds no device block (c, held, frees 0 first)
    assert t.relieve(5, now=2.0) == []
    assert t.renew("a", 10.0, 3.0) is not None
    assert t.forget("a") and t.retained_blocks == 0


def test_a_full_cap_releases_held_leases_not_unheld_ones() -> None:
    t = RetentionTable(10)
    t.add("old", 4, deadline=10.0, now=0.0)
    t.unhold("old")
    t.add("mid", 6, deadline=20.0, now=0.0)
    got = t.add("new", 8, deadline=30.0, now=1.0)
    assert got.retained and got.released == ("mid",) and "old" in t


# ---- BlockRefs.give_back -------------------------------------------------------------------------------
class Pool:
    def __init__(self, n: int) -> None:
        self.blocks = [SimpleNamespace(block_id=i) for i in range(n)]
        self.calls: list[tuple[str, list[int]]] = []

    def touch(self, blocks: Any) -> None:
        self.calls.append(("touch", [b.block_id for b in blocks]))

    def free_blocks(self, blocks: Any) -> None:
        self.calls.append(("free", [b.block_id for b in blocks]))


def test_give_back_frees_once_and_the_lease_stays_ours() -> None:
    refs, pool = BlockRefs(), Pool(10)
    refs.take(pool, "a", [[1, 2], [2, 3]])
    refs.take(pool, "b", [[5]])
    assert pool.calls == [("touch", [1, 2, 3]), ("touch", [5])]
    refs.give_back(pool, ["a", "unknown"])
    assert pool.calls[2:] == [("free", [3, 2, 1])]
    refs.give_back(pool, ["a"])  # twice: nothing more
    assert len(pool.calls) == 3
    assert refs.drop(pool, ["a", "b", "c"]) == ["a", "b"]
    assert pool.calls[3:] == [("free", [5])]  # a's blocks are not freed twice
    assert refs.drop(pool, ["a"]) == []


def test_give_back_without_a_pool_still_reports_the_lease() -> None:
    refs, pool = BlockRefs(), Pool(4)
    refs.take(pool, "a", [[0]])
    refs.give_back(None, ["a"])
    assert refs.drop(pool, ["a"]) == ["a"] and pool.calls == [("touch", [0])]


# ---- refusals of a placement on D and of a host pull on P ------------------------------------------------
def placer(**cfg: Any) -> HostPlacer:
    c = KVLeaseConfig(host_arena_bytes=1 << 20, staging_max_tokens=1024, **cfg)
    m = ConnectorMetrics()
    return HostPlacer(LeaseDesk(RetentionTable(10), m, clock=lambda: 0.0), BlockRefs(), m, c)


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"staging_ports": None}, "no staging buffer"),
        ({"staging_ports": ()}, "no staging buffer"),
        ({"staging_ports": None, "multi_group": True}, "no staging buffer"),  # the first reason wins
        ({"multi_group": True}, "several KV cache groups"),
        ({"own_refs": False}, "own reference"),
        ({"num_tokens": 1025}, "1025 tokens exceed kvlease.staging_max_tokens (1024)"),
        ({"num_tokens": 1024}, None),
        ({}, None),
    ],
)
def test_unplaceable(kw: dict[str, Any], why: str | None) -> None:
    args: dict[str, Any] = {
        "staging_ports": (9000,),
        "multi_group": False,
        "num_tokens": 16,
        "own_refs": True,
    }
    got = placer().unplaceable(**{**args, **kw})
    assert got is None if why is None else why in (got or "")


@pytest.mark.parametrize(
    ("cfg", "ports", "tokens", "why"),
    [
        ({"staging": "off"}, (9000,), 16, "kvlease.staging is off"),
        ({}, None, 16, "no staging port"),
        ({}, (), 16, "no staging port"),
        (
            {"staging_max_tokens": 100},
            (9000,),
            101,
            "101 tokens exceed this node's kvlease.staging_max_tokens",
        ),
        ({"staging_max_tokens": 100}, (9000,), 100, None),
        ({}, (9000, 9001), 16, None),
    ],
)
def test_host_pull_refusal(cfg: dict[str, Any], ports: Any, tokens: int, why: str | None) -> None:
    got = host_pull_refusal(KVLeaseConfig(**cfg), ports, tokens)
    assert got is None if why is None else why in (got or "")


@pytest.mark.parametrize(
    ("cfg", "role", "block_bytes", "device_ok"),
    [
        ({}, "kv_consumer", 100, None),  # no arena: device placement
        ({**ARENA, "placement": "device"}, "kv_consumer", 100, None),
        ({**ARENA}, "kv_producer", 100, None),  # not a decode node
        ({**ARENA}, "kv_consumer", 0, None),
        ({**ARENA}, "kv_consumer", 100, True),
        ({**ARENA}, "kv_both", 100, True),
        ({**ARENA, "placement": "host"}, "kv_consumer", 100, False),
    ],
)
def test_host_leases_from_the_config(
    cfg: dict[str, Any], role: str, block_bytes: int, device_ok: Any
) -> None:
    got = host_leases(KVLeaseConfig(max_lease_lifetime_s=90.0, **cfg), role, block_bytes)
    if device_ok is None:
        assert got is None
        return
    assert got is not None and got.device_ok is device_ok and got.block_bytes == block_bytes
    assert got.arena.capacity == 1 << 20 and got.arena.max_lease_lifetime_s == 90.0


# ---- the model runner -------------------------------------------------------------------------
@pytest.mark.parametrize("placement", ["auto", "host"])
def test_host_placement_refused_on_the_v2_model_runner_naming_the_setting(placement: str) -> None:
    from kvlease_vllm._config import check_model_runner

    cfg = parse_kvlease_config({"placement": placement, "host_arena_bytes": 1 << 20})
    with pytest.raises(ConfigError, match="VLLM_USE_V2_MODEL_RUNNER=0") as e:
        check_model_runner(cfg, kv_role="kv_consumer", v2_model_runner=True)
    assert f"kvlease.placement={placement!r}" in str(e.value)
    check_model_runner(cfg, kv_role="kv_consumer", v2_model_runner=False)  # the V1 runner: fine
    check_model_runner(cfg, kv_role="kv_producer", v2_model_runner=True)  # P holds no lease
    device = parse_kvlease_config({"placement": "device", "host_arena_bytes": 1 << 20})
    check_model_runner(device, kv_role="kv_consumer", v2_model_runner=True)
