"""The cluster simulator's pure model (``_cluster``), table-driven, with hand-computed figures."""

from __future__ import annotations

from typing import Any

import pytest

from kvlease._analyze._cluster import (
    DEVICE,
    FIRST,
    HOST,
    MISS,
    P_LOCAL,
    SimPolicy,
    build_sessions,
    simulate,
)
from kvlease._analyze._cluster_costs import (
    CLASS_PRESETS,
    STAGED_BYTES_PER_S,
    STAGED_FIXED_S,
    ClusterInputError,
    cluster_config,
)
from kvlease._analyze._cluster_report import capacity, per_turn_records, plan_cluster
from kvlease._analyze._model import TurnInput
from kvlease._analyze._plan import ModelKV
from kvlease._analyze._synth import agent_trace

#: 2 x 4 layers x 1 KV head x 64 x 2 B: 1 KiB a token.
KV = ModelKV(4, 1, 64, "bf16", "tiny")
BPT = 1024
GB = 1e9


def config(**kw: Any) -> Any:
    base: dict[str, Any] = {
        "kv": KV,
        "prefill_tps": 1000.0,
        "decode_tps": 100.0,
        "hbm_kv": 1e12,
        "host_bytes": 1e12,
        "p_cache": 0.0,
        "host_pull_gbps": 50.0,
        "ttl": 480.0,
        "max_idle": 1800.0,
        "retained_fraction": 1.0,
    }
    base.update(kw)
    return cluster_config(None, **base)


def turns(*sessions: tuple[str, float, list[tuple[int, int, float]]]) -> list[TurnInput]:
    """``(id, start, [(prompt, completion, think before this turn), ...])`` as recorded turns: each
    turn's arrival is the previous one's end (at 100 tokens/s) plus its think time."""
    rows: list[TurnInput] = []
    for sid, ts, ts_turns in sessions:
        for p, c, think in ts_turns:
            ts += think
            rows.append((sid, ts, p, c, None, None))
            ts += c / 100.0
    return rows


def pull_s(tokens: int) -> float:
    return STAGED_FIXED_S + tokens * BPT / min(STAGED_BYTES_PER_S, 50 * GB)


def two_turns(think: float) -> list[TurnInput]:
    return turns(("a", 0.0, [(1000, 100, 0.0), (1500, 100, think)]))


def test_sessions_think_time_is_the_gap_from_the_recorded_end() -> None:
    s = build_sessions(turns(("a", 5.0, [(10, 200, 0.0), (20, 100, 7.0)]), ("b", 0.0, [(1, 1, 0.0)])), 100.0)
    assert s.ids == ("b", "a") and list(s.offsets) == [0, 1, 3]
    assert list(s.think) == pytest.approx([0.0, 0.0, 7.0])
    assert list(s.start) == [0.0, 5.0] and list(s.prompt) == [1, 10, 20]


def test_hand_computed_ttft_of_a_tiny_trace() -> None:
    """Turn 1: prefill 1000 tokens at 1000/s, then P's KV to D. Turn 2 (a lease hit): pull the
    1100 tokens D holds, prefill the other 400, then the 1500-token KV to D."""
    r = simulate(build_sessions(two_turns(10.0), 100.0), config(), SimPolicy.LEASE, per_turn=True)
    ttft1 = 1.0 + pull_s(1000)
    ttft2 = pull_s(1100) + 0.4 + pull_s(1500)
    assert r.per_turn is not None
    assert [row[3] for row in r.per_turn] == pytest.approx([ttft1, ttft2])
    assert [row[4] for row in r.per_turn] == [FIRST, DEVICE]
    assert r.per_turn[1][2] == pytest.approx(ttft1 + 1.0 + 10.0)  # arrival: end of turn 1 + think
    assert r.reused_tokens == 1100
    # the lease holds turn 1's 1100 tokens for the 10 s think time, then turn 2's for max-idle
    assert r.hbm_retained_byte_s == pytest.approx(1100 * BPT * 10.0 + 1600 * BPT * 1800.0)


