"""``benchmarks/run.py`` runs every benchmark through ``run(quick) -> dict``: each module it names
must have one (a missing one surfaces only when the whole suite is run), and the fast plugin
benchmark runs for real in its quick form."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(autouse=True)
def _bench_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))


def test_every_benchmark_has_run_and_its_result_renders() -> None:
    run = importlib.import_module("run")
    for name, (module, _title, _real) in run.BENCHMARKS.items():
        mod = importlib.import_module(module)
        assert callable(getattr(mod, "run", None)), f"benchmark {name}: {module}.run is missing"


def test_plugin_benchmark_quick(capsys: pytest.CaptureFixture[str]) -> None:
    mod = importlib.import_module("bench_plugin_stream")
    res = mod.run(quick=True)
    assert res["chunks_per_request"] == 256 and res["plugin_us_per_request"] > 0
    mod.print_table(res)
    assert "final-chunk injection" in capsys.readouterr().out
    run = importlib.import_module("run")
    md = run.write_markdown(
        {"plugin": {"command": "c", "when": "d", "machine": run.machine(), "wall_s": 1.0, "result": res}}
    )
    assert "streaming overhead" in md and '"added_us_per_chunk"' in md
    sys.modules.pop("run", None)
