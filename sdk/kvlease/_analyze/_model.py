"""The analyzer's core: per-conversation state and the figures, sans-IO.

:class:`Analyzer` takes turns one at a time (``add``) in any order and returns an
:class:`AnalysisReport`. It never reads files or clocks; the readers in ``_formats`` feed it.

Memory is bounded by the per-conversation state: for each conversation, its last finalised turn and
at most ``reorder_window`` pending turns. Everything else is a fixed-size aggregate (sums, a
log-binned gap histogram, per-turn-index sums up to :data:`MAX_TURN_INDEX`, and the first
:data:`EXACT_GAPS_LIMIT` gaps kept exactly so that small inputs get exact percentiles).

Definitions (one *follow-up turn* is every turn of a conversation after its first, in timestamp
order; ``prev`` is the turn before it):

- repeated share, lower bound: ``sum(min(prev.prompt, prompt)) / sum(prompt)`` over follow-up turns
  whose prompt sizes are known (the classic formula, unchanged so results compare);
- repeated share, estimate: the same with ``min(prev.prompt + prev.completion, prompt)`` when the
  previous response's size is known (decode also holds the KV of the tokens it generated);
- gap: seconds from the end of ``prev`` (when the input records it) or else its start, to the start
  of the turn; an explicit gap in the input (the SDK turn log's ``gap_s``) wins. Negative gaps
  (overlapping requests) count as 0;
- beyond the TTL: ``gap > ttl``; recovered by heartbeat leases: ``ttl < gap <= max_idle``;
- prefill tokens saved: the estimate's repeated tokens of the follow-up turns a lease still covers
  (``gap <= max_idle`` with kvlease, ``gap <= ttl`` with the fixed TTL), per hour of the input's
  time span.
"""

from __future__ import annotations

import math
from array import array
from bisect import insort
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import replace
from operator import itemgetter
from typing import Final

from kvlease._analyze._types import AnalysisReport, InputSummary, TurnIndexFigures, ratio

#: Default TTL of upstream vLLM's retained decode blocks (``decoder_kv_blocks_ttl``), seconds.
DEFAULT_TTL: Final = 480.0
#: Default idle limit after which the SDK's lease keeper stops renewing, seconds.
DEFAULT_MAX_IDLE: Final = 1800.0
#: Turns of one conversation that may arrive out of timestamp order and still be placed exactly.
DEFAULT_REORDER_WINDOW: Final = 8
#: Gaps kept exactly (for exact percentiles); beyond this the histogram answers (about 0.6 %).
EXACT_GAPS_LIMIT: Final = 100_000
#: Per-turn-index figures are kept for indexes 2..MAX_TURN_INDEX; later turns fall in the last one.
MAX_TURN_INDEX: Final = 50

_HIST_MIN: Final = 1e-3  # seconds; smaller gaps (and 0) fall in bin 0
_HIST_LOG_MIN: Final = -3  # log10(_HIST_MIN)
_HIST_DECADES: Final = 10  # up to 1e7 s (about 116 days); larger gaps fall in the last bin
_HIST_PER_DECADE: Final = 200
_HIST_BINS: Final = _HIST_DECADES * _HIST_PER_DECADE + 2

#: One turn as the readers give it: (conversation id, start ts, prompt tokens, completion tokens,
#: end ts, measured gap); ``None`` means unknown.
TurnInput = tuple[str, float, "int | None", "int | None", "float | None", "float | None"]
_ts = itemgetter(1)


