"""The shape of a pull, and which UCX transport a READ will take (sans-IO, observability only).

vLLM's NIXL worker posts one descriptor per (registered KV region, block): at 24k tokens of a
64-layer model that is 98,304 descriptors (one region per layer, K and V packed), each costing a
few µs to post (~3 µs measured on an H200 for half-page descriptors; see
``benchmarks/gpu_nixl_pull.json``). NIXL merges descriptors whose addresses are adjacent on both
sides, so what a pull costs depends on how many contiguous runs of block ids P's and D's lists
hold. :func:`pull_shape` counts them; :func:`transport_advice` says, from the configuration alone,
whether a READ will run zero-copy or is known to fall back to UCX's TCP emulation.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

__all__ = [
    "PullShape",
    "contiguous_runs",
    "kv_regions",
    "pull_shape",
    "transfer_groups",
    "transport_advice",
]


def contiguous_runs(ids: Sequence[int]) -> int:
    """Runs of consecutive block ids (each next id one more than the last): ``[4, 5, 6, 9]`` -> 2."""
    runs, last = 0, None
    for i in ids:
        if last is None or i != last + 1:
            runs += 1
        last = i
    return runs


@dataclass(frozen=True)
class PullShape:
    """What one pull asks of NIXL: descriptors vLLM's worker posts, and runs on each side."""

    descriptors: int
    local_runs: int  # P's destination block ids
    remote_runs: int  # D's source block ids

    def describe(self, regions: int | None = None) -> str:
        of = f" ({regions} KV regions x blocks)" if regions else ""
        return f"{self.descriptors} descriptors{of}, block-id runs P {self.local_runs} / D {self.remote_runs}"


