"""Exact by default: on logs whose lines are not in time order (merged logs of several servers),
``analyze`` gives the reference definition's figures, that of the seed's ``reprefill.py``: each
conversation's rows sorted by time, each turn paired with the one before it.

The reference here is independent of the Analyzer: a stable sort per conversation, then
``test_model_reference.reference`` over the sorted rows with nothing pending (window 0)."""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path
from typing import Any

import pytest
import typer
from hypothesis import given, settings
from hypothesis import strategies as st
from test_model_reference import figures, reference
from typer.testing import CliRunner

from kvlease._analyze import analyze
from kvlease._analyze._model import TurnInput
from kvlease._analyze._synth import agent_trace, write_requests
from kvlease._analyze.cli import analyze_command


def seed_reference(rows: list[TurnInput], ttl: float = 480.0, max_idle: float = 1800.0) -> dict[str, Any]:
    """The seed's definition: each conversation's rows sorted by time (stable: ties keep file order)."""
    ordered = sorted(rows, key=lambda r: (r[0], r[1]))
    return reference(ordered, window=0, ttl=ttl, max_idle=max_idle)


def rows_of(path: Path) -> list[TurnInput]:
    """The turns of a request log, in file order."""
    out: list[TurnInput] = []
    for line in path.read_text().splitlines():
        o = json.loads(line)
        out.append(
            (o["conversation_id"], o["ts"], o["prompt_tokens"], o.get("completion_tokens"), None, None)
        )
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_shuffled_log_has_the_reference_figures(tmp_path: Path, seed: int) -> None:
    log = write_requests(agent_trace(400, seed=seed), tmp_path / "merged.jsonl", shuffle_seed=seed)
    want = seed_reference(rows_of(log))
    report = analyze(log)
    assert figures(report) == want
    assert report.input.passes == 2 and report.late_turns == 0
    # today's streaming pass alone (the behaviour before the exact pass) differs: this test would fail
    streaming = analyze(log, exact=False)
    assert streaming.late_turns > 0 and figures(streaming) != want


def test_an_ordered_log_is_read_once(tmp_path: Path) -> None:
    log = write_requests(agent_trace(300, seed=4), tmp_path / "ordered.jsonl")
    report = analyze(log)
    assert report.input.passes == 1
    assert figures(report) == seed_reference(rows_of(log))


def test_the_exact_pass_matches_for_every_window(tmp_path: Path) -> None:
    log = write_requests(agent_trace(200, seed=5), tmp_path / "m.jsonl", shuffle_seed=9)
    want = seed_reference(rows_of(log))
    for window in (0, 1, 8, 100):
        assert figures(analyze(log, reorder_window=window)) == want


_line = st.tuples(
    st.sampled_from("abcd"),
    st.one_of(st.integers(0, 30), st.sampled_from([0.5, 2.25, 600.0, 2500.0])),
    st.integers(0, 400),
    st.one_of(st.none(), st.integers(0, 40)),
)


@settings(max_examples=150, deadline=None)
@given(lines=st.lists(_line, max_size=40), window=st.integers(0, 3), ttl=st.sampled_from([1.0, 480.0]))
def test_any_order_any_window(
    lines: list[tuple[str, float, int, int | None]], window: int, ttl: float
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "log.jsonl"
        log.write_text(
            "".join(
                json.dumps({"conversation_id": c, "ts": t, "prompt_tokens": p, "completion_tokens": k}) + "\n"
                for c, t, p, k in lines
            )
        )
        got = figures(analyze(log, ttl=ttl, max_idle=ttl + 1000.0, reorder_window=window))
        assert got == seed_reference(rows_of(log), ttl=ttl, max_idle=ttl + 1000.0)


def test_other_formats_shuffled(tmp_path: Path) -> None:
    """A turn log (measured gaps) and vLLM stats lines (end times) are sorted as well."""
    rows = agent_trace(150, seed=6)
    rng = random.Random(6)
    turnlog: list[TurnInput] = []
    vllm: list[dict[str, Any]] = []
    for cid, ts, p, c, _, _ in rows:
        gap = round(rng.uniform(0, 900), 3)
        turnlog.append((cid, ts, p, c, None, gap))
        vllm.append({"conversation_id": cid, "start_time_ms": ts * 1000, "latency_ms": 1500.0,
                     "input_num_tokens": p, "output_num_tokens": c})  # fmt: skip
    order = list(range(len(rows)))
    rng.shuffle(order)
    keys = ("conversation_id", "ts", "prompt_tokens", "completion_tokens", "gap_s", "status")
    tl = tmp_path / "turns.jsonl"
    tl.write_text(
        "".join(json.dumps(dict(zip(keys, (*turnlog[i][:4], turnlog[i][5], None)))) + "\n" for i in order)
    )
    assert figures(analyze(tl, format="turnlog")) == seed_reference([turnlog[i] for i in order])
    vl = tmp_path / "stats.jsonl"
    vl.write_text("".join(json.dumps(vllm[i]) + "\n" for i in order))
    vrows: list[TurnInput] = [
        (v["conversation_id"], v["start_time_ms"] / 1000, v["input_num_tokens"], v["output_num_tokens"],
         v["start_time_ms"] / 1000 + 1.5, None)
        for v in (vllm[i] for i in order)
    ]  # fmt: skip
    assert figures(analyze(vl, format="vllm")) == seed_reference(vrows)


def test_standard_input_is_spilled_and_read_twice(tmp_path: Path) -> None:
    log = write_requests(agent_trace(200, seed=7), tmp_path / "m.jsonl", shuffle_seed=7)
    app = typer.Typer()
    app.command()(analyze_command)
    res = CliRunner().invoke(app, ["-", "--json"], input=log.read_bytes())
    assert res.exit_code == 0, res.stderr
    got = json.loads(res.stdout)
    want = analyze(log).to_json()
    assert got["input"]["source"] == "<stdin>" and got["input"]["passes"] == 2
    got["input"]["source"] = want["input"]["source"]
    assert got == want