class GapHistogram:
    """Log-binned histogram of gaps in seconds: 200 bins per decade from 1 ms to 1e7 s."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = array("q", bytes(8 * _HIST_BINS))
        self.total = 0

    @staticmethod
    def index(gap: float) -> int:
        if gap < _HIST_MIN:
            return 0
        i = int((math.log10(gap) - _HIST_LOG_MIN) * _HIST_PER_DECADE) + 1
        return i if i < _HIST_BINS - 1 else _HIST_BINS - 1

    @staticmethod
    def edges(i: int) -> tuple[float, float]:
        """``[lo, hi)`` of bin ``i`` in seconds (``hi`` is ``inf`` for the last bin)."""
        if i == 0:
            return 0.0, _HIST_MIN
        lo = _HIST_MIN * 10 ** ((i - 1) / _HIST_PER_DECADE)
        hi = math.inf if i == _HIST_BINS - 1 else _HIST_MIN * 10 ** (i / _HIST_PER_DECADE)
        return lo, hi

    def add(self, gap: float) -> None:
        self.counts[self.index(gap)] += 1
        self.total += 1

    def percentile(self, q: float) -> float | None:
        """The ``q`` quantile (0..1): the geometric middle of the bin holding rank ``q * (n - 1)``."""
        if self.total == 0:
            return None
        rank = q * (self.total - 1)
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen > rank:
                lo, hi = self.edges(i)
                if i == 0:
                    return 0.0
                return lo if math.isinf(hi) else math.sqrt(lo * hi)
        raise AssertionError("unreachable: rank below total")  # pragma: no cover

    def nonempty(self) -> list[tuple[float, float, int]]:
        return [(*self.edges(i), c) for i, c in enumerate(self.counts) if c]


def exact_percentile(sorted_values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default ``linear`` method)."""
    n = len(sorted_values)
    if n == 0:
        return None
    pos = q * (n - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class _Conv:
    __slots__ = ("last", "n", "pending")

    def __init__(self) -> None:
        self.last: TurnInput | None = None
        self.n = 0  # finalised turns
        self.pending: list[TurnInput] = []


class Analyzer:
    """Accumulates turns and computes an :class:`AnalysisReport`.

    Turns may come in any order: each conversation keeps up to ``reorder_window`` turns pending,
    sorted by timestamp (equal timestamps keep input order), and a turn is paired with its
    predecessor only when it leaves that window (or at :meth:`report`). A turn older than one
    already paired is a *late* turn: counted, not paired (raise the window or sort the input).
    """

    def __init__(
        self,
        ttl: float = DEFAULT_TTL,
        max_idle: float = DEFAULT_MAX_IDLE,
        reorder_window: int = DEFAULT_REORDER_WINDOW,
    ) -> None:
        if not ttl >= 0 or math.isinf(ttl):
            raise ValueError(f"ttl must be a finite number of seconds >= 0, got {ttl!r}")
        if not max_idle >= ttl or math.isinf(max_idle):
            raise ValueError(f"max_idle must be finite and >= ttl ({ttl}), got {max_idle!r}")
        if reorder_window < 0:
            raise ValueError("reorder_window must be >= 0")
        self.ttl = float(ttl)
        self.max_idle = float(max_idle)
        self.window = reorder_window
        self._convs: dict[str, _Conv] = {}
        self._turns = 0
        self._late = 0
        self._t_min = math.inf
        self._t_max = -math.inf
        # over follow-up turns: follow, token_turns, completion_known, prompt, lower, estimate,
        # within_ttl, beyond_ttl, recovered, saved_fixed_ttl, saved_leases
        self._acc = [0] * 11
        self._hist = GapHistogram()
        self._exact: array[float] | None = array("d")
        n_idx = MAX_TURN_INDEX + 1
        self._idx = ([0] * n_idx, [0] * n_idx, [0] * n_idx, [0] * n_idx)  # turns, prompt, lower, est
        self._statuses: Counter[str] = Counter()
        self._reused = 0

    # ---------------------------------------------------------------------------------------------
    def add(
        self,
        conversation_id: str,
        ts: float,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        end: float | None = None,
        gap: float | None = None,
    ) -> None:
        """One turn: start ``ts`` (seconds), token counts, optional end time and measured gap."""
        self.add_many(((conversation_id, ts, prompt_tokens, completion_tokens, end, gap),))

    def add_many(self, turns: Iterable[TurnInput]) -> None:
        """Many turns (the fast path: one tight loop over an iterator of :data:`TurnInput`)."""
        self._turns += self._consume(turns, self.window)

    def observe_status(self, status: str | None, reused_tokens: int | None) -> None:
        """Reuse outcome the router reported for one turn (SDK turn log only)."""
        if status is not None:
            self._statuses[status] += 1
        if reused_tokens is not None:
            self._reused += reused_tokens

    def flush(self) -> None:
        """Pair every pending turn (:meth:`report` does it)."""

        def drain() -> Iterator[TurnInput]:
            for conv in self._convs.values():
                if conv.pending:
                    pending = conv.pending
                    conv.pending = []
                    yield from pending

        self._consume(drain(), 0)

    def _consume(self, turns: Iterable[TurnInput], window: int) -> int:
        """Place each turn in its conversation's window; when one leaves the window (in timestamp
        order), pair it with the conversation's previous turn and add the pair to the figures.
        One loop, locals only: this is the analyzer's hot path. Returns the number of turns."""
        convs = self._convs
        get = convs.get
        t_min, t_max = self._t_min, self._t_max
        n_turns = late = hist_added = 0
        ttl, max_idle = self.ttl, self.max_idle
        (follow, token_turns, c_known, prompt, lower, est_sum, within, beyond, recovered, saved_ttl,
         saved_lease) = self._acc  # fmt: skip
        exact = self._exact
        hist = self._hist
        counts = hist.counts
        log10 = math.log10
        idx_turns, idx_prompt, idx_lower, idx_est = self._idx
        top = MAX_TURN_INDEX
        try:
            for turn in turns:
                n_turns += 1
                ts = turn[1]
                end = turn[4]
                if ts < t_min:
                    t_min = ts
                if end is not None and end > ts:
                    if end > t_max:
                        t_max = end
                elif ts > t_max:
                    t_max = ts
                conv = get(turn[0])
                if conv is None:
                    conv = convs[turn[0]] = _Conv()
                prev = conv.last
                if prev is not None and ts < prev[1]:
                    late += 1
                    continue
                if window:
                    pending = conv.pending
                    if pending and ts < pending[-1][1]:
                        insort(pending, turn, key=_ts)
                    else:
                        pending.append(turn)
                    if len(pending) <= window:
                        continue
                    turn = pending.pop(0)
                    ts = turn[1]
                # ---- pair ``turn`` with ``prev`` ----
                conv.last = turn
                n = conv.n = conv.n + 1
                if prev is None:
                    continue
                follow += 1
                _, _, p, _, _, gap = turn
                if gap is None:
                    prev_end = prev[4]
                    gap = ts - (prev[1] if prev_end is None else prev_end)
                if gap < 0.0:
                    gap = 0.0
                if exact is not None:
                    exact.append(gap)
                    if len(exact) > EXACT_GAPS_LIMIT:
                        for g in exact:
                            hist.add(g)
                        exact = None
                else:
                    if gap < _HIST_MIN:
                        i = 0
                    else:
                        i = int((log10(gap) - _HIST_LOG_MIN) * _HIST_PER_DECADE) + 1
                        if i >= _HIST_BINS:
                            i = _HIST_BINS - 1
                    counts[i] += 1
                    hist_added += 1
                if gap <= ttl:
                    within += 1
                else:
                    beyond += 1
                    if gap <= max_idle:
                        recovered += 1
                pp = prev[2]
                if p is None or pp is None:
                    continue
                token_turns += 1
                prompt += p
                low = pp if pp < p else p
                lower += low
                pc = prev[3]
                if pc is None:
                    est = low
                else:
                    c_known += 1
                    est = pp + pc
                    if est > p:
                        est = p
                est_sum += est
                if gap <= max_idle:
                    saved_lease += est
                    if gap <= ttl:
                        saved_ttl += est
                i = n if n < top else top
                idx_turns[i] += 1
                idx_prompt[i] += p
                idx_lower[i] += low
                idx_est[i] += est
        finally:
            self._acc = [follow, token_turns, c_known, prompt, lower, est_sum, within, beyond, recovered,
                         saved_ttl, saved_lease]  # fmt: skip
            self._exact = exact
            hist.total += hist_added
            self._late += late
            self._t_min, self._t_max = t_min, t_max
        return n_turns

    # ---------------------------------------------------------------------------------------------
    def report(self, source: InputSummary | None = None) -> AnalysisReport:
        """Flush pending turns and compute every figure, with the recommendation."""
        from kvlease._analyze._recommend import recommend

        self.flush()
        (follow, token_turns, c_known, prompt, lower, est_sum, within, beyond, recovered, saved_ttl,
         saved_lease) = self._acc  # fmt: skip
        turns = self._turns
        convs = self._convs.values()
        beyond_idle = beyond - recovered
        span = float(self._t_max - self._t_min) if turns else 0.0
        hours = span / 3600.0
        hist = self._hist
        if self._exact is not None:
            gaps = sorted(self._exact)
            p50, p90, p99 = (exact_percentile(gaps, q) for q in (0.5, 0.9, 0.99))
            hist = GapHistogram()
            for g in gaps:
                hist.add(g)
        else:
            p50, p90, p99 = (hist.percentile(q) for q in (0.5, 0.9, 0.99))
        idx_turns, idx_prompt, idx_lower, idx_est = self._idx
        per_index = tuple(
            TurnIndexFigures(
                index=i,
                turns=idx_turns[i],
                prompt_tokens=idx_prompt[i],
                repeated_lower_bound=ratio(idx_lower[i], idx_prompt[i]),
                repeated_estimate=ratio(idx_est[i], idx_prompt[i]),
            )
            for i in range(2, MAX_TURN_INDEX + 1)
            if idx_turns[i]
        )
        report = AnalysisReport(
            input=source or InputSummary(records=turns),
            ttl=self.ttl,
            max_idle=self.max_idle,
            conversations=len(self._convs),
            turns=turns,
            follow_up_turns=follow,
            one_turn_conversations=sum(1 for c in convs if c.n == 1),
            max_turns_in_conversation=max((c.n for c in convs), default=0),
            late_turns=self._late,
            token_turns=token_turns,
            completion_known_turns=c_known,
            prompt_tokens=prompt,
            repeated_tokens_lower_bound=lower,
            repeated_tokens_estimate=est_sum,
            repeated_share_lower_bound=ratio(lower, prompt),
            repeated_share_estimate=ratio(est_sum, prompt),
            turns_within_ttl=within,
            turns_beyond_ttl=beyond,
            turns_recovered_by_leases=recovered,
            turns_beyond_max_idle=beyond_idle,
            share_beyond_ttl=ratio(beyond, follow),
            share_recovered_by_leases=ratio(recovered, follow),
            share_beyond_max_idle=ratio(beyond_idle, follow),
            span_s=span,
            saved_tokens_fixed_ttl=saved_ttl,
            saved_tokens_leases=saved_lease,
            saved_tokens_per_hour_fixed_ttl=saved_ttl / hours if hours > 0 else None,
            saved_tokens_per_hour_leases=saved_lease / hours if hours > 0 else None,
            gap_p50_s=p50,
            gap_p90_s=p90,
            gap_p99_s=p99,
            gap_percentiles_exact=self._exact is not None,
            gap_histogram=tuple(hist.nonempty()),
            per_turn_index=per_index,
            statuses=dict(self._statuses),
            reused_tokens_observed=self._reused,
        )
        return replace(report, recommendation=recommend(report))
