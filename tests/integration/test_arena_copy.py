"""The host arena's copy kernels on the vLLM venv's torch (issue 30).

A lease's blocks of every KV region, as ``KVLeaseWorker._kvl_map_regions`` maps them (uint8 rows
of one flat storage, strided), demoted into an arena range the arena core hands out, promoted into
a staging buffer and scattered into other blocks must come back bit for bit, directly and in
chunks through scratch memory; and the GPU benchmark's own smoke run must pass its data checks.
On a CUDA device (none on the CPU stack) the same round trip also runs on the GPU.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import random, sys
import torch
from kvlease_vllm import _arena, _arena_copy as cp

def round_trip(device, scratch_bytes, pinned):
    rng = random.Random(scratch_bytes)
    blocks, layers, row = 64, 6, 2048  # a layer's K and V rows side by side in one storage
    flat = torch.randint(0, 256, (blocks * layers * 2 * row,), dtype=torch.uint8, device=device)
    regions = [
        flat[i * row :].as_strided((blocks, row), (layers * 2 * row, 1), 0) for i in range(2 * layers)
    ]
    ids = rng.sample(range(blocks), 20)
    src, dst = ids[:10], ids[10:]
    n = cp.lease_bytes([row] * len(regions), len(src))
    core = _arena.HostArena(4 * n)
    core.admit("filler", n // 3, 60.0, 0.0)
    off = core.admit("lease", n, 60.0, 1.0).offset
    arena = torch.zeros(4 * n, dtype=torch.uint8, pin_memory=pinned)
    kv = torch.device(device)
    scratch = torch.empty(scratch_bytes, dtype=torch.uint8, device=kv) if scratch_bytes else None
    stream = torch.cuda.Stream() if kv.type == "cuda" else None
    want = torch.cat([r[src].reshape(-1) for r in regions]).cpu()
    h = cp.demote(regions, src, arena, off, stream=stream, scratch=scratch)
    h.wait()
    assert h.done()
    assert torch.equal(arena[off : off + n], want), "demote"
    staging = torch.zeros(n + 4096, dtype=torch.uint8, device=kv)
    cp.promote(arena, off, n, staging, 4096, stream=stream).wait()
    assert torch.equal(staging[4096:].cpu(), want), "promote"
    before = [r.clone() for r in regions]
    cp.scatter(staging, 4096, regions, dst, stream=stream).wait()
    for r, b in zip(regions, before):
        assert torch.equal(r[dst], b[src]), "scatter"
        keep = [i for i in range(blocks) if i not in dst]
        assert torch.equal(r[keep], b[keep]), "scatter wrote outside its blocks"
    for r, b in zip(regions, before):
        r.copy_(b)
    cp.scatter(arena, off, regions, dst, stream=stream, scratch=scratch).wait()
    for r, b in zip(regions, before):
        assert torch.equal(r[dst], b[src]), "scatter from the arena"
    return f"{device} scratch={scratch_bytes}"

done = [round_trip("cpu", s, False) for s in (0, 2048, 3 * 2048 + 100)]
if torch.cuda.is_available():
    done += [round_trip("cuda", s, True) for s in (2048, 1 << 20)]
print("RESULT " + "; ".join(done))
"""


def test_demote_promote_scatter_round_trip(run_in_vllm_venv: Callable[..., str]) -> None:
    out = run_in_vllm_venv(SCRIPT, timeout=300)
    line = next(x for x in out.splitlines() if x.startswith("RESULT"))
    assert "cpu scratch=0" in line and "cpu scratch=6244" in line


def test_the_gpu_benchmark_smoke_run_checks_its_data(
    run_in_vllm_venv: Callable[..., str], tmp_path: Path
) -> None:
    report = tmp_path / "arena.json"
    out = run_in_vllm_venv(
        ROOT / "benchmarks" / "gpu_arena.py",
        *("--cpu", "--tokens", "64,160", "--layers", "4", "--runs", "1", "--json", str(report)),
        timeout=300,
    )
    assert "all equal" in out
    res = json.loads(report.read_text())
    assert res["data_ok"] and not res["vllm_imported"]
    assert [r["tokens"] for r in res["rows"]] == [64, 160]
    assert res["arena"]["kvlease_host_bytes_used"] == 0.0  # every lease released
