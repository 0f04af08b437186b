"""The cluster simulator's inputs: model classes and the costs, each figure with where it comes from.

Every figure the simulator uses is a :class:`Figure` carrying its value, its unit and its *source*
(a measurement of this project, a stated assumption, or the user's override), so the report can name
each one. :func:`cluster_config` turns a class preset and the user's overrides into a
:class:`ClusterConfig` (pure: no files, no clocks).

The measured figures (one H200, NIXL 1.5.1, the 32B-class layout of 64 layers x 8 KV heads x 128,
bf16, 16-token blocks: 262,144 bytes a token):

- staged device pull: 5.3 ms at 1k tokens, 18.1 ms at 24k tokens (``benchmarks/RESULTS.md``, "GPU
  pull on one H200"); the simulator uses the straight line through them: a fixed 4.8 ms plus
  484 GB/s, and never faster than the NIC;
- per-block device READ: 635.9 ms at 24k tokens, 196,608 descriptors (same table): 3.23 us a
  descriptor (one per layer, K or V, and block);
- host arena pull, the path D runs: D promotes the lease into its staging buffer (pinned H2D), P
  reads it with one READ and scatters it: 130.7 ms for 6 GiB end to end (49 GB/s;
  ``gpu_nixl_pull.py --arena``, 2026-12-04); a NIXL READ of the pinned host memory itself ran
  about 0.9 GB/s with UCX's default transports (7,046 ms for 6 GiB, 2026-12-03);
- demotion through D's worker code: 120.5 ms for 6 GiB (53 GB/s, the same run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Final

from kvlease._analyze._plan import DEFAULT_BLOCK_SIZE, DTYPE_BYTES, PRESETS, ModelKV

GB: Final = 1e9

#: H200 HBM per GPU (NVIDIA's datasheet), bytes.
H200_HBM: Final = 141e9
#: vLLM's default ``gpu_memory_utilization``.
GPU_MEMORY_UTILIZATION: Final = 0.9
#: H200 dense bf16 tensor throughput (NVIDIA's datasheet), FLOP/s.
H200_BF16_FLOPS: Final = 989e12
#: The share of it prefill is assumed to reach (model FLOPs utilisation).
PREFILL_MFU: Final = 0.4

RESULTS: Final = "benchmarks/RESULTS.md"
HOST_NOTES: Final = "H200 host-memory runs, 2026-12-03, NIXL 1.5.1 / UCX 1.23"
ARENA_NOTES: Final = "H200, 2026-12-04, gpu_nixl_pull.py --arena"

#: Staged device pull (RESULTS.md, GPU pull on one H200, 32B-class layout): (tokens, seconds).
STAGED_1K: Final = (1024, 5.309e-3)
STAGED_24K: Final = (24576, 18.054e-3)
MEASURED_BYTES_PER_TOKEN: Final = 262_144
#: Per-block READ at 24k tokens: 635.9 ms over 196,608 descriptors.
PER_BLOCK_S_PER_DESCRIPTOR: Final = 635.858e-3 / 196_608
#: A pull from D's host arena by the path kvlease runs (D promotes into its staging buffer, P READs
#: it and scatters): 6 GiB in 130.7 ms end to end (RESULTS.md, "Pulls from D's host arena").
HOST_PULL_GBPS: Final = 6 * 2**30 / 130.7e-3 / 1e9
#: The path not taken: a NIXL READ of another process's pinned host memory (UCX defaults).
HOST_PULL_NIXL_GBPS: Final = 0.9
#: Demotion through D's worker code: 6 GiB in 120.5 ms (same runs).
DEMOTE_GBPS: Final = 6 * 2**30 / 120.5e-3 / 1e9
NIC_GBPS: Final = 50.0
#: Host DRAM per GPU when not given: a 2 TB, 8-GPU H200 host.
HOST_BYTES_PER_GPU: Final = 250e9


def _staged_line() -> tuple[float, float]:
    """(fixed seconds, bytes/s) of the line through the two staged-pull measurements."""
    (t1, s1), (t2, s2) = STAGED_1K, STAGED_24K
    rate = (t2 - t1) * MEASURED_BYTES_PER_TOKEN / (s2 - s1)
    return s1 - t1 * MEASURED_BYTES_PER_TOKEN / rate, rate


STAGED_FIXED_S, STAGED_BYTES_PER_S = _staged_line()


def describe(k: ModelKV) -> str:
    """``name: layers x KV heads x head dim x 2 (K, V) x dtype bytes = bytes a token``."""
    return (
        f"{k.name + ': ' if k.name else ''}{k.layers} layers x {k.kv_heads} KV heads x {k.head_dim} x 2 "
        f"(K, V) x {DTYPE_BYTES[k.dtype]} B ({k.dtype}) = {k.bytes_per_token:,} B/token"
    )


class ClusterInputError(ValueError):
    """A cluster simulation input is out of range or missing (the message names it)."""


@dataclass(frozen=True)
class Figure:
    """One input of the simulation: its value, unit and where it comes from."""

    name: str
    value: float
    unit: str
    source: str


@dataclass(frozen=True)
class ClassPreset:
    """A model class: its KV shape (``kv``), its size and the GPUs of one node (tensor parallel)."""

    name: str
    kv: ModelKV
    params: float  # parameters, for the weights (bf16) and the prefill FLOPs
    gpus: int
    decode_tps: float  # tokens/s one sequence decodes at (assumed)

    @property
    def prefill_tps_per_gpu(self) -> float:
        """``PREFILL_MFU`` of the H200's bf16 FLOP/s at ``2 x params`` FLOPs a token."""
        return H200_BF16_FLOPS * PREFILL_MFU / (2 * self.params)

    @property
    def kv_bytes_per_node(self) -> float:
        """``0.9 x HBM x gpus`` less the bf16 weights: vLLM's KV cache on one node."""
        return GPU_MEMORY_UTILIZATION * H200_HBM * self.gpus - 2 * self.params


