"""``KVLeaseScheduler``: the scheduler side of :class:`~kvlease_vllm.connector.KVLeaseConnector`.

P: verify D's handle against the prompt, decide pull or recompute, claim the lease on D, trim the
read to the scheduler's final count. D: make a finished request's lease (its handle, its block
references, its placement: HBM or the host arena, ``_placement``), carry renewals, releases and the
host arena's orders to the workers, relieve pressure. Its overrides are pinned by a test against
the sources of vLLM 0.32 and 0.33 (see the connector module).
"""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvlease import __version__ as KVLEASE_VERSION
from kvlease.protocol import KV, ControlInfo, Role, tenant_tag_of
from kvlease.protocol._handle import PLACEMENT_HOST
from kvlease_vllm import _control, _sendcheck, _staging
from kvlease_vllm._compat import (
    NIXL_CONNECTOR_VERSION,
    NIXL_VERSION,
    PLATFORM_DEVICE_TYPE,
    VLLM_VERSION,
    NixlPullConnectorScheduler,
    init_logger,
)
from kvlease_vllm._config import (
    BIDIR_KEY,
    KVLeaseConfig,
    no_secret_warning,
)
from kvlease_vllm._control import ClaimResult, ControlServer, LeaseDesk
from kvlease_vllm._cost import CostModel, bytes_per_token, descriptors_per_token
from kvlease_vllm._guards import (
    context_parallel_reason,
    control_port,
    group_windows,
    hybrid_partial_reason,
    lora_tag,
    request_mm_digest,
    uncovered_inputs,
)
from kvlease_vllm._layout import kv_regions, pull_shape, transport_advice
from kvlease_vllm._metrics import ConnectorMetrics
from kvlease_vllm._placement import HostPlacer, host_leases, host_pull_refusal
from kvlease_vllm._pull import Pull, claim_outcome, final_trim, reclaim_waiting, submit_unclaim
from kvlease_vllm._retention import BlockRefs, RetentionTable
from kvlease_vllm._verify import (
    HandleRejected,
    Reason,
    handle_ext,
    handle_mac,
    parse_handle,
    strip_remote,
    verified_tokens,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# a child of "vllm" so vLLM's log handler and level apply to our decision lines
logger = init_logger("vllm.kvlease.connector")

__all__ = ["KVLeaseScheduler"]

_PROCESSED = "_remote_blocks_processed"  # upstream's marker: the handle was used once


class KVLeaseScheduler(NixlPullConnectorScheduler):
    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig, cfg: KVLeaseConfig
    ) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self.cfg = cfg
        self.secret = cfg.secret()
        self.block_pool: BlockPool | None = None
        self.metrics = ConnectorMetrics()
        cap = int(kv_cache_config.num_blocks * cfg.max_retained_fraction)
        kv_role = vllm_config.kv_transfer_config.kv_role  # type: ignore[union-attr]
        block_bytes = round(bytes_per_token(kv_cache_config, self.block_size) * self.block_size)
        self.desk = LeaseDesk(
            RetentionTable(
                cap,
                max_ttl=cfg.max_ttl_s,
                renew_guard=cfg.renew_guard_s,
                tenant_quota_fraction=cfg.tenant_quota_fraction,
                max_lifetime=cfg.max_lease_lifetime_s,
            ),
            self.metrics,
            host=host_leases(cfg, kv_role, block_bytes),
        )
        self.cost = CostModel(
            bytes_per_token=bytes_per_token(kv_cache_config, self.block_size),
            descriptors_per_token=descriptors_per_token(kv_cache_config, self.block_size),
            default_bandwidth_bps=cfg.default_pull_bandwidth_bps,
            per_descriptor_s=cfg.pull_per_descriptor_s,
            default_prefill_tokens_per_s=cfg.default_prefill_tokens_per_s,
            fixed_latency_s=cfg.pull_fixed_latency_s,
            explore_fraction=cfg.pull_explore_fraction,
            staged_bandwidth_bps=cfg.staging_bandwidth_bps,
            host_bandwidth_bps=cfg.arena_bandwidth_bps,
        )
        #: D: its workers' staging ports by TP rank (from their handshake payloads), or None;
        #: P: request id -> D's ports, for the staged pulls planned this step (to the workers).
        self.staging_ports: tuple[int, ...] | None = None
        self._stage_plans: dict[str, tuple[int, ...]] = {}
        parallel = vllm_config.parallel_config
        self.dp_index = int(parallel.data_parallel_index or 0)
        self.context_parallel = (
            int(parallel.decode_context_parallel_size or 1),
            int(parallel.prefill_context_parallel_size or 1),
        )
        self.hybrid = bool(self._is_hma_required)
        self.multi_group = self.hybrid or len(kv_cache_config.transfer_groups) > 1
        self.kv_regions = kv_regions(kv_cache_config)  # registered NIXL regions (one per layer)
        buffer = getattr(vllm_config.kv_transfer_config, "kv_buffer_device", None)
        level, self.transport = transport_advice(PLATFORM_DEVICE_TYPE, os.environ, buffer)
        self._pulls: dict[str, Pull] = {}
        self._prefill_t0: dict[str, tuple[float, int]] = {}
        #: Blocks each waiting request asked about this step still needs (dropped once allocated):
        #: what is left at the end of the step could not get its blocks.
        self._waiting_blocks: dict[str, int] = {}
        self._owned = BlockRefs()  # D: its own references on leased blocks (own_block_refs)
        self.placer = HostPlacer(self.desk, self._owned, self.metrics, cfg)  # D: host placement
        self._host_only: set[str] = set()  # P: this step's pulls of host-placed leases
        self._claims = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvlease-claim")
        self.sends = _sendcheck.SendDesk(self.secret)  # P: its P->D sends, for D's post-read check
        self.control = ControlServer(
            self.desk,
            self._info,
            host=cfg.control_host,
            port=control_port(cfg.control_port, self.dp_index),
            secret=self.secret,
            max_ttl=cfg.max_ttl_s,
            sends=self.sends,
        ).start()
        advertise = cfg.control_advertise_host or (
            self.side_channel_host if cfg.control_host in ("0.0.0.0", "::", "") else cfg.control_host
        )
        self.control_url = self.sends.control_url = self.control.url(advertise)
        logger.info(
            "kvlease control endpoint on %s (data-parallel rank %d, auth %s); lease cap %d blocks",
            self.control_url,
            self.dp_index,
            "on" if self.secret else "off: renew/release refused",
            cap,
        )
        warning = no_secret_warning(cfg, self.secret, kv_role)
        if warning:
            logger.warning("kvlease: %s", warning)
        logger.log(level, "kvlease: NIXL READ transport: %s", self.transport)

    def _info(self) -> ControlInfo:
        kv_role = self.vllm_config.kv_transfer_config.kv_role  # type: ignore[union-attr]
        role = {"kv_producer": Role.PREFILL, "kv_consumer": Role.DECODE}.get(kv_role, Role.BOTH)
        model = self.vllm_config.model_config
        return ControlInfo(
            role=role,
            engine_id=self.engine_id,
            vllm_version=VLLM_VERSION,
            kvlease_version=KVLEASE_VERSION,
            bidirectional_kv_xfer=bool(self.is_bidirectional_kv_xfer_enabled),
            ttl_s=float(self.decoder_kv_blocks_ttl),
            recompute_threshold=int(self.kv_recompute_threshold),
            block_size=int(self.block_size),
            model=(model.served_model_name if model is not None else None),  # type: ignore[arg-type]
            nixl_version=NIXL_VERSION,
            connector_version=int(NIXL_CONNECTOR_VERSION),
            data_parallel_index=self.dp_index,
            transport=self.transport,
            placement=self.cfg.resolved_placement() if role is not Role.PREFILL else None,
            tier=self.metrics.tier(),
        )

    # ------------------------------------------------------------------ P side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if self.desk.held():
            # the blocks the whole prompt and its first output token need, minus local prefix hits
            need = -(-(request.num_tokens + 1) // self.block_size) - num_computed_tokens // self.block_size
            self._waiting_blocks.setdefault(request.request_id, need)
        params = request.kv_transfer_params
        if not params or not params.get(KV.DO_REMOTE_DECODE):
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        rid = request.request_id
        self._prefill_t0.setdefault(
            rid, (time.perf_counter(), request.num_prompt_tokens - num_computed_tokens)
        )
        if not params.get(KV.REMOTE_BLOCK_IDS) or params.get(_PROCESSED):
            return 0, False
        pull = self._pulls.get(rid)
        if pull is None:
            if not self.is_bidirectional_kv_xfer_enabled:
                return self._decline(
                    request,
                    params,
                    Reason.BIDIRECTIONAL_OFF,
                    f"kv_connector_extra_config.{BIDIR_KEY} is off on this node, so it cannot read D's blocks",
                )
            if request.skip_reading_prefix_cache:  # vLLM zeroes any hit after asking: never claim
                why = "the request skips every prefix cache (prompt logprobs)"
                return self._decline(request, params, Reason.SCHEDULER_DROPPED, why)
            pull = self._pulls[rid] = self._plan(request, params, num_computed_tokens)
        if pull.handle is None:  # declined: the handle was stripped from params
            return 0, False
        if pull.claim is not None:
            if not pull.claim.done():
                return None, False  # type: ignore[return-value]  # vLLM: "ask again next step"
            result, error = claim_outcome(pull.claim)
            pull.claim = None
            if result is None:
                return self._decline(request, params, Reason.CLAIM_FAILED, error, warn=True)
            if result.left is None:
                return self._decline(
                    request,
                    params,
                    Reason.LEASE_GONE,
                    "D no longer holds the lease, or another reader claimed it",
                )
            if result.left < 1.0:
                return self._decline(
                    request, params, Reason.LEASE_GONE, f"D's lease has only {result.left:.2f} s left"
                )
            # pinned on D for claim_hold_s; its renewed deadline goes to upstream's expiry guard
            pull.deadline, pull.claimed_at = result.deadline, time.perf_counter()
        gain = pull.verified - num_computed_tokens
        if gain <= 0:
            return self._decline(request, params, Reason.LOCAL_HIT, "P's prefix cache covers it")
        # vLLM asks again, with a fresh local hit, every step the admission fails to allocate: the
        # last ask is the one it admits. The handle is trimmed at the scheduler's final count
        # (update_state_after_alloc), to this local hit + that count.
        pull.local, pull.tokens = num_computed_tokens, gain
        if pull.started is None:
            pull.started, pull.outcome = time.perf_counter(), Reason.PULL
            logger.info("kvlease %s: pulling %d verified tokens from %s", rid, gain, pull.handle.engine_id)
        return gain, True

    def _plan(self, request: Request, params: dict[str, Any], num_computed_tokens: int) -> Pull:
        try:
            handle = parse_handle(
                params,
                num_groups=len(self.kv_cache_config.transfer_groups),
                host_allowed=self.cfg.host_allowed,
                max_parallel=self.cfg.max_remote_parallel,
                secret=self.secret,
            )
            verified = verified_tokens(
                handle, request.prompt_token_ids or [], request.cache_salt, self.block_size
            )
        except HandleRejected as e:
            return self._decline_plan(
                request, params, e.reason, e.detail, warn=e.reason is not Reason.UNVERIFIABLE
            )
        remote_dcp = handle.params.dcp_size if handle.params is not None else None
        why = context_parallel_reason(
            local_dcp=self.context_parallel[0], local_pcp=self.context_parallel[1], remote_dcp=remote_dcp
        )
        if why:
            return self._decline_plan(request, params, Reason.CONTEXT_PARALLEL, why)
        why = uncovered_inputs(
            handle.ext,
            lora=lora_tag(request.lora_request),
            mm=request_mm_digest(request.mm_features, handle.ext.num_tokens),
            prompt_embeds=request.prompt_embeds is not None,
        )
        if why:
            return self._decline_plan(request, params, Reason.UNCOVERED, why)
        self.metrics.verified_tokens.inc(verified)
        self.metrics.trimmed_tokens.inc(max(handle.num_tokens - verified, 0))
        if verified == 0:
            return self._decline_plan(
                request, params, Reason.MISMATCH, f"0 of {len(handle.ext.hashes)} blocks match"
            )
        why = hybrid_partial_reason(
            windows=group_windows(
                (g.kv_cache_spec for g in self.kv_cache_config.transfer_groups), self.block_size
            ),
            hybrid=self.hybrid,
            verified=verified,
            remote_tokens=handle.num_tokens,
            block_size=self.block_size,
            named=[len(g) for g in handle.block_ids],
        )
        if why:
            return self._decline_plan(request, params, Reason.HYBRID_PARTIAL, why)
        gain = verified - num_computed_tokens
        host = handle.ext.placement == PLACEMENT_HOST
        if host:
            why = host_pull_refusal(self.cfg, handle.ext.staging, handle.num_tokens)
            if why:
                return self._decline_plan(request, params, Reason.PLACEMENT, why)
            self._host_only.add(request.request_id)
        staged = host or _staging.expect_staged(self.cfg, bool(handle.ext.staging), gain)
        decision = self.cost.decide(gain, self.kv_recompute_threshold, staged=staged, host=host)
        if not decision.pull:
            return self._decline_plan(request, params, decision.reason, decision.describe())
        (logger.info if decision.explored else logger.debug)(
            "kvlease %s: %s", request.request_id, decision.describe()
        )
        pull = Pull(handle, verified, staged=staged, tenant=tenant_tag_of(params))
        if self.cfg.claim and handle.ext.control:
            if not self.secret:
                return self._decline_plan(
                    request,
                    params,
                    Reason.CLAIM_FAILED,
                    "no control secret on this node, and D refuses unauthenticated claims",
                )
            pull.claim = self._submit_claim(pull, request.request_id)
        return pull

    def _submit_claim(self, pull: Pull, claimant: str) -> Future[ClaimResult]:
        """Claim ``pull``'s lease on D in the claim pool, for ``claimant`` (P's request id) and
        under the pull's tenant tag."""
        handle, cfg = pull.handle, self.cfg
        assert handle is not None and handle.ext.control is not None
        return self._claims.submit(
            _control.claim,
            handle.ext.control,
            handle.request_id,
            cfg.claim_hold_s,
            self.secret,
            cfg.claim_timeout_s,
            claimant,
            tenant=pull.tenant,
        )

    def _decline(
        self, request: Request, params: dict[str, Any], reason: Reason, detail: str, *, warn: bool = False
    ) -> tuple[int, bool]:
        # recompute; never contact the decode node for this handle. vLLM reads the request's
        # kv_transfer_params dict: a fresh copy that names no blocks replaces it (not edited).
        old = self._pulls.get(request.request_id)
        if old is not None and old.handle is not None and old.claimed_at is not None:  # claimed: unpin
            submit_unclaim(self._claims, old, request.request_id, self.secret, self.cfg.claim_timeout_s)
        request.kv_transfer_params = strip_remote(params)
        self._pulls[request.request_id] = Pull(None, outcome=reason)
        self.metrics.pull_decisions.labels(reason.value).inc()
        (logger.warning if warn else logger.info)(
            "kvlease %s: recompute (%s): %s", request.request_id, reason.value, detail
        )
        return 0, False

    def _decline_plan(
        self, request: Request, params: dict[str, Any], reason: Reason, detail: str, *, warn: bool = False
    ) -> Pull:
        self._decline(request, params, reason, detail, warn=warn)
        return self._pulls[request.request_id]

    # ------------------------------------------------------------------ D side
    def request_finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        pull = self._pulls.pop(rid, None)
        t0 = self._prefill_t0.pop(rid, None)
        if t0 is not None and (pull is None or pull.started is None):
            self.cost.observe_prefill(t0[1], time.perf_counter() - t0[0])
        delay, out = super().request_finished(request, block_ids)
        if delay and out is not None and out.get(KV.DO_REMOTE_PREFILL):  # P: a send D will read
            out = self.sends.issue(rid, self._reqs_need_send.get(rid), out)
        # vLLM's request_finished returns the response's kv_transfer_params as a dict: the kvlease
        # objects go into fresh copies of upstream's dict, serialized from their typed shapes.
        if pull is not None and out is not None:
            out = {**out, KV.KVLEASE: pull.report().to_json()}
        if not (delay and out and out.get(KV.DO_REMOTE_DECODE) and self.is_bidirectional_kv_xfer_enabled):
            return delay, out
        deadline = out.get(KV.REMOTE_BLOCKS_EXPIRY_TIME)
        blocks = sum(len(g) for g in out.get(KV.REMOTE_BLOCK_IDS) or ())
        if not isinstance(deadline, float):
            return delay, out
        if request.prompt_embeds is not None:
            # no identity to prove: an upstream handle without a kvlease object (P never pulls it)
            logger.info("kvlease %s: prompt embeddings; KV not leased", rid)
            return delay, out
        result = self.desk.add(rid, blocks, deadline, tenant_tag_of(request.kv_transfer_params))
        if not result.retained:
            self._reqs_need_send[rid] = time.perf_counter()  # free at the next worker sweep
            self.metrics.releases.labels("not_retained").inc()
            logger.info("kvlease %s: %d blocks over the retention cap; not retained", rid, blocks)
            return delay, None
        num_tokens = int(out.get(KV.REMOTE_NUM_TOKENS) or 0)
        ext = handle_ext(
            token_ids=request.all_token_ids,
            num_tokens=num_tokens,
            block_size=self.block_size,
            salt=request.cache_salt,
            lease_id=rid,
            engine_id=self.engine_id,
            control=self.control_url,
            lora=lora_tag(request.lora_request),
            mm=request_mm_digest(request.mm_features, num_tokens),
        )
        if self.staging_ports and self.cfg.staging != _staging.OFF:
            ext = replace(ext, staging=self.staging_ports)
        own = self.cfg.own_block_refs and self.block_pool is not None
        if self.placer.enabled and self._place_host(request, out, num_tokens, own):
            ext = replace(ext, placement=PLACEMENT_HOST)
        if self.secret:  # the MAC covers the routing fields of upstream's dict and the object
            ext = replace(ext, mac=handle_mac(self.secret, {**out, KV.KVLEASE: ext.to_json()}))
        if self.cfg.own_block_refs and self.block_pool is not None:
            self._owned.take(self.block_pool, rid, out.get(KV.REMOTE_BLOCK_IDS) or ())
            delay = False  # our reference holds the blocks: no delayed free
        return delay, {**out, KV.KVLEASE: ext.to_json()}

    def _place_host(self, request: Request, out: dict[str, Any], num_tokens: int, own: bool) -> bool:
        """D: write the lease through to the host arena (the blocks are given back at the next
        step's metadata); False: it stays held on the device, logged with the reason."""
        rid = request.request_id
        why = self.placer.unplaceable(
            staging_ports=self.staging_ports if self.cfg.staging != _staging.OFF else None,
            multi_group=self.multi_group,
            num_tokens=num_tokens,
            own_refs=own,
        )
        if why is None:
            groups = out.get(KV.REMOTE_BLOCK_IDS) or ((),)
            why = self.placer.place(rid, groups[0], tenant_tag_of(request.kv_transfer_params))
        if why is not None:
            logger.info("kvlease %s: lease kept on the device: %s", rid, why)
        return why is None

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        self._waiting_blocks.pop(request.request_id, None)
        pull = self._pulls.get(request.request_id)
        if pull is not None and pull.handle is not None and pull.started is not None and not pull.trimmed:
            self._trim_final(request, pull, blocks, num_external_tokens)
            if self._pulls[request.request_id].handle is not None:  # not declined by the trim
                self._observe_shape(request, blocks, num_external_tokens)
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def _observe_shape(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        """Observability only: descriptors and block-id runs (P: upstream's unhashed blocks, D: handle)."""
        try:
            local = blocks.get_unhashed_block_ids_all_groups()
            remote = (request.kv_transfer_params or {}).get(KV.REMOTE_BLOCK_IDS) or ()
            shape = pull_shape(local, remote, self.kv_regions)
        except Exception as e:  # never let a figure change the pull
            logger.debug("kvlease %s: no pull shape (%s)", request.request_id, e)
            return
        self.metrics.observe_pull_shape(shape)
        rid, regions = request.request_id, self.kv_regions
        pull = self._pulls[rid]
        ports = pull.handle.ext.staging if pull.handle is not None else None
        host = pull.handle is not None and pull.handle.ext.placement == PLACEMENT_HOST
        cfg = replace(self.cfg, staging=_staging.ALWAYS) if host else self.cfg  # never block by block
        choice = _staging.plan_pull(cfg, self.cost, ports, local, remote, regions, num_external_tokens)
        if choice.staged and ports:
            pull.staged, self._stage_plans[rid] = True, ports
        described = f"{shape.describe(regions)}; {choice.describe()}"
        logger.info("kvlease %s: pull of %d tokens: %s", rid, num_external_tokens, described)

    def _trim_final(self, request: Request, pull: Pull, blocks: Any, num_external_tokens: int) -> None:
        """Cut the handle to P's local hit + the scheduler's final external count (0.33's
        ``cap_external_hit`` and the prefix-replay truncation may lower it after
        ``get_num_new_matched_tokens``), never past the verified prefix (``_pull.final_trim``)."""
        pull.trimmed = True
        trim = final_trim(pull, blocks, num_external_tokens, self.block_size, hybrid=self.multi_group)
        if trim.reason is not Reason.PULL:
            self._decline(request, request.kv_transfer_params or {}, trim.reason, trim.detail, warn=trim.warn)
        elif trim.detail:
            (logger.warning if trim.warn else logger.info)("kvlease %s: %s", request.request_id, trim.detail)
        if trim.params is None:
            return
        # vLLM's connector API: upstream reads (and marks) the pull in the request's own
        # kv_transfer_params dict. This is the one place the typed handle becomes that dict
        # again: a fresh one, serialized from the trimmed handle; vLLM's dict is not edited.
        request.kv_transfer_params = trim.params.to_json()
        if trim.reason is Reason.PULL:
            pull.tokens = num_external_tokens
            self.metrics.pull_decisions.labels(Reason.PULL.value).inc()
            self.metrics.pulled_tokens.inc(num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        # The first waiting request that got no blocks this step heads the queue (FCFS): free what it
        # needs now rather than let it wait for leases to run out.
        head = next(iter(self._waiting_blocks.values()), 0)
        self._waiting_blocks.clear()
        self._relieve_pressure(need=head)
        self._reqs_need_send.update(self.desk.take_updates())
        self._reclaim_waiting(time.perf_counter())
        checks = _sendcheck.read_targets(self._reqs_need_recv, self.secret)  # D: reads of P to check
        meta = super().build_connector_meta(scheduler_output)
        if checks and meta is not None:
            setattr(meta, _sendcheck.TARGETS_ATTR, checks)
        if self._stage_plans and meta is not None:  # P: this step's staged pulls, to the workers
            setattr(meta, _staging.PLANS_ATTR, self._stage_plans)
            self._stage_plans = {}
        if self._host_only and meta is not None:  # P: pulls that must not go block by block
            setattr(meta, _staging.HOST_ONLY_ATTR, frozenset(self._host_only))
            self._host_only = set()
        if self.placer.enabled and meta is not None:  # D: the host arena's orders
            self.placer.attach(meta, scheduler_output, self.block_pool)
        return meta

    def _reclaim_waiting(self, now: float) -> None:
        """P: renew the claim of every read still waiting past half the claim hold."""
        for rid, why in reclaim_waiting(self._pulls, now, self.cfg.claim_hold_s, self._submit_claim):
            logger.warning("kvlease %s: re-claim refused while the read waits: %s", rid, why)

    def _relieve_pressure(self, emergency: bool = False, need: int = 0) -> list[str]:
        leases, _ = self.desk.snapshot()
        if not leases or self.block_pool is None:
            return []
        total = self.kv_cache_config.num_blocks
        target = total if emergency else max(math.ceil(self.cfg.min_free_fraction * total), need)
        short = target - self.block_pool.get_num_free_blocks() - self.desk.releasing_blocks()
        # an allocation failure frees one lease (the oldest unpinned) per failure, not all of them
        released = self.desk.relieve(short, limit=1 if emergency else None) if short > 0 else []
        if released:
            logger.info("kvlease: KV cache pressure, released %d leases early", len(released))
        return released

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        self.metrics.observe_worker_stats(getattr(connector_output, "kv_connector_stats", None))
        sent = connector_output.finished_sending or set()
        self.sends.ended(sent)
        self.desk.forget(sent)
        # read, expired or released: drop our reference; the scheduler no longer knows these
        # requests (it freed them at finish), so they must not reach its finished_sending loop
        owned = self._owned.drop(self.block_pool, sent) if sent else ()
        self.placer.forget(sent)
        if owned:
            connector_output.finished_sending = set(sent).difference(owned)
        failed = connector_output.failed_recving or set()
        now = time.perf_counter()
        for rid in connector_output.finished_recving or ():
            pull = self._pulls.get(rid)
            if pull is None or pull.started is None:
                continue
            if rid in failed:
                pull.outcome = Reason.FAILED
                self.metrics.pull_decisions.labels(Reason.FAILED.value).inc()
                logger.warning("kvlease %s: pull failed; recomputing", rid)
            else:
                self.cost.observe_pull(pull.tokens, now - pull.started, staged=pull.staged)
            pull.started = -1.0  # observed once

    def shutdown(self) -> None:
        self.control.stop()
        self._claims.shutdown(wait=False, cancel_futures=True)
        super().shutdown()
