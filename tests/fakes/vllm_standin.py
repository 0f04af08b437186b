"""A stand-in for vLLM's NIXL scheduler and connector, for ``KVLeaseScheduler``'s tests (no vLLM).

vLLM cannot be imported in the unit venv, so ``_compat``'s imports are served by a small fake package
(the base classes keep only what the connector calls and reads: the attribute names are checked
against the real 0.32 and 0.33 sources by ``test_vllm_sources``). What runs on top is the connector's
own code: :func:`connector_over_fake_vllm` imports it, :func:`answer_claims` answers D's claims.
"""

from __future__ import annotations

import enum
import importlib
import logging
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvlease.protocol import KV, LEASE_HANDLE_MAC
from kvlease_vllm._control import ClaimResult
from kvlease_vllm._verify import handle_ext, handle_mac

BS = 16
SECRET = "s3cret"
D_TOKENS = list(range(1000, 1000 + 10 * BS + 5))
D_IDS = list(range(100, 111))  # d_handle()'s block ids: 11 blocks for D's 165 tokens


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
        self._reqs_need_recv: dict[str, Any] = {}
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


def import_over_fake_vllm(
    monkeypatch: pytest.MonkeyPatch,
    module: str,
    *,
    nixl: dict[str, Any] | None = None,
    role: Any = _Role,
    device_type: str = "cuda",
) -> Iterator[types.ModuleType]:
    """``module`` (a ``kvlease_vllm`` module) imported over a fake vLLM 0.33 whose upstream NIXL
    classes are ``object`` unless ``nixl`` names them, on a ``device_type`` platform."""
    fakes = {
        "vllm": {"__version__": "0.33.0"},
        "vllm.distributed": {},
        "vllm.distributed.kv_transfer": {},
        "vllm.distributed.kv_transfer.kv_connector": {},
        "vllm.distributed.kv_transfer.kv_connector.v1": {},
        "vllm.distributed.kv_transfer.kv_connector.v1.base": {"KVConnectorRole": role},
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl": {
            "NixlConnector": object,
            "NixlConnectorMetadata": object,
            "NixlKVConnectorStats": object,
            "NixlPullConnectorScheduler": object,
            "NixlPullConnectorWorker": object,
            **(nixl or {}),
        },
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata": {"NIXL_CONNECTOR_VERSION": 15},
        "vllm.envs": {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"},
        "vllm.logger": {"init_logger": logging.getLogger},
        "vllm.platforms": {"current_platform": types.SimpleNamespace(device_type=device_type)},
        "vllm.v1": {},
        "vllm.v1.request": {"RequestStatus": object},
    }
    for name, attrs in fakes.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)
    stale = ("kvlease_vllm._compat", "kvlease_vllm._scheduler", "kvlease_vllm._worker_state", module)
    for name in stale:
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield importlib.import_module(module)
    for name in stale:
        sys.modules.pop(name, None)


def connector_over_fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """``kvlease_vllm.connector`` imported over a fake vLLM 0.33 on a CUDA platform (the body of
    each test module's ``connector`` fixture: ``yield from connector_over_fake_vllm(monkeypatch)``)."""
    yield from import_over_fake_vllm(
        monkeypatch,
        "kvlease_vllm.connector",
        nixl={"NixlConnector": _FakeNixlConnector, "NixlPullConnectorScheduler": _FakeNixlScheduler},
    )


class FullAttentionSpec:
    """vLLM's ``kv_cache_spec`` of a full-attention group (kvlease reads its kind by class name)."""


@dataclass
class SlidingWindowSpec:
    """vLLM's ``kv_cache_spec`` of a sliding-window group."""

    sliding_window: int
    extra_retained_tokens: int = 0


@dataclass
class _Group:
    layer_names: list[str]
    kv_cache_spec: Any = field(default_factory=FullAttentionSpec)


@dataclass
class _KVCacheConfig:
    groups: int = 1
    num_blocks: int = 1000
    kv_cache_tensors: list[Any] = field(default_factory=list)
    #: Sliding windows (tokens) of the groups after the first (0: full attention), as a hybrid model.
    windows: tuple[int, ...] = ()

    @property
    def transfer_groups(self) -> list[_Group]:
        windows = (0, *self.windows, *(0,) * self.groups)[: self.groups]
        return [
            _Group([f"l{i}" for i in range(4)], SlidingWindowSpec(w) if w else FullAttentionSpec())
            for w in windows
        ]

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
        scheduler_config=types.SimpleNamespace(async_scheduling=False),
        max_concurrent_batches=1,
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
    skip_reading_prefix_cache: bool = False  # vLLM: prompt logprobs skip every prefix cache

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
        KV.REMOTE_BLOCK_IDS: [list(D_IDS)],
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


def scheduler(c: types.ModuleType, groups: int = 1, windows: tuple[int, ...] = (), **kw: Any) -> Any:
    conn = c.KVLeaseConnector(
        vllm_config(**kw), _Role.SCHEDULER, _KVCacheConfig(groups=groups, windows=windows)
    )
    return conn


def ask(sched: Any, req: _Request, computed: int = 0) -> tuple[int | None, bool]:
    for _ in range(200):
        got = sched.get_num_new_matched_tokens(req, computed)
        if got[0] is not None:
            return got  # type: ignore[no-any-return]
        time.sleep(0.01)
    raise AssertionError("the claim never finished")


def answer_claims(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str | None]]:
    """D's claims answered in process (29 s left, D's deadline 4321.0); returns the (lease id,
    claimant) of each claim, as it arrives."""
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


@dataclass
class _KVBlock:
    block_id: int
    block_hash: bytes | None = None
    is_null: bool = False


class Allocation:
    """vLLM's ``KVCacheBlocks`` for a loading request: ``local`` tokens of P's prefix cache (hashed
    blocks), then fresh blocks for the external tokens (hashed only once the load is done)."""

    def __init__(self, local: int, total: int) -> None:
        n = -(-total // BS)
        self.blocks = ([_KVBlock(500 + i, b"h%d" % i if i < local // BS else None) for i in range(n)],)

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return [[b.block_id for b in g if b.block_hash is None] for g in self.blocks]
