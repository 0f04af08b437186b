"""The committed samples are exactly what scripts/make_samples.py writes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_samples_match_the_generator() -> None:
    spec = importlib.util.spec_from_file_location("make_samples", ROOT / "scripts" / "make_samples.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    samples = mod.samples()
    assert samples == mod.samples()  # deterministic
    for name, data in samples.items():
        assert (ROOT / "tests" / "data" / name).read_bytes() == data, (
            f"{name} is stale: run scripts/make_samples.py"
        )
