"""NIXL READ of vLLM-shaped KV blocks on one GPU: per-block, coalesced, and staged pulls.

Needs a CUDA GPU, torch, numpy and NIXL (`pip install nixl-cu13==1.5.1`); no vLLM. Two processes
(D holds the KV and is read from; P initiates the READs), both on GPU 0, talking through UCX
(`cuda_ipc` with `UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on`, which this script sets unless you set it).

The KV layout is vLLM's. ``--kv-regions packed`` (the default: vLLM 0.32 and 0.33, whose NIXL
connector asks for the LBHNC layout) registers ONE region per layer, K and V packed into each
page, `num_blocks x block_size x kv_heads x 2 * head_dim`; ``--kv-regions split`` registers one
region per (layer, K/V), each `num_blocks x block_size x kv_heads x head_dim` (the layout the first
H200 figures were taken with). bf16 either way; a pull of `n` tokens moves `ceil(n / block_size)`
blocks of every region, the same bytes in both layouts, in half as many descriptors when packed.
Block ids are drawn at random on each side, as a long-running server's free pool hands them out.
Methods, per history length:

- ``per_block``: one descriptor per (region, block), as vLLM's NIXL worker posts them (prepped
  descriptor lists of every block on both sides, `make_prepped_xfer` by index). NIXL merges only
  descriptors adjacent on both sides, so random ids leave it one descriptor per block.
- ``coalesced``: the same bytes as one contiguous run per region (one descriptor per region): the
  ceiling.
- ``staged``: D gathers the blocks into a registered contiguous staging buffer (one `index_select`
  per region), P reads it with ONE descriptor and scatters it into its own blocks (`index_copy_`).
  Timed end to end from P's request to D until P's blocks hold the data (the request and the
  answer go over a local pipe, as a control-endpoint call would).
- ``staged_pregathered``: the READ and the scatter only, for a D that stages a leased
  conversation while it is idle (the gather is off the critical path).
- ``torch_copy``: a device-to-device copy of the same bytes (the memory-bandwidth floor).
- with ``--arena``, a lease in D's host arena, run by D's worker code itself
  (``kvlease_vllm._worker_arena.ArenaStore``): ``demote`` (the step's order carried out: the blocks
  gathered into the pinned arena, until the copy is done), and ``arena``: P's pull of it, from the
  request until P's blocks hold the data = D's ``promote`` (arena -> staging buffer, H2D) + ONE
  READ + P's scatter (the path issue 30 chose: a NIXL READ of pinned host memory ran at 0.9 GB/s).

Every method is checked: P's blocks must hold D's data for the drawn ids. Prints a table and, with
``--json FILE``, writes the figures (milliseconds, medians of ``--runs``).

    python benchmarks/gpu_nixl_pull.py --tokens 1024,4096,8192,16384,24576 --json out.json
    python benchmarks/gpu_nixl_pull.py --kv-regions split --json split.json   # the old layout
    python benchmarks/gpu_nixl_pull.py --arena --runs 3 --json arena.json      # + the host arena

kvlease's cost-model defaults (``kvlease_vllm._config.KVLeaseConfig``: ``pull_per_descriptor_s``,
``default_pull_bandwidth_bps``, ``pull_fixed_latency_s``, ``staging_min_descriptors``,
``staging_bandwidth_bps``) are derived from this script's figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Layout:
    layers: int = 64
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    num_blocks: int = 4096
    dtype_bytes: int = 2  # bf16
    kv_regions: str = "packed"  # "packed": one region per layer (vLLM 0.32, 0.33); "split": K, V

    @property
    def regions(self) -> int:
        return self.layers if self.kv_regions == "packed" else 2 * self.layers

    @property
    def block_elems(self) -> int:
        per_head = 2 * self.head_dim if self.kv_regions == "packed" else self.head_dim
        return self.block_size * self.kv_heads * per_head

    @property
    def block_bytes(self) -> int:
        return self.block_elems * self.dtype_bytes

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)


def _value(region: Any, block_ids: Any) -> Any:
    """The value D's block ``block_ids`` of ``region`` holds (exact in bf16: integers < 256)."""
    return ((block_ids * 131 + region * 7) % 251).float()


def _alloc(layout: Layout, max_blocks: int, fill: bool) -> tuple[list[Any], Any]:
    import torch

    caches = []
    for r in range(layout.regions):
        t = torch.empty((layout.num_blocks, layout.block_elems), dtype=torch.bfloat16, device="cuda")
        if fill:
            ids = torch.arange(layout.num_blocks, device="cuda")
            t.copy_(_value(r, ids)[:, None].expand_as(t))
        else:
            t.zero_()
        caches.append(t)
    staging = torch.zeros(
        (layout.regions * max_blocks, layout.block_elems), dtype=torch.bfloat16, device="cuda"
    )
    torch.cuda.synchronize()
    return caches, staging


