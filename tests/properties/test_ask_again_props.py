"""P's trim under any sequence of asks (hypothesis), on the stand-in for vLLM's scheduler.

vLLM asks ``get_num_new_matched_tokens`` again, with a fresh local prefix hit, every step an async
load's admission fails to allocate, and calls ``update_state_after_alloc`` once, after the last
ask. For random local hits per ask, any number of failed allocations, a random cap on the final
external count and D's sequence edited anywhere (or not at all), the handle upstream reads is:
declined, or cut to exactly the last local hit + the external count, within the verified prefix,
and the block list upstream pairs tail-first with P's unhashed blocks maps each of P's blocks onto
D's block of the same token positions.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from fakes.vllm_standin import (
    BS,
    D_IDS,
    D_TOKENS,
    NEW_TURN,
    SECRET,
    Allocation,
    _Request,
    answer_claims,
    ask,
    connector_over_fake_vllm,
    d_handle,
    scheduler,
)
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvlease.protocol import KV

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
_ids = itertools.count()


@pytest.fixture
def sched(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """One P scheduler for every example (each example is a new request)."""
    for connector in connector_over_fake_vllm(monkeypatch):
        answer_claims(monkeypatch)
        s = scheduler(connector, control_secret=SECRET).connector_scheduler
        try:
            yield s
        finally:
            s.shutdown()


@SETTINGS
@given(
    edit_block=st.one_of(st.none(), st.integers(4, 9)),  # D's sequence edited in that block
    hits=st.lists(st.integers(0, 11).map(lambda b: b * BS), min_size=1, max_size=6),
    cap=st.one_of(st.none(), st.integers(1, 200)),
)
def test_the_trimmed_handle_is_the_last_local_hit_plus_the_external_count(
    sched: Any, edit_block: int | None, hits: list[int], cap: int | None
) -> None:
    prompt = list(D_TOKENS)
    if edit_block is not None:
        prompt[edit_block * BS] = 1
    verified = len(D_TOKENS) if edit_block is None else edit_block * BS
    req = _Request(f"p-{next(_ids)}", prompt + NEW_TURN, d_handle())
    first, _ = ask(sched, req, hits[0])
    assume(first)  # the first ask's local hit left too little to pull (threshold / cost): not this test
    got = first
    for local in hits[1:]:  # the allocation failed; the scheduler asks again next step
        got, load_async = ask(sched, req, local)
        if local >= verified:  # P's own cache covers the verified prefix now
            assert (got, load_async) == (0, False)
            assert req.kv_transfer_params[KV.REMOTE_BLOCK_IDS] is None  # D is never read
            return
        assert (got, load_async) == (verified - local, True)
    last = hits[-1]
    ext = got if cap is None else min(got, cap)
    alloc = Allocation(last, last + ext)
    sched.update_state_after_alloc(req, alloc, ext)
    params, n = sched.allocated[-1]
    assert n == ext
    tokens = params[KV.REMOTE_NUM_TOKENS]
    assert tokens == last + ext <= verified
    assert params[KV.REMOTE_BLOCK_IDS] == [D_IDS[: -(-tokens // BS)]]
    # upstream's pairing: P's unhashed blocks take the tail of D's list, block for block
    (mine,) = alloc.get_unhashed_block_ids_all_groups()
    (theirs,) = params[KV.REMOTE_BLOCK_IDS]
    assert theirs[len(theirs) - len(mine) :] == D_IDS[last // BS : -(-tokens // BS)]
