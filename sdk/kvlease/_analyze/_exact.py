"""The exact pass: when a streaming pass saw late turns, read the input again and sort the
conversations that had them (sans-IO; ``_api`` does the reading).

The streaming :class:`~kvlease._analyze._model.Analyzer` places a turn exactly while it arrives
within ``reorder_window`` turns of where it belongs, and counts a later one as *late* (not paired).
The reference definition (the seed's ``reprefill.py``) sorts each conversation's turns by time.
:class:`SortingAnalyzer` gives that answer on a second pass: the turns of the conversations that had
a late turn are held back and placed at the report, each conversation's sorted by timestamp (a
stable sort: equal timestamps keep input order, as the streaming placement does); every other
turn streams as in the first pass. Figures are sums over conversations, so placing the held ones
last changes nothing else.

Memory of the second pass: the held turns (one tuple each), at most every turn of the input when
every conversation arrives shuffled.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from itertools import compress
from operator import itemgetter

from kvlease._analyze._model import DEFAULT_MAX_IDLE, DEFAULT_REORDER_WINDOW, DEFAULT_TTL, Analyzer, TurnInput
from kvlease._analyze._types import AnalysisReport, InputSummary

_BY_CONVERSATION_THEN_TIME = itemgetter(0, 1)


class SortingAnalyzer(Analyzer):
    """An :class:`Analyzer` that holds back every turn of ``conversations`` and places them sorted
    per conversation at :meth:`report`: no turn of theirs is late, whatever the input order."""

    def __init__(
        self,
        conversations: Collection[str],
        ttl: float = DEFAULT_TTL,
        max_idle: float = DEFAULT_MAX_IDLE,
        reorder_window: int = DEFAULT_REORDER_WINDOW,
    ) -> None:
        super().__init__(ttl=ttl, max_idle=max_idle, reorder_window=reorder_window)
        self._sorted_ids = frozenset(conversations)
        self._held: list[TurnInput] = []

    @property
    def held_turns(self) -> int:
        return len(self._held)

    def _divert(self, turns: Iterable[TurnInput]) -> Iterator[TurnInput]:
        ids = self._sorted_ids
        hold = self._held.append
        for turn in turns:
            if turn[0] in ids:
                hold(turn)
            else:
                yield turn

    def add_many(self, turns: Iterable[TurnInput]) -> None:
        super().add_many(self._divert(turns))

    def add_columns(
        self,
        conversation_ids: Sequence[str],
        ts: Sequence[float],
        prompt_tokens: Sequence[int | None],
        completion_tokens: Sequence[int | None],
    ) -> None:
        ids = self._sorted_ids
        if ids.isdisjoint(conversation_ids):
            super().add_columns(conversation_ids, ts, prompt_tokens, completion_tokens)
            return
        held = [cid in ids for cid in conversation_ids]
        self._held.extend(
            (cid, t, p, c, None, None)
            for cid, t, p, c in compress(zip(conversation_ids, ts, prompt_tokens, completion_tokens), held)
        )
        kept = [not h for h in held]
        super().add_columns(
            list(compress(conversation_ids, kept)),
            list(compress(ts, kept)),
            list(compress(prompt_tokens, kept)),
            list(compress(completion_tokens, kept)),
        )

    def place_held(self) -> None:
        """Place the held turns, sorted per conversation (:meth:`report` does it)."""
        if self._held:
            held, self._held = self._held, []
            held.sort(key=_BY_CONVERSATION_THEN_TIME)
            super().add_many(held)

    def report(self, source: InputSummary | None = None) -> AnalysisReport:
        self.place_held()
        return super().report(source)
