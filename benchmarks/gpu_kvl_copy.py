"""kvlease's staged-pull copies on one GPU: the engine thread never waits, D's gather waits for the mark.

Runs kvlease's own copy code (``kvlease_vllm._stagecopy``: the ``StagingCopier`` and the region
mapping ``KVLeaseWorker`` uses) on vLLM-0.33-shaped KV (one region per layer, K and V packed, all
layers in one backing allocation). Needs torch with CUDA; no vLLM, no NIXL. Two checks:

- ``stall``: a ~200 ms kernel (``torch.cuda._sleep``) is queued on the default stream, which vLLM's
  GPU model runner computes on; then P's scatter and D's gather are called from the same thread.
  Each must return in well under the kernel's time (the index goes to the device from pinned
  memory on the staging stream). For contrast it times what the copy used to start with, a
  pageable ``torch.as_tensor(ids, device="cuda")``, which waits for the kernel.
- ``ordering``: an "engine" thread makes a non-default stream current, queues a ~200 ms kernel and
  then a write into block B, and records the engine's mark (``StagingCopier.mark``); another
  thread gathers B after that mark and must see the write. For contrast a second write is gathered
  without the mark (that gather may read the bytes from before the write).

``--cpu`` runs the same logic on CPU tensors (no streams: every copy is synchronous), to check the
script itself. Prints one line per check and, with ``--json FILE``, writes the figures. Exit status
0 when every check passes.

    PYTHONPATH=server_patch:sdk python3 benchmarks/gpu_kvl_copy.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any

try:
    import kvlease_vllm  # noqa: F401
except ImportError:  # run from a checkout: the package roots are beside this directory
    _root = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(_root / "server_patch"), str(_root / "sdk")]

import torch

from kvlease_vllm._stagecopy import StagingCopier, region_views


def _build(args: argparse.Namespace, device: str) -> tuple[torch.Tensor, StagingCopier, Any]:
    """One backing allocation of ``layers`` regions, each ``num_blocks x block_bytes`` (0.33's
    single KV tensor), mapped by kvlease's own ``region_views``; a staging buffer for ``blocks``."""
    layers, nb, bb = args.layers, args.num_blocks, args.block_bytes
    kv = torch.randint(0, 255, (layers * nb * bb,), dtype=torch.uint8, device=device)
    base = kv.data_ptr()
    got = region_views(
        [kv], [base + i * nb * bb for i in range(layers)], [bb] * layers, [bb] * layers, [nb] * layers
    )
    if isinstance(got, str):
        raise SystemExit(f"region mapping failed: {got}")
    views, region_bytes = got
    stream = torch.cuda.Stream(device=device) if device != "cpu" else None
    buffer = torch.zeros(args.blocks * sum(region_bytes), dtype=torch.uint8, device=device)
    return kv, StagingCopier(buffer, views, region_bytes, stream), views


def _cycles_per_ms(device: str) -> float:
    if device == "cpu":
        return 0.0
    torch.cuda._sleep(1000)  # warm
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    torch.cuda._sleep(20_000_000)
    e1.record()
    e1.synchronize()
    return 20_000_000 / e0.elapsed_time(e1)


def _sleep(device: str, ms: float, cycles_per_ms: float) -> None:
    """Queue ~``ms`` of GPU work on the current stream (CPU: nothing; copies are synchronous)."""
    if device != "cpu":
        torch.cuda._sleep(int(ms * cycles_per_ms))


