"""``KVLeaseWorker``: upstream's pull worker with staged pulls (``kvlease.staging``).

D side: the staging buffer is registered with upstream's own NIXL agent *before* upstream registers
the KV cache, so the agent metadata P loads at upstream's handshake already covers it (no second
agent, no second handshake). A :class:`~kvlease_vllm._staging.StagingServer` thread answers P's
requests while D's engine loop sleeps: it checks the lease is live in upstream's send bookkeeping,
gathers the blocks (read-only; on a GPU on its own stream, after the engine's mark recorded on the
compute stream once the lease reached the worker, and synchronised before the answer),
checks the lease is still live (so nothing freed the blocks during the gather), and answers where
the bytes lie. Its port reaches D's scheduler on upstream's handshake payload (an attribute the
scheduler drops before upstream serves the payload) and P through the handle (``kvlease.staging``).

P side: for a request its scheduler planned as staged, ``_read_blocks_for_req`` asks D in a thread
instead of posting upstream's per-block READ; each step polls the answer (bounded by
``staging_timeout_s``), posts ONE READ into P's staging buffer, scatters it into the request's
blocks, sends upstream's completion notification to D (so D frees or keeps the lease exactly as
upstream's own notification does), releases D's range and hands the request to upstream's
bookkeeping as a finished receive. Before the READ is posted anything that goes wrong falls back
to upstream's per-block path; after it, upstream's failure path runs (the request recomputes).

The READ has a deadline, sent with the request (``_staging.read_deadline_s``): D keeps the range
strictly longer unless P releases it, so it never gathers another request over bytes P may still
use; P uses the bytes only if it saw the READ done by the deadline, and otherwise recomputes. The
READ lands in P's staging buffer, never in the request's blocks, so those are given back at once;
a READ still posted keeps its handle and P's range until NIXL reports it ended (a release while it
runs need not stop the DMA).

Overridden (signatures pinned against vLLM 0.32 and 0.33): ``__init__``, ``register_kv_caches``,
``start_load_kv``, ``_read_blocks_for_req``, ``get_transfer_results``, ``shutdown`` and
``_engines_with_inflight_transfers`` (a staged pull's READ is not in upstream's
``_recving_transfers`` until it is done, and upstream must not remove D's agent under it).
"""

from __future__ import annotations

import functools
import socket
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from kvlease.protocol._staging import (
    STAGING_OP_RELEASE,
    STAGING_OP_STAGE,
    StagingRefusal,
    StagingReply,
    StagingRequest,
)
from kvlease_vllm import _staging
from kvlease_vllm._compat import NixlPullConnectorWorker, init_logger, vllm_envs
from kvlease_vllm._config import PLACEMENT_DEVICE, ConfigError, KVLeaseConfig
from kvlease_vllm._metrics import STAT_DEMOTION_S, STAT_PULLS
from kvlease_vllm._stagecopy import StagingCopier, kv_tensors, region_views, staging_buffer
from kvlease_vllm._worker_arena import ArenaStore, allocate_arena, stage_lease
from kvlease_vllm._worker_state import _ASK, KVLeaseStats, _Abandoned, _Staged

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger("vllm.kvlease.worker")

__all__ = ["KVLeaseWorker"]

_READ, _SCATTER = "read", "scatter"


