"""``kvlease_vllm._layout``: a pull's shape (descriptors, block-id runs) and the transport advice,
table-tested (sans-IO, no vLLM)."""

from __future__ import annotations

import logging
import types

import pytest

from kvlease_vllm._layout import PullShape, contiguous_runs, kv_regions, pull_shape, transport_advice

INFO, WARN = logging.INFO, logging.WARNING


@pytest.mark.parametrize(
    ("ids", "runs"),
    [
        ([], 0),
        ([5], 1),
        ([1, 2, 3, 4], 1),
        ([4, 3, 2, 1], 4),  # descending ids are not adjacent in NIXL's merge (address order)
        ([1, 2, 4, 5], 2),
        ([1, 3, 5, 7], 4),
        ([1, 1, 2], 2),  # a repeated id breaks the run
        ([10, 11, 12, 0, 1, 99], 3),
        (range(100, 1636), 1),  # 24k tokens of a fresh pool
    ],
)
def test_contiguous_runs(ids: list[int], runs: int) -> None:
    assert contiguous_runs(list(ids)) == runs


@pytest.mark.parametrize(
    ("local", "remote", "regions", "shape"),
    [
        ([[1, 2, 3]], [[7, 8, 9]], 128, PullShape(384, 1, 1)),
        ([[1, 3, 5]], [[7, 8, 9]], 128, PullShape(384, 3, 1)),
        ([[1, 2, 3]], [[9, 4, 5]], 8, PullShape(24, 1, 2)),
        # D's list also covers P's locally cached prefix: paired from the end
        ([[20, 21]], [[1, 5, 6]], 8, PullShape(16, 1, 1)),
        ([[20, 30, 31]], [[6, 7]], 8, PullShape(16, 1, 1)),
        # a full local hit: nothing is read
        ([[]], [[1, 2, 3]], 8, PullShape(0, 0, 0)),
        ([], [], 8, PullShape(0, 0, 0)),
        # two KV cache groups share the regions; runs are summed
        ([[1, 2], [5, 9]], [[3, 4], [6, 7]], 8, PullShape(16, 3, 2)),
        # the figure: 24k tokens, 64 layers x (K, V), random ids
        ([list(range(0, 3072, 2))], [list(range(1, 3073, 2))], 128, PullShape(196_608, 1536, 1536)),
    ],
)
def test_pull_shape(local: list[list[int]], remote: list[list[int]], regions: int, shape: PullShape) -> None:
    assert pull_shape(local, remote, regions) == shape


def test_shape_describes_itself() -> None:
    assert PullShape(40, 2, 1).describe(8) == (
        "40 descriptors (8 KV regions x blocks), block-id runs P 2 / D 1"
    )
    assert PullShape(40, 2, 1).describe() == "40 descriptors, block-id runs P 2 / D 1"


def test_kv_regions_from_the_kv_cache_config() -> None:
    group = types.SimpleNamespace
    config = types.SimpleNamespace(kv_cache_groups=[group(layer_names=["a", "b"]), group(layer_names=["c"])])
    assert kv_regions(config) == 6
    assert kv_regions(object()) == 64  # unknown layout: a 32-layer model


ZC = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}


@pytest.mark.parametrize(
    ("platform", "env", "buffer", "level", "says"),
    [
        ("cpu", {}, None, INFO, "host memory (CPU platform)"),
        ("cpu", {"UCX_TLS": "tcp"}, "cpu", INFO, "host memory (CPU platform)"),
        ("cuda", {}, "cuda", WARN, "UCX_CUDA_IPC_ENABLE_GET_ZCOPY is not on"),
        ("cuda", {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "off"}, None, WARN, "TCP emulation"),
        ("cuda", {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "true"}, None, WARN, "not on"),  # not UCX's spelling
        ("cuda", ZC, "cuda", INFO, "cuda_ipc zero-copy"),
        ("cuda", {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "YES"}, None, INFO, "UCX default transports"),
        ("cuda", {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "1"}, None, INFO, "cuda_ipc"),
        ("cuda", {**ZC, "UCX_TLS": "tcp,cuda_copy"}, None, WARN, "UCX_TLS=tcp,cuda_copy leaves out"),
        ("cuda", {**ZC, "UCX_TLS": "cuda_ipc,cuda_copy"}, None, INFO, "UCX_TLS=cuda_ipc,cuda_copy"),
        ("cuda", {**ZC, "UCX_TLS": "rc_x,cuda_copy"}, None, INFO, "cuda_ipc"),
        ("cuda", {**ZC, "UCX_TLS": "dc_mlx5"}, None, INFO, "cuda_ipc"),
        ("cuda", {**ZC, "UCX_TLS": "all"}, None, INFO, "cuda_ipc"),
        ("cuda", {**ZC, "UCX_TLS": "^cuda_ipc"}, None, WARN, "leaves out"),
        ("cuda", {**ZC, "UCX_TLS": "^tcp"}, None, INFO, "cuda_ipc"),
        ("cuda", {**ZC, "FI_PROVIDER": "efa"}, None, INFO, "FI_PROVIDER=efa"),
        ("cuda", ZC, "cpu", WARN, "host buffer (kv_buffer_device=cpu)"),
        ("xpu", {}, None, INFO, "xpu platform"),
    ],
)
def test_transport_advice(
    platform: str, env: dict[str, str], buffer: str | None, level: int, says: str
) -> None:
    got_level, message = transport_advice(platform, env, buffer)
    assert (got_level, says in message) == (level, True), message


def test_info_carries_the_transport_and_old_peers_still_parse() -> None:
    from kvlease.protocol import ControlInfo, Role

    info = ControlInfo(
        Role.DECODE, "e", "0.33.0", "0.2.0", True, 120.0, 64, 16, transport="host memory (CPU platform)"
    )
    assert ControlInfo.from_json(info.to_json()) == info
    old = {k: v for k, v in info.to_json().items() if k != "transport"}
    assert ControlInfo.from_json(old).transport is None
    assert ControlInfo.from_json({**old, "transport": 7}).transport is None


def test_router_status_shows_each_nodes_transport() -> None:
    from kvlease.protocol import ControlInfo, Role
    from kvlease_router._app import _describe
    from kvlease_router._upstreams import Node

    info = ControlInfo(
        Role.PREFILL, "e", "0.33.0", "0.2.0", True, 120.0, 64, 16, transport="cuda_ipc zero-copy"
    )
    node = Node("http://p", "http://p:9", "prefill", info=info)
    assert _describe(node, 0.0)["transport"] == "cuda_ipc zero-copy"
    assert _describe(node, 0.0)["url"] == "http://p"
    assert _describe(Node("http://d", None, "decode"), 0.0)["transport"] is None  # no /info yet
