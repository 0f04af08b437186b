"""``benchmarks/plan_cluster.py`` (the cluster simulator's comparison) and its RESULTS.md section
(``benchmarks/_report_cluster.py``, hooked into ``_report.py``): a ``--quick`` run (a small trace, a
few seconds) has every policy's row and names every cost's source."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvlease._analyze._cluster import SimPolicy

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench() -> Iterator[Any]:
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("plan_cluster")
    finally:
        sys.path.remove(str(BENCH))
        for name in ("plan_cluster", "_report_cluster", "_report", "_report_agents"):
            sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def result(bench: Any) -> dict[str, Any]:
    return bench.run(quick=True)


def _rows(lines: list[str]) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in lines if line.startswith("| ")]


def test_quick_run_simulates_every_policy_with_named_costs(result: dict[str, Any], bench: Any) -> None:
    assert list(result["policies"]) == [p.value for p in SimPolicy]
    for p in result["policies"].values():
        assert p["ttft"]["p90_s"] is not None
        assert set(p["hit_rate_by_source"]) == {"device", "host", "p_local", "miss"}
        assert p["sessions_per_decode_node"] >= 0
    names = {c["name"] for c in result["costs"]}
    assert {
        "prefill rate per P node",
        "host arena pull rate",
        "demotion rate (D2H gather)",
        "NIC per node",
    } <= names
    assert all(c["source"] and c["unit"] for c in result["costs"])
    sp = result["speed"]
    assert sp["sessions"] == bench.QUICK_SESSIONS < sp["goal_sessions"]
    assert sp["goal_met"] is None and "--quick" in sp["note"]  # a small trace says so, judges nothing
    assert result["trace"]["quick"] is True
    assert set(result["goals"]) == {"auto_vs_ttl", "auto_vs_lru_host"}


def test_table_has_every_policy_row_and_every_cost_source(result: dict[str, Any], bench: Any) -> None:
    from _report_cluster import cluster_table

    rows = _rows(cluster_table(result))
    policies = [r[0] for r in rows if len(r) == 6 and r[0] != "policy"]
    assert policies == [bench.LABELS[p.value] for p in SimPolicy]
    costs = {r[0]: r[2] for r in rows if len(r) == 3 and r[0] != "cost"}
    assert costs == {c["name"]: c["source"].replace("|", "\\|") for c in result["costs"]}


def test_results_md_section_names_sources_and_reports_goals(result: dict[str, Any]) -> None:
    report = importlib.import_module("_report")
    entry = {"command": "python benchmarks/run.py cluster --quick", "when": "2026-01-02", "machine": {},
             "wall_s": 2.0, "result": result}  # fmt: skip
    md = report.render_markdown({"cluster": entry}, {"cluster": "Cluster, simulated"})
    section = md.split("## Cluster, simulated", 1)[1]
    for c in result["costs"]:
        assert c["source"] in section
    assert "kvlease write-through (auto" in section and "LRU host offload" in section
    glance = md.split("## Goals at a glance", 1)[1].split("\n## ", 1)[0]
    assert "auto vs upstream TTL" in glance and "auto vs LRU host offload" in glance
    assert "(--quick)" in glance
