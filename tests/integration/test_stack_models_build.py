"""The stack's model build script makes each spec's architecture (in the vLLM venv, which the
``vllm_python`` fixture provisions when missing)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvlease_stack._model import MODEL_SPECS

pytestmark = [pytest.mark.integration, pytest.mark.slow]

_MAKE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import _build_model
for name in ("hybrid", "tiny"):
    s = {**json.loads(sys.argv[2])[name], "hidden_size": 32, "intermediate_size": 64}
    m = _build_model.make_model(s, vocab_size=64, eos_id=2, pad_id=0)
    c = m.config
    print(json.dumps({
        "name": name,
        "cls": type(m).__name__,
        "layer_types": list(getattr(c, "layer_types", None) or []),
        "sliding_window": getattr(c, "sliding_window", None),
        "head_dim": getattr(c, "head_dim", None),
        "layers": c.num_hidden_layers,
    }))
"""


def test_make_model_builds_the_configured_architectures(vllm_python: Path) -> None:
    """The build script's model for each spec (in the vLLM venv, where torch and transformers are)."""
    python = vllm_python
    script_dir = Path(__file__).parents[2] / "server_patch" / "kvlease_stack"
    out = subprocess.run(
        [str(python), "-c", _MAKE, str(script_dir), json.dumps(MODEL_SPECS)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=True,
    ).stdout
    got = {d["name"]: d for d in map(json.loads, out.strip().splitlines())}
    hybrid = got["hybrid"]
    assert hybrid["cls"] == "Gemma3ForCausalLM"
    assert hybrid["layer_types"] == MODEL_SPECS["hybrid"]["layer_types"]
    assert hybrid["sliding_window"] == 128
    assert hybrid["head_dim"] == 32 // MODEL_SPECS["hybrid"]["num_heads"]
    tiny = got["tiny"]
    assert tiny["cls"] == "Qwen2ForCausalLM"
    assert tiny["sliding_window"] is None
    assert set(tiny["layer_types"]) <= {"full_attention"}
