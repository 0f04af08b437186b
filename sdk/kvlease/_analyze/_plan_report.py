"""The planner's sweep, recommendation and rendering: :func:`plan_trace` runs the replays of
``_plan`` (pure), :func:`render` and :meth:`CapacityPlan.to_json` show them."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from kvlease._analyze._plan import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_IDLE,
    DEFAULT_TTL,
    Policy,
    ReplayResult,
    Trace,
    auto_caps,
    percentile,
    replay,
)
from kvlease._analyze._recommend import MIN_SUGGESTED_TTL, nice_ceil
from kvlease._analyze._report import _pct

#: A cap is enough when leases under it keep this share of the uncapped leases' hits.
DEFAULT_TARGET: Final = 0.95
#: Sweep points (caps halving down from the uncapped need).
DEFAULT_POINTS: Final = 12
#: max-idle covers this quantile of the follow-up gaps.
MAX_IDLE_QUANTILE: Final = 0.95


@dataclass(frozen=True)
class PlanConfig:
    bytes_per_token: int
    nodes: int = 1
    ttl: float = DEFAULT_TTL
    max_idle: float = DEFAULT_MAX_IDLE
    block_size: int = DEFAULT_BLOCK_SIZE
    caps: tuple[int, ...] | None = None  # per node; None: DEFAULT_POINTS caps from the uncapped need
    points: int = DEFAULT_POINTS
    node_kv_bytes: int | None = None  # the KV cache of one decode node (for max_retained_fraction)
    target: float = DEFAULT_TARGET
    model: str = ""
    release_on_close: bool = False  # leases: the client releases when the conversation closes


@dataclass(frozen=True)
class SweepPoint:
    cap_bytes: int
    ttl: ReplayResult
    lease: ReplayResult


@dataclass(frozen=True)
class PlanRecommendation:
    ttl_s: float | None
    max_idle_s: float | None
    cap_bytes: int | None  # per node
    max_retained_fraction: float | None  # cap / node_kv_bytes, rounded up to 0.01 (None without it)
    fits: bool | None  # the cap fits in the node's KV cache (None without --node-kv-bytes)
    text: str


@dataclass(frozen=True)
class CapacityPlan:
    config: PlanConfig
    conversations: int
    turns: int
    follow_up_turns: int
    gap_p50_s: float | None
    gap_p95_s: float | None
    ttl: ReplayResult  # uncapped
    lease: ReplayResult  # uncapped
    sweep: tuple[SweepPoint, ...]
    recommendation: PlanRecommendation
    source: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        c = self.config
        return {
            "input": dict(self.source),
            "settings": {
                "model": c.model,
                "kv_bytes_per_token": c.bytes_per_token,
                "nodes": c.nodes,
                "ttl_s": c.ttl,
                "max_idle_s": c.max_idle,
                "block_size": c.block_size,
                "node_kv_bytes": c.node_kv_bytes,
                "target": c.target,
                "release_on_close": c.release_on_close,
            },
            "conversations": self.conversations,
            "turns": self.turns,
            "follow_up_turns": self.follow_up_turns,
            "gaps": {"p50_s": self.gap_p50_s, "p95_s": self.gap_p95_s},
            "uncapped": {"ttl": result_json(self.ttl), "lease": result_json(self.lease)},
            "sweep": [
                {"cap_bytes": p.cap_bytes, "ttl": result_json(p.ttl), "lease": result_json(p.lease)}
                for p in self.sweep
            ],
            "recommendation": {
                "ttl_s": self.recommendation.ttl_s,
                "max_idle_s": self.recommendation.max_idle_s,
                "cap_bytes": self.recommendation.cap_bytes,
                "max_retained_fraction": self.recommendation.max_retained_fraction,
                "fits": self.recommendation.fits,
                "text": self.recommendation.text,
            },
        }


def result_json(r: ReplayResult) -> dict[str, Any]:
    return {
        "policy": r.policy.value,
        "retention_s": r.retention_s,
        "cap_bytes": r.cap_bytes,
        "hits": r.hits,
        "hit_rate": r.hit_rate,
        "reused_tokens": r.reused_tokens,
        "reused_share": r.reused_share,
        "evictions": r.evictions,
        "peak_bytes": r.peak_bytes,
    }


def plan_trace(trace: Trace, config: PlanConfig) -> CapacityPlan:
    """Replay both policies uncapped, then under each cap of the sweep; recommend settings."""
    c = config

    def run(policy: Policy, cap: int | None) -> ReplayResult:
        retention = c.ttl if policy is Policy.TTL else c.max_idle
        return replay(
            trace,
            policy,
            retention,
            bytes_per_token=c.bytes_per_token,
            nodes=c.nodes,
            cap_bytes=cap,
            block_size=c.block_size,
            release_on_close=c.release_on_close,
        )

    ttl, lease = run(Policy.TTL, None), run(Policy.LEASE, None)
    caps = sorted(set(c.caps)) if c.caps is not None else auto_caps(lease.peak_bytes, c.points)
    sweep = tuple(SweepPoint(cap, run(Policy.TTL, cap), run(Policy.LEASE, cap)) for cap in caps)
    gaps = sorted(trace.gaps)
    p50, p95 = percentile(gaps, 0.5), percentile(gaps, MAX_IDLE_QUANTILE)
    return CapacityPlan(
        config=c,
        conversations=len(trace.conversation_ids),
        turns=trace.turns,
        follow_up_turns=trace.follow_up_turns,
        gap_p50_s=p50,
        gap_p95_s=p95,
        ttl=ttl,
        lease=lease,
        sweep=sweep,
        recommendation=recommend(c, lease, smallest_cap(c, lease, sweep, run), p50, p95),
    )


REFINE_STEPS: Final = 6


def smallest_cap(
    c: PlanConfig,
    lease: ReplayResult,
    sweep: tuple[SweepPoint, ...],
    run: Callable[[Policy, int | None], ReplayResult],
) -> int:
    """The smallest cap whose leases keep ``target`` of the uncapped leases' hits: the smallest such
    swept cap (the uncapped peak if none), then :data:`REFINE_STEPS` bisections towards the swept
    cap below it (hits grow with the cap: ``test_plan`` checks it on a generated trace)."""
    want = c.target * lease.hits
    hi = lease.peak_bytes
    lo = 0
    for p in sweep:
        if p.lease.hits >= want:
            hi = min(hi, p.cap_bytes)
            break
        lo = p.cap_bytes
    for _ in range(REFINE_STEPS if hi > 0 else 0):
        mid = (lo + hi) // 2
        if mid <= lo:
            break
        if run(Policy.LEASE, mid).hits >= want:
            hi = mid
        else:
            lo = mid
    return hi


def recommend(
    c: PlanConfig, lease: ReplayResult, cap: int, p50: float | None, p95: float | None
) -> PlanRecommendation:
    """TTL and max-idle from the gaps (the analyzer's rule for the TTL: the median gap rounded up,
    60 s to the given TTL; max-idle: the 95th percentile rounded up); ``cap`` from :func:`smallest_cap`."""
    if p50 is None or p95 is None:
        return PlanRecommendation(None, None, None, None, None, "No follow-up turns: nothing to retain.")
    ttl = max(MIN_SUGGESTED_TTL, min(c.ttl, nice_ceil(p50))) if c.ttl >= MIN_SUGGESTED_TTL else c.ttl
    max_idle = max(ttl, nice_ceil(p95))
    parts = [
        f"Lease TTL {_secs(ttl)} and max-idle {_secs(max_idle)} (median gap {_secs(p50)}, 95% under "
        f"{_secs(p95)}).",
        f"Leases need {_bytes(cap)} per decode node to keep {c.target:.0%} of their hits "
        f"({_pct(lease.hit_rate)} uncapped with max-idle {_secs(c.max_idle)}, peak {_bytes(lease.peak_bytes)}).",
    ]
    fraction = fits = None
    if c.node_kv_bytes:
        raw = cap / c.node_kv_bytes
        fits = raw <= 1.0
        fraction = min(1.0, math.ceil(raw * 100 - 1e-9) / 100)
        if fits:
            parts.append(
                f"Set max_retained_fraction = {fraction:.2f} of the node's {_bytes(c.node_kv_bytes)} KV cache."
            )
        else:
            parts.append(
                f"That is {raw:.1f}x the node's {_bytes(c.node_kv_bytes)} KV cache: add decode nodes "
                "(retention divides across them) or shorten max-idle; capped at the whole cache the "
                "oldest leases are evicted first."
            )
    return PlanRecommendation(ttl, max_idle, cap, fraction, fits, " ".join(parts))


def to_json_text(plan: CapacityPlan) -> str:
    return json.dumps(plan.to_json(), indent=2, allow_nan=False)


def _secs(x: float | None) -> str:
    if x is None:
        return "n/a"
    if x < 120:
        return f"{x:.0f} s"
    return f"{x / 60:.1f} min" if x < 7200 else f"{x / 3600:.1f} h"


def _bytes(x: float | None) -> str:
    if x is None:
        return "n/a"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x:.0f} B"


def _mtok(x: int) -> str:
    return f"{x / 1e6:,.1f}M"


def render(plan: CapacityPlan, console: Console) -> None:
    c = plan.config
    head = Table(title=Text(f"kvlease plan: {plan.source.get('source') or 'input'}"), title_justify="left")
    head.add_column("figure")
    head.add_column("value", justify="right")
    head.add_column("notes", style="dim")
    head.add_row("conversations / turns", f"{plan.conversations:,} / {plan.turns:,}",
                 f"{plan.follow_up_turns:,} follow-up turns")  # fmt: skip
    head.add_row("KV per token", _bytes(c.bytes_per_token), c.model or "given")
    head.add_row("decode nodes", str(c.nodes), "conversations hashed to nodes (crc32)")
    for r, label in (
        (plan.ttl, f"fixed TTL {_secs(c.ttl)}"),
        (plan.lease, f"leases, max-idle {_secs(c.max_idle)}"),
    ):
        head.add_row(f"hit rate, {label}", _pct(r.hit_rate),
                     f"uncapped; peak {_bytes(r.peak_bytes)} per node, {_mtok(r.reused_tokens)} tokens reused")  # fmt: skip
    console.print(head)
    if plan.sweep:
        t = Table(title="retention cap per node", title_justify="left")
        for col in ("cap / node", "TTL hit rate", "lease hit rate", "lease reused tokens", "lease evictions"):
            t.add_column(col, justify="right")
        if c.node_kv_bytes:
            t.add_column("of node KV", justify="right")
        for p in plan.sweep:
            row = [_bytes(p.cap_bytes), _pct(p.ttl.hit_rate), _pct(p.lease.hit_rate),
                   _mtok(p.lease.reused_tokens), f"{p.lease.evictions:,}"]  # fmt: skip
            if c.node_kv_bytes:
                row.append(f"{p.cap_bytes / c.node_kv_bytes:.2f}")
            t.add_row(*row)
        console.print(t)
    console.print(Panel(Text(plan.recommendation.text), title="recommendation"))
