"""P asked again: vLLM 0.33's admission of an async load, replayed on the stand-in scheduler.

While an admission with ``load_kv_async`` fails to allocate, vLLM's scheduler asks the connector
again every step with a fresh local prefix hit (``scheduler.py``: the ``num_computed_tokens == 0``
branch; ``allocate_slots`` returning None breaks the loop before ``update_state_after_alloc``).
Upstream then pairs P's unhashed blocks with the tail of D's trimmed list, so the handle must be
cut to exactly the FINAL local hit + the external count, never past the verified prefix. Also
here: the scheduler dropping a claimed pull afterwards (the claim's pin on D ends early, and the
reason says so), and the unclaim on D's real control endpoint.
"""

from __future__ import annotations

import logging
import time
import types
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

from kvlease.protocol import KV, ControlInfo, PrefillReport, ReuseStatus, Role
from kvlease_vllm._control import ControlServer, LeaseDesk, claim, unclaim
from kvlease_vllm._metrics import ConnectorMetrics
from kvlease_vllm._retention import RetentionTable
from kvlease_vllm._verify import Reason

EDITED = list(D_TOKENS)
EDITED[6 * BS] = 1  # an earlier turn edited (or a think block stripped): only 6 blocks verify


@pytest.fixture
def connector(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    yield from connector_over_fake_vllm(monkeypatch)


@pytest.fixture
def claims(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str | None]]:
    return answer_claims(monkeypatch)


