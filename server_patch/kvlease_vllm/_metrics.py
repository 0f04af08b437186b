"""Prometheus counters of the connector, served by the control endpoint's ``GET /metrics``.

The connector's scheduler side runs in vLLM's engine-core process, whose registry vLLM's API server
does not export; so the counters live in their own registry and the control endpoint serves it.

Host placement (issue-facing names, also used by ``kvlease plan`` and the benchmarks):
``kvlease_device_blocks_held``, ``kvlease_device_blocks_cached``, ``kvlease_host_bytes_used``,
``kvlease_host_bytes_capacity``, ``kvlease_demotions_total``, ``kvlease_demotion_bytes_total``,
``kvlease_evictions_total{reason}``, ``kvlease_demotion_seconds`` and ``kvlease_pulls_total{source}``.
The last two are measured where the copies run, in the workers (often other processes), and reach
the scheduler on upstream's own per-step connector stats (:data:`STAT_KEYS`, TP rank 0's).
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


#: Keys kvlease's workers add to upstream's NIXL connector stats (lists, as upstream's own).
STAT_PULLS = "kvlease_pulls_"  # + source: one entry per staged pull done on P
STAT_DEMOTION_S = "kvlease_demotion_s"  # seconds per demotion on D
STAT_KEYS = (STAT_PULLS + "device", STAT_PULLS + "host", STAT_DEMOTION_S)
#: A demotion's time, from the copy's start to the worker seeing it done (polled once a step on
#: CUDA): 1k-24k tokens of a 32B-class model are 0.25-6 GiB, 5-120 ms at the PCIe rate.
_TIER_PREFIXES = (
    "kvlease_device_blocks_",
    "kvlease_host_bytes_",
    "kvlease_demotion",
    "kvlease_evictions",
    "kvlease_pulls",
)
_DEMOTION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


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
        self.device_blocks_held = Gauge(
            "kvlease_device_blocks_held", "KV blocks leases hold against reuse (device placement)", registry=r
        )
        self.device_blocks_cached = Gauge(
            "kvlease_device_blocks_cached",
            "KV blocks of host-placed leases whose device copy is intact and evictable",
            registry=r,
        )
        self.host_bytes_used = Gauge("kvlease_host_bytes_used", "Host arena bytes leases use", registry=r)
        self.host_bytes_capacity = Gauge(
            "kvlease_host_bytes_capacity", "Host arena bytes (per worker)", registry=r
        )
        self.demotions = Counter("kvlease_demotions", "Leases written through to the host arena", registry=r)
        self.demotion_bytes = Counter(
            "kvlease_demotion_bytes", "Bytes written through to the host arena (per worker)", registry=r
        )
        self.evictions = Counter(
            "kvlease_evictions",
            "Leases that left the host arena, by reason (pressure, lifetime, expiry, release)",
            ["reason"],
            registry=r,
        )
        self.placements = Counter(
            "kvlease_placements",
            "Finished leased requests by placement (device: held in HBM, host: in the arena, "
            "device_fallback: host placement refused for this lease)",
            ["placement"],
            registry=r,
        )
        self.demotion_seconds = Histogram(
            "kvlease_demotion_seconds",
            "Time to write a lease through to the host arena (one worker's shard)",
            buckets=_DEMOTION_BUCKETS,
            registry=r,
        )
        self.pulls = Counter(
            "kvlease_pulls",
            "Staged pulls done on a prefill node, by where D's bytes came from (device, host)",
            ["source"],
            registry=r,
        )
        for source in ("device", "host"):
            self.pulls.labels(source)
        for reason in Reason:
            self.pull_decisions.labels(reason.value)
        for result in ("ok", "unknown"):
            self.renewals.labels(result)
        for cause in ("request", "cap", "pressure", "not_retained"):
            self.releases.labels(cause)
        for side in ("local", "remote"):
            self.pull_runs.labels(side)
        for reason in ("pressure", "lifetime", "expiry", "release"):
            self.evictions.labels(reason)
        for placement in ("device", "host", "device_fallback"):
            self.placements.labels(placement)

    def observe_pull_shape(self, shape: PullShape) -> None:
        self.pull_descriptors.observe(shape.descriptors)
        self.pull_runs.labels("local").observe(shape.local_runs)
        self.pull_runs.labels("remote").observe(shape.remote_runs)

    def observe_worker_stats(self, stats: object) -> None:
        """The workers' figures (:data:`STAT_KEYS`) off a step's connector stats."""
        data = getattr(stats, "data", None)
        if not isinstance(data, dict):
            return
        for source in ("device", "host"):
            n = len(data.get(STAT_PULLS + source) or ())
            if n:
                self.pulls.labels(source).inc(n)
        for seconds in data.get(STAT_DEMOTION_S) or ():
            self.demotion_seconds.observe(seconds)

    def tier(self) -> dict[str, float]:
        """The tier figures now, under their exported names (labels in Prometheus' text form), for
        ``GET /info`` and the router's status."""
        out: dict[str, float] = {}
        for family in self.registry.collect():
            for sample in family.samples:
                if not sample.name.startswith(_TIER_PREFIXES) or sample.name.endswith(
                    ("_created", "_bucket")
                ):
                    continue
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
        return out

    def render(self) -> bytes:
        return generate_latest(self.registry)
