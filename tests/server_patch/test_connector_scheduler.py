"""KVLeaseScheduler's decisions, run against a stand-in for vLLM's NIXL scheduler (no vLLM here).

vLLM cannot be imported in this venv, so ``_compat``'s imports are served by a small fake package
(the base classes keep only what the connector calls and reads: the attribute names are checked
against the real 0.32 and 0.33 sources by ``test_vllm_sources``). What runs is the connector's own
code: the P-side verify/claim/trim flow and every decline's log line, the D-side ``kvlease`` object,
the start-up refusals, ``supports_sleep_mode``, data-parallel ports and emergency relief.
"""

from __future__ import annotations

import enum
import logging
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvlease._errors import ConfigError
from kvlease.protocol import KV, LEASE_HANDLE_MAC
from kvlease_vllm._control import ClaimResult
from kvlease_vllm._verify import handle_ext, handle_mac

BS = 16
SECRET = "s3cret"
D_TOKENS = list(range(1000, 1000 + 10 * BS + 5))


class _Role(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class _FakeNixlScheduler:
    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        self.vllm_config = vllm_config
        self.engine_id = engine_id
        self.kv_cache_config = kv_cache_config
        self.block_size = vllm_config.cache_config.block_size
        self.side_channel_host = "127.0.0.1"
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.is_bidirectional_kv_xfer_enabled = bool(extra.get("bidirectional_kv_xfer", False))
        self.decoder_kv_blocks_ttl = 120.0
        self.kv_recompute_threshold = 64
        self._is_hma_required = vllm_config.hybrid
        self._reqs_need_send: dict[str, float] = {}
        self.allocated: list[tuple[dict[str, Any] | None, int]] = []

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.allocated.append((request.kv_transfer_params, num_external_tokens))

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return True, {
            KV.DO_REMOTE_DECODE: True,
            KV.DO_REMOTE_PREFILL: False,
            KV.REMOTE_BLOCK_IDS: [list(range(100, 111))],
            KV.REMOTE_ENGINE_ID: self.engine_id,
            KV.REMOTE_REQUEST_ID: request.request_id,
            KV.REMOTE_HOST: "127.0.0.1",
            KV.REMOTE_PORT: 5601,
            KV.REMOTE_NUM_TOKENS: len(request.all_token_ids),
            KV.REMOTE_BLOCKS_EXPIRY_TIME: time.perf_counter() + 120.0,
        }

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return None

    def update_connector_output(self, connector_output: Any) -> None:
        return None

    def shutdown(self) -> None:
        return None


class _FakeNixlConnector:
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        self.engine_id = "engine-p"
        self.connector_scheduler = None

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        return None


@pytest.fixture
def connector(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """``kvlease_vllm.connector`` imported over a fake vLLM 0.33 on a CUDA platform."""
    fakes = {
        "vllm": {"__version__": "0.33.0"},
        "vllm.distributed": {},
        "vllm.distributed.kv_transfer": {},
        "vllm.distributed.kv_transfer.kv_connector": {},
        "vllm.distributed.kv_transfer.kv_connector.v1": {},
        "vllm.distributed.kv_transfer.kv_connector.v1.base": {"KVConnectorRole": _Role},
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl": {
            "NixlConnector": _FakeNixlConnector,
            "NixlConnectorMetadata": object,
            "NixlPullConnectorScheduler": _FakeNixlScheduler,
            "NixlPullConnectorWorker": object,
        },
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata": {"NIXL_CONNECTOR_VERSION": 15},
        "vllm.envs": {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"},
        "vllm.logger": {"init_logger": logging.getLogger},
        "vllm.platforms": {"current_platform": types.SimpleNamespace(device_type="cuda")},
        "vllm.v1": {},
        "vllm.v1.request": {"RequestStatus": object},
    }
    for name, attrs in fakes.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)
    for name in ("kvlease_vllm._compat", "kvlease_vllm.connector"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import kvlease_vllm.connector as c

    yield c
    for name in ("kvlease_vllm._compat", "kvlease_vllm.connector"):
        sys.modules.pop(name, None)


@dataclass
class _Group:
    layer_names: list[str]


@dataclass
class _KVCacheConfig:
    groups: int = 1
    num_blocks: int = 1000
    kv_cache_tensors: list[Any] = field(default_factory=list)

    @property
    def transfer_groups(self) -> list[_Group]:
        return [_Group([f"l{i}" for i in range(4)]) for _ in range(self.groups)]

    @property
    def kv_cache_groups(self) -> list[_Group]:
        return self.transfer_groups


def vllm_config(
    *,
    bidir: bool = True,
    buffer: str = "cuda",
    role: str = "kv_producer",
    hybrid: bool = False,
    **kvlease: Any,
) -> Any:
    extra: dict[str, Any] = {"bidirectional_kv_xfer": bidir, "kvlease": kvlease}
    return types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(
            kv_connector_extra_config=extra,
            kv_buffer_device=buffer,
            kv_role=role,
            kv_load_failure_policy="fail",
        ),
        cache_config=types.SimpleNamespace(block_size=BS),
        parallel_config=types.SimpleNamespace(
            data_parallel_index=0, decode_context_parallel_size=1, prefill_context_parallel_size=1
        ),
        model_config=None,
        hybrid=hybrid,
    )


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = None
    lora_request: Any = None
    mm_features: list[Any] = field(default_factory=list)
    prompt_embeds: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids


def d_handle(tokens: list[int] = D_TOKENS, **ext_kw: Any) -> dict[str, Any]:
    ext = handle_ext(
        token_ids=tokens,
        num_tokens=len(tokens),
        block_size=BS,
        salt=None,
        lease_id="d-1",
        engine_id="engine-d",
        control="http://127.0.0.1:9",
        **ext_kw,
    )
    params: dict[str, Any] = {
        KV.DO_REMOTE_DECODE: True,
        KV.DO_REMOTE_PREFILL: False,
        KV.REMOTE_BLOCK_IDS: [list(range(100, 111))],
        KV.REMOTE_ENGINE_ID: "engine-d",
        KV.REMOTE_REQUEST_ID: "d-1",
        KV.REMOTE_HOST: "127.0.0.1",
        KV.REMOTE_PORT: 5601,
        KV.REMOTE_NUM_TOKENS: len(tokens),
        KV.REMOTE_BLOCKS_EXPIRY_TIME: 50.0,
        KV.KVLEASE: ext.to_json(),
    }
    params[KV.KVLEASE] = {**params[KV.KVLEASE], LEASE_HANDLE_MAC: handle_mac(SECRET, params)}
    return params


def scheduler(c: types.ModuleType, groups: int = 1, **kw: Any) -> Any:
    conn = c.KVLeaseConnector(vllm_config(**kw), _Role.SCHEDULER, _KVCacheConfig(groups=groups))
    return conn


def ask(sched: Any, req: _Request, computed: int = 0) -> tuple[int | None, bool]:
    for _ in range(200):
        got = sched.get_num_new_matched_tokens(req, computed)
        if got[0] is not None:
            return got  # type: ignore[no-any-return]
        time.sleep(0.01)
    raise AssertionError("the claim never finished")


@pytest.fixture
def claims(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str | None]]:
    seen: list[tuple[str, str | None]] = []

    def fake_claim(
        url: str, lease_id: str, hold: float, secret: Any, timeout: float, claimant: Any = None, **kw: Any
    ) -> Any:
        seen.append((lease_id, claimant))
        return ClaimResult(29.0, 4321.0)

    import kvlease_vllm._control as control

    monkeypatch.setattr(control, "claim", fake_claim)
    return seen


