"""Start-up validation of a P/D cluster (sans-IO: takes what the nodes reported, returns a plan).

The router refuses to start (:class:`ConfigError` naming the nodes) when prefill and decode disagree
on the model, vLLM version, NIXL version, NIXL connector version (14 in vLLM 0.32, 15 in 0.33: P
and D must be upgraded together), ``bidirectional_kv_xfer`` or block size, when a node has the
wrong role, or when the router's TTL is not below D's TTL minus the safety margin.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvlease.protocol import PROTOCOL_VERSION, ControlInfo, Role
from kvlease_router._settings import ConfigError, RouterSettings

__all__ = ["ClusterPlan", "NodeFacts", "plan_cluster"]


@dataclass(frozen=True)
class NodeFacts:
    """What one node reported: ``/info`` of its control endpoint, or ``/v1/models`` + ``/version``."""

    url: str
    model: str | None
    vllm_version: str | None
    info: ControlInfo | None = None


@dataclass(frozen=True)
class ClusterPlan:
    ttl: float  # the router's lease TTL
    decode_ttl: float  # the smallest TTL among decode nodes
    reuse: bool  # False when bidirectional_kv_xfer is off everywhere
    block_size: int | None
    model: str | None
    vllm_version: str | None
    warnings: tuple[str, ...]


def _agree(what: str, facts: Sequence[NodeFacts], values: Sequence[object]) -> object:
    known = {(f.url, v) for f, v in zip(facts, values) if v is not None}
    distinct = {v for _, v in known}
    if len(distinct) > 1:
        listing = ", ".join(f"{url}: {v!r}" for url, v in sorted(known, key=str))
        raise ConfigError(f"prefill and decode nodes disagree on {what} ({listing})")
    return next(iter(distinct), None)


def plan_cluster(
    settings: RouterSettings, prefill: Sequence[NodeFacts], decode: Sequence[NodeFacts]
) -> ClusterPlan:
    facts = list(prefill) + list(decode)
    warnings: list[str] = []
    model = _agree("the served model", facts, [f.model for f in facts])
    version = _agree("the vLLM version", facts, [f.vllm_version for f in facts])
    if not settings.kvlease_mode:
        warnings.append(
            "stock-vLLM mode (no kvlease control endpoints): handles are offered only after a "
            "message-level continuity check, captured from non-streaming decodes only, and leases "
            "cannot be renewed (they last D's fixed decoder_kv_blocks_ttl)"
        )
        ttl = settings.resolved_ttl(settings.node_ttl)
        return ClusterPlan(ttl, settings.node_ttl, True, None, _s(model), _s(version), tuple(warnings))

    infos: list[ControlInfo] = []
    for f in facts:
        if f.info is None:
            raise ConfigError(f"{f.url}: no kvlease control information")
        infos.append(f.info)
    for f in prefill:
        assert f.info is not None
        if f.info.role not in (Role.PREFILL, Role.BOTH):
            raise ConfigError(
                f"{f.url} is configured as prefill but its connector reports role {f.info.role.value}"
            )
    for f in decode:
        assert f.info is not None
        if f.info.role not in (Role.DECODE, Role.BOTH):
            raise ConfigError(
                f"{f.url} is configured as decode but its connector reports role {f.info.role.value}"
            )
    for f, i in zip(facts, infos):
        if i.protocol_version != PROTOCOL_VERSION:
            raise ConfigError(
                f"{f.url} speaks kvlease protocol {i.protocol_version}; this router speaks {PROTOCOL_VERSION}"
            )
    _agree("the served model", facts, [i.model for i in infos])
    version = _agree("the vLLM version", facts, [i.vllm_version or None for i in infos]) or version
    _agree("the NIXL version", facts, [i.nixl_version for i in infos])
    _agree("the NIXL connector version", facts, [i.connector_version for i in infos])
    bidir = _agree("bidirectional_kv_xfer", facts, [i.bidirectional_kv_xfer for i in infos])
    block = _agree("the KV block size", facts, [i.block_size for i in infos])
    decode_ttl = min(i.ttl_s for f, i in zip(facts, infos) if f in decode)
    ttl = settings.resolved_ttl(decode_ttl)
    if bidir is False:
        warnings.append(
            "bidirectional_kv_xfer is off on every node: KV reuse is disabled (status 'disabled')"
        )
    return ClusterPlan(
        ttl,
        decode_ttl,
        bool(bidir),
        block if isinstance(block, int) else None,
        _s(model) or infos[0].model,
        _s(version),
        tuple(warnings),
    )


def _s(v: object) -> str | None:
    return v if isinstance(v, str) else None
