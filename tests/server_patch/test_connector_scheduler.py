"""KVLeaseScheduler's decisions, run against a stand-in for vLLM's NIXL scheduler (no vLLM here:
``fakes.vllm_standin``). What runs is the connector's own code: the P-side verify/claim/trim flow
and every decline's log line, the D-side ``kvlease`` object, the start-up refusals,
``supports_sleep_mode``, data-parallel ports and emergency relief.
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
    D_TOKENS,
    NEW_TURN,
    SECRET,
    _KVCacheConfig,
    _Request,
    _Role,
    answer_claims,
    ask,
    connector_over_fake_vllm,
    d_handle,
    scheduler,
    vllm_config,
)

from kvlease._errors import ConfigError
from kvlease.protocol import KV, LEASE_HANDLE_MAC
from kvlease_vllm._control import ClaimResult
from kvlease_vllm._verify import handle_mac


@pytest.fixture
def connector(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    yield from connector_over_fake_vllm(monkeypatch)


@pytest.fixture
def claims(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str | None]]:
    return answer_claims(monkeypatch)


def test_pull_claims_then_trims_at_the_final_count_with_ds_deadline(connector: Any, claims: list) -> None:
    conn = scheduler(connector, control_secret=SECRET)
    sched = conn.connector_scheduler
    try:
        req = _Request("p-1", D_TOKENS + NEW_TURN, d_handle())
        assert ask(sched, req) == (len(D_TOKENS), True)  # token-exact: D's whole sequence
        assert claims == [("d-1", "p-1")]  # exclusive claim, as this request
        assert req.kv_transfer_params[KV.REMOTE_NUM_TOKENS] == len(D_TOKENS)  # not trimmed yet
        # the scheduler lowers the external count (cap_external_hit / prefix replay): trim to it
        sched.update_state_after_alloc(req, None, 5 * BS)
        params, n = sched.allocated[-1]
        assert n == 5 * BS and params[KV.REMOTE_NUM_TOKENS] == 5 * BS
        assert params[KV.REMOTE_BLOCK_IDS] == [[100, 101, 102, 103, 104]]
        assert params[KV.REMOTE_BLOCKS_EXPIRY_TIME] == 4321.0  # D's renewed deadline, guard stays on
        assert params[KV.KVLEASE][LEASE_HANDLE_MAC] == req.kv_transfer_params[KV.KVLEASE][LEASE_HANDLE_MAC]
    finally:
        sched.shutdown()


def _declined(
    connector: Any, caplog: pytest.LogCaptureFixture, req: _Request, groups: int = 1, **kw: Any
) -> str:
    conn = scheduler(connector, groups=groups, **kw)
    sched = conn.connector_scheduler
    try:
        with caplog.at_level(logging.INFO):
            assert ask(sched, req) == (0, False)
        assert req.kv_transfer_params[KV.REMOTE_BLOCK_IDS] is None  # D is never contacted
        lines = [r.getMessage() for r in caplog.records if "recompute (" in r.getMessage()]
        assert len(lines) == 1 and "<object object" not in lines[0]
        return lines[0]
    finally:
        sched.shutdown()


def test_bidirectional_off_declines(connector: Any, caplog: pytest.LogCaptureFixture) -> None:
    line = _declined(
        connector, caplog, _Request("p", D_TOKENS + NEW_TURN, d_handle()), bidir=False, control_secret=SECRET
    )
    assert "recompute (bidirectional_off)" in line and "bidirectional_kv_xfer is off" in line


def test_claims_without_a_secret_decline_in_words(connector: Any, caplog: pytest.LogCaptureFixture) -> None:
    line = _declined(connector, caplog, _Request("p", D_TOKENS + NEW_TURN, d_handle()))
    assert "recompute (claim_failed)" in line and "no control secret on this node" in line
    assert any("will never pull" in r.getMessage() for r in caplog.records)  # said once, at start


def test_failed_claim_logs_the_error(
    connector: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvlease_vllm._control as control

    def refused(*a: Any, **k: Any) -> Any:
        raise OSError("control endpoint answered 403")

    monkeypatch.setattr(control, "claim", refused)
    line = _declined(connector, caplog, _Request("p", D_TOKENS + NEW_TURN, d_handle()), control_secret=SECRET)
    assert "recompute (claim_failed)" in line and "OSError: control endpoint answered 403" in line


def test_claim_refused_by_another_reader(
    connector: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvlease_vllm._control as control

    monkeypatch.setattr(control, "claim", lambda *a, **k: ClaimResult(None))
    line = _declined(connector, caplog, _Request("p", D_TOKENS + NEW_TURN, d_handle()), control_secret=SECRET)
    assert "recompute (lease_gone)" in line and "another reader claimed it" in line


def test_hybrid_partial_prefix_recomputes(
    connector: Any, caplog: pytest.LogCaptureFixture, claims: list
) -> None:
    """A full-attention and a sliding-window group (a 16-token window: D names its last 2 blocks):
    a prefix of 6 blocks needs the window's block 5, which D no longer holds."""
    edited = list(D_TOKENS)
    edited[6 * BS] = 1  # an earlier word edited: only 6 blocks verify
    handle = d_handle()
    handle[KV.REMOTE_BLOCK_IDS] = [list(range(100, 111)), [209, 210]]
    handle[KV.KVLEASE] = {**handle[KV.KVLEASE], LEASE_HANDLE_MAC: handle_mac(SECRET, handle)}
    req = _Request("p", edited + NEW_TURN, handle)
    line = _declined(connector, caplog, req, groups=2, windows=(BS,), hybrid=True, control_secret=SECRET)
    assert "recompute (hybrid_partial)" in line and f"only {6 * BS} of D's {len(D_TOKENS)} tokens" in line
    assert "need the KV of blocks 5..5, and D holds only blocks 9..10" in line


