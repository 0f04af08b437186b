"""The stack's model specs: the cached builds of ``tiny``/``small`` stay valid, ``hybrid`` is a
Gemma-3-style model with sliding-window and global layers, and the marker decides readiness."""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_args

import pytest

from kvlease_stack import StackSpec
from kvlease_stack._config import ModelName
from kvlease_stack._model import MARKER, MODEL_SPECS, MODEL_VERSION, _marker, model_dir, model_ready

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
