"""``benchmarks/_report.py`` renders a results.json as RESULTS.md tables and PNG plots, without
running any benchmark."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
MACHINE = {"cpu": "Test CPU", "cores": 2, "memory": "8 GiB", "python": "3.11.7", "os": "Linux"}


def _entry(name: str, result: dict[str, Any]) -> dict[str, Any]:
    return {
        "command": f"python benchmarks/run.py {name}",
        "when": "2026-01-02",
        "machine": MACHINE,
        "wall_s": 3.0,
        "result": result,
    }


RESULTS = {
    "analyze": _entry(
        "analyze",
        {
            "lines": 1000,
            "goal_lines_per_s": 200_000,
            "goal_met": True,
            "orjson": {"lines_per_s": 250_000},
            "json": {"lines_per_s": 120_000},
            "peak_rss_mib": 50.0,
            "peak_rss_mib_2x_lines": 50.5,
        },
    ),
    "ttft": _entry(
        "ttft",
        {
            "sizes": [1024, 2048],
            "results": {
                "kvlease/prefix_cache=off": {
                    "1024": {"pull": 100.0, "recompute": 1200.0, "edited": 700.0},
                    "2048": {"pull": 150.0, "recompute": 3000.0, "edited": 1800.0},
                },
                "nixl/prefix_cache=off": {
                    "1024": {"pull": 110.0, "recompute": 1190.0},
                    "2048": {"pull": 150.0, "recompute": 2900.0},
                },
            },
            "pull_vs_upstream": {"prefix_cache=off": {"1024": 0.91, "2048": 1.0}},
        },
    ),
    "trace": _entry(
        "trace",
        {
            "follow_up_turns": 10,
            "pauses_beyond_ttl": 4,
            "d_ttl_s": 15.0,
            "arms": {
                "fixed-ttl": {
                    "reuse_share": 0.6,
                    "reuse_share_after_long_pause": 0.0,
                    "median_ttft_ms": 5000.0,
                },
                "heartbeats": {
                    "reuse_share": 1.0,
                    "reuse_share_after_long_pause": 1.0,
                    "median_ttft_ms": 1000.0,
                },
                "no-reuse": {
                    "reuse_share": 0.0,
                    "reuse_share_after_long_pause": 0.0,
                    "median_ttft_ms": 6000.0,
                },
            },
        },
    ),
    "newbench": _entry(
        "newbench", {"turns_per_min": 1_500_000.0, "nested": {"ok": True}, "goal": ">= 1M", "goal_met": True}
    ),
}


@pytest.fixture()
def report(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(BENCH))
    yield importlib.import_module("_report")
    sys.modules.pop("_report", None)


def _rows(md: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.strip("|").split(" | ")] for line in md.splitlines() if line.startswith("| ")
    ]


def test_renders_tables_and_plots_from_results_json(tmp_path: Path, report: Any) -> None:
    store = tmp_path / "results.json"
    store.write_text(json.dumps(RESULTS))
    assert report.main(["--results", str(store)]) == 0
    md = (tmp_path / "RESULTS.md").read_text()
    rows = _rows(md)
    assert ["figure", "goal", "anchor", "measured", "command", "date", "machine"] in rows
    machine = "2 cores (Test CPU), 8 GiB, Python 3.11.7"
    assert [
        "analyzer throughput (1,000 lines)",
        ">= 200,000 lines/s",
        "stdlib json: 120,000 lines/s",
        "250,000 lines/s (orjson) (met)",
        "`python benchmarks/run.py analyze`",
        "2026-01-02",
        machine,
    ] in rows
    assert [
        "turn-2 prefill, 1,024-token history: kvlease pull",
        "within 10 % of upstream's pull",
        "upstream pull 110 ms; recompute 1200 ms",
        "100 ms (12.0x faster than recompute, 0.91x upstream) (met)",
    ] in rows
    assert ["heartbeats: median TTFT", "—", "no reuse: 6.0 s", "1.0 s"] in rows
    # a benchmark without a dedicated summary still gets a table of its figures
    assert ["turns_per_min", "—", "—", "1.5e+06"] in rows and ["nested.ok", "—", "—", "True"] in rows
    assert ["`python benchmarks/run.py ttft`", "2026-01-02", machine + ", real vLLM CPU stack", "3 s"] in rows
    for png in ("ttft_history.png", "pull_vs_recompute.png", "hit_rate_pause.png"):
        data = (tmp_path / png).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) < 200_000
        assert f"]({png})" in md
    assert "```json" not in md  # tables, not dumps; the raw figures stay in results.json


def test_a_result_of_another_shape_falls_back_to_its_figures(report: Any) -> None:
    md = report.render_markdown({"ttft": _entry("ttft", {"median_ms": 12.5})})
    assert ["median_ms", "—", "—", "12.5"] in _rows(md)


def test_run_report_only_renders_without_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    run = importlib.import_module("run")
    monkeypatch.setattr(run, "HERE", tmp_path)
    (tmp_path / "results.json").write_text(json.dumps({"analyze": RESULTS["analyze"]}))
    monkeypatch.setattr(run, "BENCHMARKS", {"analyze": ("no_such_module", "Analyzer", False)})
    assert run.main(["--report-only"]) == 0
    assert "## Analyzer" in (tmp_path / "RESULTS.md").read_text()
    sys.modules.pop("run", None)
    sys.modules.pop("_report", None)


def test_gpu_pull_and_fragmentation_sections(report: Any) -> None:
    """The stored H200 table renders per token count against the <= 3x-coalesced goal, and the
    fragmentation histograms (a real-stack result) render their buckets."""
    stored = json.loads((BENCH / "results.json").read_text())
    frag = {
        f: {"pulls": 3, "mean": m, "cumulative_buckets": {"1.0": 1.0, "+Inf": 3.0}}
        for f, m in (("descriptors", 4096.0), ("local_runs", 2.0), ("remote_runs", None))
    }
    md = report.render_markdown(
        {"gpu_pull": stored["gpu_pull"], "fragmentation": _entry("fragmentation", frag)}
    )
    assert "## GPU pull on one H200" in md
    at_24k = next(r for r in _rows(md) if r[0].startswith("24k tokens"))
    assert at_24k[1] == "<= 3x coalesced, <= ~20 ms" and "coalesced 8.6 ms" in at_24k[2]
    assert "per-block 635.9 ms" in at_24k[2] and at_24k[3].endswith("(met)")
    assert "descriptors per pull, mean over 3 pulls" in md and "<= +Inf: 3" in md


def test_sdk_rows_show_the_a_a_noise_floor(report: Any) -> None:
    """The SDK overhead row gives the A/A arm beside the overhead (two identical raw clients: how far
    the figure can move by noise alone); results stored before the A/A arm render without it."""
    mode = {
        "raw_ms_per_call": 4.3,
        "wrapped_ms_per_call": 4.52,
        "added_us_per_call": 220.0,
        "overhead_pct": 5.11,
        "overhead_pct_p25_p75": [4.43, 6.86],
        "client_cpu_overhead_pct": 5.81,
        "aa_pct": 0.28,
    }
    old = {k: v for k, v in mode.items() if k != "aa_pct"}
    md = report.render_markdown({"sdk": _entry("sdk", {"non_streaming": mode, "streaming": old})})
    rows = {r[0]: r[3] for r in _rows(md) if r[0].startswith("SDK overhead")}
    assert rows["SDK overhead per call, non-streaming"].endswith("client CPU +5.81 %; A/A +0.28 %) (missed)")
    assert "A/A" not in rows["SDK overhead per call, streaming"]


def test_sdk_rows_compare_with_the_raw_client_on_the_same_conversation(report: Any) -> None:
    """With the ``raw_id`` arm the row's baseline is the raw client sending the same conversation id
    (the server's work is then the same for both) and the figure against a raw client sending no id
    is shown beside it; results stored before that arm keep the raw client as their baseline."""
    mode = {
        "raw_ms_per_call": 3.79,
        "raw_id_ms_per_call": 3.95,
        "wrapped_ms_per_call": 4.1,
        "added_us_per_call": 143.1,
        "overhead_pct": 2.9,
        "overhead_pct_p25_p75": [1.5, 6.55],
        "client_cpu_overhead_pct": 2.2,
        "aa_pct": 1.1,
        "vs_no_id_overhead_pct": 7.86,
    }
    old = {k: v for k, v in mode.items() if k not in ("raw_id_ms_per_call", "vs_no_id_overhead_pct")}
    md = report.render_markdown({"sdk": _entry("sdk", {"non_streaming": mode, "streaming": old})})
    rows = {r[0]: r[2:] for r in _rows(md) if r[0].startswith("SDK overhead")}
    baseline, measured = rows["SDK overhead per call, non-streaming"]
    assert baseline == "raw openai client, same conversation id: 3.95 ms/call"
    assert measured.endswith("A/A +1.10 %; vs a raw client sending no id +7.86 %) (met)")
    old_baseline, old_measured = rows["SDK overhead per call, streaming"]
    assert old_baseline == "raw openai client: 3.79 ms/call" and "no id" not in old_measured


def test_hostile_load_is_one_row_per_attack(report: Any) -> None:
    """The stored hostile-load result renders as one row per attack (the victim's p50/p99 alone and
    under attack, hits kept, failed turns, router CPU per attack request) under three headline
    goals, not as its ~200 flattened keys; the raw figures stay in the folded raw results."""
    stored = json.loads((BENCH / "results.json").read_text())["hostile"]
    md = report.render_markdown({"hostile": stored})
    rows = _rows(md)
    head = next(r for r in rows if r[0] == "attack")
    assert head[1:7] == [
        "victim p50 / p99 alone (ms)",
        "under attack (ms)",
        "hits kept under attack",
        "failed turns (alone / under)",
        "attack requests/s",
        "router CPU per attack request",
    ]
    by_attack = {r[0].split(":")[0]: r for r in rows[rows.index(head) + 1 :]}
    assert list(by_attack) == [
        "none (victim alone)",
        "renew flood",
        "renew flood, a new bearer token every request",
        "anonymous renew, 101 ids a second",
        "slow clients",
        "stalled streams",
        "fuzz",
    ]
    flood = by_attack["renew flood"]
    assert flood[1:7] == ["3.2 / 5.5", "6.8 / 11.5 (2.1x p99)", "100 % of 630", "0 / 0", "2,839", "0.137 ms"]
    assert by_attack["anonymous renew, 101 ids a second"][6] == "82.2 ms (5 requests: noise)"
    assert by_attack["stalled streams"][6] == "—"  # it holds connections, sends no stream of requests
    assert ["victim's failed turns, every window", "0", "12,233 turns", "0 (met)"] in rows
    stalled = next(r for r in rows if r[0] == "victim's p99 under 50 stalled stream readers")
    assert stalled[1:4] == ["<= 2x its p99 alone", "alone: 58 ms", "2,872 ms (49.1x) (missed)"]
    assert ["router 5xx to garbage", "0", "10,166 garbage requests", "0 (met)"] in rows
    assert not any(r[0].startswith("phases.") for r in rows)  # no flattened keys in the tables
    assert '"p99_ms": 2871.79' in md  # the raw result, folded at the end


def test_hostile_counts_server_errors_and_survives_another_shape(report: Any) -> None:
    assert report._server_errors({"http 200": 3, "http 503": 2, "raw 500": 1, "5xx": 4, "ms_total": 9}) == 7
    md = report.render_markdown({"hostile": _entry("hostile", {"window_s": 5.0, "p99_ms": 3.0})})
    assert ["p99_ms", "—", "—", "3"] in _rows(md) and "| attack |" not in md