@pytest.mark.parametrize("exact", [True, False], ids=["token_exact", "ends_in_d_last_blocks"])
def test_hybrid_prefix_pulls_where_d_holds_its_window(connector: Any, claims: list, exact: bool) -> None:
    """The token-exact continuation pulls D's whole sequence; a prefix ending one block before D's
    end (its window in D's block 9) pulls too, each group cut from its end."""
    conn = scheduler(connector, groups=2, windows=(BS,), hybrid=True, control_secret=SECRET)
    sched = conn.connector_scheduler
    try:
        handle = d_handle()
        handle[KV.REMOTE_BLOCK_IDS] = [list(range(100, 111)), [209, 210]]
        handle[KV.KVLEASE] = {**handle[KV.KVLEASE], LEASE_HANDLE_MAC: handle_mac(SECRET, handle)}
        prompt = D_TOKENS + NEW_TURN if exact else D_TOKENS[: 10 * BS] + NEW_TURN
        tokens = len(D_TOKENS) if exact else 10 * BS
        req = _Request("p", prompt, handle)
        assert ask(sched, req) == (tokens, True)
        sched.update_state_after_alloc(req, None, tokens)
        params, _ = sched.allocated[-1]
        assert params[KV.REMOTE_BLOCK_IDS] == (
            handle[KV.REMOTE_BLOCK_IDS] if exact else [list(range(100, 110)), [209]]
        )
    finally:
        sched.shutdown()


def test_hybrid_pull_lowered_by_the_scheduler_fails_unread(connector: Any, claims: list) -> None:
    """The scheduler lowers a hybrid pull below the end whose window was checked: the read is failed
    unread (D's deadline in the past) and P recomputes, instead of reading misplaced window blocks."""
    conn = scheduler(connector, groups=2, windows=(BS,), hybrid=True, control_secret=SECRET)
    sched = conn.connector_scheduler
    try:
        handle = d_handle()
        handle[KV.REMOTE_BLOCK_IDS] = [list(range(100, 111)), [209, 210]]
        handle[KV.KVLEASE] = {**handle[KV.KVLEASE], LEASE_HANDLE_MAC: handle_mac(SECRET, handle)}
        req = _Request("p", D_TOKENS + NEW_TURN, handle)
        assert ask(sched, req) == (len(D_TOKENS), True)
        sched.update_state_after_alloc(req, None, 5 * BS)
        params, _ = sched.allocated[-1]
        assert params[KV.REMOTE_BLOCKS_EXPIRY_TIME] == 0.0
    finally:
        sched.shutdown()


def test_lora_switch_declines(connector: Any, caplog: pytest.LogCaptureFixture, claims: list) -> None:
    req = _Request(
        "p", D_TOKENS + NEW_TURN, d_handle(), lora_request=types.SimpleNamespace(lora_name="x", lora_int_id=2)
    )
    line = _declined(connector, caplog, req, control_secret=SECRET)
    assert "recompute (uncovered_inputs)" in line and "LoRA adapter differs" in line


def test_d_records_lora_and_mm_in_the_handle(connector: Any) -> None:
    conn = scheduler(connector, role="kv_consumer", control_secret=SECRET)
    sched = conn.connector_scheduler
    try:
        feature = types.SimpleNamespace(
            identifier="img", mm_position=types.SimpleNamespace(offset=3, length=8)
        )
        req = _Request(
            "d-9",
            D_TOKENS,
            lora_request=types.SimpleNamespace(lora_name="a", lora_int_id=1),
            mm_features=[feature],
        )
        _, out = sched.request_finished(req, [[1]])
        assert out[KV.KVLEASE]["lora"] == "a#1" and len(out[KV.KVLEASE]["mm"]) == 32
        embeds = _Request("d-10", D_TOKENS, prompt_embeds=object())
        _, out = sched.request_finished(embeds, [[1]])
        assert KV.KVLEASE not in out  # no identity to prove: P never pulls it
    finally:
        sched.shutdown()


