"""The analyzer's core: per-conversation state and the figures, sans-IO.

:class:`Analyzer` takes turns one at a time (``add``), or many (``add_many``, ``add_columns``), in
any order and returns an :class:`AnalysisReport`. It never reads files or clocks; the readers in
``_formats`` feed it.

Memory is bounded by the per-conversation state: for each conversation, its last
``reorder_window + 1`` turns. Everything else is a fixed-size aggregate (sums, a log-binned gap
histogram, per-turn-index sums up to :data:`MAX_TURN_INDEX`, and the first :data:`EXACT_GAPS_LIMIT`
gaps kept exactly so that small inputs get exact percentiles).

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
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import replace
from itertools import repeat
from typing import Any, Final, Protocol

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

# A conversation's state is one flat list, no object per turn: [turns, finalised, then its latest
# turns newest first, as records of _F fields: ts, prompt, completion, end, gap]. ``turns`` counts the
# turns placed (it is the index of the newest); ``finalised`` says whether the oldest record is the
# conversation's last *finalised* turn (one that left the reorder window: older turns are late).
_F: Final = 5
_REC: Final = 2
Record = tuple[float, "int | None", "int | None", "float | None", "float | None"]


class TurnSink(Protocol):
    """What the readers in ``_formats`` feed: the :class:`Analyzer`, or the planner's collector."""

    def add_many(self, turns: Iterable[TurnInput]) -> None: ...

    def add_columns(
        self,
        conversation_ids: Sequence[str],
        ts: Sequence[float],
        prompt_tokens: Sequence[int | None],
        completion_tokens: Sequence[int | None],
    ) -> None: ...

    def observe_status(self, status: str | None, reused_tokens: int | None) -> None: ...


