"""What the connector checks when a node of a deployment example starts, shared by the deploy-script
and Kubernetes tests."""

from __future__ import annotations

from typing import Any

from kvlease_vllm._config import KVLeaseConfig, check_free_ordering, check_staging_memory

#: The GPU the examples target and the model they size for: an H200 and a 70B-class model
#: (80 layers x 8 KV heads x 128 x 2 bytes, K and V: 320 KiB of KV per token).
H200_BYTES = 140 << 30
PER_TOKEN_70B = 80 * 2 * 8 * 128 * 2


def check_connector_start(
    role: str,
    extra: dict[str, Any],
    cfg: KVLeaseConfig,
    *,
    async_scheduling: bool,
    gpu_memory_utilization: float | None = None,
) -> None:
    """The free ordering of ``role``'s pulls and, on a GPU (``gpu_memory_utilization`` given), the
    staging buffer's memory on an H200 serving a 70B-class model."""
    check_free_ordering(
        kv_role=role,
        bidirectional=extra["bidirectional_kv_xfer"],
        concurrent_batches=2 if async_scheduling else 1,
        async_scheduling=async_scheduling,
    )
    if gpu_memory_utilization is None:
        return
    check_staging_memory(
        staging_bytes=cfg.staging_max_tokens * PER_TOKEN_70B,
        staging_tokens=cfg.staging_max_tokens,
        total_bytes=H200_BYTES,
        free_bytes=int(H200_BYTES * (1 - gpu_memory_utilization)),
        gpu_memory_utilization=gpu_memory_utilization,
    )
