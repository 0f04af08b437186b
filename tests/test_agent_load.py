"""The agent-load benchmark's pure parts: the sessions, the figures' arithmetic, the report section.
No vLLM and no stack here (``tests/integration/test_agent_load_stack.py`` runs the replay)."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
S = importlib.import_module("_agent_sessions")
A = importlib.import_module("agent_load")
RA = importlib.import_module("_report_agents")


def test_the_session_file_loads_the_same_every_time_and_keeps_its_shape() -> None:
    one, two = S.load_sessions(), S.load_sessions()
    assert one == two
    assert len(one) == 64 and sum(len(s.turns) for s in one) == 361
    assert all(s.turns[0].delay_s == 0 and all(t.delay_s > 0 for t in s.turns[1:]) for s in one)
    assert S.shared_prefix_blocks(one) == 32  # AIPerf's layer 1: a 512-token shared system prompt
    assert S.SESSIONS_FILE.stat().st_size < 200_000
    assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)


def test_text_is_a_pure_function_of_the_hash_ids() -> None:
    s = S.load_sessions()[3]
    assert S.first_messages(s, 32) == S.first_messages(s, 32)
    assert S.block_text(7) == S.block_text(7) != S.block_text(8)
    other = S.load_sessions()[4]
    assert S.first_messages(s, 32)[0] == S.first_messages(other, 32)[0]  # the shared system prompt


def test_schedule_keeps_n_slots_and_every_session_once() -> None:
    sessions = S.load_sessions()
    slots = S.schedule(sessions, 5)
    assert len(slots) == 5 and sorted(x.id for q in slots for x in q) == sorted(x.id for x in sessions)
    with pytest.raises(ValueError):
        S.schedule(sessions, 0)


def test_answer_regex_asks_for_about_the_recorded_tokens() -> None:
    assert S.answer_regex(24) == "[0-9](,[0-9]){11}"
    assert S.answer_regex(1) == "[0-9](,[0-9]){1}"


@pytest.mark.parametrize(
    ("values", "q", "want"),
    [([], 50, None), ([3.0], 90, 3.0), ([1, 2, 3, 4], 50, 2.5), ([1, 2, 3, 4, 5], 90, 4.6), ([5, 1], 100, 5)],
)
def test_percentile_matches_linear_interpolation(values: list[float], q: float, want: float | None) -> None:
    got = S.percentile(values, q)
    assert got == want if want is None else math.isclose(got, want)


@pytest.mark.parametrize(
    ("gap", "bucket"), [(0.0, "<10s"), (9.99, "<10s"), (10.0, "10-60s"), (60.0, "60-480s"), (480.0, ">480s")]
)
def test_gap_buckets(gap: float, bucket: str) -> None:
    assert S.gap_bucket(gap) == bucket


def test_block_seconds_is_a_step_function_integral() -> None:
    assert S.block_seconds([]) == (0.0, 0.0)
    assert S.block_seconds([(0.0, 4.0)]) == (0.0, 4.0)
    assert S.block_seconds([(0.0, 4.0), (2.0, 10.0), (3.0, 0.0), (5.0, 1.0)]) == (18.0, 10.0)


def test_supported_sessions_is_the_largest_n_under_the_target() -> None:
    assert S.supported_sessions({2: 0.4, 4: 0.9, 8: 2.0}, 1.0) == 4
    assert S.supported_sessions({2: 1.4, 4: None}, 1.0) == 0


def _turns() -> list[dict[str, Any]]:
    base = {"itl_s": [0.01, 0.02], "completion_tokens": 10}
    return [
        {**base, "turn": 0, "ttft_s": 0.5, "prompt_tokens": 100, "status": "first"},
        {
            **base,
            "turn": 1,
            "ttft_s": 0.1,
            "prompt_tokens": 200,
            "status": "hit",
            "reused_tokens": 150,
            "bucket": "<10s",
            "round_trip": True,
        },
        {
            **base,
            "turn": 2,
            "ttft_s": 0.3,
            "prompt_tokens": 200,
            "status": "miss",
            "reused_tokens": 0,
            "bucket": "10-60s",
            "round_trip": False,
        },
        {"turn": 3, "error": "APIError: boom", "bucket": "<10s"},
    ]


def test_summarize() -> None:
    r = S.summarize(_turns(), wall_s=10.0)
    assert r["turns"] == 4 and r["failed_turns"] == 1 and r["follow_up_turns"] == 2
    assert r["hit_rate"] == 0.5 and r["reused_token_share"] == 150 / 400 and r["round_trip_rate"] == 0.5
    assert r["ttft_by_gap_s"]["<10s"]["n"] == 1 and r["ttft_by_gap_s"][">480s"]["p90"] is None
    assert r["decode_tokens_per_s"] == 3.0 and r["statuses"] == {"hit": 1, "miss": 1}


def _result() -> dict[str, Any]:
    by_n = {
        str(n): S.summarize(_turns(), 10.0)
        | {
            "n": n,
            "d_preemptions": 0.0,
            "lease_blocks": {"block_s": 18.0, "max": 10.0, "series": [[0, 4], [2, 10]]},
            "d_kv_used": {"mean_share": 0.5, "max_share": 0.9, "block_s": 5.0},
        }
        for n in (2, 4)
    }
    arm = {"connectors": "P/D: X", "budgets": "D KV 10 blocks", "by_n": by_n, "supported_sessions": 4}
    return {
        "sessions": 64,
        "sessions_file": "f",
        "gap_note": "x 0.1",
        "duration_s": 30,
        "replay": "light",
        "d_sizing": "D: 10 blocks",
        "ttft_target_s": 1.5,
        "ns": [2, 4],
        "arms": {
            "upstream": arm,
            "kvlease-auto": {**arm, "supported_sessions": 8},
            "kvlease-host": {"not_run": "ValueError: unknown key"},
        },
    }


def test_report_section_and_rows(tmp_path: Path) -> None:
    r = json.loads(json.dumps(_result()))  # as stored in results.json
    lines = RA.section("agents", r)
    table = [ln for ln in lines if ln.startswith("| upstream")]
    assert len(table) == 2 and table[0].endswith("| 1 of 4 |")  # the failed-turns column
    assert any("not run" in ln for ln in lines) and RA.section("ttft", r) == []
    rows = RA.agent_rows(r)
    assert ("upstream: failed turns", "0", "—", "2 of 8") in rows
    assert rows[-1][-1] == "2.0x"
    pytest.importorskip("matplotlib")
    made = RA.plot_agents(r, tmp_path)
    assert [f for f, _ in made] == ["agents_ttft_p90.png", "agents_lease_blocks.png"]
    assert all((tmp_path / f).stat().st_size > 0 for f, _ in made)


def test_the_plan_is_data_driven_and_sizes_d_small() -> None:
    plan = A.make_plan(True, None, None, None)
    assert [a.name for a in plan.arms] == list(A.QUICK_ARMS) and plan.gap_scale < 1
    full = A.make_plan(False, None, None, None)
    assert {a.name for a in full.arms} == {a.name for a in A.ARMS} and full.ns == (2, 4)
    # one TTL for every arm, long enough that the SDK's renewals (every 0.6 x (TTL - 5 s)) are never late
    assert plan.ttl_s == full.ttl_s == A.TTL_S and A.RENEW_FRACTION * (A.TTL_S - A.ROUTER_TTL_MARGIN_S) >= 10
    assert "--node-ttl" not in A.settings_line(full) or "told" in A.settings_line(full)
    up = next(a for a in A.ARMS if a.name == "upstream")
    assert not up.stream and all(a.stream for a in A.ARMS if a.name != "upstream")
    assert "--num-gpu-blocks-override" in full.sizing and full.d_blocks < 200
    with pytest.raises(ValueError):
        A.make_plan(False, "nope", None, None)


def test_counter_deltas_keep_the_named_counters_that_moved() -> None:
    before = {'kvlease_pull_decisions_total{reason="pull"}': 2.0, "kvlease_leases": 3.0}
    after = {
        'kvlease_pull_decisions_total{reason="pull"}': 5.0,
        'kvlease_pull_decisions_total{reason="local_hit"}': 1.0,
        'kvlease_pulls_total{source="host"}': 0.0,
        "kvlease_leases": 9.0,
        "other_total": 4.0,
    }
    assert S.counter_deltas(before, after, ("kvlease_pull",)) == {
        'kvlease_pull_decisions_total{reason="local_hit"}': 1.0,
        'kvlease_pull_decisions_total{reason="pull"}': 3.0,
    }


def test_histogram_quantile_of_the_run_interpolates_like_prometheus() -> None:
    name = "vllm:inter_token_latency_seconds"
    key = name + '_bucket{engine="0",le="%s"}'
    before = {
        key % "0.01": 1.0,
        key % "0.1": 1.0,
        key % "+Inf": 1.0,
        name + "_sum": 0.005,
        name + "_count": 1.0,
    }
    after = {
        key % "0.01": 1.0,
        key % "0.1": 11.0,
        key % "+Inf": 11.0,
        name + "_sum": 0.505,
        name + "_count": 11.0,
    }
    buckets, total, count = S.histogram_delta(before, after, name)
    assert buckets == [(0.01, 0.0), (0.1, 10.0), (math.inf, 10.0)] and count == 10.0
    assert math.isclose(total, 0.5)
    assert math.isclose(S.histogram_quantile(buckets, 0.5), 0.055)
    assert S.histogram_quantile([], 0.5) is None and S.histogram_quantile([(1.0, 0.0)], 0.5) is None


def test_the_ttft_of_an_unstreamed_turn_is_its_time_less_the_later_decode_steps() -> None:
    assert math.isclose(S.estimate_ttft(1.0, 11, 0.05), 0.5)
    assert S.estimate_ttft(0.2, 11, 0.05) == 0.0 and S.estimate_ttft(0.3, 0, 0.05) == 0.3