def test_host_buffer_with_bidirectional_refused_at_construction(connector: Any) -> None:
    with pytest.raises(ConfigError, match=r"kv_transfer_config\.kv_buffer_device='cpu' on a cuda platform"):
        scheduler(connector, buffer="cpu")


def test_decode_keeps_upstreams_failure_policy(connector: Any) -> None:
    cfg = vllm_config(role="kv_consumer")
    sched = connector.KVLeaseConnector(cfg, _Role.SCHEDULER, _KVCacheConfig()).connector_scheduler
    sched.shutdown()
    assert cfg.kv_transfer_config.kv_load_failure_policy == "fail"
    cfg = vllm_config(role="kv_producer")
    sched = connector.KVLeaseConnector(cfg, _Role.SCHEDULER, _KVCacheConfig()).connector_scheduler
    sched.shutdown()
    assert cfg.kv_transfer_config.kv_load_failure_policy == "recompute"


def test_sleep_mode_refused(connector: Any) -> None:
    assert connector.KVLeaseConnector.supports_sleep_mode(object()) is False


def test_data_parallel_rank_offsets_the_control_port(connector: Any) -> None:
    import socket

    def free_pair() -> int:  # a free port whose successor is free too
        for _ in range(50):
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", 0))
                port = a.getsockname()[1]
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return int(port)
        raise AssertionError("no two consecutive free ports")

    base = free_pair()
    cfg = vllm_config(control_port=base)
    cfg.parallel_config.data_parallel_index = 1
    sched = connector.KVLeaseConnector(cfg, _Role.SCHEDULER, _KVCacheConfig()).connector_scheduler
    try:
        assert sched.control_url.endswith(f":{base + 1}")
        info = sched._info()
        assert info.data_parallel_index == 1 and info.connector_version == 15
    finally:
        sched.shutdown()


def test_context_parallel_declines(connector: Any, caplog: pytest.LogCaptureFixture, claims: list) -> None:
    handle = d_handle()
    handle[KV.DCP_SIZE] = 2
    handle[KV.KVLEASE] = {**handle[KV.KVLEASE], LEASE_HANDLE_MAC: handle_mac(SECRET, handle)}
    line = _declined(connector, caplog, _Request("p", D_TOKENS + NEW_TURN, handle), control_secret=SECRET)
    assert "recompute (context_parallel)" in line and "dcp_size=2" in line


def test_p_reclaims_while_the_read_waits(connector: Any, claims: list) -> None:
    conn = scheduler(connector, control_secret=SECRET, claim_hold_s=0.2)
    sched = conn.connector_scheduler
    try:
        req = _Request("p-1", D_TOKENS + NEW_TURN, d_handle())
        assert ask(sched, req)[1] is True
        sched.update_state_after_alloc(req, None, len(D_TOKENS))
        sched.build_connector_meta(None)
        assert len(claims) == 1  # fresh claim: nothing to renew yet
        time.sleep(0.12)  # past half the hold, the read still waiting
        sched.build_connector_meta(None)
        for _ in range(100):
            if len(claims) > 1:
                break
            time.sleep(0.01)
        assert claims[1] == ("d-1", "p-1")  # the same claimant: D lets it extend its pin
    finally:
        sched.shutdown()


def test_emergency_relief_frees_one_lease_per_failure(connector: Any) -> None:
    conn = scheduler(connector, role="kv_consumer", control_secret=SECRET)
    sched = conn.connector_scheduler
    try:
        conn.bind_gpu_block_pool(types.SimpleNamespace(get_num_free_blocks=lambda: 0))
        now = time.perf_counter()
        for i, lid in enumerate(("old", "mid", "new")):
            sched.desk.add(lid, 10, now + 100 + i)
        assert conn.has_pending_block_frees() is True
        assert sched.desk.snapshot() == (2, 20)  # only the oldest went
        assert "old" in sched.desk.take_updates()
    finally:
        sched.shutdown()


class _Block:
    def __init__(self, i: int) -> None:
        self.block_id, self.ref_cnt = i, 1  # held by the finished request


class _Pool:
    def __init__(self) -> None:
        self.blocks = [_Block(i) for i in range(300)]
        self.freed: list[int] = []

    def touch(self, blocks: list[_Block]) -> None:
        for b in blocks:
            b.ref_cnt += 1

    def free_blocks(self, blocks: Any) -> None:
        for b in blocks:
            b.ref_cnt -= 1
            self.freed.append(b.block_id)

    def get_num_free_blocks(self) -> int:
        return 1000


