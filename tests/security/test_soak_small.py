"""A small soak (100 conversations x 5 turns, 10% mid-stream hang-ups) through the router process
against the fake P/D process: the invariants of ``benchmarks/soak.py``, not its timings."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest


def _soak_module(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
    monkeypatch.syspath_prepend(str(path.parent))  # its helper modules (_procs)
    spec = importlib.util.spec_from_file_location("kvlease_bench_soak", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_small_soak_loses_nothing_and_leaks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    soak = _soak_module(monkeypatch)
    res = soak.run_soak(100, 5, p_drop=0.1, seed=7, rounds=1)
    assert res["failures"] == [], res
    assert res["turns_completed"] == 500 and res["conversations_incomplete"] == 0
    assert res["wrong_or_crossed_answers"] == 0
    assert res["prefill_requests"] == res["decode_requests"] == res["client_attempts"]
    assert res["mid_stream_disconnects"] > 0  # the hang-ups really happened
    assert res["fake_open_streams_after"] == 0 and res["router_in_flight_after"] == 0
    assert res["router_upstream_sockets_after"].get("CLOSE_WAIT", 0) == 0
    assert sum(res["router_upstream_sockets_after"].values()) <= 2 * 100 + 100
