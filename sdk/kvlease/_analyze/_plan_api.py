"""``plan(path)``: the IO shell of the capacity planner. Reads any format the analyzer reads,
through the analyzer's readers, into columns; ``_plan`` replays them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from itertools import repeat
from pathlib import Path
from typing import Any

from kvlease._analyze._api import readable_twice
from kvlease._analyze._formats import MOONCAKE_BLOCK_SIZE, InputFormat, read_into
from kvlease._analyze._model import TurnInput
from kvlease._analyze._plan import prepare
from kvlease._analyze._plan_report import CapacityPlan, PlanConfig, plan_trace


class TurnCollector:
    """A :class:`~kvlease._analyze._model.TurnSink` that keeps every turn (the planner needs them
    all, sorted by time across conversations: memory grows with the input)."""

    def __init__(self) -> None:
        self.turns: list[TurnInput] = []

    def add_many(self, turns: Iterable[TurnInput]) -> None:
        self.turns.extend(turns)

    def add_columns(
        self,
        conversation_ids: Sequence[str],
        ts: Sequence[float],
        prompt_tokens: Sequence[int | None],
        completion_tokens: Sequence[int | None],
    ) -> None:
        self.turns.extend(
            zip(conversation_ids, ts, prompt_tokens, completion_tokens, repeat(None), repeat(None))
        )

    def observe_status(self, status: str | None, reused_tokens: int | None) -> None:
        """Observed outcomes are the analyzer's business; the planner predicts them."""


def read_turns(
    path: str | Path,
    *,
    format: InputFormat | str | None = None,
    strict: bool = False,
    mooncake_block_size: int = MOONCAKE_BLOCK_SIZE,
) -> tuple[list[TurnInput], dict[str, Any]]:
    """Every turn of ``path`` (``-``: standard input, spilled to a temporary file) and what was read."""
    sink = TurnCollector()
    with readable_twice(path) as (readable, source):
        fmt = None if format is None else InputFormat(format)
        s = read_into(sink, readable, fmt, strict=strict, mooncake_block_size=mooncake_block_size)
    info = {
        "source": source,
        "format": s.format,
        "lines": s.lines,
        "records": s.records,
        "malformed": s.malformed,
    }
    return sink.turns, info


def plan(
    path: str | Path,
    config: PlanConfig,
    *,
    format: InputFormat | str | None = None,
    strict: bool = False,
    mooncake_block_size: int = MOONCAKE_BLOCK_SIZE,
) -> CapacityPlan:
    """Read ``path`` and plan the decode-side retention of its traffic (``_plan_report.plan_trace``)."""
    turns, info = read_turns(path, format=format, strict=strict, mooncake_block_size=mooncake_block_size)
    return replace(plan_trace(prepare(turns), config), source=info)
