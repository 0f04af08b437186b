"""``KVLeaseConnector``: vLLM's pull ``NixlConnector`` with renewable leases and verified pulls.

Load it with ``"kv_connector": "KVLeaseConnector", "kv_connector_module_path": "kvlease_vllm.connector"``.
The workers are upstream's (renewals and releases reach their expiry sweep as new deadlines in
upstream's own ``reqs_to_send`` metadata), subclassed for staged pulls (``kvlease_vllm._worker``,
unless ``kvlease.staging`` is off). D holds a leased request's blocks with its own block-pool reference (``kvlease.own_block_refs``), so the finished
request leaves vLLM's scheduler at once and an idle engine stops stepping while leases are held;
the workers' ``finished_sending`` for those ids drops the reference and never reaches the
scheduler's own loop.

Overridden (signatures pinned by a test against the sources of vLLM 0.32 and 0.33):
- connector: ``__init__`` (config checks that refuse at start-up; the staging worker),
  ``set_xfer_handshake_metadata_pp_aware`` (D: the workers' staging ports), ``bind_gpu_block_pool``,
  ``has_pending_block_frees``, ``supports_sleep_mode`` (0.33: refused, sleep discards leased KV),
  ``get_transfer_results`` (D: a read of P waits for P's post-read check, ``_sendcheck``),
  ``handle_preemptions`` (D's workers take the host arena's orders before a step touches a block);
- scheduler (``kvlease_vllm._scheduler``): ``get_num_new_matched_tokens`` (P: verify, decide, claim under the tenant tag of P's
  request), ``update_state_after_alloc`` (P: trim to the last ask's local hit + the final external
  count), ``request_finished`` (D: a lease tagged with the router's tenant tag of D's request + ``kvlease``
  object, placed in HBM or the host arena), ``build_connector_meta`` (lease deadlines and the
  arena's orders to workers, pressure relief, re-claims),
  ``update_connector_output`` (observations, freed leases), ``shutdown``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvlease_vllm import _progress, _sendcheck, _staging
from kvlease_vllm._compat import (
    PLATFORM_DEVICE_TYPE,
    KVConnectorRole,
    NixlConnector,
    init_logger,
    vllm_envs,
)
from kvlease_vllm._config import (
    BIDIR_KEY,
    check_free_ordering,
    check_model_runner,
    check_platform,
    normalize_extra_config,
    recompute_policy,
)
from kvlease_vllm._scheduler import KVLeaseScheduler

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.kv_cache_interface import KVCacheConfig

# a child of "vllm" so vLLM's log handler and level apply to our decision lines
logger = init_logger("vllm.kvlease.connector")

__all__ = ["KVLeaseConnector", "KVLeaseScheduler"]

_PROCESSED = "_remote_blocks_processed"  # upstream's marker: the handle was used once


class KVLeaseConnector(NixlConnector):  # type: ignore[misc,valid-type]
    """``NixlConnector`` (pull) with kvlease leases, verified pulls and a control endpoint."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        cfg, warnings = normalize_extra_config(ktc.kv_connector_extra_config)
        for w in warnings:
            logger.warning("kvlease: %s", w)
        bidirectional = bool(ktc.kv_connector_extra_config.get(BIDIR_KEY, False))
        check_platform(
            device_type=PLATFORM_DEVICE_TYPE,
            kv_buffer_device=ktc.kv_buffer_device,
            bidirectional=bidirectional,
        )
        check_model_runner(
            cfg, kv_role=ktc.kv_role, v2_model_runner=bool(getattr(vllm_config, "use_v2_model_runner", False))
        )
        check_free_ordering(
            kv_role=ktc.kv_role,
            bidirectional=bidirectional,
            concurrent_batches=int(vllm_config.max_concurrent_batches),
            async_scheduling=bool(vllm_config.scheduler_config.async_scheduling),
        )
        policy, warning = recompute_policy(ktc.kv_load_failure_policy, ktc.kv_role)
        if warning and role == KVConnectorRole.SCHEDULER:
            logger.warning("kvlease: %s", warning)
        ktc.kv_load_failure_policy = policy
        self._read_checks = _sendcheck.ReadChecks(cfg.secret(), _sendcheck.CHECK_TIMEOUT_S)  # D's workers
        if role == KVConnectorRole.WORKER:  # before upstream's worker creates its NIXL agent
            _progress.configure(cfg.nixl_progress_delay_us)
        if role == KVConnectorRole.WORKER and cfg.staging != _staging.OFF:
            # upstream's base connector, then our worker in place of upstream's pull worker
            super(NixlConnector, self).__init__(vllm_config, role, kv_cache_config)
            from kvlease_vllm._worker import KVLeaseWorker  # torch: only in the worker role

            self.connector_scheduler = None
            self.connector_worker = KVLeaseWorker(vllm_config, self.engine_id, kv_cache_config, cfg)
            return
        super().__init__(vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KVLeaseScheduler(vllm_config, self.engine_id, kv_cache_config, cfg)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """Refused (vLLM 0.33 asks; 0.32 has no such hook): sleep discards the KV cache while D
        still advertises leases on it, and P would read freed or foreign blocks."""
        return False

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """D: the workers' staging ports, taken off their handshake payloads before upstream
        serves them (P's upstream reads exactly upstream's payload)."""
        ports, clean = _staging.take_ports(metadata, vllm_envs.VLLM_NIXL_SIDE_CHANNEL_HOST)
        if isinstance(self.connector_scheduler, KVLeaseScheduler):
            self.connector_scheduler.staging_ports = ports
        super().set_xfer_handshake_metadata_pp_aware(clean)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """D: a finished read of P is reported once P confirms it held the blocks (``_sendcheck``)."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        return self._read_checks.settle(super().get_transfer_results(finished_req_ids), meta)

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        super().bind_gpu_block_pool(gpu_block_pool)
        if isinstance(self.connector_scheduler, KVLeaseScheduler):
            self.connector_scheduler.block_pool = gpu_block_pool

    def has_pending_block_frees(self) -> bool:
        """Allocation failed: release leases now rather than let the scheduler preempt a request."""
        sched = self.connector_scheduler
        if not isinstance(sched, KVLeaseScheduler):
            return False
        # Released leases are freed by the workers' sweep in this very step, so the request that
        # could not allocate waits one step instead of evicting a running request.
        return bool(sched._relieve_pressure(emergency=True))

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """vLLM calls it in every step, before the step zeroes, copies or writes any block: D's
        workers take the host arena's orders here (``_worker_arena``)."""
        super().handle_preemptions(kv_connector_metadata)
        worker = self.connector_worker
        if worker is not None and hasattr(worker, "_kvl_before_step"):
            worker._kvl_before_step(kv_connector_metadata)