@pytest.fixture
def unclaims(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []

    def fake_unclaim(url: str, lease_id: str, secret: Any, timeout: float, claimant: str) -> bool:
        seen.append((lease_id, claimant))
        return True

    import kvlease_vllm._control as control

    monkeypatch.setattr(control, "unclaim", fake_unclaim)
    return seen


def admit(
    sched: Any, req: _Request, local_hits: list[int], cap: int | None = None, alloc_local: int | None = None
) -> dict[str, Any]:
    """0.33's admission: one ask per step with that step's local hit; every allocation but the last
    fails (no ``update_state_after_alloc``); the last succeeds with the scheduler's final external
    count (``cap``: lowered by its caps). Returns the handle upstream's ``update_state_after_alloc``
    got."""
    ext = 0
    for local in local_hits:
        got, load_async = ask(sched, req, local)
        assert load_async and got is not None and got > 0
        ext = got if cap is None else min(got, cap)
    local = local_hits[-1] if alloc_local is None else alloc_local
    sched.update_state_after_alloc(req, Allocation(local, local + ext), ext)
    params, n = sched.allocated[-1]
    assert n == ext
    return params  # type: ignore[no-any-return]


def blocks_of(tokens: int) -> list[list[int]]:
    return [D_IDS[: -(-tokens // BS)]]


@pytest.mark.parametrize(
    ("prompt", "verified", "local_hits"),
    [
        (D_TOKENS, len(D_TOKENS), [0, 4 * BS]),  # the hit grew (a shared prefix was recomputed)
        (D_TOKENS, len(D_TOKENS), [4 * BS, 0]),  # the hit shrank (evicted by the pressure)
        (D_TOKENS, len(D_TOKENS), [2 * BS, 5 * BS, BS]),
        (EDITED, 6 * BS, [0, 2 * BS]),  # D's handle longer than the verified prefix
        (EDITED, 6 * BS, [2 * BS, 0]),  # old code: past the verified prefix, into D's unverified blocks
        (EDITED, 6 * BS, [0, 5 * BS, BS]),
    ],
)
def test_the_trim_follows_the_final_ask(
    connector: Any, claims: list, prompt: list[int], verified: int, local_hits: list[int]
) -> None:
    sched = scheduler(connector, control_secret=SECRET).connector_scheduler
    try:
        req = _Request("p-1", prompt + NEW_TURN, d_handle())
        params = admit(sched, req, local_hits)
        # P's unhashed blocks pair with the tail of this list: exactly the verified prefix
        assert params[KV.REMOTE_NUM_TOKENS] == verified
        assert params[KV.REMOTE_BLOCK_IDS] == blocks_of(verified)
        assert sched.allocated[-1][1] == verified - local_hits[-1]
        assert len(claims) == 1  # claimed once, for the first ask
    finally:
        sched.shutdown()


def test_a_capped_final_count_trims_to_the_final_local_hit_plus_it(connector: Any, claims: list) -> None:
    sched = scheduler(connector, control_secret=SECRET).connector_scheduler
    try:
        req = _Request("p-1", D_TOKENS + NEW_TURN, d_handle())
        params = admit(sched, req, [0, 2 * BS], cap=3 * BS)  # cap_external_hit lowered it
        assert params[KV.REMOTE_NUM_TOKENS] == 5 * BS
        assert params[KV.REMOTE_BLOCK_IDS] == [D_IDS[:5]]
    finally:
        sched.shutdown()


def test_an_allocation_that_disagrees_with_the_last_ask_is_never_read(
    connector: Any, claims: list, unclaims: list, caplog: pytest.LogCaptureFixture
) -> None:
    """Should a vLLM adopt another local prefix than its last ask said, the span is unproven: the
    load the scheduler already waits for gets D's handle expired (upstream's guard declines it
    unread: a failed load, recomputed), the pin on D ends, and the reason is logged."""
    sched = scheduler(connector, control_secret=SECRET).connector_scheduler
    try:
        req = _Request("p-1", EDITED + NEW_TURN, d_handle())
        with caplog.at_level(logging.INFO):
            params = admit(sched, req, [0], alloc_local=2 * BS)
        assert params[KV.REMOTE_BLOCKS_EXPIRY_TIME] == 0.0  # D's clock: long past
        assert params[KV.REMOTE_BLOCK_IDS]  # upstream still registers (and finishes) the load
        assert "recompute (span_mismatch): P's allocation holds 32 prefix-cache tokens" in caplog.text
        assert sched._pulls["p-1"].report() == PrefillReport(0, ReuseStatus.MISS.value)
        wait_for(lambda: unclaims == [("d-1", "p-1")])
    finally:
        sched.shutdown()


def wait_for(cond: Any, timeout: float = 3.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "never happened"
        time.sleep(0.01)


# ------------------------------------------------------------ the scheduler drops a claimed hit
def test_prompt_logprobs_decline_before_claiming(
    connector: Any, claims: list, caplog: pytest.LogCaptureFixture
) -> None:
    sched = scheduler(connector, control_secret=SECRET).connector_scheduler
    try:
        req = _Request("p-1", D_TOKENS + NEW_TURN, d_handle(), skip_reading_prefix_cache=True)
        with caplog.at_level(logging.INFO):
            assert ask(sched, req) == (0, False)
        assert claims == []  # D's lease was never pinned
        assert req.kv_transfer_params[KV.REMOTE_BLOCK_IDS] is None
        assert "recompute (scheduler_dropped): the request skips every prefix cache" in caplog.text
    finally:
        sched.shutdown()


def test_a_hit_the_scheduler_zeroes_after_the_claim_unpins_d_and_says_so(
    connector: Any, claims: list, unclaims: list, caplog: pytest.LogCaptureFixture
) -> None:
    """0.33's partial-tail rule, ``cap_external_hit`` or prefix replay zero the count after the
    claim: the pin on D ends now (not after claim_hold_s), and the reason is the scheduler's."""
    sched = scheduler(connector, control_secret=SECRET).connector_scheduler
    try:
        req = _Request("p-1", D_TOKENS + NEW_TURN, d_handle())
        assert ask(sched, req) == (len(D_TOKENS), True)
        with caplog.at_level(logging.INFO):
            sched.update_state_after_alloc(req, Allocation(0, 0), 0)
        assert sched.allocated[-1] == (req.kv_transfer_params, 0)
        assert req.kv_transfer_params[KV.REMOTE_BLOCK_IDS] is None  # upstream: nothing to read
        assert "recompute (scheduler_dropped)" in caplog.text and "local_hit" not in caplog.text
        assert sched._pulls["p-1"].outcome is Reason.SCHEDULER_DROPPED
        wait_for(lambda: unclaims == [("d-1", "p-1")])
    finally:
        sched.shutdown()


def test_a_re_ask_covered_locally_unpins_d(connector: Any, claims: list, unclaims: list) -> None:
    sched = scheduler(connector, control_secret=SECRET).connector_scheduler
    try:
        req = _Request("p-1", EDITED + NEW_TURN, d_handle())
        assert ask(sched, req) == (6 * BS, True)
        assert ask(sched, req, 6 * BS) == (0, False)  # the allocation failed; now P holds it all
        assert sched._pulls["p-1"].outcome is Reason.LOCAL_HIT
        wait_for(lambda: unclaims == [("d-1", "p-1")])
    finally:
        sched.shutdown()


def test_unclaim_ends_only_the_claimants_pin_on_ds_control_endpoint() -> None:
    desk = LeaseDesk(RetentionTable(1000, renew_guard=0.0), ConnectorMetrics())
    desk.add("d-1", 4, time.perf_counter() + 60)
    info = ControlInfo(Role.DECODE, "engine-d", "0.33.0", "0.1.0", True, 20.0, 64, BS, "tiny")
    server = ControlServer(desk, lambda: info, secret=SECRET, max_ttl=600.0).start()
    url = server.url("127.0.0.1")
    try:
        assert claim(url, "d-1", 30.0, SECRET, 5.0, "p-1").left is not None
        assert claim(url, "d-1", 30.0, SECRET, 5.0, "p-2").left is None  # exclusive while pinned
        assert unclaim(url, "d-1", SECRET, 5.0, "p-2") is False  # not its pin
        assert desk.relieve(4) == []  # still pinned: never released early
        assert unclaim(url, "d-1", SECRET, 5.0, "p-1") is True
        assert desk.snapshot() == (1, 4)  # the lease itself stays
        assert claim(url, "d-1", 30.0, SECRET, 5.0, "p-2").left is not None  # the next reader may
    finally:
        server.stop()
