"""The stack's model specs: the cached builds of ``tiny``/``small`` stay valid, ``hybrid`` is a
Gemma-3-style model with sliding-window and global layers, and the marker decides readiness."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import get_args

import pytest

from kvlease_stack import StackSpec
from kvlease_stack._config import ModelName
from kvlease_stack._model import MARKER, MODEL_SPECS, MODEL_VERSION, _marker, model_dir, model_ready
from kvlease_stack._paths import venv_python

_COMMON = {
    "seed": 0,
    "corpus_bytes": 6_000_000,
    "vocab_size": 4096,
    "num_kv_heads": 2,
    "max_position_embeddings": 4096,
    "train_seq": 256,
    "train_batch": 16,
    "lr": 0.002,
}
#: The specs the cached ``tiny-v1`` / ``small-v1`` builds were made from: changing one rebuilds
#: every cache (CI and developers' machines) and changes the models the other tests run on.
PINNED = {
    "tiny": {
        **_COMMON,
        "num_heads": 4,
        "num_layers": 4,
        "hidden_size": 256,
        "intermediate_size": 768,
        "train_steps": 300,
        "verify_prompt_dependence": True,
    },
    "small": {
        **_COMMON,
        "num_heads": 8,
        "num_layers": 8,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "train_steps": 0,
        "verify_prompt_dependence": False,
    },
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_cached_models_keep_their_spec(name: str) -> None:
    assert MODEL_VERSION == 1
    assert MODEL_SPECS[name] == PINNED[name]
    assert _marker(name) == {"name": name, "version": 1, "spec": PINNED[name]}


def test_every_stack_model_has_a_spec() -> None:
    assert set(get_args(ModelName)) == set(MODEL_SPECS)
    for name in MODEL_SPECS:
        assert StackSpec(model=name).model == name  # type: ignore[arg-type]


def test_hybrid_is_gemma3_with_sliding_window_and_global_layers() -> None:
    spec = MODEL_SPECS["hybrid"]
    assert spec["arch"] == "gemma3"
    assert spec["num_layers"] == len(spec["layer_types"]) == 4
    assert spec["layer_types"].count("sliding_attention") == 3
    assert spec["layer_types"].count("full_attention") == 1
    assert spec["sliding_window"] == 128  # one block of vLLM's CPU backend
    assert spec["hidden_size"] % spec["num_heads"] == 0
    assert spec["num_heads"] % spec["num_kv_heads"] == 0
    # trained, checked for prompt dependence and for the global layer's reach
    assert spec["train_steps"] > 0
    assert spec["verify_prompt_dependence"] and spec["verify_long_range"]
    # the tokenizer (and so the vocabulary and chat template) is built like the other models'
    for key in ("seed", "corpus_bytes", "vocab_size"):
        assert spec[key] == MODEL_SPECS["tiny"][key]
    # the training windows span more than one sliding window, so the global layer learns to look past it
    assert spec["train_seq"] > spec["sliding_window"]


def test_model_ready_reads_the_marker(tmp_path: Path) -> None:
    path = model_dir("hybrid", tmp_path)
    assert path.name == f"hybrid-v{MODEL_VERSION}"
    assert not model_ready("hybrid", tmp_path)
    path.mkdir(parents=True)
    (path / MARKER).write_text(json.dumps(_marker("tiny")))  # another model's marker
    assert not model_ready("hybrid", tmp_path)
    (path / MARKER).write_text("not json")
    assert not model_ready("hybrid", tmp_path)
    (path / MARKER).write_text(json.dumps(_marker("hybrid")))
    assert model_ready("hybrid", tmp_path)


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


@pytest.mark.slow
def test_make_model_builds_the_configured_architectures() -> None:
    """The build script's model for each spec (in the vLLM venv, where torch and transformers are)."""
    python = venv_python()
    if not python.exists():
        pytest.skip("the vLLM venv is not provisioned")
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
