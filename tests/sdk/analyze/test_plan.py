"""The capacity planner's core (``_plan``, ``_plan_report``): each policy, the cap's eviction order,
node hashing, block rounding, the analyzer's figures as a cross-check, a generated agent trace."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlease._analyze import analyze
from kvlease._analyze._model import TurnInput
from kvlease._analyze._plan import PRESETS, ModelKV, Policy, node_of, prepare, replay
from kvlease._analyze._plan_api import read_turns
from kvlease._analyze._plan_report import PlanConfig, plan_trace
from kvlease._analyze._synth import agent_trace

DATA = Path(__file__).resolve().parents[2] / "data"


def t(cid: str, ts: float, p: int | None = 16, c: int | None = 0, end: float | None = None,
      gap: float | None = None) -> TurnInput:  # fmt: skip
    return (cid, ts, p, c, end, gap)


def hits(
    rows: list[TurnInput], policy: str, retention: float, nodes: int = 1, cap_bytes: int | None = None
) -> int:
    return replay(prepare(rows), policy, retention, bytes_per_token=1, nodes=nodes, cap_bytes=cap_bytes).hits


@pytest.mark.parametrize(
    ("rows", "policy", "retention", "want"),
    [
        ([t("a", 0), t("a", 100), t("a", 700)], "ttl", 480, 1),  # the 600 s pause is beyond the TTL
        ([t("a", 0), t("a", 100), t("a", 700)], "lease", 1800, 2),  # ... and within max-idle
        ([t("a", 0), t("a", 480)], "ttl", 480, 1),  # deadline == arrival: still retained
        ([t("a", 0), t("a", 480.5)], "ttl", 480, 0),
        ([t("a", 0, end=100), t("a", 550)], "ttl", 480, 1),  # counted from the end when known
        ([t("a", 0), t("a", 550, gap=10)], "ttl", 480, 1),  # a measured gap wins
        ([t("a", 0), t("a", 400, gap=500)], "ttl", 480, 0),
        ([t("a", 0), t("b", 1), t("a", 2), t("b", 3)], "ttl", 480, 2),  # conversations are separate
        ([t("a", 5), t("a", 0)], "ttl", 1, 0),  # input order does not matter: sorted by time
        ([t("a", 0), t("a", 1), t("a", 2)], "lease", 0, 0),
    ],
)
def test_policies(rows: list[TurnInput], policy: str, retention: float, want: int) -> None:
    assert hits(rows, policy, retention) == want


@pytest.mark.parametrize(
    ("rows", "cap", "want_hits", "want_evictions"),
    [
        # 16 bytes each (one block); cap 32: c evicts a (oldest deadline); b renews; d evicts c;
        # c evicts d, a evicts b
        ([t("a", 0), t("b", 1), t("c", 2), t("b", 3), t("d", 4), t("b", 5), t("c", 6), t("a", 7)], 32, 2, 4),
        # the oldest *deadline* goes, not the oldest arrival: a ends late, b early
        ([t("a", 0, end=50), t("b", 1, end=2), t("c", 3), t("a", 4), t("b", 5)], 32, 1, 2),
        ([t("a", 0), t("b", 1), t("a", 2), t("b", 3)], 32, 2, 0),  # fits: no eviction
        ([t("a", 0, p=40), t("a", 1)], 32, 0, 1),  # larger than the cap on its own: never retained
    ],
)
def test_cap_evicts_the_oldest_deadline_first(
    rows: list[TurnInput], cap: int, want_hits: int, want_evictions: int
) -> None:
    r = replay(prepare(rows), Policy.LEASE, 1800, bytes_per_token=1, cap_bytes=cap)
    assert (r.hits, r.evictions) == (want_hits, want_evictions)
    assert r.peak_bytes <= cap


def test_nodes_are_separate_memories() -> None:
    ids = [f"c{i}" for i in range(50)]
    a = ids[0]
    b = next(x for x in ids if node_of(x, 2) != node_of(a, 2))
    rows = [t(a, 0), t(b, 1), t(a, 2), t(b, 3)]
    assert hits(rows, "lease", 1800, cap_bytes=16, nodes=2) == 2  # one conversation per node
    assert hits(rows, "lease", 1800, cap_bytes=16, nodes=1) == 0  # they evict each other


def test_node_hashing_is_stable_and_spread() -> None:
    assert node_of("conv-1", 1) == 0
    assert node_of("agent-000001", 8) == node_of("agent-000001", 8)
    import zlib

    assert node_of("agent-000001", 8) == zlib.crc32(b"agent-000001") % 8
    counts = [0] * 8
    for i in range(10_000):
        counts[node_of(f"agent-{i:06d}", 8)] += 1
    assert all(1_100 < n < 1_400 for n in counts)


@pytest.mark.parametrize(
    ("p", "c", "block", "want"), [(16, 0, 16, 16), (16, 1, 16, 32), (0, 0, 16, 0), (5, 5, 1, 10)]
)
def test_retained_bytes_are_whole_blocks(p: int, c: int, block: int, want: int) -> None:
    r = replay(prepare([t("a", 0, p=p, c=c)]), "lease", 10, bytes_per_token=3, block_size=block)
    assert r.peak_bytes == 3 * want


def test_reused_tokens_are_the_analyzers_estimate() -> None:
    rows = [
        t("a", 0, p=100, c=20),
        t("a", 1, p=150, c=None),
        t("a", 2, p=140),
        t("a", 3, p=None),
        t("a", 4, p=9),
    ]
    r = replay(prepare(rows), "lease", 1800, bytes_per_token=1)
    assert r.hits == 4
    assert r.reused_tokens == 120 + 140 + 0 + 0  # min(prev prompt + completion, prompt); unknown: 0
    assert r.prompt_tokens == 150 + 140


def test_release_on_close() -> None:
    rows = [t("a", 0), t("a", 1), t("b", 2)]
    open_ = replay(prepare(rows), "lease", 1800, bytes_per_token=1)
    closed = replay(prepare(rows), "lease", 1800, bytes_per_token=1, release_on_close=True)
    assert open_.hits == closed.hits == 1
    assert open_.peak_bytes == 32 and closed.peak_bytes == 16  # a's last turn keeps nothing
    ttl = replay(prepare(rows), "ttl", 480, bytes_per_token=1, release_on_close=True)
    assert ttl.peak_bytes == 32  # upstream's TTL has no release


@pytest.mark.parametrize(
    ("name", "per_token"),
    [
        ("llama-3.1-8b", 131_072),
        ("llama-3.1-70b", 327_680),
        ("qwen2.5-32b", 262_144),
        ("gpt-oss-120b", 73_728),
    ],
)
def test_presets(name: str, per_token: int) -> None:
    m = PRESETS[name]
    assert m.bytes_per_token == per_token
    assert ModelKV(m.layers, m.kv_heads, m.head_dim, "fp8").bytes_per_token == per_token // 2
    with pytest.raises(ValueError):
        ModelKV(m.layers, m.kv_heads, m.head_dim, "int3")


@pytest.mark.parametrize(
    ("name", "fmt"),
    [("agents.jsonl", None), ("turnlog_small.jsonl", None), ("vllm_multiturn_stats.json", None)],
)
def test_uncapped_hits_are_the_analyzers_figures(name: str, fmt: str | None) -> None:
    """With no cap, retention depends on the gaps only: the analyzer's own figures."""
    turns, _ = read_turns(DATA / name, format=fmt)
    trace = prepare(turns)
    an = analyze(DATA / name)
    ttl = replay(trace, "ttl", 480, bytes_per_token=1, nodes=3)
    lease = replay(trace, "lease", 1800, bytes_per_token=1, nodes=3)
    assert trace.follow_up_turns == an.follow_up_turns
    assert ttl.hits == an.turns_within_ttl
    assert lease.hits == an.turns_within_ttl + an.turns_recovered_by_leases
    assert ttl.reused_tokens == an.saved_tokens_fixed_ttl
    assert lease.reused_tokens == an.saved_tokens_leases


