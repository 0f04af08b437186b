"""``KVLeaseWorker``'s staged-pull state machine over a stand-in for vLLM's NIXL worker (no vLLM).

What runs is kvlease's own worker code (``kvlease_vllm._worker``, ``_staging``, ``_stagecopy``) on
CPU tensors: D's gather answering a staging request, P's READ deadline, the abandoned READ kept
until NIXL reports it ended, and the peers upstream must not clean up under a staged READ. The
stand-in keeps only the upstream state and helpers the worker calls (their names are checked
against the real 0.32 and 0.33 sources by ``test_vllm_sources``); NIXL is a stub whose READ copies
bytes when the test says it is done. The CUDA stream ordering (D's gather after the engine's last
write) needs a GPU: ``benchmarks/gpu_kvl_copy.py`` checks it on one (``gpu_kvl_copy.json``).
"""

from __future__ import annotations

import time
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fakes.vllm_standin import import_over_fake_vllm

from kvlease.protocol._staging import STAGING_OP_STAGE, StagingRefusal, StagingRequest
from kvlease_vllm import _staging
from kvlease_vllm._config import KVLeaseConfig

REGION_BYTES = (64, 32)
BLOCKS = 16


class _Nixl:
    """NIXL as the worker sees it: READs whose state the test sets; DONE copies the bytes."""

    def __init__(self) -> None:
        self.state: dict[int, str] = {}
        self.reads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # handle -> (src, dst)
        self.released: list[int] = []
        self.notifs: list[tuple[str, bytes]] = []

    def post(self, handle: int, src: torch.Tensor, dst: torch.Tensor) -> int:
        self.state[handle] = "PROC"
        self.reads[handle] = (src, dst)
        return handle

    def finish(self, handle: int, state: str = "DONE") -> None:
        src, dst = self.reads[handle]
        if state == "DONE":
            dst.copy_(src)
        self.state[handle] = state

    def check_xfer_state(self, handle: int) -> str:
        return self.state[handle]

    def release_xfer_handle(self, handle: int) -> None:
        self.released.append(handle)

    def send_notif(self, agent: str, notif_msg: bytes) -> None:
        self.notifs.append((agent, notif_msg))


class _StubUpstreamWorker:
    """vLLM's pull worker, reduced to the state and helpers KVLeaseWorker uses (bodies as 0.33's)."""

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        self.vllm_config = vllm_config
        self.engine_id = engine_id
        self.kv_cache_config = kv_cache_config
        self.nixl_wrapper = _Nixl()
        self.xfer_stats = types.SimpleNamespace(record_failed_notification=lambda: None)
        self._recving_transfers: dict[str, list[int]] = {}
        self._recving_metadata: dict[str, Any] = {}
        self._recv_failures: set[str] = set()
        self._reqs_to_send: dict[str, float] = {}
        self._reqs_to_process: set[str] = set()
        self.per_block: list[str] = []

    def _engines_with_inflight_transfers(self) -> set[str]:
        return {
            meta.remote.engine_id
            for req_id in self._recving_transfers
            if (meta := self._recving_metadata.get(req_id)) is not None and meta.remote is not None
        }

    def _try_release_xfer_handle(self, req_id: str, handle: int) -> bool:
        try:
            self.nixl_wrapper.release_xfer_handle(handle)
        except Exception:
            return False
        return True

    def _handle_failed_transfer(
        self,
        req_id: str,
        handle: int | None,
        failed_req_ids: set[str] | None = None,
        record_failed_transfer: bool = True,
    ) -> bool:
        if failed_req_ids is not None:
            failed_req_ids.add(req_id)
        return handle is None or self._try_release_xfer_handle(req_id, handle)

    def _read_blocks_for_req(self, req_id: str, meta: Any) -> None:
        self.per_block.append(req_id)

    def start_load_kv(self, metadata: Any) -> None:
        for req_id, expires in getattr(metadata, "reqs_to_send", {}).items():
            self._reqs_to_send[req_id] = expires

    def shutdown(self) -> None:
        return None


