"""The pull-or-recompute cost model (sans-IO)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kvlease_vllm._cost import CostModel, bytes_per_token, descriptors_per_token
from kvlease_vllm._verify import Reason


def model(**over: float) -> CostModel:
    args = {
        "bytes_per_token": 4096.0,
        "default_bandwidth_bps": 1e9,
        "default_prefill_tokens_per_s": 4000.0,
        "fixed_latency_s": 0.005,
    }
    args.update(over)
    return CostModel(**args)


@pytest.mark.parametrize(
    ("gain", "threshold", "over", "pull", "reason"),
    [
        (0, 64, {}, False, Reason.LOCAL_HIT),
        (-16, 64, {}, False, Reason.LOCAL_HIT),
        (48, 64, {}, False, Reason.BELOW_THRESHOLD),
        (64, 64, {}, True, Reason.PULL),  # 5 ms + 0.26 ms vs 16 ms
        (1024, 0, {}, True, Reason.PULL),
        # slow link: 1024 tokens * 4 KiB at 1 MB/s = 4.2 s vs 0.26 s recompute
        (1024, 64, {"default_bandwidth_bps": 1e6}, False, Reason.COST),
        # fixed latency dominates a small gain on a fast prefill
        (64, 0, {"default_prefill_tokens_per_s": 1e6}, False, Reason.COST),
    ],
)
def test_decide(gain: int, threshold: int, over: dict[str, float], pull: bool, reason: Reason) -> None:
    d = model(**over).decide(gain, threshold)
    assert (d.pull, d.reason, d.gain_tokens) == (pull, reason, gain)
    assert ("pull" if pull else "recompute") in d.describe()


def test_defaults_until_first_observation_then_online() -> None:
    m = model()
    assert m.bandwidth_bps == pytest.approx(1e9) and m.prefill_tokens_per_s == 4000.0
    assert m.observations == (0, 0)
    m.observe_prefill(2000, 0.2)  # 10k tok/s
    assert m.prefill_tokens_per_s == pytest.approx(10000.0)
    m.observe_pull(1000, 0.005 + 4096 * 1000 / 2e8)  # 200 MB/s after the fixed latency
    assert m.bandwidth_bps == pytest.approx(2e8)
    m.observe_prefill(1000, 0.5)  # 2k tok/s: EWMA moves towards it
    assert 2000.0 < m.prefill_tokens_per_s < 10000.0
    assert m.observations == (1, 2)


def test_observations_flip_the_decision() -> None:
    m = model(default_bandwidth_bps=1e10)
    assert m.decide(512, 64).pull
    for _ in range(20):
        m.observe_pull(512, 3.0)  # pulls turn out to be very slow
    d = m.decide(512, 64)
    assert not d.pull and d.reason is Reason.COST


@pytest.mark.parametrize(
    ("tokens", "seconds"), [(0, 1.0), (-1, 1.0), (10, 0.0), (10, float("inf")), (10, float("nan"))]
)
def test_bad_observations_are_ignored(tokens: int, seconds: float) -> None:
    m = model()
    m.observe_pull(tokens, seconds)
    m.observe_prefill(tokens, seconds)
    assert m.observations == (0, 0)


def test_bad_defaults_rejected() -> None:
    with pytest.raises(ValueError):
        model(bytes_per_token=0)


# An 8B-class GQA model: 32 layers x (K, V) x 8 KV heads x 128 dims x bf16, 16-token blocks.
LAYERS, BLOCK = 32, 16
BYTES_8B = LAYERS * 2 * 8 * 128 * 2


def gpu_default_model(prefill_tps: float | None = None) -> CostModel:
    from kvlease_vllm._config import KVLeaseConfig

    cfg = KVLeaseConfig()
    m = CostModel(
        bytes_per_token=BYTES_8B,
        descriptors_per_token=LAYERS / BLOCK,  # one region per layer, K and V packed (vLLM 0.32, 0.33)
        default_bandwidth_bps=cfg.default_pull_bandwidth_bps,
        per_descriptor_s=cfg.pull_per_descriptor_s,
        default_prefill_tokens_per_s=cfg.default_prefill_tokens_per_s,
        fixed_latency_s=cfg.pull_fixed_latency_s,
        explore_fraction=cfg.pull_explore_fraction,
    )
    if prefill_tps is not None:
        for _ in range(10):
            m.observe_prefill(int(prefill_tps), 1.0)  # learned from recomputes
    return m


@pytest.mark.parametrize("gain", [1024, 4096, 24576])
def test_8b_gqa_on_an_h200_class_prefill_pulls_with_default_settings(gain: int) -> None:
    m = gpu_default_model(prefill_tps=15_000)
    d = m.decide(gain, 64)
    assert d.pull and d.reason is Reason.PULL and not d.explored, d.describe()


def test_defaults_reproduce_the_h200_measurement() -> None:
    """benchmarks/gpu_nixl_pull.json: 196,608 descriptors (24k tokens, 64 layers, K and V as separate
    regions, as that run laid them out) in ~636 ms."""
    m = CostModel(
        bytes_per_token=64 * 2 * 8 * 128 * 2,
        descriptors_per_token=2 * 64 / 16,
        default_bandwidth_bps=750e9,
        per_descriptor_s=3.2e-6,
        default_prefill_tokens_per_s=4000.0,
        fixed_latency_s=0.005,
    )
    assert m.predict_pull_s(24_576) == pytest.approx(0.6359, rel=0.05)


def test_exploration_tries_a_small_fraction_of_cost_declines() -> None:
    m = model(default_bandwidth_bps=1e7, explore_fraction=0.1)  # pulls look slower than recompute
    decisions = [m.decide(1024, 64) for _ in range(30)]
    explored = [d for d in decisions if d.pull]
    assert len(explored) == 3 and all(d.explored and d.reason is Reason.PULL for d in explored)
    assert "exploring" in explored[0].describe()
    assert all(d.reason is Reason.COST for d in decisions if not d.pull)


def test_exploration_corrects_a_wrong_default() -> None:
    m = model(default_bandwidth_bps=1e7, explore_fraction=0.5)
    assert not m.decide(1024, 64).pull
    assert m.decide(1024, 64).explored  # tried ...
    m.observe_pull(1024, 0.005 + 0.01)  # ... and fast in reality
    d = m.decide(1024, 64)
    assert d.pull and not d.explored


def test_no_exploration_of_hopeless_pulls() -> None:
    m = model(default_bandwidth_bps=1e5, explore_fraction=1.0)  # ~40 s pull vs 0.26 s recompute
    assert not any(m.decide(1024, 64).pull for _ in range(5))


def test_layout_helpers_from_a_kv_cache_config() -> None:
    blocks = 1000
    spec = _Spec(BLOCK, num_kv_heads=8, head_size=128)
    cfg = _KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[_Tensor(size=BYTES_8B * BLOCK * blocks)],
        kv_cache_groups=[_Group([f"l{i}" for i in range(LAYERS)], spec)],
        kv_cache_layout="LBHNC",
    )
    assert descriptors_per_token(cfg, BLOCK) == LAYERS / BLOCK  # one region per layer
    assert bytes_per_token(cfg, BLOCK) == BYTES_8B
    assert descriptors_per_token(object(), BLOCK) == 32 / BLOCK  # unknown layouts: a guess
    assert bytes_per_token(object(), BLOCK) == 131072.0


# ---- a vLLM 0.33-shaped KVCacheConfig (the fields of v1/kv_cache_interface.py; no vLLM here) -----
@dataclass(frozen=True)
class _Spec:  # AttentionSpec: a page holds K and V of every head for block_size tokens
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int = 2

    @property
    def page_size_bytes(self) -> int:
        return self.num_kv_heads * self.block_size * 2 * self.head_size * self.dtype_bytes


@dataclass(frozen=True)
class _UniformSpecs:  # UniformTypeKVCacheSpecs: one group, layers of different shapes
    block_size: int
    kv_cache_specs: dict[str, _Spec]

    @property
    def page_size_bytes(self) -> int:
        return sum(s.page_size_bytes for s in self.kv_cache_specs.values())


@dataclass
class _Group:
    layer_names: list[str]
    kv_cache_spec: Any
    enable_kv_transfer: bool = True


@dataclass
class _Tensor:  # KVCacheTensor: ``size`` is "total size of the backing allocation"
    size: int
    layers: list[str] = field(default_factory=list)


@dataclass
class _KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: list[_Tensor]
    kv_cache_groups: list[_Group]
    kv_cache_layout: str | None = None


def test_bytes_per_token_of_a_multi_spec_model_counts_each_page_once() -> None:
    """Two groups, one of them with two layer shapes: vLLM 0.33's planner emits one tensor per
    (group, spec), each with ``size`` = the whole backing allocation (v1/core/kv_cache_planning.py).
    A pulled token moves every transferable group's page once; summing the sizes counted the
    backing three times."""
    blocks = 1000
    wide, narrow = _Spec(BLOCK, 8, 128), _Spec(BLOCK, 8, 64)
    full = _Group(
        ["l0", "l1", "l2", "l3"],
        _UniformSpecs(BLOCK, {"l0": wide, "l1": wide, "l2": narrow, "l3": narrow}),
    )
    window = _Group(["s0", "s1"], wide)
    per_block = max(full.kv_cache_spec.page_size_bytes, 2 * wide.page_size_bytes)  # groups alias
    backing = per_block * blocks
    cfg = _KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[
            _Tensor(backing, ["l0", "l1"]),
            _Tensor(backing, ["l2", "l3"]),
            _Tensor(backing, ["s0", "s1"]),
        ],
        kv_cache_groups=[full, window],
        kv_cache_layout="LBHNC",
    )
    truth = (2 * wide.page_size_bytes + 2 * narrow.page_size_bytes + 2 * wide.page_size_bytes) / BLOCK
    assert bytes_per_token(cfg, BLOCK) == truth
    assert sum(t.size for t in cfg.kv_cache_tensors) / blocks / BLOCK > 1.4 * truth  # the old sum
    assert descriptors_per_token(cfg, BLOCK) == 6 / BLOCK  # six layers, one region each
    # a group that does not take part in transfers moves nothing
    cfg.kv_cache_groups[1].enable_kv_transfer = False
    assert bytes_per_token(cfg, BLOCK) == (2 * wide.page_size_bytes + 2 * narrow.page_size_bytes) / BLOCK
    assert descriptors_per_token(cfg, BLOCK) == 4 / BLOCK
