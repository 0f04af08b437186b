"""The Analyzer against a plain reference model of its definitions (hypothesis).

The reference places each conversation's turns the slow, obvious way: a sorted window of pending
turns, each one paired with its predecessor when it leaves the window, late turns dropped. The
Analyzer pairs turns as they arrive and redoes pairs when a turn arrives out of order; every figure
must come out the same, whatever the order, the window, the ties and the unknown fields.
"""

from __future__ import annotations

from bisect import insort
from typing import Any
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from kvlease._analyze import _model
from kvlease._analyze._model import MAX_TURN_INDEX, Analyzer, GapHistogram, TurnInput, exact_percentile


def reference(
    rows: list[TurnInput],
    window: int,
    ttl: float = 480.0,
    max_idle: float = 1800.0,
    exact_limit: int = 100_000,
    flush_at: int | None = None,
) -> dict[str, Any]:
    """The figures of ``rows``; ``flush_at``: finalise every pending turn after that many rows."""
    last: dict[str, TurnInput] = {}
    n: dict[str, int] = {}
    pending: dict[str, list[TurnInput]] = {}
    pairs: list[tuple[TurnInput, TurnInput, int]] = []
    late = 0

    def finalise(turn: TurnInput) -> None:
        cid = turn[0]
        prev = last.get(cid)
        last[cid] = turn
        n[cid] = n.get(cid, 0) + 1
        if prev is not None:
            pairs.append((prev, turn, n[cid]))

    def flush() -> None:
        for pend in pending.values():
            for turn in pend:
                finalise(turn)
            pend.clear()

    for k, turn in enumerate(rows):
        if k == flush_at:
            flush()
        cid, ts = turn[0], turn[1]
        n.setdefault(cid, 0)
        prev = last.get(cid)
        if prev is not None and ts < prev[1]:
            late += 1
            continue
        pend = pending.setdefault(cid, [])
        insort(pend, turn, key=lambda t: t[1])
        if len(pend) > window:
            finalise(pend.pop(0))
    flush()

    gaps: list[float] = []
    within = beyond = recovered = token_turns = c_known = prompt = lower = est_sum = 0
    saved_ttl = saved_lease = 0
    per_index: dict[int, list[int]] = {}
    for prev, turn, index in pairs:
        gap = turn[5]
        if gap is None:
            gap = turn[1] - (prev[1] if prev[4] is None else prev[4])
        gap = max(gap, 0.0)
        gaps.append(gap)
        if gap <= ttl:
            within += 1
        else:
            beyond += 1
            recovered += gap <= max_idle
        p, pp, pc = turn[2], prev[2], prev[3]
        if p is None or pp is None:
            continue
        token_turns += 1
        low = min(pp, p)
        est = low if pc is None else min(pp + pc, p)
        c_known += pc is not None
        prompt, lower, est_sum = prompt + p, lower + low, est_sum + est
        saved_lease += est if gap <= max_idle else 0
        saved_ttl += est if gap <= ttl else 0
        sums = per_index.setdefault(min(index, MAX_TURN_INDEX), [0, 0])
        sums[0] += 1
        sums[1] += p
    hist = GapHistogram()
    for g in gaps:
        hist.add(g)
    exact = len(gaps) <= exact_limit
    s = sorted(gaps)
    starts = [t[1] for t in rows]
    ends = [t[4] for t in rows if t[4] is not None and t[4] > t[1]]
    return {
        "conversations": len(n),
        "turns": len(rows),
        "late": late,
        "follow": len(pairs),
        "one_turn": sum(1 for v in n.values() if v == 1),
        "max_turns": max(n.values(), default=0),
        "tokens": (token_turns, c_known, prompt, lower, est_sum),
        "gaps": (within, beyond, recovered, beyond - recovered),
        "saved": (saved_ttl, saved_lease),
        "span": float(max(starts + ends) - min(starts)) if rows else 0.0,
        "percentiles": tuple(
            (exact_percentile(s, q) if exact else hist.percentile(q)) for q in (0.5, 0.9, 0.99)
        ),
        "exact": exact,
        "histogram": tuple(hist.nonempty()),
        "per_index": tuple((i, v[0], v[1]) for i, v in sorted(per_index.items())),
    }