class GapHistogram:
    """Log-binned histogram of gaps in seconds: 200 bins per decade from 1 ms to 1e7 s."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * _HIST_BINS
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

    def add_many(self, gaps: Iterable[float]) -> None:
        """``add`` each gap (one loop, the bin formula inlined)."""
        counts = self.counts
        log10 = math.log10
        trunc = float.__trunc__
        log_min, per_decade, last_bin = float(_HIST_LOG_MIN), float(_HIST_PER_DECADE), _HIST_BINS - 1
        n = 0
        for gap in gaps:
            n += 1
            if gap < _HIST_MIN:
                counts[0] += 1
            else:
                i = trunc((log10(gap) - log_min) * per_decade) + 1
                counts[i if i < last_bin else last_bin] += 1
        self.total += n

    def remove(self, gap: float) -> None:
        """Take back one ``add(gap)``."""
        self.counts[self.index(gap)] -= 1
        self.total -= 1

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


class Analyzer:
    """Accumulates turns and computes an :class:`AnalysisReport`.

    Turns may come in any order: each conversation's turns are placed in timestamp order (equal
    timestamps keep input order) as long as they arrive within ``reorder_window`` turns of where
    they belong. A turn older than the conversation's last *finalised* turn (one followed by more
    than ``reorder_window`` newer turns, or any turn before :meth:`flush`) is a *late* turn:
    counted, not paired (raise the window or sort the input).

    Each turn is paired with its predecessor when it arrives; a turn that arrives out of order is
    inserted and the pairs after it are redone (the figures are sums and counts, so a pair is taken
    back by subtracting it). The result is the same as pairing each turn only once it leaves the
    window, in timestamp order.
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
        self._convs: dict[str, list[Any]] = {}
        self._turns = 0
        self._late = 0
        self._t_min = math.inf
        self._t_max = -math.inf
        # follow-up turns with ttl < gap <= max_idle, and beyond max_idle (the rest are within the TTL);
        # the estimate's repeated tokens of the token turns with gap <= ttl, and in (ttl, max_idle];
        # token turns whose previous response's size is unknown
        self._acc = [0, 0, 0, 0, 0]  # recovered, idle, saved_ttl, saved_recovered, c_unknown
        self._hist = GapHistogram()
        self._exact: array[float] | None = array("d")
        self._exact_out: list[float] = []  # gaps taken back while they are kept exactly
        n_idx = MAX_TURN_INDEX + 1
        # per turn index: follow-up turns that are not token turns; over token turns: prompt, lower
        # bound, estimate (the totals are sums; the token turns are the conversations' turns less these)
        self._idx = ([0] * n_idx, [0] * n_idx, [0] * n_idx, [0] * n_idx)
        self._statuses: Counter[str] = Counter()
        self._reused = 0
        self._late_ids: set[str] = set()

    @property
    def late_conversations(self) -> frozenset[str]:
        """The conversations that had a late turn (an exact pass sorts these: ``_exact``)."""
        return frozenset(self._late_ids)

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
        self._turns += self._consume(turns, True)

    def add_columns(
        self,
        conversation_ids: Sequence[str],
        ts: Sequence[float],
        prompt_tokens: Sequence[int | None],
        completion_tokens: Sequence[int | None],
    ) -> None:
        """Turns without end times or measured gaps, as four equally long columns: the same as
        ``add_many`` over the rows (the readers' fastest path)."""
        if not ts:
            return
        lo, hi = min(ts), max(ts)
        if lo < self._t_min:
            self._t_min = lo
        if hi > self._t_max:
            self._t_max = hi
        rows = zip(conversation_ids, ts, prompt_tokens, completion_tokens, repeat(None), repeat(None))
        self._consume(rows, False)
        self._turns += len(ts)

    def observe_status(self, status: str | None, reused_tokens: int | None) -> None:
        """Reuse outcome the router reported for one turn (SDK turn log only)."""
        if status is not None:
            self._statuses[status] += 1
        if reused_tokens is not None:
            self._reused += reused_tokens

    def flush(self) -> None:
        """Finalise every conversation's turns (:meth:`report` does it): from now on a turn older
        than its conversation's latest one is late."""
        newest = _REC + _F
        for st in self._convs.values():
            if len(st) > newest:
                del st[newest:]
            st[1] = True

    def _consume(self, turns: Iterable[TurnInput], span: bool) -> int:
        """Pair each turn with its conversation's latest one and place it first; hand a turn that
        is older than the latest to :meth:`_insert`. One loop, locals only: this is the analyzer's
        hot path. ``span``: count the turns and track the time span here (``add_columns`` does both
        on whole columns). Returns the number of turns counted."""
        convs = self._convs
        get = convs.get
        window = self.window
        full = _REC + _F * (window + 1)  # the last finalised turn and ``window`` pending ones
        pending_max = _REC + _F * window
        first_finalised = window == 0
        t_min, t_max = self._t_min, self._t_max
        n_turns = late = 0
        ttl, max_idle = self.ttl, self.max_idle
        recovered, idle, saved_ttl, saved_recovered, c_unknown = self._acc
        exact = self._exact
        exact_limit = EXACT_GAPS_LIMIT + len(self._exact_out)
        counts = self._hist.counts
        log10 = math.log10
        trunc = float.__trunc__  # what int() does with a float, without int()'s dispatch
        # as floats: the same values as the int constants in the bin formula, and faster arithmetic
        hist_min, log_min, per_decade = _HIST_MIN, float(_HIST_LOG_MIN), float(_HIST_PER_DECADE)
        last_bin = _HIST_BINS - 1
        idx_other, idx_prompt, idx_lower, idx_est = self._idx
        top = MAX_TURN_INDEX
        try:
            for cid, ts, p, c, end, gap in turns:
                if span:
                    n_turns += 1
                    if ts < t_min:
                        t_min = ts
                    if end is not None and end > ts:
                        if end > t_max:
                            t_max = end
                    elif ts > t_max:
                        t_max = ts
                st = get(cid)
                if st is None:
                    convs[cid] = [1, first_finalised, ts, p, c, end, gap]
                    continue
                pts = st[2]
                if ts < pts:  # older than the latest turn: late, or inserted among the latest ones
                    self._acc = [recovered, idle, saved_ttl, saved_recovered, c_unknown]
                    self._exact = exact
                    if self._insert(st, (ts, p, c, end, gap)):
                        late += 1
                        self._late_ids.add(cid)
                    recovered, idle, saved_ttl, saved_recovered, c_unknown = self._acc
                    exact = self._exact
                    exact_limit = EXACT_GAPS_LIMIT + len(self._exact_out)
                    continue
                pp = st[3]
                pc = st[4]
                pend = st[5]
                st[2:2] = (ts, p, c, end, gap)
                k = len(st)
                if k > full:
                    del st[-5:]  # the last finalised turn; the oldest pending one takes its place
                elif k > pending_max:
                    st[1] = True
                n = st[0] + 1
                st[0] = n
                # ---- the pair (latest, turn) ----
                if gap is None:
                    gap = ts - (pts if pend is None else pend)
                if gap < 0.0:
                    gap = 0.0
                if exact is not None:
                    exact.append(gap)
                    if len(exact) > exact_limit:
                        self._exact = exact
                        self._to_histogram()
                        exact = None
                elif gap < hist_min:
                    counts[0] += 1
                else:
                    i = trunc((log10(gap) - log_min) * per_decade) + 1
                    counts[i if i < last_bin else last_bin] += 1
                i = n if n < top else top
                if p is None or pp is None:
                    idx_other[i] += 1
                    if gap <= ttl:
                        pass
                    elif gap <= max_idle:
                        recovered += 1
                    else:
                        idle += 1
                    continue
                low = pp if pp < p else p
                if pc is None:
                    c_unknown += 1
                    est = low
                else:
                    est = pp + pc
                    if est > p:
                        est = p
                if gap <= ttl:
                    saved_ttl += est
                elif gap <= max_idle:
                    recovered += 1
                    saved_recovered += est
                else:
                    idle += 1
                idx_prompt[i] += p
                idx_lower[i] += low
                idx_est[i] += est
        finally:
            self._acc = [recovered, idle, saved_ttl, saved_recovered, c_unknown]
            self._exact = exact
            self._late += late
            self._t_min, self._t_max = t_min, t_max
        return n_turns

    def _insert(self, st: list[Any], turn: Record) -> int:
        """A turn older than its conversation's latest: 1 if it is late, else place it in timestamp
        order (after equal timestamps): the pair it falls into is taken back and replaced by two,
        and the pairs after it move up one turn index."""
        ts = turn[0]
        if st[1] and ts < st[-5]:
            return 1
        recs: list[Record] = [tuple(st[b : b + _F]) for b in range(len(st) - _F, _REC - 1, -_F)]
        x = len(recs)
        while x and ts < recs[x - 1][0]:  # bisect_right: after equal timestamps
            x -= 1
        first = st[0] - len(recs) + 1  # turn index of the oldest record
        for y in range(x + 1, len(recs)):
            self._move(recs[y - 1], recs[y], first + y)
        # x >= 1 when the oldest record is finalised; if it is not, nothing was ever dropped, the
        # oldest record is the conversation's first turn and the new one comes before it
        if x:
            self._pair(recs[x - 1], recs[x], first + x, -1)
            self._pair(recs[x - 1], turn, first + x, 1)
        self._pair(turn, recs[x], first + x + 1, 1)
        recs.insert(x, turn)
        st[0] += 1
        if len(recs) > self.window + 1:
            del recs[0]
            st[1] = True
        elif len(recs) > self.window:
            st[1] = True
        st[_REC:] = [v for rec in reversed(recs) for v in rec]
        return 0

    @staticmethod
    def _tokens(prev: Record, turn: Record) -> tuple[int, int, int] | None:
        """(prompt, lower bound, estimate) of a token turn, else ``None``: as in :meth:`_consume`."""
        p, pp, pc = turn[1], prev[1], prev[2]
        if p is None or pp is None:
            return None
        low = pp if pp < p else p
        if pc is None:
            return p, low, low
        est = pp + pc
        return p, low, (est if est <= p else p)

    def _pair(self, prev: Record, turn: Record, n: int, sign: int) -> None:
        """Add (``sign`` 1) or take back (-1) the pair (``prev``, ``turn``); ``n`` is the turn index
        of ``turn``. The same figures as the pairing in :meth:`_consume`."""
        pts, _, pc, pend, _ = prev
        ts, _, _, _, gap = turn
        if gap is None:
            gap = ts - (pts if pend is None else pend)
        if gap < 0.0:
            gap = 0.0
        if sign < 0:
            if self._exact is not None:
                self._exact_out.append(gap)  # subtracted at the report (or when the histogram takes over)
            else:
                self._hist.remove(gap)
        elif self._exact is not None:
            self._exact.append(gap)
            if len(self._exact) > EXACT_GAPS_LIMIT + len(self._exact_out):
                self._to_histogram()
        else:
            self._hist.add(gap)
        tokens = self._tokens(prev, turn)
        acc = self._acc  # recovered, idle, saved_ttl, saved_recovered, c_unknown
        if gap <= self.ttl:
            if tokens is not None:
                acc[2] += sign * tokens[2]
        elif gap <= self.max_idle:
            acc[0] += sign
            if tokens is not None:
                acc[3] += sign * tokens[2]
        else:
            acc[1] += sign
        if tokens is not None and pc is None:
            acc[4] += sign
        self._index(tokens, n if n < MAX_TURN_INDEX else MAX_TURN_INDEX, sign)

    def _move(self, prev: Record, turn: Record, n: int) -> None:
        """The pair (``prev``, ``turn``) moves from turn index ``n`` to ``n + 1``."""
        if n < MAX_TURN_INDEX:
            tokens = self._tokens(prev, turn)
            self._index(tokens, n, -1)
            self._index(tokens, n + 1, 1)

    def _index(self, tokens: tuple[int, int, int] | None, i: int, sign: int) -> None:
        idx_other, idx_prompt, idx_lower, idx_est = self._idx
        if tokens is None:
            idx_other[i] += sign
        else:
            idx_prompt[i] += sign * tokens[0]
            idx_lower[i] += sign * tokens[1]
            idx_est[i] += sign * tokens[2]

    def _to_histogram(self) -> None:
        """Too many gaps to keep: bin them, less those taken back, and bin the later ones directly."""
        assert self._exact is not None
        self._hist.add_many(self._exact)
        for gap in self._exact_out:
            self._hist.remove(gap)
        self._exact = None
        self._exact_out.clear()

    def _exact_gaps(self) -> list[float]:
        """The gaps kept exactly, sorted, less those taken back."""
        assert self._exact is not None
        gaps = sorted(self._exact)
        if not self._exact_out:
            return gaps
        out: Counter[float | str] = Counter(g if g == g else "nan" for g in self._exact_out)
        kept = []
        for g in gaps:
            key = g if g == g else "nan"
            if out[key] > 0:
                out[key] -= 1
            else:
                kept.append(g)
        return kept

    # ---------------------------------------------------------------------------------------------
    def report(self, source: InputSummary | None = None) -> AnalysisReport:
        """Flush pending turns and compute every figure, with the recommendation."""
        from kvlease._analyze._recommend import recommend

        self.flush()
        turns = self._turns
        follow = turns - self._late - len(self._convs)  # every placed turn but each conversation's first
        recovered, idle, saved_ttl, saved_recovered, c_unknown = self._acc
        within = follow - recovered - idle
        beyond = recovered + idle
        idx_other, idx_prompt, idx_lower, idx_est = self._idx
        top = MAX_TURN_INDEX
        idx_turns = [0] * (top + 1)  # follow-up turns per index: a conversation of n turns has 2..n
        for n, k in Counter(st[0] for st in self._convs.values()).items():
            for i in range(2, min(n, top - 1) + 1):
                idx_turns[i] += k
            if n >= top:
                idx_turns[top] += k * (n - top + 1)
        idx_turns = [t - o for t, o in zip(idx_turns, idx_other)]  # token turns
        token_turns, prompt, lower, est_sum = sum(idx_turns), sum(idx_prompt), sum(idx_lower), sum(idx_est)
        saved_lease = saved_ttl + saved_recovered
        convs = self._convs.values()
        span = float(self._t_max - self._t_min) if turns else 0.0
        hours = span / 3600.0
        hist = self._hist
        hist.total = follow  # the hot loop counts the bins only
        if self._exact is not None:
            gaps = self._exact_gaps()
            p50, p90, p99 = (exact_percentile(gaps, q) for q in (0.5, 0.9, 0.99))
            hist = GapHistogram()
            hist.add_many(gaps)
        else:
            p50, p90, p99 = (hist.percentile(q) for q in (0.5, 0.9, 0.99))
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
            one_turn_conversations=sum(1 for st in convs if st[0] == 1),
            max_turns_in_conversation=max((st[0] for st in convs), default=0),
            late_turns=self._late,
            token_turns=token_turns,
            completion_known_turns=token_turns - c_unknown,
            prompt_tokens=prompt,
            repeated_tokens_lower_bound=lower,
            repeated_tokens_estimate=est_sum,
            repeated_share_lower_bound=ratio(lower, prompt),
            repeated_share_estimate=ratio(est_sum, prompt),
            turns_within_ttl=within,
            turns_beyond_ttl=beyond,
            turns_recovered_by_leases=recovered,
            turns_beyond_max_idle=idle,
            share_beyond_ttl=ratio(beyond, follow),
            share_recovered_by_leases=ratio(recovered, follow),
            share_beyond_max_idle=ratio(idle, follow),
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
