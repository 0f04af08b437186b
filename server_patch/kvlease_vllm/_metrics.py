"""Prometheus counters of the connector, served by the control endpoint's ``GET /metrics``.

The connector's scheduler side runs in vLLM's engine-core process, whose registry vLLM's API server
does not export; so the counters live in their own registry and the control endpoint serves it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvlease_vllm._verify import Reason

__all__ = ["CONTENT_TYPE_LATEST", "ConnectorMetrics"]


class ConnectorMetrics:
    """One registry per connector instance (tests create several in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.pull_decisions = Counter(
            "kvlease_pull_decisions",
            "Pull-or-recompute decisions on a prefill node, by reason",
            ["reason"],
            registry=r,
        )
        self.verified_tokens = Counter(
            "kvlease_verified_tokens", "Tokens of D's handles verified equal to P's prompt", registry=r
        )
        self.trimmed_tokens = Counter(
            "kvlease_trimmed_tokens", "Tokens of D's handles cut off by verification", registry=r
        )
        self.pulled_tokens = Counter("kvlease_pulled_tokens", "Tokens pulled from decode nodes", registry=r)
        self.renewals = Counter(
            "kvlease_lease_renewals", "Lease renewals on a decode node, by result", ["result"], registry=r
        )
        self.releases = Counter(
            "kvlease_lease_releases",
            "Leases released before their deadline, by cause (request, cap, pressure, not_retained)",
            ["cause"],
            registry=r,
        )
        self.leases = Gauge("kvlease_leases", "Leases held on this decode node", registry=r)
        self.retained_blocks = Gauge("kvlease_retained_blocks", "KV blocks retained for leases", registry=r)
        self.capacity_blocks = Gauge("kvlease_retained_blocks_cap", "Cap on retained KV blocks", registry=r)
        for reason in Reason:
            self.pull_decisions.labels(reason.value)
        for result in ("ok", "unknown"):
            self.renewals.labels(result)
        for cause in ("request", "cap", "pressure", "not_retained"):
            self.releases.labels(cause)

    def render(self) -> bytes:
        return generate_latest(self.registry)