@pytest.mark.parametrize(
    ("policy", "think", "want"),
    [
        (SimPolicy.NONE, 10.0, MISS),
        (SimPolicy.TTL, 10.0, DEVICE),
        (SimPolicy.TTL, 479.0, DEVICE),
        (SimPolicy.TTL, 500.0, MISS),
        (SimPolicy.LEASE, 1700.0, DEVICE),
        (SimPolicy.LEASE, 1900.0, MISS),
        (SimPolicy.WRITE_THROUGH, 1700.0, DEVICE),
        (SimPolicy.WRITE_THROUGH, 1900.0, MISS),
        (SimPolicy.LRU_HOST, 10.0, HOST),
        (SimPolicy.LRU_HOST, 100_000.0, HOST),  # no deadline: only memory evicts
    ],
)
def test_follow_up_source_by_policy_and_think_time(policy: SimPolicy, think: float, want: int) -> None:
    r = simulate(build_sessions(two_turns(think), 100.0), config(), policy)
    assert r.sources[want] == 1 and r.follow_ups == 1


def test_no_reuse_recomputes_every_turn() -> None:
    s = build_sessions(agent_trace(40, seed=3), 100.0)
    r = simulate(s, config(), SimPolicy.NONE)
    assert r.sources[MISS] == r.follow_ups == s.turns - s.sessions
    assert r.reused_tokens == 0 and r.hbm_retained_byte_s == 0 and r.host_peak_bytes == 0


def test_infinite_hbm_leases_hit_every_follow_up_within_max_idle() -> None:
    s = build_sessions(agent_trace(40, seed=3), 100.0)  # pauses up to 25 min, under 30 min max-idle
    r = simulate(s, config(hbm_kv=1e15), SimPolicy.LEASE)
    assert r.sources[DEVICE] == r.follow_ups > 0 and r.evictions == 0


def test_write_through_retains_no_hbm_but_host() -> None:
    s = build_sessions(agent_trace(40, seed=3), 100.0)
    wt = simulate(s, config(), SimPolicy.WRITE_THROUGH)
    lease = simulate(s, config(), SimPolicy.LEASE)
    assert wt.hbm_retained_byte_s == 0 and wt.host_peak_bytes > 0
    assert lease.hbm_retained_byte_s > 0 and lease.host_peak_bytes == 0
    assert wt.sources[DEVICE] + wt.sources[HOST] == lease.sources[DEVICE] == wt.follow_ups


def test_write_through_falls_back_to_host_when_the_running_batch_evicts_the_copy() -> None:
    """HBM fits one turn: b's turn evicts a's HBM copy, so a's follow-up comes from the host."""
    rows = turns(("a", 0.0, [(1000, 100, 0.0), (1000, 100, 60.0)]), ("b", 5.0, [(1000, 100, 0.0)]))
    r = simulate(build_sessions(rows, 100.0), config(hbm_kv=1200 * BPT), SimPolicy.WRITE_THROUGH)
    assert r.sources[HOST] == 1 and r.hbm_retained_byte_s == 0


def test_the_lru_host_tier_evicts_the_least_recent() -> None:
    """Host memory holds two sessions' KV. a, b, c end in that order: c's offload evicts a; b and c
    come back (and are offloaded again) before a does."""
    rows = turns(
        ("a", 0.0, [(1000, 100, 0.0), (1000, 100, 100.0)]),
        ("b", 10.0, [(1000, 100, 0.0), (1000, 100, 50.0)]),
        ("c", 20.0, [(1000, 100, 0.0), (1000, 100, 50.0)]),
    )
    r = simulate(
        build_sessions(rows, 100.0), config(host_bytes=2 * 1100 * BPT), SimPolicy.LRU_HOST, per_turn=True
    )
    assert r.per_turn is not None
    follow = {row[0]: row[4] for row in r.per_turn if row[1] == 1}
    assert follow == {"a": MISS, "b": HOST, "c": HOST}