def _agent(name: str, threads: int, progress_delay_us: int = 0) -> Any:
    if progress_delay_us:
        # kvlease's poll delay for NIXL's progress thread (kvlease_vllm._progress: stdlib only,
        # loaded from the source tree so that no kvlease install is needed on the GPU host)
        import importlib.util
        from pathlib import Path

        src = Path(__file__).resolve().parents[1] / "server_patch" / "kvlease_vllm" / "_progress.py"
        spec = importlib.util.spec_from_file_location("kvlease_progress", src)
        assert spec is not None and spec.loader is not None
        progress = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(progress)
        if not progress.install(progress_delay_us):
            raise SystemExit("NIXL's _api has an unexpected shape: the poll delay does not apply")
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:  # the nixl-cu13 wheel alone, without the `nixl` meta-package
        from nixl_cu13._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"], num_threads=threads))


def _block_descs(np: Any, bases: list[int], layout: Layout) -> Any:
    """Nx3 (address, length, device) for every (region, block): row r * num_blocks + block."""
    offs = np.arange(layout.num_blocks, dtype=np.int64) * layout.block_bytes
    rows = [
        np.stack([b + offs, np.full_like(offs, layout.block_bytes), np.zeros_like(offs)], 1) for b in bases
    ]
    return np.concatenate(rows).astype(np.int64)


def _idle_cores(seconds: float) -> float:
    """This process's CPU over ``seconds`` of doing nothing (NIXL's progress thread, mostly)."""
    import resource

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    c0, t0 = cpu(), time.monotonic()
    time.sleep(seconds)
    return (cpu() - c0) / (time.monotonic() - t0)


def d_main(conn: Any, layout: Layout, max_blocks: int, threads: int, progress_delay_us: int = 0) -> None:
    """D: holds the KV, answers staging requests, serves READs."""
    import torch

    torch.cuda.set_device(0)
    caches, staging = _alloc(layout, max_blocks, fill=True)
    agent = _agent("D", threads, progress_delay_us)
    agent.register_memory([*caches, staging])
    conn.send(
        {
            "meta": agent.get_agent_metadata(),
            "bases": [t.data_ptr() for t in caches],
            "staging": staging.data_ptr(),
        }
    )
    store = None
    while True:
        msg = conn.recv()
        if msg is None:
            break
        if isinstance(msg, dict):  # the host arena, with kvlease's own worker code
            if store is None:
                store = _arena_store(caches, layout, max_blocks)
            conn.send(_arena_op(store, msg, staging))
            continue
        ids = torch.as_tensor(msg, dtype=torch.int64, device="cuda")
        n = ids.numel()
        for r, cache in enumerate(caches):
            torch.index_select(cache, 0, ids, out=staging[r * n : (r + 1) * n])
        torch.cuda.synchronize()
        conn.send(n)


def _arena_store(caches: list[Any], layout: Layout, max_blocks: int) -> Any:
    """D's host arena as its worker runs it (``kvlease_vllm._worker_arena.ArenaStore``): pinned,
    one lease's range of every region's blocks, on its own stream."""
    import torch

    try:
        from kvlease_vllm._worker_arena import ArenaStore
    except ImportError:  # a bare checkout: the source tree next to this script
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        sys.path[:0] = [os.path.join(root, "server_patch"), os.path.join(root, "sdk")]
        from kvlease_vllm._worker_arena import ArenaStore
    views = [c.view(torch.uint8) for c in caches]
    nbytes = layout.regions * max_blocks * layout.block_bytes
    return ArenaStore(nbytes, views, [v.shape[1] for v in views], pin=True, stream=torch.cuda.Stream())


def _arena_op(store: Any, msg: dict[str, Any], staging: Any) -> float:
    """``demote``: the lease ``ids`` written through (the step's orders, as the scheduler sends
    them), its seconds until the copy is done; ``promote``: the lease laid out in the staging
    buffer for P's READ, its seconds."""
    import types

    import torch

    from kvlease_vllm._hostlease import DEMOTES_ATTR, DROPS_ATTR, Demotion

    ids = tuple(int(b) for b in msg["ids"])
    t = time.perf_counter()
    if msg["op"] == "demote":
        order = Demotion("lease", 0, len(ids) * store.block_bytes, ids, device_ok=False)
        meta = types.SimpleNamespace(**{DROPS_ATTR: ("lease",), DEMOTES_ATTR: (order,)})
        mark = torch.cuda.Event()
        store.before_step(meta, lambda: (mark.record(), mark)[1])
        store.wait("lease")
    else:
        if not store.promote("lease", ids, staging.view(torch.uint8).view(-1), 0):
            raise RuntimeError("the lease is not in the arena")
    torch.cuda.synchronize()
    return time.perf_counter() - t


