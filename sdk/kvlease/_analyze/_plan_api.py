"""``plan(path)``: the IO shell of the capacity planner. Reads any format the analyzer reads,
through the analyzer's readers, into columns; ``_plan`` replays them. ``plan_cluster_file(path)``
does the same for the cluster simulator (``_cluster``)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from itertools import repeat
from pathlib import Path
from typing import Any, Final

from kvlease._analyze._api import readable_twice
from kvlease._analyze._cluster import build_sessions
from kvlease._analyze._cluster_costs import ClusterConfig
from kvlease._analyze._cluster_report import ClusterPlan, plan_cluster
from kvlease._analyze._formats import MOONCAKE_BLOCK_SIZE, InputFormat, read_into
from kvlease._analyze._model import TurnInput
from kvlease._analyze._plan import prepare
from kvlease._analyze._plan_report import CapacityPlan, PlanConfig, plan_trace

#: ``plan_cluster_file`` runs the policies in parallel processes from this many turns on.
PARALLEL_TURNS: Final = 50_000


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


def plan_cluster_file(
    path: str | Path,
    config: ClusterConfig,
    *,
    format: InputFormat | str | None = None,
    strict: bool = False,
    mooncake_block_size: int = MOONCAKE_BLOCK_SIZE,
    slots: int | None = None,
    sweep: bool = True,
    per_turn: bool = False,
    jobs: int | None = None,
) -> ClusterPlan:
    """Read ``path`` and simulate its sessions on ``config``'s cluster (``_cluster_report.plan_cluster``).

    ``jobs``: processes for the policies (None: one per CPU, up to one per policy, on traces of
    :data:`PARALLEL_TURNS` turns or more; 1 runs them here)."""
    turns, info = read_turns(path, format=format, strict=strict, mooncake_block_size=mooncake_block_size)
    sessions = build_sessions(turns, config.decode_tps.value)
    del turns
    if jobs is None:
        jobs = min(os.cpu_count() or 1, 5) if sessions.turns >= PARALLEL_TURNS else 1
    if jobs <= 1:
        result = plan_cluster(sessions, config, slots=slots, sweep=sweep, per_turn=per_turn)
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            result = plan_cluster(
                sessions, config, slots=slots, sweep=sweep, per_turn=per_turn, map_fn=pool.map
            )
    return replace(result, source=info)