CLASS_PRESETS: Final[dict[str, ClassPreset]] = {
    p.name: p
    for p in (
        ClassPreset("8b", PRESETS["llama-3.1-8b"], 8.03e9, 1, 80.0),
        ClassPreset("32b", PRESETS["qwen2.5-32b"], 32.8e9, 1, 40.0),
        ClassPreset("70b", PRESETS["llama-3.1-70b"], 70.6e9, 2, 30.0),
    )
}
#: The named models of the classes resolve to their class.
CLASS_ALIASES: Final = {p.kv.name: p.name for p in CLASS_PRESETS.values()}


@dataclass(frozen=True)
class ClusterConfig:
    """Everything one simulation needs; rates in bytes/s or tokens/s, sizes in bytes, times in s."""

    model: str
    bytes_per_token: int
    p_nodes: int
    d_nodes: int
    prefill_tps: Figure  # per P node
    decode_tps: Figure  # per sequence
    hbm_kv: Figure  # vLLM's KV cache per node (P and D alike)
    host_bytes: Figure  # host arena per D node
    p_cache: Figure  # P's prefix cache per P node (0: off)
    nic: Figure  # per node
    device_pull_fixed: Figure
    device_pull_rate: Figure
    host_pull_rate: Figure
    demote_rate: Figure
    per_block_s: Figure | None = None  # per descriptor: the per-block READ instead of the staged pull
    ttl: float = 480.0
    max_idle: float = 1800.0
    retained_fraction: float = 0.5
    release_on_close: bool = False
    block_size: int = DEFAULT_BLOCK_SIZE
    layers: int = 0  # for the per-block descriptor count
    ttft_target: float = 2.0
    notes: tuple[str, ...] = field(default=())

    def figures(self) -> tuple[Figure, ...]:
        out = [self.prefill_tps, self.decode_tps, self.hbm_kv, self.host_bytes, self.p_cache, self.nic]
        out += [self.device_pull_fixed, self.device_pull_rate, self.host_pull_rate, self.demote_rate]
        return tuple(out) + ((self.per_block_s,) if self.per_block_s else ())

    def device_pull_s(self, tokens: int) -> float:
        """A pull from D's HBM (also P's KV to D): staged (fixed + bytes at min(rate, NIC)), or per
        block (a descriptor per layer, K/V and block; never faster than the NIC)."""
        b = tokens * self.bytes_per_token
        if self.per_block_s is not None:
            desc = 2 * self.layers * -(-tokens // self.block_size)
            return max(desc * self.per_block_s.value, b / self.nic.value)
        return self.device_pull_fixed.value + b / min(self.device_pull_rate.value, self.nic.value)

    def host_pull_s(self, tokens: int) -> float:
        return tokens * self.bytes_per_token / min(self.host_pull_rate.value, self.nic.value)


def _given(name: str, value: float | None, unit: str, default: float, source: str, flag: str) -> Figure:
    if value is None:
        return Figure(name, default, unit, f"{source}; override with {flag}")
    if not math.isfinite(value) or value < 0:
        raise ClusterInputError(f"{flag} must be a finite number >= 0, got {value}")
    return Figure(name, value, unit, f"given ({flag})")


def cluster_config(
    model: str | None,
    *,
    p_nodes: int = 1,
    d_nodes: int = 1,
    kv: ModelKV | None = None,
    gpus: int | None = None,
    prefill_tps: float | None = None,
    decode_tps: float | None = None,
    hbm_kv: float | None = None,
    host_bytes: float | None = None,
    p_cache: float | None = None,
    nic_gbps: float | None = None,
    host_pull_gbps: float | None = None,
    demote_gbps: float | None = None,
    per_block: bool = False,
    **policy: float | bool,
) -> ClusterConfig:
    """A :class:`ClusterConfig` from a class preset (``8b``, ``32b``, ``70b`` or their models'
    names) or an explicit ``kv`` shape, with each default named by its source.

    With ``kv`` and no preset, ``prefill_tps``, ``decode_tps`` and ``hbm_kv`` are required.
    ``policy`` passes ``ttl``, ``max_idle``, ``retained_fraction``, ``release_on_close``,
    ``block_size`` and ``ttft_target`` through.
    """
    if p_nodes < 1 or d_nodes < 1:
        raise ClusterInputError(f"P and D node counts must be >= 1, got {p_nodes} and {d_nodes}")
    preset = None
    if model is not None:
        key = CLASS_ALIASES.get(model.lower(), model.lower().removesuffix("-class"))
        preset = CLASS_PRESETS.get(key)
        if preset is None:
            raise ClusterInputError(
                f"no cluster preset {model!r}; classes: {', '.join(CLASS_PRESETS)} "
                f"(or {', '.join(CLASS_ALIASES)}); for another model give its KV shape with "
                "--prefill-tps, --decode-tps and --hbm-kv"
            )
        kv = kv or preset.kv
    if kv is None:
        raise ClusterInputError("give a model class (8b, 32b, 70b) or the model's KV shape")
    if preset is None:
        missing = [f for f, v in (("--prefill-tps", prefill_tps), ("--decode-tps", decode_tps),
                                  ("--hbm-kv", hbm_kv)) if v is None]  # fmt: skip
        if missing:
            raise ClusterInputError(f"without a class preset give {', '.join(missing)}")
    n = gpus or (preset.gpus if preset else 1)
    if n < 1:
        raise ClusterInputError(f"GPUs per node must be >= 1, got {n}")
    assumed_tps = (
        f"assumed: {PREFILL_MFU:.0%} of the H200's {H200_BF16_FLOPS / 1e12:.0f} TFLOP/s bf16 at 2 x "
        f"{preset.params / 1e9:.1f}B params FLOPs a token, x {n} GPU"
        if preset
        else ""
    )
    kv_default = (
        f"{GPU_MEMORY_UTILIZATION} x {H200_HBM / GB:.0f} GB H200 HBM x {n} GPU less "
        f"{2 * preset.params / GB:.0f} GB bf16 weights"
        if preset
        else ""
    )
    p = preset
    cfg = ClusterConfig(
        model=f"{p.name}-class, {describe(kv)}" if p else describe(kv),
        bytes_per_token=kv.bytes_per_token,
        p_nodes=p_nodes,
        d_nodes=d_nodes,
        prefill_tps=_given("prefill rate per P node", prefill_tps, "tokens/s",
                           p.prefill_tps_per_gpu * n if p else 0.0, assumed_tps, "--prefill-tps"),
        decode_tps=_given("decode rate per sequence", decode_tps, "tokens/s", p.decode_tps if p else 0.0,
                          "assumed", "--decode-tps"),
        hbm_kv=_given("KV cache per node (HBM)", hbm_kv, "B", p.kv_bytes_per_node if p else 0.0,
                      kv_default, "--hbm-kv"),
        host_bytes=_given("host arena per D node", host_bytes, "B", HOST_BYTES_PER_GPU * n,
                          f"assumed: {HOST_BYTES_PER_GPU / GB:.0f} GB DRAM per GPU (a 2 TB 8-GPU host)",
                          "--host-mem"),
        p_cache=Figure("P prefix cache per P node", 0.0, "B", ""),  # set below
        nic=_given("NIC per node", None if nic_gbps is None else nic_gbps * GB * n, "B/s", NIC_GBPS * GB * n,
                   f"assumed: {NIC_GBPS:.0f} GB/s per GPU (EFA/InfiniBand class) x {n} GPU", "--nic-gbps"),
        device_pull_fixed=Figure("device pull, fixed cost", STAGED_FIXED_S, "s",
                                 f"{RESULTS}: staged pull 5.3 ms at 1k, 18.1 ms at 24k tokens (H200, "
                                 "32B layout), the line through them"),
        device_pull_rate=Figure("device pull rate", STAGED_BYTES_PER_S, "B/s",
                                f"{RESULTS}: same line's slope; bounded by the NIC"),
        host_pull_rate=_given("host arena pull rate", None if host_pull_gbps is None else host_pull_gbps * GB,
                              "B/s", HOST_PULL_GBPS * GB,
                              f"measured ({RESULTS}): D promotes into its staging buffer, one READ, P scatters: 6 GiB "
                              f"in 130.7 ms ({ARENA_NOTES}); a NIXL READ of the host memory itself ran "
                              f"{HOST_PULL_NIXL_GBPS} GB/s ({HOST_NOTES})", "--host-pull-gbps"),
        demote_rate=_given("demotion rate (D2H gather)", None if demote_gbps is None else demote_gbps * GB,
                           "B/s", DEMOTE_GBPS * GB, f"measured ({RESULTS}): D's worker gathers into its pinned arena, "
                           f"6 GiB in 120.5 ms ({ARENA_NOTES})", "--demote-gbps"),
        per_block_s=Figure("per-block READ, per descriptor", PER_BLOCK_S_PER_DESCRIPTOR, "s",
                           f"{RESULTS}: 635.9 ms for 196,608 descriptors at 24k tokens") if per_block else None,
        layers=kv.layers,
    )  # fmt: skip
    cache = _given("P prefix cache per P node", p_cache, "B", cfg.hbm_kv.value,
                   "P's whole KV cache (prefill holds it only while it runs)", "--p-cache")  # fmt: skip
    cfg = replace(cfg, p_cache=cache, **policy)  # type: ignore[arg-type]
    check(cfg)
    return cfg


def check(c: ClusterConfig) -> None:
    """Typed errors for values the simulation cannot run with."""
    for f in (c.prefill_tps, c.decode_tps, c.hbm_kv, c.nic, c.host_pull_rate, c.demote_rate):
        if not f.value > 0:
            raise ClusterInputError(f"{f.name} must be > 0, got {f.value} ({f.source})")
    if not 0.0 <= c.retained_fraction <= 1.0:
        raise ClusterInputError(f"the retained fraction must be within 0..1, got {c.retained_fraction}")
    if min(c.ttl, c.max_idle) < 0 or c.ttft_target <= 0 or c.block_size < 1:
        raise ClusterInputError("ttl and max_idle must be >= 0, the TTFT target > 0, block_size >= 1")


__all__ = [
    "CLASS_PRESETS",
    "ClassPreset",
    "ClusterConfig",
    "ClusterInputError",
    "Figure",
    "check",
    "cluster_config",
]
