"""The shape of a pull, and which UCX transport a READ will take (sans-IO, observability only).

vLLM's NIXL worker posts one descriptor per (registered KV region, block): at 24k tokens of a
64-layer model that is 196,608 descriptors, each costing ~3 µs to post (measured on an H200; see
``benchmarks/gpu_nixl_pull.json``). NIXL merges descriptors whose addresses are adjacent on both
sides, so what a pull costs depends on how many contiguous runs of block ids P's and D's lists
hold. :func:`pull_shape` counts them; :func:`transport_advice` says, from the configuration alone,
whether a READ will run zero-copy or is known to fall back to UCX's TCP emulation.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PullShape", "contiguous_runs", "kv_regions", "pull_shape", "transport_advice"]


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
    ``regions``: the registered KV tensors of the model (layers x (K, V)), shared evenly by the
    groups. Runs are summed over the groups.
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


def kv_regions(kv_cache_config: Any) -> int:
    """Registered KV tensors of the model, as vLLM's worker splits them: layers x (K, V)."""
    try:
        layers = sum(len(g.layer_names) for g in kv_cache_config.kv_cache_groups)
    except Exception:  # layouts we do not know: a 32-layer model (as _cost.descriptors_per_token)
        layers = 32
    return 2 * max(layers, 1)


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