def figures(r: Any) -> dict[str, Any]:
    return {
        "conversations": r.conversations,
        "turns": r.turns,
        "late": r.late_turns,
        "follow": r.follow_up_turns,
        "one_turn": r.one_turn_conversations,
        "max_turns": r.max_turns_in_conversation,
        "tokens": (
            r.token_turns,
            r.completion_known_turns,
            r.prompt_tokens,
            r.repeated_tokens_lower_bound,
            r.repeated_tokens_estimate,
        ),
        "gaps": (
            r.turns_within_ttl,
            r.turns_beyond_ttl,
            r.turns_recovered_by_leases,
            r.turns_beyond_max_idle,
        ),
        "saved": (r.saved_tokens_fixed_ttl, r.saved_tokens_leases),
        "span": r.span_s,
        "percentiles": (r.gap_p50_s, r.gap_p90_s, r.gap_p99_s),
        "exact": r.gap_percentiles_exact,
        "histogram": r.gap_histogram,
        "per_index": tuple((t.index, t.turns, t.prompt_tokens) for t in r.per_turn_index),
    }


def _maybe(s: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), s)


def _row(cid: str, ts: float, p: Any, c: Any, end: float | None, gap: float | None) -> TurnInput:
    return (cid, ts, p, c, None if end is None else ts + end, gap)


_rows = st.lists(
    st.builds(
        _row,
        st.sampled_from("abc"),
        st.one_of(st.integers(0, 12), st.sampled_from([0.5, 3.25, 7.0, 1e3, 2.5e3])),
        _maybe(st.integers(0, 500)),
        _maybe(st.integers(0, 50)),
        _maybe(st.sampled_from([-2.0, 0.0, 1.5, 700.0])),
        _maybe(st.sampled_from([0.0, 0.5, 480.0, 600.0, 5000.0])),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(
    rows=_rows,
    window=st.integers(0, 4),
    ttl=st.sampled_from([0.0, 2.0, 480.0]),
    extra_idle=st.sampled_from([0.0, 3.0, 1320.0]),
    exact_limit=st.sampled_from([3, 100_000]),
)
def test_same_figures_as_the_reference(
    rows: list[TurnInput], window: int, ttl: float, extra_idle: float, exact_limit: int
) -> None:
    max_idle = ttl + extra_idle
    with mock.patch.object(_model, "EXACT_GAPS_LIMIT", exact_limit):
        an = Analyzer(ttl=ttl, max_idle=max_idle, reorder_window=window)
        an.add_many(rows)
        got = figures(an.report())
    want = reference(rows, window, ttl, max_idle, exact_limit)
    assert got == want


@settings(max_examples=150, deadline=None)
@given(rows=_rows, split=st.integers(0, 40), window=st.integers(0, 3))
def test_a_report_finalises_what_came_before(rows: list[TurnInput], split: int, window: int) -> None:
    """A report mid-way pairs every pending turn: afterwards, turns older than their conversation's
    latest are late."""
    split = min(split, len(rows))
    an = Analyzer(reorder_window=window)
    an.add_many(rows[:split])
    an.report()
    an.add_many(rows[split:])
    assert figures(an.report()) == reference(rows, window, flush_at=split)


@settings(max_examples=150, deadline=None)
@given(rows=_rows, window=st.integers(0, 3))
def test_columns_are_the_same_as_rows(rows: list[TurnInput], window: int) -> None:
    plain = [(cid, ts, p, c, None, None) for cid, ts, p, c, _, _ in rows]
    a = Analyzer(reorder_window=window)
    a.add_many(plain)
    b = Analyzer(reorder_window=window)
    half = len(plain) // 2
    for part in (plain[:half], plain[half:]):
        b.add_columns(*[[row[i] for row in part] for i in range(4)])
    assert a.report().to_json() == b.report().to_json()
