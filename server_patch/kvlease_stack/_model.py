"""Build (once, cached) the deterministic local models the stack serves.

``tiny`` is trained briefly so that greedy output depends on the prompt (KV-correctness tests need
that); ``small`` has random weights and exists for timings (recompute costs more); ``hybrid`` is a
Gemma-3-style model with sliding-window and global layers (a hybrid KV cache), trained like
``tiny``. All are built from local text only, by ``_build_model.py`` run with the vLLM venv's
interpreter, into a temporary directory renamed into place once complete (a marker file records
the spec).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from kvlease_stack._paths import kvlease_home, models_dir
from kvlease_stack._venv import (
    Progress,
    ProvisionError,
    _stderr_progress,
    ensure_venv,
    file_lock,
    run_logged,
)

MODEL_VERSION = 1
MARKER = "kvlease-model.json"

_COMMON: dict[str, Any] = {
    "seed": 0,
    "corpus_bytes": 6_000_000,
    "vocab_size": 4096,
    "num_heads": 4,
    "num_kv_heads": 2,
    "max_position_embeddings": 4096,
    "train_seq": 256,
    "train_batch": 16,
    "lr": 0.002,
}
MODEL_SPECS: dict[str, dict[str, Any]] = {
    "tiny": {
        **_COMMON,
        "num_layers": 4,
        "hidden_size": 256,
        "intermediate_size": 768,
        "train_steps": 300,
        "verify_prompt_dependence": True,
    },
    "small": {
        **_COMMON,
        "num_layers": 8,
        "hidden_size": 512,
        "num_heads": 8,
        "num_kv_heads": 2,
        "intermediate_size": 1536,
        "train_steps": 0,
        "verify_prompt_dependence": False,
    },
    # Gemma-3-style hybrid attention: three sliding-window layers (128 tokens, one CPU block) and one
    # global layer, so vLLM runs its hybrid KV cache manager (one KV cache group per layer). Trained
    # like ``tiny`` on a third of its tokens (windows of two sliding windows); the build also checks
    # that the global layer carries tokens beyond the sliding layers' reach.
    "hybrid": {
        **_COMMON,
        "arch": "gemma3",
        "num_layers": 4,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "sliding_window": 128,
        "hidden_size": 256,
        "intermediate_size": 768,
        "train_batch": 8,
        "lr": 0.003,
        "train_steps": 200,
        "verify_long_range": True,
        "verify_prompt_dependence": True,
    },
}

#: Usual build time of the trained models on 2 free cores (the set-up message only).
_BUILD_MINUTES = {"tiny": "6-10", "hybrid": "3-6"}


def model_dir(name: str, home: Path | None = None) -> Path:
    return models_dir(home) / f"{name}-v{MODEL_VERSION}"


def _marker(name: str) -> dict[str, Any]:
    return {"name": name, "version": MODEL_VERSION, "spec": MODEL_SPECS[name]}


def model_ready(name: str, home: Path | None = None) -> bool:
    path = model_dir(name, home)
    with contextlib.suppress(OSError, ValueError):
        return bool(json.loads((path / MARKER).read_text()) == _marker(name))
    return False


def ensure_model(
    name: str = "tiny", home: Path | None = None, *, progress: Progress | None = None, timeout: float = 3600.0
) -> Path:
    """Return the directory of model ``name``, building it first if needed (minutes for ``tiny``)."""
    if name not in MODEL_SPECS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODEL_SPECS)}")
    say = progress or _stderr_progress
    home = home or kvlease_home()
    final = model_dir(name, home)
    if model_ready(name, home):
        return final
    python = ensure_venv(home, progress=say)
    with file_lock(models_dir(home) / f".{name}.lock"):
        if model_ready(name, home):
            return final
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        what = (
            f"trains on local text, usually {_BUILD_MINUTES.get(name, 'a few')} min on 2 cores"
            if MODEL_SPECS[name]["train_steps"]
            else "random weights, no training"
        )
        say(
            f"one-time set-up: building model {name!r} into {final} (no downloads; {what}); later runs reuse it"
        )
        t0 = time.monotonic()
        script = Path(__file__).with_name("_build_model.py")
        try:
            run_logged(
                [str(python), str(script), json.dumps(MODEL_SPECS[name]), str(tmp)],
                timeout=timeout,
                progress=say,
                # Threads that spin at barriers starve everything else on a small, busy machine.
                env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
            )
        except ProvisionError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        (tmp / MARKER).write_text(json.dumps(_marker(name)))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        say(
            f"one-time set-up done: model {name!r} built in {time.monotonic() - t0:.0f} s (cached in {final})"
        )
    return final