def test_host_pulls_slower_than_recompute_are_declined() -> None:
    """kvlease's cost model: at 0.9 GB/s and 1 KiB a token a pull costs 1.1 us a token, but
    recomputing at 1M tokens/s costs 1 us: P recomputes."""
    s = build_sessions(two_turns(10.0), 100.0)
    slow = simulate(s, config(host_pull_gbps=0.9, prefill_tps=1e6), SimPolicy.LRU_HOST)
    fast = simulate(s, config(host_pull_gbps=0.9, prefill_tps=1e5), SimPolicy.LRU_HOST)
    assert slow.sources[MISS] == 1 and fast.sources[HOST] == 1


def test_p_local_prefix_cache_reuses_the_previous_prompt_only() -> None:
    r = simulate(build_sessions(two_turns(10.0), 100.0), config(p_cache=1e12), SimPolicy.NONE)
    assert r.sources[P_LOCAL] == 1 and r.reused_tokens == 1000
    both = simulate(build_sessions(two_turns(10.0), 100.0), config(p_cache=1e12), SimPolicy.LEASE)
    assert both.sources[DEVICE] == 1 and both.reused_tokens == 1100  # 1000 local + 100 pulled


def test_a_turn_queues_until_the_running_batch_has_room() -> None:
    """HBM fits one turn's KV: b, arriving with a, is admitted when a ends."""
    rows = turns(("a", 0.0, [(1000, 100, 0.0)]), ("b", 0.0, [(1000, 100, 0.0)]))
    r = simulate(build_sessions(rows, 100.0), config(hbm_kv=1100 * BPT, prefill_tps=1e9), SimPolicy.NONE)
    x = pull_s(1000)
    first = 1000 / 1e9 + x
    assert list(r.ttft) == pytest.approx([first, first + 1.0 + x + 1000 / 1e9], rel=1e-6)


def test_ttl_retention_blocks_decode_concurrency_leases_under_a_cap_do_not() -> None:
    """a's KV is retained after it ends; b arrives 5 s later and fits only beside nothing. With
    the TTL b waits for the deadline; with leases capped at half the cache a's lease is evicted
    at retention (over the cap) and b runs at once; write-through retains nothing."""
    rows = turns(("a", 0.0, [(1000, 100, 0.0), (1000, 100, 3000.0)]), ("b", 5.0, [(1000, 100, 0.0)]))
    s = build_sessions(rows, 100.0)
    cfg = config(hbm_kv=1500 * BPT, retained_fraction=0.5)
    ttl = simulate(s, cfg, SimPolicy.TTL, per_turn=True)
    lease = simulate(s, cfg, SimPolicy.LEASE, per_turn=True)
    wt = simulate(s, cfg, SimPolicy.WRITE_THROUGH, per_turn=True)
    b = {r.policy: next(row[3] for row in r.per_turn or () if row[0] == "b") for r in (ttl, lease, wt)}
    assert b[SimPolicy.TTL] > 470 and b[SimPolicy.LEASE] < 2 and b[SimPolicy.WRITE_THROUGH] < 2
    assert lease.evictions == 3 and lease.hbm_retained_byte_s == 0  # each over the cap at once


def test_slots_hold_the_concurrency_and_capacity_brackets_the_target() -> None:
    s = build_sessions(agent_trace(60, seed=2, long_pause_share=0.0), 100.0)
    cfg = config(hbm_kv=2e8, prefill_tps=20_000.0, ttft_target=1.0)
    light, heavy = simulate(s, cfg, SimPolicy.NONE, slots=2), simulate(s, cfg, SimPolicy.NONE, slots=64)
    assert (light.ttft_at(0.9) or 0) < (heavy.ttft_at(0.9) or 0)
    cap = capacity(s, cfg, SimPolicy.NONE)
    points = dict(cap.points)
    assert 1 <= cap.sessions < 64 and points[cap.sessions] <= 1.0
    assert any(n > cap.sessions and p90 > 1.0 for n, p90 in points.items())


