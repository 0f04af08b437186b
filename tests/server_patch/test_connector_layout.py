"""``kvlease_vllm._layout``: a pull's shape (descriptors, block-id runs) and the transport advice,
table-tested (sans-IO, no vLLM)."""

from __future__ import annotations

import ast
import logging
import types
from pathlib import Path
from typing import Any

import pytest

from kvlease_stack._vllm_src import SUPPORTED, vllm_source
from kvlease_vllm._layout import (
    HEAD_SEGMENTED_LAYOUTS,
    LAYER_REGION_LAYOUTS,
    WHOLE_ROW_LAYOUTS,
    PullShape,
    contiguous_runs,
    kv_regions,
    pull_shape,
    transport_advice,
)

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
        # 24k tokens of a 64-layer model, random ids: one region per layer (vLLM 0.32, 0.33) ...
        ([list(range(0, 3072, 2))], [list(range(1, 3073, 2))], 64, PullShape(98_304, 1536, 1536)),
        # ... and K, V as separate regions (the layout of the first H200 measurement)
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


def _config(layout: str | None = None, heads: int = 8, enabled: tuple[bool, ...] = (True, True)) -> Any:
    spec = types.SimpleNamespace(num_kv_heads=heads)
    groups = [
        types.SimpleNamespace(layer_names=names, kv_cache_spec=spec, enable_kv_transfer=on)
        for names, on in zip((["a", "b"], ["c"]), enabled)
    ]
    return types.SimpleNamespace(kv_cache_groups=groups, kv_cache_layout=layout)


@pytest.mark.parametrize(
    ("layout", "regions"),
    [
        (None, 3),  # not resolved (a stand-in): one per layer
        ("LBHNC", 3),  # what vLLM's NIXL connector asks for: one region per layer, K and V packed
        ("LBNHC", 3),
        ("BLHNC", 3),
        ("LHBNC", 24),  # head-major: one region per (layer, KV head)
        ("BLNHC", 1),  # block-outermost without contiguous pages: one whole-row region
        ("BHLNC", 1),
    ],
)
def test_kv_regions_from_the_kv_cache_config(layout: str | None, regions: int) -> None:
    assert kv_regions(_config(layout)) == regions


def test_kv_regions_count_only_transferable_groups_and_guess_the_unknown() -> None:
    assert kv_regions(_config(enabled=(True, False))) == 2
    old = types.SimpleNamespace(kv_cache_groups=[types.SimpleNamespace(layer_names=["a", "b"])])
    assert kv_regions(old) == 2  # a vLLM without enable_kv_transfer: every group
    assert kv_regions(object()) == 32  # unknown config: a 32-layer model


# ---- the rule, read from the sources of every supported vLLM -------------------------------------
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _register_kv_caches(root: Path) -> ast.FunctionDef:
    path = root / "distributed" / "kv_transfer" / "kv_connector" / "v1" / "nixl" / "base_worker.py"
    (fn,) = [
        f
        for cls in _tree(path).body
        if isinstance(cls, ast.ClassDef)
        for f in cls.body
        if isinstance(f, ast.FunctionDef) and f.name == "register_kv_caches"
    ]
    return fn


def _assigned(fn: ast.AST, name: str) -> list[ast.expr]:
    return [
        n.value
        for n in ast.walk(fn)
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("version", sorted(SUPPORTED))
def test_kv_regions_follow_upstreams_registration(version: str) -> None:
    """``kv_regions`` against the rule upstream's ``register_kv_caches`` applies, read with ``ast``:

    - a layer whose pages lie one per block (the ``storage_is_block_major`` branch) registers ONE
      region whose block is the layer's whole page, and the page holds K and V (``head_size +
      head_size_v``): one region per attention layer, not two;
    - a layer view that is not block-major is cut into ``cache.nbytes // (num_blocks x stride)``
      segments: one per KV head when heads come before blocks (``LHBNC``), one otherwise;
    - a block-outermost layout whose pages are not contiguous registers the whole row.

    Each ``KVCacheLayout`` member upstream defines is then classified from its stride order and
    compared with :func:`kv_regions` (a layout added by a vLLM upgrade fails here)."""
    root = vllm_source(version) / "vllm"
    fn = _register_kv_caches(root)
    branches = [
        n for n in ast.walk(fn) if isinstance(n, ast.If) and ast.unparse(n.test) == "storage_is_block_major"
    ]
    assert len(branches) == 1
    (per_layer,) = _assigned(ast.Module(body=branches[0].body, type_ignores=[]), "region_specs")
    assert isinstance(per_layer, ast.List)
    regions_per_layer = len(per_layer.elts)
    assert regions_per_layer == 1
    assert ast.unparse(per_layer.elts[0]) == "(cache.data_ptr(), physical_page_size, block_stride)"
    assert any("layer_spec.page_size_bytes" in ast.unparse(v) for v in _assigned(fn, "physical_page_size"))
    specs = {ast.unparse(n) for n in ast.walk(_tree(root / "v1" / "kv_cache_interface.py"))}
    assert "return (self.head_size + self.head_size_v) * get_dtype_size(self.dtype)" in specs
    (segments,) = _assigned(fn, "num_segments")
    assert ast.unparse(segments) == "cache.nbytes // segment_bytes"
    assert any(
        isinstance(v, ast.ListComp) and ast.unparse(v.generators[0].iter) == "range(num_segments)"
        for v in _assigned(fn, "region_specs")
    )
    assert "not page_contiguous" in ast.unparse(fn)  # the whole-row branch
    # every layout upstream defines, classified by the rule above
    (enum,) = [c for c in _tree(root / "v1" / "kv_cache_layout.py").body if isinstance(c, ast.ClassDef)]
    layouts = {
        n.targets[0].id: ast.literal_eval(n.value)
        for n in enum.body
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)
    }
    _, B, H, N, C = range(5)  # upstream's dim indices: [L, B, H, N, C]
    assert set(layouts) == LAYER_REGION_LAYOUTS | WHOLE_ROW_LAYOUTS | HEAD_SEGMENTED_LAYOUTS
    layers, heads = 3, 8
    for name, order in layouts.items():
        if order[0] == B:  # block-outermost: a layer's page is contiguous, or the row is registered
            expected = layers * regions_per_layer if order[-3:] == (H, N, C) else 1
        else:  # layer-outermost: segments per layer = the dims between the layer and the block
            expected = layers * (heads if order.index(H) < order.index(B) else 1)
        assert kv_regions(_config(name, heads=heads)) == expected, name


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
