"""The staged pull's block copies: D gathers blocks into its staging buffer, P scatters them out.

Torch only (no vLLM, no NIXL): the worker builds one :class:`StagingCopier` over the staging
buffer and a ``(blocks x bytes)`` view of every KV region, and hands it block ids and offsets.

On a GPU every copy runs on the copier's own stream and nothing here waits on another stream
implicitly:

- the block index goes to the device from pinned host memory, asynchronously, on that stream (a
  pageable copy would synchronise the caller's stream: on P the engine thread, which would then
  wait for the forward it just launched);
- the copy waits only for what it is told to: D's gather for the engine's *mark*, a CUDA event
  recorded on the compute stream by the engine thread (:meth:`StagingCopier.mark`) once the
  leased blocks' last writes were queued; P's scatter for nothing (blocks waiting for a remote
  load are written by nothing else);
- D's gather synchronises its own stream before it returns (D answers P only once the bytes are
  there); P's scatter returns an event to poll.

Without a stream (CPU) the copies run in the caller's thread and are done on return.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import torch

from kvlease_vllm._config import check_staging_memory
from kvlease_vllm._staging import ALIGN

__all__ = ["StagingCopier", "kv_tensors", "region_views"]


def kv_tensors(kv_caches: Mapping[str, Any]) -> list[torch.Tensor]:
    """The tensors of vLLM's ``kv_caches`` (a tensor, or a list of them, per layer)."""
    out: list[Any] = []
    for cache in kv_caches.values():
        out.extend(cache if isinstance(cache, (list, tuple)) else [cache])
    return [t for t in out if isinstance(t, torch.Tensor)]


def region_views(
    tensors: Sequence[torch.Tensor],
    bases: Sequence[int],
    lens: Sequence[int],
    strides: Sequence[int],
    counts: Sequence[int],
) -> tuple[list[torch.Tensor], tuple[int, ...]] | str:
    """A ``(blocks x bytes)`` uint8 view of every KV region, from the ``(base address, bytes per
    block, block stride, blocks)`` rows the NIXL worker registers (its own geometry), and each
    region's bytes per block; or why they cannot be mapped onto ``tensors``' storage."""
    if not bases or not len(bases) == len(lens) == len(strides) == len(counts):
        return "KV region geometry not understood"
    flats = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in flats:
            flats[s.data_ptr()] = (s.nbytes(), torch.empty(0, dtype=torch.uint8, device=t.device).set_(s))
    views = []
    for base, length, stride, count in zip(bases, lens, strides, counts):
        owner = next(((p, n, f) for p, (n, f) in flats.items() if p <= base < p + n), None)
        if owner is None or length > stride or base - owner[0] + (count - 1) * stride + length > owner[1]:
            return "a KV region lies outside the registered tensors"
        views.append(owner[2].as_strided((count, length), (stride, 1), base - owner[0]))
    return views, tuple(int(n) for n in lens)


class StagingCopier:
    """Copies between a contiguous staging buffer and the blocks of several KV regions.

    ``views``: one ``(blocks, bytes)`` uint8 view per region; ``region_bytes``: each view's bytes
    per block; ``stream``: the CUDA stream the copies run on (None: CPU, synchronous). A range of
    ``n`` blocks at ``offset`` is packed region by region: ``n * region_bytes[0]`` bytes of region
    0, then region 1, and so on."""

    def __init__(
        self,
        buffer: torch.Tensor,
        views: Sequence[torch.Tensor],
        region_bytes: Sequence[int],
        stream: Any = None,
    ) -> None:
        if len(views) != len(region_bytes):
            raise ValueError("one byte count per KV region view")
        self.buffer = buffer
        self.views = list(views)
        self.region_bytes = tuple(int(n) for n in region_bytes)
        self.stream = stream

    def nbytes(self, blocks: int) -> int:
        """Bytes a range of ``blocks`` blocks takes."""
        return blocks * sum(self.region_bytes)

    def mark(self) -> Any:
        """An event on the calling thread's current stream: everything queued there so far (the
        engine thread: the compute stream's writes of the KV). None without a stream."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.buffer.device))
        return event

    def gather(self, block_ids: Sequence[int], offset: int, *, after: Any = None) -> None:
        """D: copy the blocks into the buffer at ``offset``, after the event ``after`` (the
        engine's mark); done when this returns."""
        self._run(block_ids, offset, gather=True, after=after)
        if self.stream is not None:
            self.stream.synchronize()

    def scatter(self, block_ids: Sequence[int], offset: int) -> Any:
        """P: copy the buffer at ``offset`` into the blocks; an event to poll (None: done)."""
        self._run(block_ids, offset, gather=False, after=None)
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def _run(self, block_ids: Sequence[int], offset: int, *, gather: bool, after: Any) -> None:
        n = len(block_ids)
        if offset < 0 or offset + self.nbytes(n) > self.buffer.numel():
            raise ValueError(f"{n} blocks at offset {offset} do not fit the staging buffer")
        host = torch.tensor(list(block_ids), dtype=torch.int64)
        with ExitStack() as ctx:
            if self.stream is not None:
                # pinned, so the copy is asynchronous; the host allocator keeps the pinned block
                # until the copy is done, and idx is allocated and used on this stream only
                host = host.pin_memory()
                ctx.enter_context(torch.cuda.device(self.buffer.device))
                ctx.enter_context(torch.cuda.stream(self.stream))
                if after is not None:
                    self.stream.wait_event(after)
            idx = host.to(self.buffer.device, non_blocking=True)
            pos = offset
            for view, length in zip(self.views, self.region_bytes):
                part = self.buffer[pos : pos + n * length].view(n, length)
                if gather:
                    torch.index_select(view, 0, idx, out=part)
                else:
                    view.index_copy_(0, idx, part)
                pos += n * length


def staging_buffer(
    tensors: Sequence[torch.Tensor], num_blocks: int, block_size: int, max_tokens: int, cache_config: Any
) -> torch.Tensor:
    """A worker's staging buffer: ``max_tokens`` of this model's KV (from the registered tensors'
    bytes per token), page-aligned, on the KV's device. A CUDA buffer lives outside vLLM's memory
    budget: refused (:func:`~kvlease_vllm._config.check_staging_memory`) unless it fits there."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    per_token = sum(storages.values()) / max(num_blocks, 1) / max(block_size, 1)
    nbytes = -(-int(per_token * max_tokens) // ALIGN) * ALIGN
    device = tensors[0].device
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        check_staging_memory(
            staging_bytes=nbytes,
            staging_tokens=max_tokens,
            total_bytes=total,
            free_bytes=free,
            gpu_memory_utilization=cache_config.gpu_memory_utilization,
            kv_cache_memory_bytes=cache_config.kv_cache_memory_bytes,
        )
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)