def test_plan_cluster_and_per_turn_records() -> None:
    s = build_sessions(agent_trace(30, seed=4), 100.0)
    plan = plan_cluster(s, config(), sweep=False, per_turn=True)
    recs = list(per_turn_records(plan))
    assert len(recs) == 5 * s.turns and {r["policy"] for r in recs} == {p.value for p in SimPolicy}
    assert all(r["hit"] == (r["source"] in ("device", "host")) for r in recs)
    data = plan.to_json()
    assert set(data["policies"]) == {p.value for p in SimPolicy}
    assert all(f["source"] for f in data["costs"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"model": "13b"}, "no cluster preset"),
        ({"model": None, "kv": KV}, "--prefill-tps, --decode-tps, --hbm-kv"),
        ({"model": None}, "model class"),
        ({"model": "8b", "d_nodes": 0}, "node counts"),
        ({"model": "8b", "retained_fraction": 1.5}, "retained fraction"),
        ({"model": "8b", "prefill_tps": -1.0}, "--prefill-tps"),
        ({"model": "8b", "hbm_kv": 0.0}, "KV cache per node"),
        ({"model": "8b", "ttft_target": 0.0}, "TTFT target"),
    ],
)
def test_bad_input(kwargs: dict[str, Any], match: str) -> None:
    model = kwargs.pop("model")
    with pytest.raises(ClusterInputError, match=match):
        cluster_config(model, **kwargs)


def test_bad_simulation_input() -> None:
    with pytest.raises(ClusterInputError, match="decode rate"):
        build_sessions([], 0.0)
    with pytest.raises(ClusterInputError, match="concurrent sessions"):
        simulate(build_sessions(two_turns(1.0), 100.0), config(), SimPolicy.NONE, slots=0)


@pytest.mark.parametrize(
    ("name", "bytes_per_token", "kv_gb"),
    [("8b", 131_072, 110.8), ("32b", 262_144, 61.3), ("70b", 327_680, 112.6), ("qwen2.5-32b", 262_144, 61.3)],
)
def test_class_presets(name: str, bytes_per_token: int, kv_gb: float) -> None:
    cfg = cluster_config(name)
    assert cfg.bytes_per_token == bytes_per_token
    assert cfg.hbm_kv.value / GB == pytest.approx(kv_gb, abs=0.1)
    assert "override with --prefill-tps" in cfg.prefill_tps.source
    assert "RESULTS.md" in cfg.device_pull_fixed.source and "measured" in cfg.host_pull_rate.source
    assert set(CLASS_PRESETS) == {"8b", "32b", "70b"}


def test_staged_line_goes_through_the_measurements() -> None:
    """The device pull reproduces RESULTS.md's staged 5.3 ms (1k) and 18.1 ms (24k tokens) on the
    32B layout when the NIC does not bound it."""
    cfg = cluster_config("32b", nic_gbps=1e6)
    assert cfg.device_pull_s(1024) == pytest.approx(5.309e-3, rel=1e-3)
    assert cfg.device_pull_s(24576) == pytest.approx(18.054e-3, rel=1e-3)
    per_block = cluster_config("32b", nic_gbps=1e6, per_block=True)
    assert per_block.device_pull_s(24576) == pytest.approx(635.9e-3, rel=1e-3)


def test_a_process_pool_gives_the_same_plan() -> None:
    from concurrent.futures import ProcessPoolExecutor

    s = build_sessions(agent_trace(20, seed=6), 100.0)
    serial = plan_cluster(s, config(), sweep=False)
    with ProcessPoolExecutor(max_workers=2) as pool:
        parallel = plan_cluster(s, config(), sweep=False, map_fn=pool.map)
    assert parallel.to_json() == serial.to_json()
