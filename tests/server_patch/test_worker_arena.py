"""D's worker side of host placement (``kvlease_vllm._worker_arena.ArenaStore``) on CPU tensors.

A few fake KV regions (uint8 ``(num_blocks, row)`` views of different row sizes, random bytes);
each step's orders arrive on a metadata object as the scheduler sets them (``_hostlease``'s
attributes). The expected bytes are computed by hand: a lease is packed region-major, its blocks
in order, and a staged read of some of its blocks is ``index_select`` of each region, concatenated.
No vLLM; the CUDA stream ordering is for the GPU benchmarks.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvlease._errors import ConfigError
from kvlease.protocol._staging import STAGED_FROM_DEVICE, STAGED_FROM_HOST
from kvlease_vllm._hostlease import ALLOCATED_ATTR, DEMOTES_ATTR, DROPS_ATTR, Demotion
from kvlease_vllm._worker_arena import REUSED, ArenaStore, ReadPlan, allocate_arena

ROWS = (48, 16, 32)  # bytes of a block in each region
BLOCK = sum(ROWS)
NUM_BLOCKS = 12
ARENA = 16 * BLOCK


@pytest.fixture
def regions() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(30)
    return [torch.randint(0, 256, (NUM_BLOCKS, row), dtype=torch.uint8, generator=g) for row in ROWS]


@pytest.fixture
def store(regions: list[torch.Tensor]) -> ArenaStore:
    s = ArenaStore(ARENA, regions, ROWS, pin=False)
    assert s.arena is not None
    s.arena.zero_()
    return s


def gather(regions: Sequence[torch.Tensor], block_ids: Sequence[int]) -> torch.Tensor:
    """What a staged gather of ``block_ids`` leaves in the staging buffer."""
    idx = torch.tensor(list(block_ids), dtype=torch.int64)
    return torch.cat([torch.index_select(r, 0, idx).reshape(-1) for r in regions])


def pack(regions: Sequence[torch.Tensor], block_ids: Sequence[int]) -> torch.Tensor:
    """A lease packed by hand: region-major, the blocks in order."""
    return torch.cat([r[b] for r in regions for b in block_ids])


def step(
    store: ArenaStore,
    *,
    allocated: Sequence[int] = (),
    drops: Sequence[str] = (),
    demotes: Sequence[Demotion] = (),
) -> None:
    meta = SimpleNamespace()
    if allocated:
        setattr(meta, ALLOCATED_ATTR, tuple(allocated))
    if drops:
        setattr(meta, DROPS_ATTR, tuple(drops))
    if demotes:
        setattr(meta, DEMOTES_ATTR, tuple(demotes))
    store.before_step(meta, lambda: None)


def order(rid: str, offset: int, block_ids: Sequence[int], device_ok: bool = True) -> Demotion:
    return Demotion(rid, offset, len(block_ids) * BLOCK, tuple(block_ids), device_ok)


def promoted(store: ArenaStore, rid: str, block_ids: Sequence[int]) -> torch.Tensor | None:
    staging = torch.zeros(7 + len(block_ids) * BLOCK + 5, dtype=torch.uint8)
    if not store.promote(rid, block_ids, staging, 7):
        return None
    assert not staging[:7].any() and not staging[-5:].any()  # nothing outside the range written
    return staging[7:-5]


# ---- demotion ---------------------------------------------------------------------------------------
def test_a_demotion_copies_exactly_the_lease_bytes(store: ArenaStore, regions: list[torch.Tensor]) -> None:
    blocks = (9, 2, 5, 0)
    offset = 3 * BLOCK
    step(store, demotes=[order("a", offset, blocks)])
    assert store.arena is not None and store.placed("a")
    end = offset + len(blocks) * BLOCK
    assert torch.equal(store.arena[offset:end], pack(regions, blocks))
    assert not store.arena[:offset].any() and not store.arena[end:].any()
    assert store.snapshot() == {"placed": 1, "in_arena": 1, "arena_bytes": ARENA}


def test_the_demotion_histogram_hears_of_each_copy(regions: list[torch.Tensor]) -> None:
    seen: list[float] = []
    s = ArenaStore(ARENA, regions, ROWS, pin=False, on_demoted=seen.append)
    step(s, demotes=[order("a", 0, (1, 2)), order("b", 2 * BLOCK, (3,))])
    step(s)
    assert len(seen) == 2 and all(x >= 0 for x in seen)


def test_a_demotion_larger_than_its_budget_is_not_written_through(
    store: ArenaStore, regions: list[torch.Tensor]
) -> None:
    short = Demotion("a", 0, 2 * BLOCK - 1, (1, 2), True)
    step(store, demotes=[short])
    assert store.snapshot()["in_arena"] == 0 and store.arena is not None and not store.arena.any()
    assert store.read_plan("a", (1, 2)).source == STAGED_FROM_DEVICE  # the device copy, while intact
    step(store, allocated=[2])
    assert store.read_plan("a", (1, 2)) == ReadPlan(None, refusal=REUSED)
    assert promoted(store, "a", (1,)) is None


# ---- read_plan ----------------------------------------------------------------------------------------
def test_read_plan_of_an_auto_lease_follows_its_blocks_generations(
    store: ArenaStore, regions: list[torch.Tensor]
) -> None:
    step(store, allocated=[3, 4])  # earlier steps: the blocks have generations already
    step(store, demotes=[order("a", 0, (3, 4, 8))])
    plan = store.read_plan("a", (3, 4, 8))
    assert plan.source == STAGED_FROM_DEVICE and plan.gens == (1, 1, 0) and plan.refusal is None
    step(store, allocated=[5, 11])  # other blocks: still the device copy
    assert store.read_plan("a", (4, 8)).source == STAGED_FROM_DEVICE
    step(store, allocated=[8])
    assert store.read_plan("a", (3, 4, 8)) == ReadPlan(STAGED_FROM_HOST)
    assert store.read_plan("a", (3, 4)).source == STAGED_FROM_DEVICE  # the blocks not reused
    assert store.read_plan("a", (3, 7)) == ReadPlan(None, refusal="a block the lease does not have")


def test_read_plan_of_a_host_lease_never_reads_the_device(store: ArenaStore) -> None:
    step(store, demotes=[order("h", 0, (1, 2), device_ok=False)])
    assert store.read_plan("h", (1, 2)) == ReadPlan(STAGED_FROM_HOST)
    step(store, drops=["h"])
    assert store.read_plan("h", (1, 2)) == ReadPlan(None, refusal=REUSED)
    assert promoted(store, "h", (1, 2)) is None


def test_read_plan_of_a_lease_d_still_holds_is_the_device(store: ArenaStore) -> None:
    step(store, allocated=[6, 6])
    assert store.read_plan("held", (6, 7)) == ReadPlan(STAGED_FROM_DEVICE, (2, 0))


# ---- promote ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "subset",
    [
        (9, 2, 5, 0, 7),  # the whole lease
        (2, 5, 0),  # consecutive positions
        (9, 0),  # positions 0 and 3
        (7, 2),  # positions out of order
        (5,),
        (0, 2, 9),  # reversed, not consecutive
    ],
)
def test_promote_lays_out_a_subset_as_a_gather(
    store: ArenaStore, regions: list[torch.Tensor], subset: tuple[int, ...]
) -> None:
    blocks = (9, 2, 5, 0, 7)
    step(store, demotes=[order("a", 2 * BLOCK, blocks)])
    want = gather(regions, subset)
    for r in regions:  # the device copy is gone: the bytes come from the arena alone
        r.fill_(0)
    got = promoted(store, "a", subset)
    assert got is not None and torch.equal(got, want)


def test_promote_refuses_a_block_the_lease_does_not_have(store: ArenaStore) -> None:
    step(store, demotes=[order("a", 0, (1, 2))])
    assert promoted(store, "a", (1, 3)) is None
    assert promoted(store, "unknown", (1,)) is None


def test_a_device_copy_reused_between_the_check_and_the_read(
    store: ArenaStore, regions: list[torch.Tensor]
) -> None:
    blocks = (4, 6, 10)
    step(store, demotes=[order("a", 0, blocks)])
    want = gather(regions, blocks)
    plan = store.read_plan("a", blocks)
    assert plan.source == STAGED_FROM_DEVICE
    assert store.intact(blocks, plan.gens)
    # vLLM hands block 6 to another request and the step writes it, while the gather ran
    step(store, allocated=[6])
    regions[0][6].fill_(0xAB)
    regions[2][6].fill_(0xCD)
    gathered = gather(regions, blocks)
    assert not torch.equal(gathered, want)  # the device copy is no longer the lease's
    assert not store.intact(blocks, plan.gens)
    got = promoted(store, "a", blocks)
    assert got is not None and torch.equal(got, want)


# ---- drops before demotes -----------------------------------------------------------------------------
def test_a_dropped_lease_is_not_promoted_after_another_took_its_range(
    store: ArenaStore, regions: list[torch.Tensor]
) -> None:
    step(store, demotes=[order("a", 0, (1, 2, 3))])
    assert promoted(store, "a", (1,)) is not None
    step(store, drops=["a"], demotes=[order("b", 0, (8, 9))])
    assert promoted(store, "a", (1,)) is None
    got = promoted(store, "b", (8, 9))
    assert got is not None and torch.equal(got, gather(regions, (8, 9)))
    assert store.snapshot()["in_arena"] == 1


def test_a_drop_in_the_same_step_as_the_lease_demotion_is_applied_first(store: ArenaStore) -> None:
    """A lease evicted before its order left the scheduler: its drop and its demotion go out in
    one step (drops first); the demotion reusing its range must still leave it unreadable."""
    step(store, drops=["a"], demotes=[order("a", 0, (1, 2, 3)), order("b", 0, (8,))])
    assert promoted(store, "a", (1,)) is None
    assert promoted(store, "b", (8,)) is not None


def test_a_demotion_over_a_range_not_yet_dropped_ends_the_old_lease(store: ArenaStore) -> None:
    step(store, demotes=[order("a", BLOCK, (1, 2, 3))])
    step(store, demotes=[order("b", 0, (8, 9))])  # overlaps a's first block
    assert promoted(store, "a", (1,)) is None and promoted(store, "b", (9,)) is not None


def test_forget_removes_ended_leases(store: ArenaStore) -> None:
    step(store, demotes=[order("a", 0, (1,)), order("b", BLOCK, (2,)), order("c", 2 * BLOCK, (3,))])
    store.forget(lambda rid: rid == "b")
    assert [store.placed(r) for r in "abc"] == [False, True, False]
    assert store.snapshot() == {"placed": 1, "in_arena": 1, "arena_bytes": ARENA}
    assert promoted(store, "a", (1,)) is None and promoted(store, "b", (2,)) is not None
    step(store, demotes=[order("d", 0, (4,))])  # a's range is free for another lease
    assert promoted(store, "b", (2,)) is not None


# ---- allocate_arena ------------------------------------------------------------------------------------
def test_allocate_arena_refuses_more_than_host_memory(regions: list[torch.Tensor]) -> None:
    with pytest.raises(ConfigError) as e:
        allocate_arena(1 << 50, regions, ROWS, device=torch.device("cpu"), workers_on_host=1)
    assert "kvlease.host_arena_bytes=1125899906842624" in str(e.value)


def test_allocate_arena_on_cpu(regions: list[torch.Tensor]) -> None:
    got: Any = allocate_arena(4 * BLOCK, regions, ROWS, device=torch.device("cpu"), workers_on_host=1)
    assert isinstance(got, ArenaStore) and got.arena is not None
    assert got.arena.numel() == 4 * BLOCK and not got.arena.is_pinned() and got.stream is None
    assert got.block_bytes == BLOCK