NEW_TURN = [7] * 40


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
    edited = list(D_TOKENS)
    edited[6 * BS] = 1  # an earlier word edited: only 6 blocks verify
    handle = d_handle()
    handle[KV.REMOTE_BLOCK_IDS] = [list(range(100, 111)), list(range(200, 211))]
    handle[KV.KVLEASE] = {**handle[KV.KVLEASE], LEASE_HANDLE_MAC: handle_mac(SECRET, handle)}
    line = _declined(
        connector, caplog, _Request("p", edited + NEW_TURN, handle), groups=2, control_secret=SECRET
    )
    assert "recompute (hybrid_partial)" in line and f"only {6 * BS} of D's {len(D_TOKENS)} tokens" in line


def test_hybrid_token_exact_continuation_still_pulls(connector: Any, claims: list) -> None:
    conn = scheduler(connector, groups=2, control_secret=SECRET)
    sched = conn.connector_scheduler
    try:
        handle = d_handle()
        handle[KV.REMOTE_BLOCK_IDS] = [list(range(100, 111)), list(range(200, 211))]
        handle[KV.KVLEASE] = {**handle[KV.KVLEASE], LEASE_HANDLE_MAC: handle_mac(SECRET, handle)}
        assert ask(sched, _Request("p", D_TOKENS + NEW_TURN, handle)) == (len(D_TOKENS), True)
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
        assert sched.kv_regions == 8  # 4 layers x (K, V)
        text = sched.metrics.render().decode()
        assert "kvlease_pull_descriptors_sum 40.0" in text  # 8 regions x 5 blocks
        assert 'kvlease_pull_block_runs_sum{side="local"} 2.0' in text
        assert 'kvlease_pull_block_runs_sum{side="remote"} 1.0' in text
        assert (
            "pull of 80 tokens: 40 descriptors (8 KV regions x blocks), block-id runs P 2 / D 1"
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