def pull_shape(
    local_ids: Sequence[Sequence[int]], remote_ids: Sequence[Sequence[int]], regions: int
) -> PullShape:
    """The shape of a pull of ``remote_ids`` into ``local_ids`` (one list per KV cache group).

    Upstream's worker pairs each group's lists from the end (D's list may also cover P's locally
    cached prefix), so only the last ``min(len(local), len(remote))`` ids of each side are read.
    ``regions``: the registered KV regions of the model (:func:`kv_regions`), shared evenly by
    the groups. Runs are summed over the groups.
    """
    groups = max(len(local_ids), len(remote_ids), 1)
    per_group = max(regions // groups, 1) if regions > 0 else 0
    descriptors = local_runs = remote_runs = 0
    for local, remote in zip(local_ids, remote_ids):
        n = min(len(local), len(remote))
        if n == 0:
            continue
        descriptors += per_group * n
        local_runs += contiguous_runs(local[len(local) - n :])
        remote_runs += contiguous_runs(remote[len(remote) - n :])
    return PullShape(descriptors, local_runs, remote_runs)


#: vLLM's ``KVCacheLayout`` names (``[L, B, H, N, C]`` in memory order; the same in 0.32 and 0.33)
#: where every layer's page is one run per block: one region per layer.
LAYER_REGION_LAYOUTS: Final = frozenset({"LBHNC", "LBNHC", "BLHNC"})
#: Block-outermost layouts whose layer pages are not contiguous: upstream registers each block's
#: whole row once, de-duplicated by address across layers and groups, so one region in all.
WHOLE_ROW_LAYOUTS: Final = frozenset({"BLNHC", "BHLNC"})
#: Head-major per layer: upstream registers one region per KV head (a segment of the layer's view).
HEAD_SEGMENTED_LAYOUTS: Final = frozenset({"LHBNC"})
_UNKNOWN_LAYERS: Final = 32  # layouts we cannot read: a 32-layer model


def transfer_groups(kv_cache_config: Any) -> list[Any]:
    """The KV cache groups a pull moves (vLLM's ``enable_kv_transfer``; every group before it)."""
    return [g for g in kv_cache_config.kv_cache_groups if getattr(g, "enable_kv_transfer", True)]


def kv_regions(kv_cache_config: Any) -> int:
    """NIXL regions vLLM's worker registers for this KV cache, as its ``register_kv_caches`` does.

    vLLM 0.32 and 0.33 pack K and V into the content dim of one page, so an attention layer whose
    pages lie one per block (``LBHNC``, which vLLM's NIXL connector asks for, ``LBNHC``,
    ``BLHNC``) is ONE region whose block is the whole page; a head-major layout (``LHBNC``) is one
    region per KV head of the layer; a block-outermost layout without contiguous pages is one
    whole-row region in all. The layout is the one vLLM's engine core resolved
    (``kv_cache_config.kv_cache_layout``); unknown or unset counts as one region per layer.
    """
    try:
        groups = transfer_groups(kv_cache_config)
        layers = sum(len(g.layer_names) for g in groups)
    except Exception:  # a config we cannot read: a 32-layer model (as _cost.bytes_per_token)
        return _UNKNOWN_LAYERS
    layout = str(getattr(kv_cache_config, "kv_cache_layout", None) or "").upper()
    if layout in WHOLE_ROW_LAYOUTS:
        return 1
    if layout in HEAD_SEGMENTED_LAYOUTS:
        return max(sum(len(g.layer_names) * _kv_heads(g.kv_cache_spec) for g in groups), 1)
    return max(layers, 1)


def _kv_heads(spec: Any) -> int:
    heads = getattr(spec, "num_kv_heads", None)
    return heads if isinstance(heads, int) and heads > 0 else 1


_ON = frozenset({"on", "yes", "y", "1"})  # UCX's spellings of a true boolean
_ZERO_COPY_TLS = ("cuda_ipc", "rc", "dc")  # rc_x, dc_mlx5, ... by prefix
_ZERO_COPY_ALIASES = frozenset({"all", "cuda", "ib"})


def _tls_reads_zero_copy(tls: str) -> bool:
    """``UCX_TLS`` keeps a zero-copy READ transport: a list naming cuda_ipc, rc or dc (or an alias
    that includes them), or an exclusion list (``^...``) that does not exclude cuda_ipc."""
    exclude = tls.startswith("^")
    names = {t.strip().lower() for t in tls.lstrip("^").split(",") if t.strip()}
    if exclude:
        return not names & {"cuda_ipc", "cuda"}
    return bool(names & _ZERO_COPY_ALIASES) or any(n.startswith(_ZERO_COPY_TLS) for n in names)


def transport_advice(platform: str, env: Mapping[str, str], kv_buffer_device: str | None) -> tuple[int, str]:
    """``(logging level, message)``: the transport a READ to the peer will use, as far as the
    configuration tells, or a warning for a configuration known to fall back to TCP emulation.

    ``platform``: vLLM's device type (``cuda``, ``cpu``, ...); ``env``: the process environment
    (UCX reads ``UCX_*``, libfabric ``FI_*``); ``kv_buffer_device``: vLLM's ``kv_buffer_device``.
    """
    if platform == "cpu":
        return logging.INFO, "host memory (CPU platform)"
    if (kv_buffer_device or "").lower() == "cpu":
        return logging.WARNING, (
            "host buffer (kv_buffer_device=cpu): KV is staged through host memory and read over "
            "UCX's host transports (TCP unless RDMA is set up); expect far below the GPU rate"
        )
    if platform != "cuda":
        return logging.INFO, f"{platform or 'unknown'} platform: transport chosen by NIXL (not checked)"
    provider = env.get("FI_PROVIDER", "").strip()
    tls = env.get("UCX_TLS", "").strip()
    if tls and not _tls_reads_zero_copy(tls):
        return logging.WARNING, (
            f"UCX_TLS={tls} leaves out cuda_ipc, rc and dc: a READ falls back to TCP emulation "
            "(~0.4 GB/s); include cuda_ipc (same host) or rc/dc (InfiniBand)"
        )
    zcopy = env.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "").strip().lower()
    if zcopy not in _ON:
        return logging.WARNING, (
            "UCX_CUDA_IPC_ENABLE_GET_ZCOPY is not on: where UCX detects no NVLink a same-host READ "
            "runs as TCP emulation (~0.4 GB/s); set UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on "
            "(UCX_PROTO_INFO=y prints the protocol each READ uses)"
        )
    via = f"UCX_TLS={tls}" if tls else "UCX default transports"
    fabric = f", FI_PROVIDER={provider}" if provider else ""
    return logging.INFO, f"cuda_ipc zero-copy on the same host, rc/dc across hosts ({via}{fabric})"