def _expected(views: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    return torch.cat([v[ids].reshape(-1) for v in views])


def check_stall(args: argparse.Namespace, device: str, cycles_per_ms: float) -> dict[str, Any]:
    _kv, copier, views = _build(args, device)
    gen = torch.Generator().manual_seed(0)
    src = torch.randperm(args.num_blocks, generator=gen)[: args.blocks].tolist()
    dst = torch.randperm(args.num_blocks, generator=gen)[: args.blocks].tolist()
    for _ in range(3):  # warm: pinned host blocks, the allocator, the kernels
        copier.gather(src, 0)
        event = copier.scatter(src, 0)
        if event is not None:
            event.synchronize()
    want = _expected(views, src).clone()  # what P's blocks dst must hold after the scatter

    def timed(call: Any) -> tuple[float, float]:
        """(ms the call took, ms until the default stream's kernel ended), kernel queued first."""
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        _sleep(device, args.sleep_ms, cycles_per_ms)
        t1 = time.perf_counter()
        out = call()
        t2 = time.perf_counter()
        if device != "cpu":
            torch.cuda.current_stream().synchronize()
        t3 = time.perf_counter()
        timed.out = out  # type: ignore[attr-defined]
        return (t2 - t1) * 1e3, (t3 - t0) * 1e3

    gather_ms, gather_kernel_ms = timed(lambda: copier.gather(src, 0))
    gathered_ok = torch.equal(copier.buffer, want)
    scatter_ms, kernel_ms = timed(lambda: copier.scatter(dst, 0))
    event = timed.out  # type: ignore[attr-defined]
    if event is not None:
        event.synchronize()
    scattered_ok = torch.equal(_expected(views, dst), want)
    pageable_ms, _ = timed(lambda: torch.as_tensor(dst, dtype=torch.int64, device=device))
    limit_ms = max(args.call_limit_ms, 0.0)
    ok = gathered_ok and scattered_ok and scatter_ms < limit_ms and gather_ms < limit_ms
    if device != "cpu":
        ok = ok and kernel_ms > 4 * limit_ms  # the kernel really ran that long
    return {
        "check": "stall",
        "pass": ok,
        "kernel_ms": round(kernel_ms, 3),
        "gather_kernel_ms": round(gather_kernel_ms, 3),
        "scatter_call_ms": round(scatter_ms, 4),
        "gather_call_ms": round(gather_ms, 4),
        "pageable_index_ms": round(pageable_ms, 3),
        "call_limit_ms": limit_ms,
        "bytes": copier.nbytes(len(src)),
        "blocks": len(src),
        "copied_right": gathered_ok and scattered_ok,
    }


def check_ordering(args: argparse.Namespace, device: str, cycles_per_ms: float) -> dict[str, Any]:
    _kv, copier, views = _build(args, device)
    block = 5
    marks: queue.Queue[Any] = queue.Queue()
    go = threading.Event()

    def engine() -> None:
        stream = torch.cuda.Stream(device=device) if device != "cpu" else None
        ctx = torch.cuda.stream(stream) if stream is not None else _Null()
        with ctx:
            for value in (7, 9):  # with the mark, then without it
                _sleep(device, args.sleep_ms, cycles_per_ms)
                for v in views:
                    v[block].fill_(value)
                marks.put((value, copier.mark()))
                go.wait(timeout=30)
                go.clear()
        if stream is not None:
            stream.synchronize()

    seen: dict[str, Any] = {}

    def staging() -> None:
        value, mark = marks.get(timeout=30)
        t0 = time.perf_counter()
        copier.gather([block], 0, after=mark)
        seen["with_mark_ms"] = (time.perf_counter() - t0) * 1e3
        seen["with_mark"] = bool((copier.buffer[: copier.nbytes(1)] == value).all())
        go.set()
        value, _ = marks.get(timeout=30)
        copier.gather([block], 0, after=None)
        seen["without_mark"] = bool((copier.buffer[: copier.nbytes(1)] == value).all())
        go.set()

    threads = [threading.Thread(target=engine), threading.Thread(target=staging)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    ok = seen.get("with_mark") is True
    return {
        "check": "ordering",
        "pass": ok,
        "gather_saw_write_after_mark": seen.get("with_mark"),
        "gather_waited_ms": round(seen.get("with_mark_ms", -1.0), 3),
        "gather_saw_write_without_mark": seen.get("without_mark"),
    }


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="run the logic on CPU tensors (no CUDA)")
    ap.add_argument("--layers", type=int, default=None, help="KV regions (default 64; 4 with --cpu)")
    ap.add_argument(
        "--num-blocks", type=int, default=None, help="blocks per region (default 2048; 64 with --cpu)"
    )
    ap.add_argument(
        "--block-bytes",
        type=int,
        default=None,
        help="bytes per block per region (default 65536; 512 with --cpu)",
    )
    ap.add_argument("--blocks", type=int, default=None, help="blocks per copy (default 1536; 32 with --cpu)")
    ap.add_argument("--sleep-ms", type=float, default=200.0, help="the queued kernel's length")
    ap.add_argument("--call-limit-ms", type=float, default=5.0, help="what a non-blocking call may take")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args(argv)
    small = args.cpu
    args.layers = args.layers or (4 if small else 64)
    args.num_blocks = args.num_blocks or (64 if small else 2048)
    args.block_bytes = args.block_bytes or (512 if small else 65536)
    args.blocks = min(args.blocks or (32 if small else 1536), args.num_blocks)
    if args.cpu:
        device = "cpu"
    elif torch.cuda.is_available():
        device = "cuda:0"
        torch.cuda.set_device(0)
    else:
        print("no CUDA device: run with --cpu to check the logic", file=sys.stderr)
        return 2
    cycles = _cycles_per_ms(device)
    results = [check_stall(args, device, cycles), check_ordering(args, device, cycles)]
    for r in results:
        print(("PASS " if r["pass"] else "FAIL ") + json.dumps(r))
    report = {
        "device": torch.cuda.get_device_name(0) if device != "cpu" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "layout": {
            "layers": args.layers,
            "num_blocks": args.num_blocks,
            "block_bytes": args.block_bytes,
            "blocks_per_copy": args.blocks,
        },
        "sleep_ms": args.sleep_ms,
        "cycles_per_ms": cycles,
        "results": results,
        "pass": all(r["pass"] for r in results),
    }
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