def _staged_read(
    conn: Any, read: tuple[Any, ...], caches: list[Any], staging: Any, p_ids: Any, ask: Any
) -> tuple[float, Any]:
    """P's staged pull: D's answer to ``ask`` (None: nothing to ask, D staged already), ONE READ
    (``read``: agent, local and remote descriptors, D's agent), the scatter into P's blocks
    ``p_ids``; its seconds and D's answer."""
    import torch

    agent, local_one, remote_one, remote = read
    n = len(p_ids)
    t = time.perf_counter()
    answer = None
    if ask is not None:
        conn.send(ask)
        answer = conn.recv()
    h = agent.initialize_xfer("READ", local_one, remote_one, remote)
    _wait(agent, h)
    for r, cache in enumerate(caches):
        cache.index_copy_(0, p_ids, staging[r * n : (r + 1) * n])
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    agent.release_xfer_handle(h)
    return dt, answer


def _wait(agent: Any, handle: Any) -> None:
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"NIXL transfer ended in state {state}")


def _rows(np: Any, layout: Layout, block_ids: Any) -> Any:
    """The prepped-list row of every (region, block): ``r * num_blocks + block``, region-major."""
    return (
        (np.arange(layout.regions)[:, None] * layout.num_blocks + block_ids[None, :]).ravel().astype(np.int32)
    )


def _prepped_read(agent: Any, local_all: Any, li: Any, remote_all: Any, ri: Any) -> float:
    """One READ of prepped descriptors by index, waited for; its seconds."""
    t = time.perf_counter()
    h = agent.make_prepped_xfer("READ", local_all, li, remote_all, ri)
    _wait(agent, h)
    dt = time.perf_counter() - t
    agent.release_xfer_handle(h)
    return dt


