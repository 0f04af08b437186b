"""The host arena's copy kernels: demotion (KV blocks -> arena), promotion (arena -> staging buffer)
and scatter (packed bytes -> KV blocks), on CPU and CUDA.

The packing is the staged pull's (``KVLeaseWorker._kvl_copy``): region-major, the lease's blocks of
region 0 in ``block_ids`` order, then region 1, ...; a region being a ``(num_blocks, row)`` view of
one registered KV region (a uint8 view as ``_kvl_map_regions`` builds it, or any dtype, strided
rows allowed). So a lease promoted whole into D's staging buffer is laid out exactly as a staged
gather would have left it, and P's READ and scatter run unchanged.

On CUDA every copy runs on the caller's side stream after waiting on ``after`` (an event recorded
after the step that wrote the last token; by default the device's current stream), never on the
default stream, and returns a :class:`CopyHandle` to poll. The block ids go to the device from
pinned memory with a non-blocking copy. A demotion into host memory gathers each chunk into a
device ``scratch`` buffer (the staging buffer's spare range, or one the call allocates on the side
stream) and copies it out with one D2H per chunk, the two halves of the scratch taking turns so
that gathering a chunk overlaps the previous one's D2H; the arena must be pinned for that copy to
be asynchronous and run at the PCIe rate. A scatter from host memory is the mirror image. On CPU
the copies are synchronous and the handle is done.

Torch is imported inside the functions: importing this module (or :func:`pack_plan`, its pure
part) needs neither torch nor vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

#: A demotion's or scatter's chunk through device scratch memory when the caller passes none.
DEFAULT_CHUNK_BYTES: Final = 64 << 20


class ArenaCopyError(ValueError):
    """Arguments a copy cannot run with (layouts, devices, ranges); nothing was copied."""


@dataclass(frozen=True)
class Piece:
    """Rows ``[first, first + rows)`` of the lease's blocks of one region, at ``at`` bytes into
    the lease's packed range."""

    region: int
    first: int
    rows: int
    at: int


def lease_bytes(row_bytes: Sequence[int], blocks: int) -> int:
    """Bytes of a lease of ``blocks`` blocks, packed (every region's rows)."""
    return blocks * sum(row_bytes)


