"""The host arena on one GPU: demotion, promotion and scatter, with kvlease's own code (issue 30).

Needs torch (CUDA for the real figures); no vLLM, no NIXL. Runs ``kvlease_vllm._arena`` (the lease
budget: each history is admitted as a lease and its range taken from the arena) and
``kvlease_vllm._arena_copy`` (the copy kernels D's worker calls), imported from the package, whose
``__init__`` imports nothing (no vLLM: the script checks and reports it); put the repository's
``server_patch`` and ``sdk`` on ``PYTHONPATH``, or run it from a checkout (it falls back to the
source tree next to it).

The KV layout is the 32B-class one as vLLM 0.33 registers it: ONE region per layer with K and V
packed, each ``num_blocks x 2 x block_size x kv_heads x head_dim`` (bf16), so a block is 64 KiB per
layer and a token 256 KiB over 64 layers. Block ids are drawn at random, as a long-running server's
free pool hands them out. Per history length:

- ``demote``: ``_arena_copy.demote`` gathers the lease's blocks of every layer into a pinned host
  arena, region-major, on a side stream (chunks gathered into the halves of a device scratch
  buffer of ``--scratch-mib``, in turns, one D2H each); against ``d2h``: a plain pinned copy of the
  same bytes from a contiguous device buffer.
- ``promote``: ``_arena_copy.promote`` copies the lease's range of the arena into a device staging
  buffer (the path issue 30 picked: D promotes, P reads D's staging buffer as today); against
  ``h2d``: a plain pinned host-to-device copy of the same bytes.
- ``scatter``: ``_arena_copy.scatter`` writes the staged bytes into other random blocks (what P
  does after its READ); ``scatter_host``: the same straight from the arena (chunked H2D).
- ``matmul``: the slowdown of a bf16 matmul loop on the default stream (a stand-in for decode
  steps) while demotions of the longest history run on the side stream.

Every copy is checked on the device against the KV itself: a mismatch exits 1. Prints a table and,
with ``--json FILE``, writes the figures (milliseconds, medians of ``--runs``) and the goals.

    python benchmarks/gpu_arena.py --json out.json
    python benchmarks/gpu_arena.py --cpu --tokens 256      # a smoke test without a GPU
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

try:
    from kvlease_vllm import _arena, _arena_copy
except ImportError:  # a bare checkout: the source tree next to this script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server_patch"))
    from kvlease_vllm import _arena, _arena_copy

GOALS = {
    "demote_pct_of_d2h_min": 80.0,
    "promote_pct_of_h2d_min": 80.0,
    "promote_ms_max_at_24k": 150.0,
    "matmul_slowdown_pct_max": 5.0,
}
MiB = 1 << 20


@dataclass(frozen=True)
class Layout:
    layers: int = 64
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    num_blocks: int = 4096
    dtype_bytes: int = 2  # bf16

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (2, self.block_size, self.kv_heads, self.head_dim)  # K and V packed

    @property
    def row_bytes(self) -> int:
        return math.prod(self.block_shape) * self.dtype_bytes

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def lease_bytes(self, tokens: int) -> int:
        return _arena_copy.lease_bytes([self.row_bytes] * self.layers, self.blocks_for(tokens))


class Bench:
    def __init__(self, layout: Layout, device: str, scratch_mib: int, runs: int, seed: int, max_tokens: int):
        import torch

        self.torch, self.layout, self.device, self.runs = torch, layout, torch.device(device), runs
        self.cuda = self.device.type == "cuda"
        self.rng = random.Random(seed)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self.regions = [
            torch.randn(
                (layout.num_blocks, *layout.block_shape),
                dtype=torch.bfloat16,
                device=self.device,
                generator=gen,
            )
            for _ in range(layout.layers)
        ]
        cap = _arena.ArenaAllocator(0).size_of(layout.lease_bytes(max_tokens))
        self.core = _arena.HostArena(cap)
        self.arena = torch.empty(cap, dtype=torch.uint8, pin_memory=self.cuda)
        self.staging = torch.empty(cap, dtype=torch.uint8, device=self.device)
        self.scratch = torch.empty(scratch_mib * MiB, dtype=torch.uint8, device=self.device)
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self.mismatches: list[str] = []
        self.sync()

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def timed(self, fn: Callable[[], Any]) -> float:
        """Median wall time (ms) of ``fn`` until its copy is done (one warm-up run first)."""
        out = []
        for i in range(self.runs + 1):
            self.sync()
            t0 = time.perf_counter()
            handle = fn()
            if handle is not None:
                handle.wait()
            self.sync()
            if i:
                out.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(out)

    def plain(self, dst: Any, src: Any) -> Any:
        """A plain pinned copy on the side stream (the reference rate)."""
        if self.stream is None:
            dst.copy_(src)
            return None
        with self.torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        return None

    def check(self, what: str, ids: list[int], packed: Any = None, dst_ids: list[int] | None = None) -> None:
        """The packed bytes (or the blocks ``dst_ids``) hold exactly the KV of blocks ``ids``."""
        torch = self.torch
        idx = torch.as_tensor(ids, device=self.device)
        n, row = len(ids), self.layout.row_bytes
        for r, region in enumerate(self.regions):
            flat = region.view(region.shape[0], -1)
            want = flat.index_select(0, idx)
            if packed is not None:
                got = packed[r * n * row : (r + 1) * n * row].view(torch.bfloat16).view(n, -1)
            else:
                got = flat.index_select(0, torch.as_tensor(dst_ids, device=self.device))
            if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                self.mismatches.append(f"{what}: layer {r} differs")
                return

    def history(self, tokens: int) -> dict[str, Any]:
        torch, lay = self.torch, self.layout
        n = lay.blocks_for(tokens)
        ids = self.rng.sample(range(lay.num_blocks), 2 * n)
        src, dst = ids[:n], ids[n:]
        nbytes = lay.lease_bytes(tokens)
        lease = f"history-{tokens}"
        admitted = self.core.admit(lease, nbytes, 60.0, time.perf_counter())
        if admitted.offset is None:
            raise SystemExit(f"the arena refused {tokens} tokens: {admitted.refusal}")
        off = admitted.offset
        self.core.pin(lease, "bench", time.perf_counter(), 30.0)
        arena, staging = self.arena[off : off + nbytes], self.staging[:nbytes]
        cp, side = _arena_copy, {"stream": self.stream}

        d2h = self.timed(lambda: self.plain(arena, staging))
        demote = self.timed(
            lambda: cp.demote(self.regions, src, self.arena, off, scratch=self.scratch, **side)
        )
        h2d = self.timed(lambda: self.plain(staging, arena))
        staging.zero_()
        promote = self.timed(lambda: cp.promote(self.arena, off, nbytes, self.staging, 0, **side))
        self.check(f"{tokens} tokens: demote + promote", src, packed=self.staging)
        scatter = self.timed(lambda: cp.scatter(self.staging, 0, self.regions, dst, **side))
        self.check(f"{tokens} tokens: scatter", src, dst_ids=dst)
        for region in self.regions:
            region.view(region.shape[0], -1).index_fill_(0, torch.as_tensor(dst, device=self.device), 0)
        scatter_host = self.timed(
            lambda: cp.scatter(self.arena, off, self.regions, dst, scratch=self.scratch, **side)
        )
        self.check(f"{tokens} tokens: scatter from the arena", src, dst_ids=dst)
        self.core.unpin(lease, "bench", time.perf_counter())
        self.core.release(lease, time.perf_counter())

        def gbs(ms: float) -> float:
            return nbytes / (ms / 1e3) / 1e9

        return {
            "tokens": tokens,
            "blocks": n,
            "bytes": nbytes,
            "d2h_ms": d2h,
            "demote_ms": demote,
            "demote_gbs": gbs(demote),
            "demote_pct_of_d2h": 100.0 * d2h / demote,
            "h2d_ms": h2d,
            "promote_ms": promote,
            "promote_gbs": gbs(promote),
            "promote_pct_of_h2d": 100.0 * h2d / promote,
            "scatter_ms": scatter,
            "scatter_host_ms": scatter_host,
        }

    def matmul_slowdown(self, tokens: int, demote_ms: float, dim: int, loop_s: float) -> dict[str, Any]:
        """A bf16 matmul loop on the default stream, alone and while demotions of ``tokens`` run."""
        torch = self.torch
        a = torch.randn(dim, dim, dtype=torch.bfloat16, device=self.device)
        b, c = torch.randn_like(a), torch.empty_like(a)
        n = self.layout.blocks_for(tokens)
        src = self.rng.sample(range(self.layout.num_blocks), n)
        nbytes = self.layout.lease_bytes(tokens)
        off = self.core.admit("under-load", nbytes, 60.0, time.perf_counter()).offset
        assert off is not None, "every history was released: the arena is free"

        def loop(k: int) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(k):
                torch.matmul(a, b, out=c)
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end))

        loop(20)
        k = max(20, math.ceil(loop_s * 1e3 / (loop(20) / 20)))
        alone = statistics.median(loop(k) for _ in range(3))
        together, demoted = [], []
        for _ in range(3):
            self.sync()
            ready = torch.cuda.Event()
            ready.record()  # "the step that wrote the last token"
            s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s0.record(self.stream)
            m = math.ceil(alone / demote_ms) + 2  # demotions cover the whole loop
            for _ in range(m):
                _arena_copy.demote(
                    self.regions, src, self.arena, off, stream=self.stream, after=ready, scratch=self.scratch
                )
            s1.record(self.stream)
            together.append(loop(k))
            s1.synchronize()
            demoted.append(s0.elapsed_time(s1) / m)
        _arena_copy.promote(self.arena, off, nbytes, self.staging, 0, stream=self.stream).wait()
        self.check("demotions beside the matmul loop", src, packed=self.staging)
        self.core.release("under-load", time.perf_counter())
        return {
            "dim": dim,
            "matmuls": k,
            "alone_ms": alone,
            "with_demotion_ms": statistics.median(together),
            "slowdown_pct": 100.0 * (statistics.median(together) / alone - 1.0),
            "demote_ms_under_load": statistics.median(demoted),
            "tokens": tokens,
        }


def print_table(res: dict[str, Any]) -> None:
    print(
        f"\nhost arena on {res['device']} ({res['layout']['layers']} layers x 64 KiB blocks, chunks of {res['scratch_mib']} MiB)"
    )
    head = ("tokens", "MiB", "d2h", "demote", "% d2h", "h2d", "promote", "% h2d", "scatter", "scat.host")
    print("  ".join(f"{h:>9}" for h in head))
    for r in res["rows"]:
        cells = (
            r["tokens"],
            f"{r['bytes'] / MiB:.0f}",
            f"{r['d2h_ms']:.2f}",
            f"{r['demote_ms']:.2f}",
            f"{r['demote_pct_of_d2h']:.0f}",
            f"{r['h2d_ms']:.2f}",
            f"{r['promote_ms']:.2f}",
            f"{r['promote_pct_of_h2d']:.0f}",
            f"{r['scatter_ms']:.2f}",
            f"{r['scatter_host_ms']:.2f}",
        )
        print("  ".join(f"{c:>9}" for c in cells))
    if res.get("matmul"):
        mm = res["matmul"]
        print(
            f"matmul {mm['dim']}^3 x {mm['matmuls']}: {mm['alone_ms']:.1f} ms alone, "
            f"{mm['with_demotion_ms']:.1f} ms beside demotions of {mm['tokens']} tokens "
            f"({mm['slowdown_pct']:+.1f} %; a demotion took {mm['demote_ms_under_load']:.1f} ms meanwhile)"
        )
    for name, ok in res["goals"].items():
        print(f"goal {name}: {'met' if ok else 'MISSED' if ok is False else 'not measured'}")
    print(
        "data: "
        + ("every copy checked, all equal" if res["data_ok"] else "MISMATCH: " + "; ".join(res["mismatches"]))
    )


def goals(rows: list[dict[str, Any]], matmul: dict[str, Any] | None, cuda: bool) -> dict[str, bool | None]:
    if not cuda or not rows:
        return dict.fromkeys(GOALS)
    last = rows[-1]
    return {
        "demote_pct_of_d2h_min": all(r["demote_pct_of_d2h"] >= GOALS["demote_pct_of_d2h_min"] for r in rows),
        "promote_pct_of_h2d_min": all(
            r["promote_pct_of_h2d"] >= GOALS["promote_pct_of_h2d_min"] for r in rows
        ),
        "promote_ms_max_at_24k": last["promote_ms"] <= GOALS["promote_ms_max_at_24k"]
        if last["tokens"] >= 24576
        else None,
        "matmul_slowdown_pct_max": matmul["slowdown_pct"] <= GOALS["matmul_slowdown_pct_max"]
        if matmul
        else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1024,2048,4096,8192,16384,24576")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (a smoke test of the code path)")
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--num-blocks", type=int, default=None, help="per layer (default 4096 on a GPU)")
    ap.add_argument("--scratch-mib", type=int, default=None, help="device chunk (default 64, 4 on CPU)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--matmul-dim", type=int, default=8192)
    ap.add_argument("--matmul-seconds", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    import torch

    tokens = sorted(int(x) for x in args.tokens.split(","))
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --cpu for a smoke test")
    block_size = Layout().block_size
    need_blocks = 2 * math.ceil(tokens[-1] / block_size)
    num_blocks = args.num_blocks or (need_blocks + 16 if args.cpu else max(4096, need_blocks))
    if num_blocks < need_blocks:
        raise SystemExit(f"--num-blocks {num_blocks}: {need_blocks} needed (source and destination ids)")
    layout = Layout(layers=args.layers, num_blocks=num_blocks)
    scratch_mib = args.scratch_mib or (4 if args.cpu else 64)
    bench = Bench(layout, "cpu" if args.cpu else "cuda", scratch_mib, args.runs, args.seed, tokens[-1])
    rows = []
    for t in tokens:
        rows.append(bench.history(t))
        print(f"{t} tokens done", file=sys.stderr, flush=True)
    matmul = None
    if bench.cuda:
        matmul = bench.matmul_slowdown(
            tokens[-1], rows[-1]["demote_ms"], args.matmul_dim, args.matmul_seconds
        )
    res = {
        "benchmark": "gpu_arena",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["python", *sys.argv]),
        "device": torch.cuda.get_device_name() if bench.cuda else "cpu",
        "torch": torch.__version__,
        "vllm_imported": "vllm" in sys.modules,
        "layout": {**asdict(layout), "row_bytes": layout.row_bytes, "regions": layout.layers},
        "scratch_mib": scratch_mib,
        "runs": args.runs,
        "rows": rows,
        "matmul": matmul,
        "arena": bench.core.counters().metrics(),
        "goals": goals(rows, matmul, bench.cuda),
        "data_ok": not bench.mismatches,
        "mismatches": bench.mismatches,
    }
    print_table(res)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0 if res["data_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