class KVLeaseWorker(NixlPullConnectorWorker):  # type: ignore[misc]
    """Upstream's pull worker; staged pulls where D advertises them and the layout allows."""

    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig, cfg: KVLeaseConfig
    ) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self.xfer_stats = KVLeaseStats()  # upstream's, with kvlease's figures (TP rank 0's)
        self.kvl_cfg = cfg
        self.kvl_counts: Counter[str] = Counter()
        self._kvl_buffer: torch.Tensor | None = None
        self._kvl_alloc: _staging.RangeAllocator | None = None
        self._kvl_views: list[torch.Tensor] = []
        self._kvl_region_bytes: tuple[int, ...] = ()
        self._kvl_copier: StagingCopier | None = None
        self._kvl_server: _staging.StagingServer | None = None
        self._kvl_plans: dict[str, tuple[int, ...]] = {}
        self._kvl_pulls: dict[str, _Staged] = {}
        self._kvl_abandoned: dict[Any, _Abandoned] = {}  # NIXL handle -> what it holds
        #: D: the engine's marks (CUDA events on the compute stream, :meth:`StagingCopier.mark`)
        #: by lease, recorded when the lease reached this worker, and the latest step's.
        self._kvl_marks: dict[str, Any] = {}
        self._kvl_last_mark: Any = None
        self._kvl_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvlease-stage")
        self._kvl_stream: Any = None
        self._kvl_dev = 0
        #: D: the host arena (``kvlease.placement`` auto / host); P: the pulls of host-placed leases
        #: (never read block by block: D no longer holds those blocks).
        self._kvl_arena: ArenaStore | None = None
        self._kvl_host_only: set[str] = set()
        secret = cfg.secret()
        #: Staging requests carry it and D's listener answers only it (None: no secret, no staging).
        self._kvl_token = _staging.staging_token(secret) if secret else None

    # ------------------------------------------------------------------ set-up
    def _kvl_unsupported(self) -> str | None:
        """Layouts staging does not handle (it then never stages; upstream's path runs)."""
        checks = (
            (self.kvl_cfg.staging == _staging.OFF, "kvlease.staging is off"),
            (self.kvl_cfg.staging_max_tokens == 0, "kvlease.staging_max_tokens is 0"),
            (self._kvl_token is None, "no control secret (staging requests are authenticated with it)"),
            (self.use_host_buffer, "KV staged through a host buffer"),
            (self.use_mla, "MLA"),
            (self._has_mamba or self._is_hma_required, "hybrid KV cache groups"),
            (len(self.kv_cache_config.transfer_groups) != 1, "more than one KV cache group"),
            (self.pp_size > 1 or self.pcp_size > 1 or self.dcp_size > 1, "pipeline or context parallel"),
            (self.device_type not in ("cpu", "cuda"), f"{self.device_type} platform"),
        )
        return next((why for bad, why in checks if bad), None)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        why = self._kvl_unsupported()
        tensors = kv_tensors(kv_caches)
        if why is None and tensors:
            try:
                self._kvl_allocate(tensors)
            except ConfigError:  # a buffer that does not fit beside vLLM's budget: refused at start
                raise
            except Exception as e:  # never let staging stop the server: upstream's path remains
                why = f"no staging buffer ({type(e).__name__}: {e})"
                self._kvl_buffer = None
        super().register_kv_caches(kv_caches)
        if why is None and self._kvl_buffer is not None:
            why = self._kvl_map_regions(tensors)
        if why is not None:
            self._kvl_alloc = None
            if self.kvl_cfg.staging != _staging.OFF:
                logger.info("kvlease: staged pulls off on this worker: %s", why)
            return
        assert self._kvl_buffer is not None
        self._kvl_alloc = _staging.RangeAllocator(self._kvl_buffer.numel())
        if self.kv_transfer_config.kv_role in ("kv_consumer", "kv_both"):
            if self.kvl_cfg.resolved_placement() != PLACEMENT_DEVICE:
                self._kvl_arena = allocate_arena(
                    self.kvl_cfg.host_arena_bytes,
                    self._kvl_views,
                    self._kvl_region_bytes,
                    device=self._kvl_buffer.device,
                    workers_on_host=self.world_size,
                    on_demoted=functools.partial(self._kvl_record, STAT_DEMOTION_S),
                )
            dp = int(self.vllm_config.parallel_config.data_parallel_index or 0)
            port = _staging.staging_port(self.kvl_cfg.staging_port, dp, self.world_size, self.tp_rank)
            host = vllm_envs.VLLM_NIXL_SIDE_CHANNEL_HOST
            assert self._kvl_token is not None
            self._kvl_server = _staging.listen(
                host,
                port,
                self._kvl_serve,
                token=self._kvl_token,
                data_parallel_index=dp,
                tp_rank=self.tp_rank,
            )
            if self.xfer_handshake_metadata is not None:
                setattr(self.xfer_handshake_metadata, _staging.PORT_ATTR, self._kvl_server.port)
                setattr(self.xfer_handshake_metadata, _staging.WHERE_ATTR, (host, socket.gethostname()))
        logger.info(
            "kvlease: staged pulls %s: %.1f MiB staging buffer (%d tokens), %d KV regions%s",
            self.kvl_cfg.staging,
            self._kvl_buffer.numel() / 2**20,
            self.kvl_cfg.staging_max_tokens,
            len(self._kvl_views),
            f", listening on {self._kvl_server.port}" if self._kvl_server else "",
        )
        if self._kvl_arena is not None:
            logger.info(
                "kvlease: leases placed in a %.1f MiB host arena (%s), HBM a cache over it",
                self._kvl_arena.capacity / 2**20,
                self.kvl_cfg.resolved_placement(),
            )

    def _kvl_allocate(self, tensors: list[torch.Tensor]) -> None:
        self._kvl_buffer = staging_buffer(
            tensors,
            self.num_blocks,
            self.block_size,
            self.kvl_cfg.staging_max_tokens,
            self.vllm_config.cache_config,
        )
        nbytes, device = self._kvl_buffer.numel(), self._kvl_buffer.device
        self._kvl_dev = int(device.index or 0) if device.type == "cuda" else 0
        if device.type == "cuda":
            self._kvl_stream = torch.cuda.Stream(device=device)
        descs = self.nixl_wrapper.get_reg_descs(
            [(self._kvl_buffer.data_ptr(), nbytes, self._kvl_dev, "")], self.nixl_memory_type
        )
        self.nixl_wrapper.register_memory(descs, backends=self.nixl_backends)

    def _kvl_map_regions(self, tensors: list[torch.Tensor]) -> str | None:
        """A (blocks x bytes) view of every registered KV region, from upstream's own geometry."""
        bases = self.kv_caches_base_addr[self.engine_id][self.tp_rank]
        lens, strides = self.block_len_per_layer, self.block_stride_per_layer
        counts = self.region_num_blocks or [self.num_blocks] * len(bases)
        got = region_views(tensors, bases, lens, strides, counts)
        if isinstance(got, str):
            return got
        views, self._kvl_region_bytes = got
        self._kvl_views = views
        assert self._kvl_buffer is not None
        self._kvl_copier = StagingCopier(self._kvl_buffer, views, self._kvl_region_bytes, self._kvl_stream)
        return None

    # ------------------------------------------------------------------ D side
    def _kvl_live(self, lease_id: str) -> bool:
        # upstream's send bookkeeping: set until D is notified of the read or the lease expires
        return lease_id in self._reqs_to_send or lease_id in self._reqs_to_process

    def _kvl_mark(self, lease_ids: Any, *, prune: bool = False) -> None:
        """The engine thread, after this step's work was queued: its mark, for the gathers."""
        if self._kvl_server is None or self._kvl_copier is None or self._kvl_copier.stream is None:
            return
        mark = self._kvl_copier.mark()
        for rid in lease_ids:
            self._kvl_marks[rid] = mark
        self._kvl_last_mark = mark
        if prune:  # once a step: forget the marks of leases that ended
            for rid in [r for r in self._kvl_marks if not self._kvl_live(r)]:
                del self._kvl_marks[rid]

    def _kvl_serve(self, msg: StagingRequest) -> StagingReply:
        """The staging thread: one request, answered (never raises into the listener)."""
        assert self._kvl_alloc is not None and self._kvl_buffer is not None and self._kvl_copier is not None
        if msg.op == STAGING_OP_RELEASE:
            self._kvl_alloc.free(msg.slot)
            return StagingReply(True, slot=msg.slot)
        if not 0 < msg.read_deadline_ms <= _staging.READ_DEADLINE_MAX_S * 1e3:
            detail = (
                "no READ deadline (an older kvlease P)"
                if not msg.read_deadline_ms
                else "READ deadline too long"
            )
            return StagingReply(False, refusal=StagingRefusal.BAD_REQUEST, detail=detail)
        if not self._kvl_live(msg.lease_id):
            return StagingReply(False, refusal=StagingRefusal.UNKNOWN_LEASE, detail="no such lease")
        if msg.region_bytes != self._kvl_region_bytes:
            return StagingReply(False, refusal=StagingRefusal.LAYOUT, detail="KV regions differ")
        n = len(msg.block_ids)
        nbytes = n * sum(self._kvl_region_bytes)
        if nbytes > self._kvl_alloc.capacity:
            return StagingReply(False, refusal=StagingRefusal.TOO_LARGE, detail=f"{nbytes} bytes")
        if max(msg.block_ids) >= min(v.shape[0] for v in self._kvl_views):
            return StagingReply(False, refusal=StagingRefusal.BAD_REQUEST, detail="block id out of range")
        hold = _staging.range_hold_s(msg.read_deadline_ms / 1e3)  # longer than P may use the bytes
        got = self._kvl_alloc.alloc(nbytes, now=time.perf_counter(), hold_s=hold)
        if got is None:
            return StagingReply(False, refusal=StagingRefusal.BUSY, detail="staging buffer full")
        slot, offset = got
        try:
            source, why = self._kvl_stage(msg, offset)
        except Exception:
            self._kvl_alloc.free(slot)
            raise
        if source is None:
            self._kvl_alloc.free(slot)
            return StagingReply(False, refusal=StagingRefusal.UNKNOWN_LEASE, detail=why)
        address = self._kvl_buffer.data_ptr() + offset
        return StagingReply(
            True, slot=slot, address=address, nbytes=nbytes, device_id=self._kvl_dev, source=source
        )

    def _kvl_stage(self, msg: StagingRequest, offset: int) -> tuple[str | None, str]:
        """Lay the lease's blocks out at ``offset`` (``_worker_arena.stage_lease``)."""
        assert self._kvl_copier is not None and self._kvl_buffer is not None
        # after the lease's last KV writes: the engine's mark when the lease reached this worker,
        # else its latest (a lease whose finish has not reached it yet was written before that)
        after = self._kvl_marks.get(msg.lease_id, self._kvl_last_mark)
        return stage_lease(
            self._kvl_arena,
            self._kvl_copier,
            self._kvl_buffer,
            msg.lease_id,
            msg.block_ids,
            offset,
            after,
            self._kvl_live,
        )

    def _kvl_record(self, key: str, value: float) -> None:
        """One of kvlease's figures into upstream's stats (TP rank 0's: a pull counts once)."""
        if getattr(self, "tp_rank", 0) == 0 and isinstance(self.xfer_stats, KVLeaseStats):
            self.xfer_stats.record(key, value)

    def _kvl_before_step(self, metadata: Any) -> None:
        """vLLM's ``handle_preemptions``: before the step zeroes, copies or writes any block."""
        if self._kvl_arena is not None and self._kvl_copier is not None:
            self._kvl_arena.before_step(metadata, self._kvl_copier.mark)

    # ------------------------------------------------------------------ P side
    def start_load_kv(self, metadata: Any) -> None:
        plans = getattr(metadata, _staging.PLANS_ATTR, None)
        if plans:
            self._kvl_plans.update(plans)
        self._kvl_host_only.update(getattr(metadata, _staging.HOST_ONLY_ATTR, None) or ())
        super().start_load_kv(metadata)
        self._kvl_mark(getattr(metadata, "reqs_to_send", None) or ())
        self._kvl_advance()

    def get_transfer_results(self) -> Any:
        self._kvl_mark((), prune=True)  # called after the step's forward was queued
        self._kvl_advance()
        if self._kvl_arena is not None:
            self._kvl_arena.forget(self._kvl_live)
        results = super().get_transfer_results()
        for rid in [r for r in self._kvl_plans if r not in self._recving_metadata]:
            del self._kvl_plans[rid]  # finished or failed upstream (e.g. its handshake failed)
        self._kvl_host_only.intersection_update(self._recving_metadata)
        return results

    def _read_blocks_for_req(self, req_id: str, meta: Any) -> None:
        ports = self._kvl_plans.get(req_id)
        if ports is None or self._kvl_alloc is None or meta.remote is None:
            self._kvl_plans.pop(req_id, None)
            if req_id in self._kvl_host_only:
                return self._kvl_decline_host(req_id, "this worker cannot stage the pull")
            super()._read_blocks_for_req(req_id, meta)
            return
        engine_id = meta.remote.engine_id
        if engine_id in self._invalid_remote_engines or engine_id not in self._remote_agents:
            # upstream fails it, or handshakes and calls this again with the peer known
            super()._read_blocks_for_req(req_id, meta)
            return
        del self._kvl_plans[req_id]
        if self._bidirectional_kv_xfer_enabled and self._is_turn2_read_expired(meta):
            super()._read_blocks_for_req(req_id, meta)  # upstream declines it
            return
        try:
            staged, why = self._kvl_start(req_id, meta, ports)
        except Exception as e:
            staged, why = None, f"{type(e).__name__}: {e}"
        if staged is None:
            if req_id in self._kvl_host_only:
                return self._kvl_decline_host(req_id, why)
            self._kvl_fell_back(req_id, why)
            super()._read_blocks_for_req(req_id, meta)
            return
        self._engine_last_active[engine_id] = time.perf_counter()
        self._kvl_pulls[req_id] = staged

    def _kvl_start(self, req_id: str, meta: Any, ports: tuple[int, ...]) -> tuple[_Staged | None, str]:
        """Ask D to stage; None and why when this pull cannot be staged (upstream's path then)."""
        assert self.transfer_topo is not None and self._kvl_alloc is not None
        engine_id = meta.remote.engine_id
        plan = self.tp_mappings[engine_id]
        remote = self.transfer_topo.get_engine_info(engine_id)
        why = _staging.layout_refusal(
            source_ranks=len(plan.all_source_ranks),
            tp_ratio=self.transfer_topo.tp_ratio(remote.remote_tp_size),
            block_sizes=(self.block_size, remote.remote_block_size),
            kernel_blocks_per_block=(
                self._physical_blocks_per_logical_kv_block,
                remote.remote_physical_blocks_per_logical,
            ),
            remote_dcp=remote.remote_dcp_size,
            groups=(len(meta.local_block_ids), len(meta.remote.block_ids)),
            regions_grouped_alike=self.dst_region_group_ids.get(engine_id) == self.region_group_ids,
            plain_layout=not (
                self._mixed_mem_types
                or self.enable_permute_local_kv
                or self.enable_heterogeneous_attn_post_process
            ),
        )
        if why:
            return None, why
        rank = plan.all_source_ranks[0]
        if not 0 <= rank < len(ports):
            return None, f"D advertises no staging port for rank {rank}"
        local = list(meta.local_physical_block_ids[0])
        if not local:
            return None, "nothing to read (upstream only notifies D)"
        (local,), (remote_ids,) = self._apply_prefix_caching(
            decode_block_ids=[local],
            prefill_block_ids=[list(meta.remote.block_ids[0])],
            decode_physical_per_logical=1,
            prefill_physical_per_logical=1,
        )
        nbytes = len(local) * sum(self._kvl_region_bytes)
        timeout = self.kvl_cfg.staging_timeout_s
        read_s = _staging.read_deadline_s(timeout, nbytes)
        if read_s > _staging.READ_DEADLINE_MAX_S:
            return None, f"{nbytes} bytes may take longer than D holds a staged range"
        got = self._kvl_alloc.alloc(nbytes, now=time.perf_counter(), hold_s=float("inf"))
        if got is None:
            return None, f"{nbytes} bytes do not fit P's free staging buffer"
        msg = StagingRequest(
            STAGING_OP_STAGE,
            meta.remote.request_id,
            tuple(int(b) for b in remote_ids),
            self._kvl_region_bytes,
            auth=self._kvl_token or "",
            read_deadline_ms=int(read_s * 1e3),
        )
        host, port = meta.remote.host, ports[rank]
        agent = self._remote_agents[engine_id][(0, rank)]
        notif = f"{meta.remote.request_id}:{plan.local_consumers}".encode()
        asked = time.perf_counter()  # before the request is sent, so before D holds the range
        try:
            future = self._kvl_pool.submit(_staging.ask, host, port, msg, timeout)
        except Exception:  # nothing was sent: P's range is free again
            self._kvl_alloc.free(got[0])
            raise
        staged = _Staged(
            meta=meta,
            future=future,
            deadline=asked + timeout,
            host=host,
            port=port,
            agent=agent,
            notif=notif,
            local_ids=[int(b) for b in local],
            slot=got[0],
            offset=got[1],
            nbytes=nbytes,
            read_by=asked + msg.read_deadline_ms / 1e3,
        )
        return staged, ""

    def _kvl_advance(self) -> None:
        """Move every staged pull on, without blocking: answer -> READ -> scatter -> done."""
        self._kvl_reap()
        now = time.perf_counter()
        for rid, st in list(self._kvl_pulls.items()):
            try:
                if st.stage == _ASK:
                    self._kvl_on_answer(rid, st, now)
                if st.stage == _READ:
                    self._kvl_on_read(rid, st)
                if st.stage == _SCATTER and (st.event is None or st.event.query()):
                    self._kvl_done(rid, st)
            except Exception as e:  # after the READ: upstream's failure path (recompute)
                logger.warning(
                    "kvlease %s: staged pull failed (%s: %s); recomputing", rid, type(e).__name__, e
                )
                self._kvl_fail(rid, st)

    def _kvl_on_answer(self, rid: str, st: _Staged, now: float) -> None:
        if not st.future.done():
            if now >= st.deadline:
                st.future.add_done_callback(self._kvl_release_late(st))
                self._kvl_fallback(rid, st, "D did not answer within kvlease.staging_timeout_s")
            return
        try:
            reply = st.future.result()
        except Exception as e:
            return self._kvl_fallback(rid, st, f"D's staging listener: {type(e).__name__}: {e}")
        if not reply.ok:
            return self._kvl_fallback(rid, st, f"D refused ({reply.refusal}: {reply.detail})")
        st.reply, st.source = reply, reply.source
        if reply.nbytes != st.nbytes:
            self._kvl_release(st)
            return self._kvl_fallback(rid, st, f"D staged {reply.nbytes} bytes, expected {st.nbytes}")
        assert self._kvl_buffer is not None
        mem = self.nixl_memory_type
        try:
            local = self.nixl_wrapper.get_xfer_descs(
                [(self._kvl_buffer.data_ptr() + st.offset, st.nbytes, self._kvl_dev)], mem
            )
            remote = self.nixl_wrapper.get_xfer_descs([(reply.address, reply.nbytes, reply.device_id)], mem)
            st.handle = self.nixl_wrapper.initialize_xfer("READ", local, remote, st.agent)
            self.nixl_wrapper.transfer(st.handle)
        except Exception as e:  # nothing was written to P's blocks yet
            if st.handle is not None and not self._try_release_xfer_handle(rid, st.handle):
                raise
            self._kvl_release(st)
            return self._kvl_fallback(rid, st, f"the READ could not be posted ({type(e).__name__}: {e})")
        st.stage = _READ

    def _kvl_on_read(self, rid: str, st: _Staged) -> None:
        state = self.nixl_wrapper.check_xfer_state(st.handle)
        verdict = _staging.read_verdict(state, time.perf_counter(), st.read_by)  # the clock after
        if verdict == _staging.WAIT:
            return
        if verdict == _staging.FAILED:
            raise RuntimeError(f"the READ ended in state {state}")
        if verdict == _staging.LATE:
            return self._kvl_late(rid, st, state)
        self.nixl_wrapper.release_xfer_handle(st.handle)
        st.handle = None
        assert self._kvl_copier is not None
        st.event = self._kvl_copier.scatter(st.local_ids, st.offset)
        st.stage = _SCATTER

    def _kvl_done(self, rid: str, st: _Staged) -> None:
        del self._kvl_pulls[rid]
        assert self._kvl_alloc is not None
        self._kvl_alloc.free(st.slot)
        self._kvl_release(st)
        try:  # upstream's completion notification, as its READ would have carried
            self.nixl_wrapper.send_notif(st.agent, notif_msg=st.notif)
        except Exception as e:
            logger.warning("kvlease %s: completion notification to D failed: %s", rid, e)
            self.xfer_stats.record_failed_notification()
        self._recving_transfers[rid] = []  # no handle left: upstream reports it received
        self.kvl_counts["staged"] += 1
        self._kvl_record(STAT_PULLS + st.source, 1)
        logger.info(
            "kvlease %s: staged pull of %d blocks (%d bytes, one READ) in %.1f ms",
            rid,
            len(st.local_ids),
            st.nbytes,
            (time.perf_counter() - st.t0) * 1e3,
        )

    def _kvl_fail(self, rid: str, st: _Staged) -> None:
        self._kvl_pulls.pop(rid, None)
        self._kvl_release(st)
        self.kvl_counts["failed"] += 1
        if self._handle_failed_transfer(rid, st.handle, self._recv_failures):
            assert self._kvl_alloc is not None
            self._kvl_alloc.free(st.slot)
        else:  # a READ may still land there: keep the range until the handle is released
            self._kvl_abandoned[st.handle] = _Abandoned(rid, st.meta.remote.engine_id, st.slot)

    def _kvl_late(self, rid: str, st: _Staged, state: str) -> None:
        """Past the READ deadline: D may reuse its range, so the bytes are not used; the request
        recomputes. Its blocks were never the READ's destination, so upstream frees them now."""
        logger.warning(
            "kvlease %s: staged READ of %d bytes not done by its deadline (%.1f s after the request, "
            "state %s); recomputing",
            rid,
            st.nbytes,
            time.perf_counter() - st.t0,
            state,
        )
        handle, st.handle = st.handle, None
        self._kvl_pulls.pop(rid, None)
        self._kvl_release(st)
        self.kvl_counts["late"] += 1
        self._handle_failed_transfer(rid, None, self._recv_failures)
        # a posted READ is not released (that need not stop its DMA into P's range): kept until it ends
        self._kvl_abandoned[handle] = _Abandoned(rid, st.meta.remote.engine_id, st.slot)
        self._kvl_reap()

    def _kvl_reap(self) -> None:
        """Release the handles of abandoned READs that ended, and free P's ranges under them."""
        assert self._kvl_alloc is not None or not self._kvl_abandoned
        for handle, gone in list(self._kvl_abandoned.items()):
            try:
                if self.nixl_wrapper.check_xfer_state(handle) == "PROC":
                    continue
            except Exception:  # as upstream: try to release it
                pass
            if self._try_release_xfer_handle(gone.rid, handle):
                del self._kvl_abandoned[handle]
                assert self._kvl_alloc is not None
                self._kvl_alloc.free(gone.slot)

    def _engines_with_inflight_transfers(self) -> set[Any]:
        """Upstream's, plus the peers of staged pulls and of abandoned READs still posted: upstream
        must not remove their agents (its own READs are in ``_recving_transfers``; these are not)."""
        busy = set(super()._engines_with_inflight_transfers())
        busy.update(st.meta.remote.engine_id for st in self._kvl_pulls.values())
        busy.update(gone.engine_id for gone in self._kvl_abandoned.values())
        return busy

    def _kvl_fallback(self, rid: str, st: _Staged, why: str) -> None:
        self._kvl_pulls.pop(rid, None)
        assert self._kvl_alloc is not None
        self._kvl_alloc.free(st.slot)
        if rid in self._kvl_host_only:
            return self._kvl_decline_host(rid, why)
        self._kvl_fell_back(rid, why)
        super()._read_blocks_for_req(rid, st.meta)

    def _kvl_decline_host(self, rid: str, why: str) -> None:
        """P: a host-placed lease that cannot be staged is not read block by block (D gave those
        blocks back to vLLM): the request recomputes, with nothing written to its blocks."""
        self._kvl_host_only.discard(rid)
        self.kvl_counts["declined_host"] += 1
        logger.info("kvlease %s: host-placed lease not staged (%s); recomputing", rid, why)
        self._handle_failed_transfer(rid, None, self._recv_failures, record_failed_transfer=False)

    def _kvl_fell_back(self, rid: str, why: str) -> None:
        self.kvl_counts["fallback"] += 1
        logger.info("kvlease %s: staging fell back to the per-block READ: %s", rid, why)

    def _kvl_release(self, st: _Staged) -> None:
        if st.reply is not None and st.reply.ok:
            msg = StagingRequest(
                STAGING_OP_RELEASE, st.meta.remote.request_id, slot=st.reply.slot, auth=self._kvl_token or ""
            )
            self._kvl_pool.submit(_staging.ask, st.host, st.port, msg, self.kvl_cfg.staging_timeout_s)
            st.reply = None

    def _kvl_release_late(self, st: _Staged) -> Any:
        def release(fut: Future[StagingReply]) -> None:
            try:
                st.reply = fut.result()
            except Exception:
                return
            self._kvl_release(st)

        return release

    def shutdown(self) -> None:
        if self._kvl_server is not None:
            self._kvl_server.stop()
        self._kvl_pool.shutdown(wait=False, cancel_futures=True)
        super().shutdown()
