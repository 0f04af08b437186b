"""Prometheus metrics (one registry per app, no globals) and the miss-rate watchdog (sans-IO)."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvlease.protocol import ReuseStatus
from kvlease_router._logs import RateLimit

__all__ = ["MissRateMonitor", "RouterMetrics"]

_log = logging.getLogger("kvlease.router")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        turns = Counter("kvlease_router_turns", "Turns by KV reuse status", ["status"], registry=r)
        self.turns = {s: turns.labels(status=s.value) for s in ReuseStatus}
        self.reused_tokens = Counter(
            "kvlease_router_reused_tokens", "Prompt tokens reused from D's retained blocks", registry=r
        )
        self.prefill_seconds = Histogram(
            "kvlease_router_prefill_seconds", "Prefill call latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.decode_first_byte_seconds = Histogram(
            "kvlease_router_decode_first_byte_seconds",
            "Decode call latency to response headers",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_seconds = Histogram(
            "kvlease_router_decode_seconds",
            "Decode call latency to the end of the body",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        renewals = Counter("kvlease_router_renewals", "Lease renewals by result", ["result"], registry=r)
        self.renewals = {k: renewals.labels(result=k) for k in ("renewed", "unknown", "failed")}
        self.releases = Counter("kvlease_router_releases", "Leases released on request", registry=r)
        self.store_errors = Counter("kvlease_router_store_errors", "State store failures", registry=r)
        upstream = Counter(
            "kvlease_router_upstream_errors", "Upstream failures by role", ["role"], registry=r
        )
        self.upstream_errors = {k: upstream.labels(role=k) for k in ("prefill", "decode", "control")}
        self.handle_retries = Counter(
            "kvlease_router_prefill_retries_without_handle", "Prefill retried without the handle", registry=r
        )
        self.upstream_retries = Counter(
            "kvlease_router_upstream_retries",
            "Requests sent again to the same node after it did not take them (refused, connection closed)",
            registry=r,
        )
        self.client_errors = Counter(
            "kvlease_router_client_errors", "Requests rejected with a 4xx", registry=r
        )
        self.in_flight = Gauge("kvlease_router_in_flight", "Turns in flight", registry=r)
        self.stalled_streams = Counter(
            "kvlease_router_stalled_streams",
            "Streams closed (their D requests aborted) because the client stopped reading",
            registry=r,
        )
        #: Client errors are logged at most once a second per kind (a flood of bad requests
        #: must not become a flood of log lines).
        self.client_log = RateLimit(1.0)

    def client_error(self, kind: str, message: str) -> None:
        """Count a 4xx; log it at most once a second per kind (never a traceback)."""
        self.client_errors.inc()
        self.log_client(kind, message)

    def log_client(self, kind: str, message: str) -> None:
        """Log what a client did at most once a second per kind (never a traceback)."""
        if self.client_log.allow(kind):
            skipped = self.client_log.take_suppressed(kind)
            more = f" ({skipped} more suppressed)" if skipped else ""
            _log.info("client error %s: %s%s", kind, message[:200], more)

    def render(self) -> bytes:
        return generate_latest(self.registry)


_MISS = frozenset({ReuseStatus.MISS, ReuseStatus.EXPIRED, ReuseStatus.MISMATCH, ReuseStatus.ERROR})


@dataclass
class MissRateMonitor:
    """Says when every follow-up turn with an id missed over a window (the misconfiguration
    symptom: e.g. streaming through stock vLLM, which never returns a handle).

    ``observe`` returns a warning text at most once per window; ``first``/``disabled``/``no-id``
    turns are not counted (nothing could have been reused).
    """

    window_s: float = 300.0
    min_turns: int = 20

    def __post_init__(self) -> None:
        self._events: deque[tuple[float, bool]] = deque()
        self._misses = 0
        self._last_warn = float("-inf")

    def observe(self, now: float, status: ReuseStatus) -> str | None:
        if status is ReuseStatus.HIT:
            miss = False
        elif status in _MISS:
            miss = True
        else:
            return None
        self._events.append((now, miss))
        self._misses += miss
        horizon = now - self.window_s
        while self._events and self._events[0][0] < horizon:
            _, old = self._events.popleft()
            self._misses -= old
        n = len(self._events)
        if n >= self.min_turns and self._misses == n and now - self._last_warn >= self.window_s:
            self._last_warn = now
            return (
                f"all {n} follow-up turns with a conversation id in the last {self.window_s:g} s missed "
                "KV reuse: check that bidirectional_kv_xfer is on, that decodes return handles "
                "(the kvlease plugin for streaming), and the TTLs"
            )
        return None