def p_main(
    conn: Any,
    layout: Layout,
    tokens: list[int],
    runs: int,
    threads: int,
    seed: int,
    progress_delay_us: int = 0,
    arena: bool = False,
) -> dict[str, Any]:
    """P: initiates every READ, times it, checks the data."""
    import numpy as np
    import torch

    torch.cuda.set_device(0)
    max_blocks = layout.blocks_for(max(tokens))
    caches, staging = _alloc(layout, max_blocks, fill=False)
    agent = _agent("P", threads, progress_delay_us)
    agent.register_memory([*caches, staging])
    info = conn.recv()
    remote = agent.add_remote_agent(info["meta"])
    t0 = time.perf_counter()
    local_all = agent.prep_xfer_dlist(
        "NIXL_INIT_AGENT", _block_descs(np, [t.data_ptr() for t in caches], layout), "VRAM"
    )
    remote_all = agent.prep_xfer_dlist(remote, _block_descs(np, info["bases"], layout), "VRAM")
    prep_ms = (time.perf_counter() - t0) * 1e3 / 2
    rng = np.random.default_rng(seed)
    idle = _idle_cores(3.0)
    print(f"P idle with NIXL's progress thread (delay {progress_delay_us} us): {idle:.3f} cores", flush=True)
    results: dict[str, Any] = {"prep_xfer_dlist_ms_per_side": prep_ms, "p_idle_cores": idle, "rows": []}

    def check(p_ids: Any, d_ids: Any) -> None:
        pi = torch.as_tensor(p_ids, device="cuda")
        di = torch.as_tensor(d_ids, device="cuda")
        for r in (0, layout.regions // 2, layout.regions - 1):
            got = caches[r].index_select(0, pi)[:, [0, -1]].float()
            want = _value(r, di)[:, None].expand_as(got)
            if not torch.equal(got, want):
                raise AssertionError(f"region {r}: P's blocks do not hold D's data")
        for c in caches:
            c.zero_()

    for n_tok in tokens:
        n = layout.blocks_for(n_tok)
        times: dict[str, list[float]] = {
            k: []
            for k in ("per_block", "coalesced", "staged", "staged_pregathered", "torch_copy")
            + (("demote", "promote", "arena") if arena else ())
        }
        for run in range(runs + 1):  # the first run warms up and is not counted
            d_ids = rng.choice(layout.num_blocks, n, replace=False)
            p_ids = rng.choice(layout.num_blocks, n, replace=False)
            keep = run > 0

            # per block, as vLLM's worker posts them
            dt = _prepped_read(
                agent, local_all, _rows(np, layout, p_ids), remote_all, _rows(np, layout, d_ids)
            )
            check(p_ids, d_ids)
            if keep:
                times["per_block"].append(dt)

            # coalesced ceiling: one contiguous run per region on both sides (blocks 0..n-1)
            seq = np.arange(n)
            li = _rows(np, layout, seq)
            dt = _prepped_read(agent, local_all, li, remote_all, li)
            check(seq, seq)
            if keep:
                times["coalesced"].append(dt)

            # staged: D gathers, ONE descriptor, P scatters
            nbytes = layout.regions * n * layout.block_bytes
            local_one = agent.get_xfer_descs([(staging.data_ptr(), nbytes, 0)], "VRAM")
            remote_one = agent.get_xfer_descs([(info["staging"], nbytes, 0)], "VRAM")
            pi = torch.as_tensor(p_ids, device="cuda")
            read = (agent, local_one, remote_one, remote)
            for pre in (False, True):
                dt, _ = _staged_read(conn, read, caches, staging, pi, None if pre else d_ids.tolist())
                check(p_ids, d_ids)
                if keep:
                    times["staged_pregathered" if pre else "staged"].append(dt)

            if arena:  # the lease in D's host arena: D promotes it, P READs it and scatters it
                conn.send({"op": "demote", "ids": d_ids.tolist()})
                demote_s = conn.recv()
                ask = {"op": "promote", "ids": d_ids.tolist()}
                dt, promote_s = _staged_read(conn, read, caches, staging, pi, ask)
                check(p_ids, d_ids)
                if keep:
                    times["arena"].append(dt)
                    times["demote"].append(demote_s)
                    times["promote"].append(promote_s)

            # the memory-bandwidth floor: a device copy of the same bytes
            src = staging[: layout.regions * n]
            dst = torch.empty_like(src)
            torch.cuda.synchronize()
            t = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize()
            if keep:
                times["torch_copy"].append(time.perf_counter() - t)
            del dst
        row = {
            "tokens": n_tok,
            "blocks": n,
            "descriptors_per_block": layout.regions * n,
            "bytes": layout.regions * n * layout.block_bytes,
            **{f"{k}_ms": statistics.median(v) * 1e3 for k, v in times.items()},
        }
        results["rows"].append(row)
        print(
            f"{n_tok:>6} tok {row['descriptors_per_block']:>8} descs | per-block {row['per_block_ms']:8.2f} ms | "
            f"coalesced {row['coalesced_ms']:6.2f} | staged {row['staged_ms']:6.2f} | "
            f"staged (pre-gathered) {row['staged_pregathered_ms']:6.2f} | copy {row['torch_copy_ms']:5.2f}"
            + (
                f" | arena pull {row['arena_ms']:7.2f} (promote {row['promote_ms']:7.2f}, "
                f"demote {row['demote_ms']:7.2f})"
                if arena
                else ""
            ),
            flush=True,
        )
    conn.send(None)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1024,4096,8192,16384,24576")
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument(
        "--kv-regions",
        choices=("packed", "split"),
        default="packed",
        help="packed: one region per layer, K and V in each page (vLLM 0.32, 0.33); "
        "split: one region per layer and K/V (the layout of the first H200 figures)",
    )
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=4, help="NIXL UCX worker threads (vLLM uses 4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--progress-delay-us",
        type=int,
        default=0,
        help="poll delay of NIXL's progress thread (kvlease's nixl_progress_delay_us; 0: NIXL's spin)",
    )
    ap.add_argument(
        "--arena",
        action="store_true",
        help="also the host arena (kvlease_vllm._worker_arena): D demotes a lease, then P's pull is "
        "D's promotion into its staging buffer + one READ + P's scatter",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on")
    import torch.multiprocessing as mp

    layout = Layout(
        args.layers,
        args.kv_heads,
        args.head_dim,
        args.block_size,
        args.num_blocks,
        kv_regions=args.kv_regions,
    )
    tokens = [int(x) for x in args.tokens.split(",")]
    ctx = mp.get_context("spawn")
    p_end, d_end = ctx.Pipe()
    d = ctx.Process(
        target=d_main,
        args=(d_end, layout, layout.blocks_for(max(tokens)), args.threads, args.progress_delay_us),
        daemon=True,
    )
    d.start()
    try:
        res = p_main(
            p_end, layout, tokens, args.runs, args.threads, args.seed, args.progress_delay_us, args.arena
        )
    finally:
        d.join(timeout=60)
        if d.is_alive():
            d.kill()
    import torch

    res.update(
        layout=asdict(layout),
        runs=args.runs,
        threads=args.threads,
        progress_delay_us=args.progress_delay_us,
        gpu=torch.cuda.get_device_name(0),
        torch=torch.__version__,
        ucx_cuda_ipc_get_zcopy=os.environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY"),
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
