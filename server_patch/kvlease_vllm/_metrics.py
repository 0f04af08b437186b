"""Prometheus counters of the connector, served by the control endpoint's ``GET /metrics``.

The connector's scheduler side runs in vLLM's engine-core process, whose registry vLLM's API server
does not export; so the counters live in their own registry and the control endpoint serves it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvlease_vllm._layout import PullShape
from kvlease_vllm._verify import Reason

__all__ = ["CONTENT_TYPE_LATEST", "ConnectorMetrics"]

#: Descriptors vLLM's worker posts per pull (regions x blocks): 1k tokens of a 64-layer model are
#: 8,192, 24k are 196,608.
_DESCRIPTOR_BUCKETS = (64, 256, 1024, 4096, 16384, 65536, 131072, 262144, 524288, 1048576)
#: Contiguous runs of block ids on one side of a pull (1: one run, coalescible to one READ per region).
_RUN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


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
        self.pull_descriptors = Histogram(
            "kvlease_pull_descriptors",
            "NIXL descriptors vLLM's worker posts per pull on a prefill node (KV regions x blocks)",
            buckets=_DESCRIPTOR_BUCKETS,
            registry=r,
        )
        self.pull_runs = Histogram(
            "kvlease_pull_block_runs",
            "Contiguous runs of block ids per pull, by side (local: P's destination, remote: D's source)",
            ["side"],
            buckets=_RUN_BUCKETS,
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
        for side in ("local", "remote"):
            self.pull_runs.labels(side)

    def observe_pull_shape(self, shape: PullShape) -> None:
        self.pull_descriptors.observe(shape.descriptors)
        self.pull_runs.labels("local").observe(shape.local_runs)
        self.pull_runs.labels("remote").observe(shape.remote_runs)

    def render(self) -> bytes:
        return generate_latest(self.registry)