def test_d_holds_leased_blocks_with_its_own_reference(connector: Any) -> None:
    conn = scheduler(connector, role="kv_consumer", control_secret=SECRET)
    sched = conn.connector_scheduler
    pool = _Pool()
    conn.bind_gpu_block_pool(pool)
    try:
        delay, out = sched.request_finished(_Request("d-1", D_TOKENS), [[1]])
        # the finished request leaves the scheduler at once: the engine need not keep stepping
        assert delay is False and KV.KVLEASE in out
        assert [pool.blocks[i].ref_cnt for i in (100, 110)] == [2, 2]
        output = types.SimpleNamespace(
            finished_sending={"d-1", "someone-else"}, finished_recving=None, failed_recving=None
        )
        sched.update_connector_output(output)
        # our ids never reach the scheduler's finished_sending loop (it no longer knows them)
        assert output.finished_sending == {"someone-else"}
        assert pool.freed == list(range(110, 99, -1))  # tail first
        assert sched.desk.snapshot() == (0, 0)
    finally:
        sched.shutdown()


def test_own_block_refs_off_keeps_upstreams_delayed_free(connector: Any) -> None:
    conn = scheduler(connector, role="kv_consumer", control_secret=SECRET, own_block_refs=False)
    sched = conn.connector_scheduler
    conn.bind_gpu_block_pool(_Pool())
    try:
        delay, _ = sched.request_finished(_Request("d-1", D_TOKENS), [[1]])
        assert delay is True
    finally:
        sched.shutdown()


class _Blocks:
    """vLLM's ``KVCacheBlocks``, reduced to the one method the connector's pull shape reads."""

    def __init__(self, *groups: list[int]) -> None:
        self.groups = [list(g) for g in groups]

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return self.groups


def test_pull_reports_its_shape_in_metrics_and_the_log_line(
    connector: Any, claims: list, caplog: pytest.LogCaptureFixture
) -> None:
    conn = scheduler(connector, control_secret=SECRET)
    sched = conn.connector_scheduler
    try:
        req = _Request("p-1", D_TOKENS + NEW_TURN, d_handle())
        assert ask(sched, req) == (len(D_TOKENS), True)
        with caplog.at_level(logging.INFO):
            # P's destination blocks in 2 runs; D's trimmed handle is [100..104], 1 run
            sched.update_state_after_alloc(req, _Blocks([7, 8, 9, 20, 21]), 5 * BS)
        assert sched.kv_regions == 4  # 4 layers, K and V packed in one region each
        text = sched.metrics.render().decode()
        assert "kvlease_pull_descriptors_sum 20.0" in text  # 4 regions x 5 blocks
        assert 'kvlease_pull_block_runs_sum{side="local"} 2.0' in text
        assert 'kvlease_pull_block_runs_sum{side="remote"} 1.0' in text
        assert (
            "pull of 80 tokens: 20 descriptors (4 KV regions x blocks), block-id runs P 2 / D 1"
            in caplog.text
        )
        assert sched.allocated[-1][1] == 5 * BS  # upstream's allocation is unchanged
    finally:
        sched.shutdown()


def test_pull_shape_never_breaks_the_pull(connector: Any, claims: list) -> None:
    conn = scheduler(connector, control_secret=SECRET)
    sched = conn.connector_scheduler
    try:
        req = _Request("p-1", D_TOKENS + NEW_TURN, d_handle())
        ask(sched, req)
        sched.update_state_after_alloc(req, object(), 5 * BS)  # blocks of an unknown shape
        assert sched.allocated[-1][1] == 5 * BS
        assert "kvlease_pull_descriptors_count 0.0" in sched.metrics.render().decode()
    finally:
        sched.shutdown()


def test_transport_is_logged_at_start_and_reported_in_info(
    connector: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("UCX_TLS", raising=False)
    monkeypatch.delenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", raising=False)
    with caplog.at_level(logging.INFO):
        sched = scheduler(connector, control_secret=SECRET).connector_scheduler
    try:
        warned = [r for r in caplog.records if "NIXL READ transport" in r.getMessage()]
        assert [r.levelno for r in warned] == [logging.WARNING]
        assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" in warned[0].getMessage()
        assert sched._info().transport == sched.transport
        assert "TCP emulation" in sched._info().to_json()["transport"]
    finally:
        sched.shutdown()
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on")
    sched = scheduler(connector, control_secret=SECRET).connector_scheduler
    try:
        assert sched.transport.startswith("cuda_ipc zero-copy")
    finally:
        sched.shutdown()