def pack_plan(row_bytes: Sequence[int], blocks: int, chunk_bytes: int) -> list[list[Piece]]:
    """The packed range cut into chunks of at most ``chunk_bytes``, each a run of pieces that are
    contiguous in the packed layout (so a chunk moves with one copy between host and device)."""
    if blocks <= 0 or not row_bytes:
        return []
    widest = max(row_bytes)
    if min(row_bytes) <= 0:
        raise ArenaCopyError("every region's row must have bytes")
    if chunk_bytes < widest:
        raise ArenaCopyError(f"chunk of {chunk_bytes} bytes is smaller than a block row ({widest})")
    chunks: list[list[Piece]] = []
    current: list[Piece] = []
    room, at = chunk_bytes, 0
    for region, row in enumerate(row_bytes):
        first = 0
        while first < blocks:
            take = min(blocks - first, room // row)
            if take == 0:
                chunks.append(current)
                current, room = [], chunk_bytes
                continue
            current.append(Piece(region, first, take, at))
            first += take
            at += take * row
            room -= take * row
    if current:
        chunks.append(current)
    return chunks


def promote_plan(
    row_bytes: Sequence[int], lease_blocks: int, positions: Sequence[int]
) -> list[tuple[int, int, int]]:
    """The copies that lay out the blocks at ``positions`` (indexes into a lease of ``lease_blocks``
    blocks packed by :func:`demote`) as a staged gather of those blocks would: region-major, in
    ``positions`` order. ``(source offset in the lease's range, destination offset, bytes)``, runs
    of consecutive positions merged into one copy per region."""
    if any(not 0 <= p < lease_blocks for p in positions):
        raise ArenaCopyError(f"a position outside the lease's {lease_blocks} blocks")
    runs: list[tuple[int, int, int]] = []  # (first position, first index in the request, length)
    for k, pos in enumerate(positions):
        if runs and runs[-1][0] + runs[-1][2] == pos:
            first, at, n = runs[-1]
            runs[-1] = (first, at, n + 1)
        else:
            runs.append((pos, k, 1))
    out: list[tuple[int, int, int]] = []
    m = len(positions)
    before = 0
    for row in row_bytes:
        for first, at, n in runs:
            out.append((lease_blocks * before + first * row, m * before + at * row, n * row))
        before += row
    return out


def promote_pieces(
    arena: Any,
    offset: int,
    pieces: Sequence[tuple[int, int, int]],
    staging: Any,
    staging_offset: int,
    *,
    stream: Any = None,
    after: Any = None,
) -> CopyHandle:
    """:func:`promote` of the ``pieces`` of :func:`promote_plan`: ``arena[offset + src]`` to
    ``staging[staging_offset + dst]``, all on one side stream."""
    if not pieces:
        return CopyHandle()
    end = max(src + n for src, _, n in pieces)
    _check_range(arena, offset, end, "arena")
    _check_range(staging, staging_offset, max(dst + n for _, dst, n in pieces), "staging buffer")
    device = staging.device if staging.device.type != "cpu" else arena.device
    with _on(stream, after, device) as side:
        for src, dst, n in pieces:
            a, b = offset + src, staging_offset + dst
            staging[b : b + n].copy_(arena[a : a + n], non_blocking=True)
        return _finish(side, (arena, staging))


class CopyHandle:
    """A copy in flight: :meth:`done` polls it, :meth:`wait` blocks until it is over. Holds what
    the copy reads and writes until then (pinned index tensors, scratch chunks)."""

    def __init__(self, event: Any = None, keep: tuple[Any, ...] = ()) -> None:
        self.event = event
        self._keep: tuple[Any, ...] = keep

    def done(self) -> bool:
        if self.event is None or self.event.query():
            self._keep = ()
            return True
        return False

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
        self._keep = ()


# ------------------------------------------------------------------------------------ the copies
def demote(
    regions: Sequence[Any],
    block_ids: Sequence[int],
    arena: Any,
    offset: int,
    *,
    stream: Any = None,
    after: Any = None,
    scratch: Any = None,
    work_stream: Any = None,
) -> CopyHandle:
    """Gather the blocks ``block_ids`` of every region into ``arena[offset:]``, region-major.

    ``arena``: a 1-D uint8 tensor, pinned host memory on CUDA (or on the KV's device, then the
    gather writes it directly). ``scratch``: a 1-D uint8 tensor on the KV's device for the chunks
    (given, it is used even where a direct gather would do); only this copy may use it until the
    handle is done. Its two halves take turns: the gathers of one chunk (on ``work_stream``, by
    default a pooled stream) run while the previous chunk's D2H (on ``stream``) does."""
    import torch

    rows, row_bytes, n, device = _checked(regions, block_ids, arena, offset, "arena")
    if arena.device == device and scratch is None:
        with _on(stream, after, device) as side:
            idx, keep = _index(block_ids, device, side)
            for r, view in enumerate(rows):
                at = offset + n * sum(row_bytes[:r])
                torch.index_select(view, 0, idx, out=_as_rows(arena, at, n, view))
            return _finish(side, (*keep, idx, arena))
    with _on(stream, after, device) as side:
        idx, keep = _index(block_ids, device, side)
        buf = _scratch(scratch, device, row_bytes, side)
        lanes = _Lanes(side, work_stream, device)
        halves = _halves(buf, row_bytes)
        free: list[Any] = [None] * len(halves)
        for i, chunk in enumerate(pack_plan(row_bytes, n, halves[0].numel())):
            part, start, size = halves[i % len(halves)], chunk[0].at, _chunk_bytes(chunk, row_bytes)
            with lanes.work_current():  # gather chunk i while chunk i - 1 goes to the host
                lanes.work_waits(free[i % len(halves)])
                for p in chunk:
                    view = rows[p.region]
                    out = _as_rows(part, p.at - start, p.rows, view)
                    torch.index_select(view, 0, idx[p.first : p.first + p.rows], out=out)
                gathered = lanes.work_mark()
            lanes.side_waits(gathered)
            arena[offset + start : offset + start + size].copy_(part[:size], non_blocking=True)
            free[i % len(halves)] = lanes.side_mark()
        return _finish(side, (*keep, idx, buf, arena), lanes)


def promote(
    arena: Any,
    offset: int,
    nbytes: int,
    staging: Any,
    staging_offset: int,
    *,
    stream: Any = None,
    after: Any = None,
) -> CopyHandle:
    """Copy ``arena[offset:offset + nbytes]`` into ``staging[staging_offset:]`` (one H2D from a
    pinned arena into D's registered VRAM staging buffer, which P then READs as today)."""
    _check_range(arena, offset, nbytes, "arena")
    _check_range(staging, staging_offset, nbytes, "staging buffer")
    device = staging.device if staging.device.type != "cpu" else arena.device
    if arena.device.type != "cpu" and arena.device != staging.device:
        raise ArenaCopyError(f"arena on {arena.device}, staging buffer on {staging.device}")
    with _on(stream, after, device) as side:
        staging[staging_offset : staging_offset + nbytes].copy_(
            arena[offset : offset + nbytes], non_blocking=True
        )
        return _finish(side, (arena, staging))


def scatter(
    source: Any,
    offset: int,
    regions: Sequence[Any],
    block_ids: Sequence[int],
    *,
    stream: Any = None,
    after: Any = None,
    scratch: Any = None,
    work_stream: Any = None,
) -> CopyHandle:
    """The inverse of :func:`demote`: write the packed bytes at ``source[offset:]`` into the blocks
    ``block_ids`` of every region. ``source`` on the KV's device (a staging buffer) is read
    directly; on the host (the arena) it goes through ``scratch`` chunk by chunk (one H2D each)."""
    rows, row_bytes, n, device = _checked(regions, block_ids, source, offset, "source")
    if source.device == device and scratch is None:
        with _on(stream, after, device) as side:
            idx, keep = _index(block_ids, device, side)
            for r, view in enumerate(rows):
                at = offset + n * sum(row_bytes[:r])
                view.index_copy_(0, idx, _as_rows(source, at, n, view))
            return _finish(side, (*keep, idx, source))
    with _on(stream, after, device) as side:
        idx, keep = _index(block_ids, device, side)
        buf = _scratch(scratch, device, row_bytes, side)
        lanes = _Lanes(side, work_stream, device)
        halves = _halves(buf, row_bytes)
        free: list[Any] = [None] * len(halves)
        for i, chunk in enumerate(pack_plan(row_bytes, n, halves[0].numel())):
            part, start, size = halves[i % len(halves)], chunk[0].at, _chunk_bytes(chunk, row_bytes)
            lanes.side_waits(free[i % len(halves)])  # chunk i - 2 is scattered out of this half
            part[:size].copy_(source[offset + start : offset + start + size], non_blocking=True)
            arrived = lanes.side_mark()
            with lanes.work_current():  # scatter chunk i while chunk i + 1 comes from the host
                lanes.work_waits(arrived)
                for p in chunk:
                    view = rows[p.region]
                    view.index_copy_(
                        0, idx[p.first : p.first + p.rows], _as_rows(part, p.at - start, p.rows, view)
                    )
                free[i % len(halves)] = lanes.work_mark()
        return _finish(side, (*keep, idx, buf, source), lanes)


# ------------------------------------------------------------------------------------- internals
def _rows(regions: Sequence[Any]) -> tuple[list[Any], list[int]]:
    """Each region as a 2-D (blocks, row) view (never a copy: a scatter into a copy would be lost)
    and its row's bytes."""
    if not regions:
        raise ArenaCopyError("no KV regions")
    rows, row_bytes = [], []
    for r, t in enumerate(regions):
        if t.dim() < 2 or t.shape[0] == 0:
            raise ArenaCopyError(f"region {r}: expected (num_blocks, ...) with blocks, got {tuple(t.shape)}")
        try:
            v = t if t.dim() == 2 else t.view(t.shape[0], -1)
        except RuntimeError as e:
            raise ArenaCopyError(f"region {r}: a block is not one strided row ({e})") from None
        if v.stride(1) != 1:
            raise ArenaCopyError(f"region {r}: a block's bytes are not contiguous")
        rows.append(v)
        row_bytes.append(v.shape[1] * v.element_size())
    if len({v.device for v in rows}) != 1:
        raise ArenaCopyError("KV regions on more than one device")
    return rows, row_bytes


def _checked(
    regions: Sequence[Any], block_ids: Sequence[int], packed: Any, offset: int, what: str
) -> tuple[list[Any], list[int], int, Any]:
    """The checks of :func:`demote` and :func:`scatter`: the regions as rows (:func:`_rows`), the
    block ids, ``packed[offset:]`` holding the lease's bytes, and its device; returns the rows,
    their bytes, the number of blocks and the KV's device."""
    rows, row_bytes = _rows(regions)
    n = _check_ids(block_ids, rows)
    _check_range(packed, offset, lease_bytes(row_bytes, n), what)
    device = rows[0].device
    _check_devices(packed.device, device, what)
    return rows, row_bytes, n, device


def _check_ids(block_ids: Sequence[int], rows: Sequence[Any]) -> int:
    n = len(block_ids)
    if n == 0:
        raise ArenaCopyError("no blocks to copy")
    if min(block_ids) < 0 or max(block_ids) >= min(v.shape[0] for v in rows):
        raise ArenaCopyError("a block id is out of range")
    return n


def _check_devices(packed: Any, kv: Any, what: str) -> None:
    """The packed side is on the KV's device, or on the host of a CUDA device."""
    if packed != kv and not (kv.type == "cuda" and packed.type == "cpu"):
        raise ArenaCopyError(f"{what} on {packed}, KV on {kv}")


def _check_range(buf: Any, offset: int, nbytes: int, what: str) -> None:
    import torch

    if buf.dim() != 1 or buf.dtype != torch.uint8:
        raise ArenaCopyError(f"the {what} must be a 1-D uint8 tensor")
    if offset < 0 or nbytes < 0 or offset + nbytes > buf.numel():
        raise ArenaCopyError(f"{what} range [{offset}, {offset + nbytes}) outside its {buf.numel()} bytes")


def _as_rows(buf: Any, at: int, n: int, like: Any) -> Any:
    """``buf[at:]`` as ``n`` rows shaped and typed like ``like``'s (a view: the copy lands in buf)."""
    size = like.element_size()
    if (buf.data_ptr() + at) % size:
        raise ArenaCopyError(f"offset {at} is not aligned to the KV dtype ({size} bytes)")
    return buf[at : at + n * like.shape[1] * size].view(like.dtype).view(n, like.shape[1])


def _index(block_ids: Sequence[int], device: Any, side: Any) -> tuple[Any, tuple[Any, ...]]:
    """The block ids as an int64 tensor on ``device``: on CUDA built in pinned memory and copied
    non-blocking on the side stream (the host tensor is kept until the copy is done)."""
    import torch

    host = torch.as_tensor(list(block_ids), dtype=torch.int64)
    if device.type == "cpu":
        return host, ()
    host = host.pin_memory()
    return host.to(device, non_blocking=True), (host,)


def _chunk_bytes(chunk: Sequence[Piece], row_bytes: Sequence[int]) -> int:
    return chunk[-1].at + chunk[-1].rows * row_bytes[chunk[-1].region] - chunk[0].at


def _halves(buf: Any, row_bytes: Sequence[int]) -> list[Any]:
    """The scratch buffer as two halves that take turns, or whole when a half holds no row."""
    half = buf.numel() // 2 // 512 * 512  # halves start aligned for any KV dtype
    return [buf[:half], buf[half : 2 * half]] if half >= max(row_bytes) else [buf]


class _Lanes:
    """A chunked copy's two streams: ``side`` (the caller's: host <-> device copies) and ``work``
    (the gathers or scatters), ordered by events; on CPU every call is a no-op."""

    def __init__(self, side: Any, work: Any, device: Any) -> None:
        self.side: Any = side
        self.work: Any = None
        if side is not None:
            import torch

            self.work = work if work is not None else torch.cuda.Stream(device=device)
            self.work.wait_stream(side)  # the block ids were copied on the side stream

    def work_current(self) -> Any:
        import contextlib

        if self.work is None:
            return contextlib.nullcontext()
        import torch

        return torch.cuda.stream(self.work)

    def _mark(self, stream: Any) -> Any:
        if stream is None:
            return None
        import torch

        event = torch.cuda.Event()
        event.record(stream)
        return event

    def work_mark(self) -> Any:
        return self._mark(self.work)

    def side_mark(self) -> Any:
        return self._mark(self.side)

    def work_waits(self, event: Any) -> None:
        if event is not None:
            self.work.wait_event(event)

    def side_waits(self, event: Any) -> None:
        if event is not None:
            self.side.wait_event(event)


def _scratch(scratch: Any, device: Any, row_bytes: Sequence[int], side: Any) -> Any:
    import torch

    if scratch is None:
        # allocated while the side stream is current: the caching allocator ties it to that stream
        return torch.empty(max(DEFAULT_CHUNK_BYTES, max(row_bytes)), dtype=torch.uint8, device=device)
    if scratch.device != device or scratch.dim() != 1 or scratch.dtype != torch.uint8:
        raise ArenaCopyError(f"scratch must be a 1-D uint8 tensor on {device}")
    if scratch.numel() < max(row_bytes):
        raise ArenaCopyError(f"scratch of {scratch.numel()} bytes is smaller than a block row")
    return scratch


class _on:
    """The side stream as current, after it waited on ``after`` (or on the current stream); on CPU
    a no-op. Yields the stream (None on CPU)."""

    def __init__(self, stream: Any, after: Any, device: Any) -> None:
        self.device = device
        self.stream, self.after = stream, after
        self._ctx: list[Any] = []

    def __enter__(self) -> Any:
        if self.device.type != "cuda":
            return None
        import torch

        self._ctx = [torch.cuda.device(self.device)]
        self._ctx[0].__enter__()
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=self.device)
        if self.after is not None:
            self.stream.wait_event(self.after)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self._ctx.append(torch.cuda.stream(self.stream))
        self._ctx[1].__enter__()
        return self.stream

    def __exit__(self, *exc: object) -> None:
        for ctx in reversed(self._ctx):
            ctx.__exit__(*exc)
        self._ctx = []


def _finish(side: Any, keep: tuple[Any, ...], lanes: _Lanes | None = None) -> CopyHandle:
    if side is None:
        return CopyHandle()
    import torch

    if lanes is not None and lanes.work is not None:
        side.wait_stream(lanes.work)  # the handle's event covers the work lane too
    for t in keep:  # device memory of other streams: not reused before this stream is done with it
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(side)
    event = torch.cuda.Event()
    event.record(side)
    return CopyHandle(event, keep)
