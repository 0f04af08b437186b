"""The analyzer's figures on hand-computed cases (sans-IO: turns go straight into Analyzer)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvlease._analyze import Analyzer
from kvlease._analyze._model import EXACT_GAPS_LIMIT, GapHistogram, exact_percentile
from kvlease._analyze._recommend import nice_ceil

# (conversation, ts, prompt, completion, end, gap)
Row = tuple[str, float, "int | None", "int | None", "float | None", "float | None"]


def run(rows: list[Row], **kw: Any) -> Any:
    an = Analyzer(**kw)
    for r in rows:
        an.add(*r)
    return an.report()


def test_empty_input() -> None:
    r = run([])
    assert (r.conversations, r.turns, r.follow_up_turns) == (0, 0, 0)
    assert r.repeated_share_lower_bound is None and r.repeated_share_estimate is None
    assert r.share_beyond_ttl is None and r.gap_p50_s is None
    assert r.saved_tokens_per_hour_leases is None
    assert r.recommendation.verdict == "no-data"
    assert r.to_json()["gaps"]["histogram"] == []


def test_one_turn_conversations_have_no_follow_ups() -> None:
    r = run([("a", 0, 100, 10, None, None), ("b", 5, 200, None, None, None)])
    assert (r.conversations, r.turns, r.follow_up_turns, r.one_turn_conversations) == (2, 2, 0, 2)
    assert r.repeated_share_lower_bound is None
    assert r.recommendation.verdict == "no-data"
    assert "second turn" in r.recommendation.text


def test_classic_lower_bound_formula_exactly() -> None:
    # a: 100 -> 150 -> 120 ; b: 1000 -> 400 (a shrinking prompt: min() keeps the bound honest)
    rows: list[Row] = [
        ("a", 0, 100, None, None, None),
        ("a", 10, 150, None, None, None),
        ("a", 20, 120, None, None, None),
        ("b", 0, 1000, None, None, None),
        ("b", 30, 400, None, None, None),
    ]
    r = run(rows)
    lower = min(100, 150) + min(150, 120) + min(1000, 400)
    total = 150 + 120 + 400
    assert r.repeated_tokens_lower_bound == lower == 620
    assert r.prompt_tokens == total == 670
    assert r.repeated_share_lower_bound == pytest.approx(620 / 670)
    # no completion sizes: the estimate equals the lower bound
    assert r.repeated_share_estimate == r.repeated_share_lower_bound
    assert r.completion_known_turns == 0


def test_estimate_counts_previous_response_capped_at_prompt() -> None:
    rows: list[Row] = [
        ("a", 0, 100, 30, None, None),  # next: min(100 + 30, 150) = 130
        ("a", 10, 150, 500, None, None),  # next: min(150 + 500, 200) = 200
        ("a", 20, 200, None, None, None),
    ]
    r = run(rows)
    assert r.repeated_tokens_lower_bound == 100 + 150
    assert r.repeated_tokens_estimate == 130 + 200
    assert r.repeated_share_estimate == pytest.approx(330 / 350)
    assert r.completion_known_turns == 2


def test_zero_token_prompts_do_not_divide_by_zero() -> None:
    r = run([("a", 0, 0, 0, None, None), ("a", 1, 0, None, None, None), ("a", 2, 0, None, None, None)])
    assert r.follow_up_turns == 2 and r.token_turns == 2 and r.prompt_tokens == 0
    assert r.repeated_share_lower_bound is None and r.repeated_share_estimate is None
    assert r.per_turn_index[0].repeated_lower_bound is None


def test_unknown_prompt_sizes_count_for_gaps_only() -> None:
    r = run(
        [
            ("a", 0, None, None, None, None),
            ("a", 600, 100, None, None, None),
            ("a", 700, 200, None, None, None),
        ]
    )
    assert r.follow_up_turns == 2 and r.token_turns == 1
    assert r.turns_beyond_ttl == 1
    assert r.repeated_tokens_lower_bound == 100


@pytest.mark.parametrize(
    ("gaps", "ttl", "max_idle", "within", "beyond", "recovered", "beyond_idle"),
    [
        (
            [10, 480, 481, 1800, 1801],
            480,
            1800,
            2,
            3,
            2,
            1,
        ),  # boundaries: <= ttl is within, <= max_idle recovered
        ([0, 0, 0], 480, 1800, 3, 0, 0, 0),
        ([5000], 480, 1800, 0, 1, 0, 1),
        ([100, 200], 100, 100, 1, 1, 0, 1),  # max_idle == ttl: leases recover nothing
    ],
)
def test_ttl_and_max_idle_buckets(
    gaps: list[float], ttl: float, max_idle: float, within: int, beyond: int, recovered: int, beyond_idle: int
) -> None:
    rows: list[Row] = [("a", 0.0, 10, None, None, None)]
    t = 0.0
    for g in gaps:
        t += g
        rows.append(("a", t, 10, None, None, None))
    r = run(rows, ttl=ttl, max_idle=max_idle)
    assert (r.turns_within_ttl, r.turns_beyond_ttl, r.turns_recovered_by_leases, r.turns_beyond_max_idle) == (
        within,
        beyond,
        recovered,
        beyond_idle,
    )
    n = len(gaps)
    assert r.share_beyond_ttl == pytest.approx(beyond / n)
    assert r.share_recovered_by_leases == pytest.approx(recovered / n)


def test_gap_uses_end_time_and_explicit_gap() -> None:
    rows: list[Row] = [
        ("a", 0, 10, None, 100.0, None),  # ends at 100
        ("a", 700, 10, None, None, None),  # gap from the end: 600 (from the start it would be 700)
        ("a", 710, 10, None, None, 3.0),  # measured gap wins over 10
        ("b", 0, 10, None, 50.0, None),
        ("b", 20, 10, None, None, None),  # overlaps the previous turn: gap clamped to 0
    ]
    r = run(rows)
    assert r.gap_p50_s == 3.0  # gaps 600, 3, 0
    assert r.gap_p99_s == pytest.approx(3 + 0.98 * 597)
    assert r.gap_percentiles_exact
    assert next(lo for lo, _, _ in r.gap_histogram) == 0.0  # the 0 gap is in the first bin
    assert r.turns_beyond_ttl == 1


def test_percentiles_exact_linear_interpolation() -> None:
    gaps = [10.0, 590.0, 0.0, 2000.0, 100.0]
    s = sorted(gaps)
    assert exact_percentile(s, 0.5) == 100.0
    assert exact_percentile(s, 0.9) == pytest.approx(590 + 0.6 * 1410)
    assert exact_percentile(s, 0.99) == pytest.approx(590 + 0.96 * 1410)
    assert exact_percentile([], 0.5) is None
    assert exact_percentile([7.0], 0.99) == 7.0


def test_histogram_percentiles_are_close_and_bins_are_consistent() -> None:
    h = GapHistogram()
    values = [0.0, 0.0005, *[float(i) for i in range(1, 1001)], 1e9]
    for v in values:
        h.add(v)
    assert h.total == len(values)
    exact = sorted(values)
    for q in (0.5, 0.9, 0.99):
        got = h.percentile(q)
        want = exact_percentile(exact, q)
        assert got is not None and want is not None
        assert got == pytest.approx(want, rel=0.012)
    for v in (0.001, 1.0, 480.0, 1000.0, 123.456):
        lo, hi = GapHistogram.edges(GapHistogram.index(v))
        assert lo <= v < hi
    assert math.isinf(GapHistogram.edges(GapHistogram.index(1e9))[1])


def test_large_inputs_switch_to_the_histogram() -> None:
    an = Analyzer()
    an.add_many(("a", float(i), 100, None, None, None) for i in range(EXACT_GAPS_LIMIT + 10))
    r = an.report()
    assert not r.gap_percentiles_exact
    assert r.gap_p50_s == pytest.approx(1.0, rel=0.01)
    assert sum(c for _, _, c in r.gap_histogram) == r.follow_up_turns == EXACT_GAPS_LIMIT + 9


def test_unsorted_turns_are_sorted_per_conversation() -> None:
    ordered: list[Row] = [
        ("a", 0, 100, 20, None, None),
        ("a", 10, 150, 30, None, None),
        ("a", 600, 200, None, None, None),
    ]
    shuffled = [ordered[2], ordered[0], ordered[1]]
    assert run(shuffled).to_json() == run(ordered).to_json()


def test_duplicate_timestamps_keep_input_order() -> None:
    r = run(
        [
            ("b", 2000, 0, None, None, None),
            ("b", 2000, 50, None, None, None),
            ("b", 2000, 30, None, None, None),
        ]
    )
    # pairs in input order: (0 -> 50), (50 -> 30): gap 0 both
    assert r.follow_up_turns == 2 and r.turns_within_ttl == 2
    assert r.repeated_tokens_lower_bound == 0 + 30
    assert r.gap_p99_s == 0.0


def test_turns_beyond_the_reorder_window_are_late() -> None:
    rows: list[Row] = [("a", float(t), 10, None, None, None) for t in (10, 20, 30, 5)]
    assert run(rows, reorder_window=8).late_turns == 0
    r = run(rows, reorder_window=1)  # 10 and 20 already paired when 5 arrives
    assert r.late_turns == 1 and r.turns == 4 and r.follow_up_turns == 2


def test_saved_tokens_per_hour() -> None:
    rows: list[Row] = [
        ("a", 0, 100, 20, None, None),
        ("a", 100, 200, None, None, None),  # within TTL: est 120
        ("a", 1000, 300, None, None, None),  # gap 900: leases only, est 200
        ("a", 3600, 400, None, None, None),  # gap 2600: beyond max-idle, est 300 not saved
    ]
    r = run(rows)
    assert r.saved_tokens_fixed_ttl == 120
    assert r.saved_tokens_leases == 320
    assert r.span_s == 3600.0
    assert r.saved_tokens_per_hour_leases == pytest.approx(320.0)
    assert r.saved_tokens_per_hour_fixed_ttl == pytest.approx(120.0)


def test_single_instant_has_no_rate() -> None:
    r = run([("a", 5, 100, None, None, None), ("a", 5, 100, None, None, None)])
    assert r.span_s == 0.0 and r.saved_tokens_per_hour_leases is None


def test_per_turn_index() -> None:
    rows: list[Row] = [
        ("a", 0, 100, None, None, None),
        ("a", 1, 200, None, None, None),
        ("a", 2, 300, None, None, None),
        ("b", 0, 50, None, None, None),
        ("b", 1, 100, None, None, None),
    ]
    r = run(rows)
    by = {t.index: t for t in r.per_turn_index}
    assert set(by) == {2, 3}
    assert (by[2].turns, by[2].prompt_tokens, by[2].repeated_lower_bound) == (
        2,
        300,
        pytest.approx(150 / 300),
    )
    assert (by[3].turns, by[3].repeated_lower_bound) == (1, pytest.approx(200 / 300))


@pytest.mark.parametrize(
    ("kw", "message"),
    [({"ttl": -1}, "ttl"), ({"ttl": 100, "max_idle": 50}, "max_idle"), ({"reorder_window": -1}, "reorder")],
)
def test_bad_settings(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Analyzer(**kw)


# --- recommendation -------------------------------------------------------------------------------


def _conv(cid: str, prompts: list[int], gaps: list[float]) -> list[Row]:
    rows: list[Row] = [(cid, 0.0, prompts[0], None, None, None)]
    t = 0.0
    for p, g in zip(prompts[1:], gaps):
        t += g
        rows.append((cid, t, p, None, None, None))
    return rows


def test_recommends_prefix_caching_when_little_repeats() -> None:
    r = run(_conv("a", [100, 1000, 2000, 4000], [5, 5, 5]))
    assert r.repeated_share_estimate == pytest.approx((100 + 1000 + 2000) / 7000)
    assert r.recommendation.verdict == "prefix-caching"
    assert "simpler answer" in r.recommendation.text


def test_recommends_prefix_caching_when_gaps_exceed_max_idle() -> None:
    r = run(_conv("a", [1000, 1100, 1200, 1300], [4000, 5000, 30]))
    assert r.share_beyond_max_idle == pytest.approx(2 / 3)
    assert r.recommendation.verdict == "prefix-caching"
    assert "simpler answer" in r.recommendation.text


def test_recommends_kvlease_with_settings_from_the_gaps() -> None:
    r = run(_conv("a", [1000, 1100, 1200, 1300, 1400, 1500], [20, 30, 40, 700, 900]))
    assert r.recommendation.verdict == "kvlease"
    # p50 = 40 -> TTL rounded up to 60 s; p90 = 700 + 0.6 * 200 = 820 -> max-idle 900 s
    assert r.recommendation.suggested_ttl == 60.0
    assert r.recommendation.suggested_max_idle == 900.0
    assert "Enable kvlease" in r.recommendation.text


@pytest.mark.parametrize(("s", "want"), [(0, 60), (60, 60), (61, 120), (1000, 1200), (1e9, 14400)])
def test_nice_ceil(s: float, want: float) -> None:
    assert nice_ceil(s) == want