@pytest.fixture
def worker_mod(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """``kvlease_vllm._worker`` imported over a fake vLLM 0.33 whose NIXL worker is the stand-in."""
    yield from import_over_fake_vllm(
        monkeypatch,
        "kvlease_vllm._worker",
        nixl={"NixlPullConnectorWorker": _StubUpstreamWorker},
        role=object,
        device_type="cpu",
    )


def _kv(seed: int) -> torch.Tensor:
    """One KV storage of BLOCKS rows: region 0 is bytes [0, 64), region 1 bytes [64, 96) of a row."""
    return torch.randint(
        0, 255, (BLOCKS, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def _worker(worker_mod: types.ModuleType, kv: torch.Tensor, buffer_bytes: int) -> Any:
    """A worker with its staging set up as ``register_kv_caches`` leaves it (on a GPU, with its
    own staging stream)."""
    from kvlease_vllm._stagecopy import StagingCopier, region_views

    w = worker_mod.KVLeaseWorker(None, "engine-x", None, KVLeaseConfig(control_secret="s", staging="always"))
    base = kv.data_ptr()
    got = region_views([kv], [base, base + 64], list(REGION_BYTES), [96, 96], [BLOCKS, BLOCKS])
    assert not isinstance(got, str)
    w._kvl_views, w._kvl_region_bytes = got
    w._kvl_buffer = torch.zeros(buffer_bytes, dtype=torch.uint8, device=kv.device)
    w._kvl_alloc = _staging.RangeAllocator(buffer_bytes)
    w._kvl_stream = torch.cuda.Stream(device=kv.device) if kv.is_cuda else None
    w._kvl_copier = StagingCopier(w._kvl_buffer, w._kvl_views, w._kvl_region_bytes, w._kvl_stream)
    return w


def _packed(kv: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return torch.cat([kv[ids, :64].reshape(-1), kv[ids, 64:].reshape(-1)])


# ------------------------------------------------------------------------------ D side
def test_d_gathers_and_holds_the_range_past_p_read_deadline(worker_mod: types.ModuleType) -> None:
    kv = _kv(1)
    d = _worker(worker_mod, kv, buffer_bytes=8192)
    d._reqs_to_send["lease-1"] = time.perf_counter() + 60.0
    ids = (5, 2, 11)
    req = StagingRequest(STAGING_OP_STAGE, "lease-1", ids, REGION_BYTES, read_deadline_ms=12_000)
    t0 = time.perf_counter()
    reply = d._kvl_serve(req)
    assert reply.ok and reply.nbytes == 3 * 96
    offset = reply.address - d._kvl_buffer.data_ptr()
    assert torch.equal(d._kvl_buffer[offset : offset + reply.nbytes], _packed(kv, list(ids)))
    # nothing else is staged over those bytes until P releases them or its READ deadline is long past
    ((_, _, expires),) = d._kvl_alloc._ranges.values()
    assert expires - t0 > _staging.range_hold_s(12.0) - 1.0 > 12.0
    whole = StagingRequest(
        STAGING_OP_STAGE, "lease-1", tuple(range(BLOCKS)), REGION_BYTES, read_deadline_ms=1000
    )
    busy = d._kvl_serve(
        StagingRequest(STAGING_OP_STAGE, "lease-1", (0,) * 80, REGION_BYTES, read_deadline_ms=1)
    )
    assert not busy.ok and busy.refusal == StagingRefusal.BUSY
    again = d._kvl_serve(whole)  # 1536 more bytes fit after the held range, never over it
    assert again.ok and again.address - d._kvl_buffer.data_ptr() >= offset + _staging.ALIGN


def test_d_refuses_a_request_without_a_read_deadline(worker_mod: types.ModuleType) -> None:
    d = _worker(worker_mod, _kv(2), buffer_bytes=8192)
    d._reqs_to_send["lease-1"] = time.perf_counter() + 60.0
    for ms, why in ((0, "older kvlease P"), (int(_staging.READ_DEADLINE_MAX_S * 1e3) + 1, "too long")):
        reply = d._kvl_serve(
            StagingRequest(STAGING_OP_STAGE, "lease-1", (1,), REGION_BYTES, read_deadline_ms=ms)
        )
        assert not reply.ok and reply.refusal == StagingRefusal.BAD_REQUEST and why in reply.detail
    assert d._kvl_alloc.in_use() == 0


# ------------------------------------------------------------------------------ P side
def _staged_read(
    worker_mod: types.ModuleType, p: Any, d_bytes: torch.Tensor, local: list[int], read_by: float
) -> Any:
    """A staged pull whose READ P has posted (what ``_kvl_on_answer`` leaves)."""
    from concurrent.futures import Future

    slot, offset = p._kvl_alloc.alloc(d_bytes.numel(), now=0.0, hold_s=float("inf"))
    meta = types.SimpleNamespace(remote=types.SimpleNamespace(engine_id="engine-d", request_id="lease-1"))
    st = worker_mod._Staged(
        meta=meta,
        future=Future(),
        deadline=time.perf_counter() + 2.0,
        host="127.0.0.1",
        port=1,
        agent="agent-d",
        notif=b"lease-1:1",
        local_ids=local,
        slot=slot,
        offset=offset,
        nbytes=d_bytes.numel(),
        read_by=read_by,
        stage=worker_mod._READ,
    )
    st.handle = p.nixl_wrapper.post(7, d_bytes, p._kvl_buffer[offset : offset + d_bytes.numel()])
    p._recving_metadata["req-p"] = meta
    p._kvl_pulls["req-p"] = st
    return st


def test_p_scatters_a_read_done_by_its_deadline(worker_mod: types.ModuleType) -> None:
    d_kv, p_kv = _kv(3), _kv(4)
    p = _worker(worker_mod, p_kv, buffer_bytes=8192)
    _staged_read(worker_mod, p, _packed(d_kv, [1, 2, 3]), [9, 4, 6], time.perf_counter() + 30.0)
    p._kvl_advance()
    assert "req-p" in p._kvl_pulls and p._kvl_alloc.in_use() == 1  # still reading
    p.nixl_wrapper.finish(7)
    p._kvl_advance()
    assert torch.equal(p_kv[[9, 4, 6]], d_kv[[1, 2, 3]])
    assert p._recving_transfers == {"req-p": []} and p._recv_failures == set()
    assert p.nixl_wrapper.released == [7] and p._kvl_alloc.in_use() == 0
    assert p.nixl_wrapper.notifs == [("agent-d", b"lease-1:1")]


def test_p_declines_a_read_done_after_its_deadline(worker_mod: types.ModuleType) -> None:
    d_kv, p_kv = _kv(5), _kv(6)
    p = _worker(worker_mod, p_kv, buffer_bytes=8192)
    before = p_kv.clone()
    _staged_read(worker_mod, p, _packed(d_kv, [1, 2]), [9, 4], time.perf_counter() - 0.001)
    p.nixl_wrapper.finish(7)  # done, but seen only past the deadline: D may have reused its range
    p._kvl_advance()
    assert torch.equal(p_kv, before)  # never scattered
    assert p._recv_failures == {"req-p"} and "req-p" not in p._recving_transfers  # recomputes
    assert p.nixl_wrapper.released == [7] and p._kvl_alloc.in_use() == 0
    assert p.kvl_counts["late"] == 1 and not p._kvl_pulls


def test_p_gives_up_a_posted_read_but_keeps_its_handle_and_range_until_it_ends(
    worker_mod: types.ModuleType,
) -> None:
    d_kv, p_kv = _kv(7), _kv(8)
    p = _worker(worker_mod, p_kv, buffer_bytes=8192)
    before = p_kv.clone()
    _staged_read(worker_mod, p, _packed(d_kv, [1, 2]), [9, 4], time.perf_counter() - 0.001)
    p._kvl_advance()
    # the request recomputes now: its blocks were never the READ's destination
    assert p._recv_failures == {"req-p"} and not p._kvl_pulls
    # the READ still runs into P's staging range: neither released nor handed out again
    assert p.nixl_wrapper.released == [] and p._kvl_alloc.in_use() == 1
    assert p._kvl_alloc.alloc(8192, now=1e12, hold_s=1.0) is None
    assert "engine-d" in p._engines_with_inflight_transfers()  # upstream keeps D's agent
    for _ in range(3):
        p._kvl_advance()
    assert p.nixl_wrapper.released == []
    p.nixl_wrapper.finish(7)
    p._kvl_advance()
    assert p.nixl_wrapper.released == [7] and p._kvl_alloc.in_use() == 0
    assert "engine-d" not in p._engines_with_inflight_transfers()
    assert torch.equal(p_kv, before)


# ------------------------------------------------------------------------------ upstream's clean-up
def test_engines_under_staged_reads_count_as_in_flight(worker_mod: types.ModuleType) -> None:
    p = _worker(worker_mod, _kv(9), buffer_bytes=8192)
    upstream = types.SimpleNamespace(remote=types.SimpleNamespace(engine_id="engine-u"))
    p._recving_metadata["req-u"] = upstream
    p._recving_transfers["req-u"] = [3]  # upstream's own per-block READ
    assert p._engines_with_inflight_transfers() == {"engine-u"}
    _staged_read(worker_mod, p, _packed(_kv(10), [1]), [2], time.perf_counter() + 30.0)
    # upstream's own view (what 0.32 and 0.33 read) misses the staged READ, posted against engine-d
    assert _StubUpstreamWorker._engines_with_inflight_transfers(p) == {"engine-u"}
    assert p._engines_with_inflight_transfers() == {"engine-u", "engine-d"}