@pytest.fixture(scope="module")
def agents_10k() -> list[TurnInput]:
    rows: list[TurnInput] = agent_trace(10_000, seed=11)
    return rows


def test_generated_agent_trace_is_monotone_in_the_cap(agents_10k: list[TurnInput]) -> None:
    trace = prepare(agents_10k)
    assert len(trace.conversation_ids) == 10_000
    cfg = PlanConfig(bytes_per_token=PRESETS["llama-3.1-8b"].bytes_per_token, nodes=4, node_kv_bytes=64 << 30)
    plan = plan_trace(trace, cfg)
    assert len(plan.sweep) >= 10
    for policy in ("ttl", "lease"):
        results = [getattr(p, policy) for p in plan.sweep]
        assert [r.hits for r in results] == sorted(r.hits for r in results), policy
        assert [r.reused_tokens for r in results] == sorted(r.reused_tokens for r in results), policy
        assert [r.evictions for r in results] == sorted((r.evictions for r in results), reverse=True), policy
        assert all(r.peak_bytes <= (r.cap_bytes or 0) for r in results)
    assert plan.sweep[-1].lease.hits == plan.lease.hits  # the largest cap is the uncapped need
    # pauses beyond the TTL (a quarter are 10-25 min): leases beat the fixed TTL
    assert plan.lease.hits > plan.ttl.hits * 1.2
    assert plan.lease.reused_tokens > plan.ttl.reused_tokens
    assert plan.sweep[-1].lease.hits > plan.sweep[-1].ttl.hits
    rec = plan.recommendation
    assert rec.cap_bytes is not None and rec.max_retained_fraction is not None
    assert rec.max_idle_s is not None and rec.max_idle_s >= 1500  # covers the long pauses
    assert replay(trace, "lease", 1800, bytes_per_token=cfg.bytes_per_token, nodes=4,
                  cap_bytes=rec.cap_bytes).hits >= cfg.target * plan.lease.hits  # fmt: skip


def test_short_pauses_leave_nothing_to_recover() -> None:
    rows = agent_trace(500, seed=2, long_pause_share=0.0, tool_pause_s=(1.0, 60.0))
    plan = plan_trace(prepare(rows), PlanConfig(bytes_per_token=1000))
    assert plan.lease.hits == plan.ttl.hits == plan.follow_up_turns


def test_empty_trace() -> None:
    plan = plan_trace(prepare([]), PlanConfig(bytes_per_token=1))
    assert plan.turns == 0 and plan.sweep == () and plan.recommendation.cap_bytes is None
    assert plan.to_json()["recommendation"]["text"]
