"""The cluster simulator's comparison and rendering: :func:`plan_cluster` runs every policy at the
trace's own load and finds how many concurrent sessions one decode node sustains under the TTFT
target (pure); :func:`render_cluster`, :meth:`ClusterPlan.to_json` and :func:`per_turn_records`
show it.

The sweep simulates one decode node with its share of the P side (the prefill rate and P's prefix
cache times ``p_nodes / d_nodes``, as one P node) under N concurrent sessions (``simulate(...,
slots=N)``): doubling N from 1 until TTFT p90 passes the target, then bisecting to within
:data:`SWEEP_PRECISION` of N.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import repeat
from typing import Any, Final

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvlease._analyze._cluster import (
    DEVICE,
    HOST,
    MISS,
    P_LOCAL,
    SOURCES,
    Sessions,
    SimPolicy,
    SimResult,
    simulate,
)
from kvlease._analyze._cluster_costs import ClusterConfig, Figure
from kvlease.protocol import TurnLogKey

#: The sweep stops bisecting when the bracket is this share of N (or 1 session).
SWEEP_PRECISION: Final = 0.05
#: The sweep tries at most this many concurrent sessions per decode node.
SWEEP_MAX: Final = 1 << 14
QUANTILES: Final = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class Capacity:
    """The largest N with TTFT p90 under the target, and the points tried (N, p90 seconds)."""

    sessions: int  # 0: not even one session meets the target
    capped: bool  # the target held up to SWEEP_MAX
    points: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class ClusterPlan:
    config: ClusterConfig
    sessions: int
    turns: int
    results: tuple[SimResult, ...]
    capacity: dict[SimPolicy, Capacity]
    slots: int | None = None  # the load: None, the trace's own start times
    source: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        c = self.config
        return {
            "input": dict(self.source),
            "model": c.model,
            "kv_bytes_per_token": c.bytes_per_token,
            "p_nodes": c.p_nodes,
            "d_nodes": c.d_nodes,
            "load": "trace start times" if self.slots is None else f"{self.slots} concurrent sessions",
            "settings": {
                "ttl_s": c.ttl,
                "max_idle_s": c.max_idle,
                "retained_fraction": c.retained_fraction,
                "release_on_close": c.release_on_close,
                "block_size": c.block_size,
                "ttft_target_p90_s": c.ttft_target,
                "device_pull": "per-block" if c.per_block_s else "staged",
            },
            "costs": [figure_json(f) for f in c.figures()],
            "sessions": self.sessions,
            "turns": self.turns,
            "policies": {r.policy.value: result_json(r, self.capacity.get(r.policy)) for r in self.results},
        }


def figure_json(f: Figure) -> dict[str, Any]:
    return {"name": f.name, "value": f.value, "unit": f.unit, "source": f.source}


def result_json(r: SimResult, cap: Capacity | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "turns": r.turns,
        "follow_up_turns": r.follow_ups,
        "ttft": {f"p{round(q * 100)}_s": r.ttft_at(q) for q in QUANTILES},
        "hit_rate_by_source": {SOURCES[s]: r.share(s) for s in (DEVICE, HOST, P_LOCAL, MISS)},
        "tokens_reused": r.reused_tokens,
        "hbm_retained_gib_s": r.hbm_retained_byte_s / 2**30,
        "host_peak_gib": r.host_peak_bytes / 2**30,
        "evictions": r.evictions,
        "span_s": r.span_s,
    }
    if cap is not None:
        out["sessions_per_decode_node"] = cap.sessions
        out["sessions_per_decode_node_capped"] = cap.capped
        out["sweep"] = [
            {"sessions": n, "ttft_p90_s": None if p90 == float("inf") else p90} for n, p90 in cap.points
        ]
    return out


def one_node(cfg: ClusterConfig) -> ClusterConfig:
    """One decode node with its share of the P side, as one P node."""
    share = cfg.p_nodes / cfg.d_nodes
    return replace(
        cfg,
        p_nodes=1,
        d_nodes=1,
        prefill_tps=replace(cfg.prefill_tps, value=cfg.prefill_tps.value * share),
        p_cache=replace(cfg.p_cache, value=cfg.p_cache.value * share),
    )


def capacity(sessions: Sessions, cfg: ClusterConfig, policy: SimPolicy) -> Capacity:
    """Concurrent sessions one decode node sustains with TTFT p90 <= ``cfg.ttft_target``."""
    node = one_node(cfg)
    points: dict[int, float] = {}

    def ok(n: int) -> bool:
        if n not in points:
            p90 = simulate(sessions, node, policy, slots=n).ttft_at(0.9)
            points[n] = float("inf") if p90 is None else p90
        return points[n] <= cfg.ttft_target

    if not sessions.sessions or not ok(1):
        return Capacity(0, False, tuple(sorted(points.items())))
    lo = 1
    while lo < SWEEP_MAX and ok(min(2 * lo, SWEEP_MAX)):
        lo = min(2 * lo, SWEEP_MAX)
    if lo >= SWEEP_MAX:
        return Capacity(lo, True, tuple(sorted(points.items())))
    hi = 2 * lo
    while hi - lo > max(1, int(lo * SWEEP_PRECISION)):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return Capacity(lo, False, tuple(sorted(points.items())))


def plan_cluster(
    sessions: Sessions,
    cfg: ClusterConfig,
    *,
    policies: Sequence[SimPolicy] = tuple(SimPolicy),
    slots: int | None = None,
    sweep: bool = True,
    per_turn: bool = False,
    map_fn: Callable[..., Iterable[Any]] = map,
) -> ClusterPlan:
    """Every policy at the same offered load (the trace's start times, or ``slots`` concurrent
    sessions), and with ``sweep`` the sessions per decode node each sustains under the target.

    ``map_fn`` runs the per-policy work (``map``; the IO shell may pass a process pool's ``map``:
    the policies are independent)."""
    n = len(policies)
    sim = partial(simulate, slots=slots, per_turn=per_turn)
    results = tuple(map_fn(sim, repeat(sessions, n), repeat(cfg, n), policies))
    caps = (
        dict(zip(policies, map_fn(capacity, repeat(sessions, n), repeat(cfg, n), policies))) if sweep else {}
    )
    return ClusterPlan(cfg, sessions.sessions, sessions.turns, results, caps, slots)


def per_turn_records(plan: ClusterPlan) -> Iterator[dict[str, Any]]:
    """One record per simulated turn and policy (``plan_cluster(..., per_turn=True)``), keyed as the
    SDK's turn log where the field is the same."""
    for r in plan.results:
        for sid, turn, arrival, ttft, src, reused in r.per_turn or ():
            yield {
                "policy": r.policy.value,
                TurnLogKey.CONVERSATION_ID: sid,
                TurnLogKey.TURN: turn,
                "arrival_s": round(arrival, 6),
                TurnLogKey.TTFT_S: round(ttft, 6),
                "source": SOURCES[src],
                "hit": src in (DEVICE, HOST),
                TurnLogKey.REUSED_TOKENS: reused,
            }


def to_json_text(plan: ClusterPlan) -> str:
    return json.dumps(plan.to_json(), indent=2, allow_nan=False)


def _value(f: Figure) -> str:
    v, u = f.value, f.unit
    if u == "B":
        return f"{v / 1e9:,.1f} GB"
    if u == "B/s":
        return f"{v / 1e9:,.1f} GB/s"
    if u == "s":
        return f"{v * 1e3:.3g} ms" if v < 1 else f"{v:.3g} s"
    return f"{v:,.0f} {u}"


def _s(x: float | None) -> str:
    if x is None:
        return "n/a"
    if x == float("inf"):
        return "inf"
    return f"{x * 1e3:.0f} ms" if x < 1 else f"{x:,.1f} s"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def render_cluster(plan: ClusterPlan, console: Console) -> None:
    c = plan.config
    load = "the trace's start times" if plan.slots is None else f"{plan.slots} concurrent sessions"
    head = Table(
        title=Text(f"kvlease plan --cluster: {plan.source.get('source') or 'input'}"), title_justify="left"
    )
    head.add_column("figure")
    head.add_column("value", justify="right")
    head.add_column("source", style="dim")
    head.add_row("model", f"{c.bytes_per_token:,} B/token", c.model)
    head.add_row("nodes", f"{c.p_nodes} P, {c.d_nodes} D", "sessions hashed to nodes (crc32)")
    head.add_row("sessions / turns", f"{plan.sessions:,} / {plan.turns:,}", f"load: {load}")
    for f in c.figures():
        head.add_row(f.name, _value(f), f.source)
    console.print(head)
    t = Table(title=f"policies at equal offered load ({load})", title_justify="left")
    for col in ("policy", "TTFT p50", "p90", "p99", "device", "host", "P-local", "miss",
                "HBM retained GiB·s", "host peak / node", "sessions / D node"):  # fmt: skip
        t.add_column(col, justify="right")
    for r in plan.results:
        cap = plan.capacity.get(r.policy)
        n = "n/a" if cap is None else f"{cap.sessions:,}" + ("+" if cap.capped else "")
        t.add_row(
            r.policy.value,
            *(_s(r.ttft_at(q)) for q in QUANTILES),
            *(_pct(r.share(s)) for s in (DEVICE, HOST, P_LOCAL, MISS)),
            f"{r.hbm_retained_byte_s / 2**30:,.0f}",
            f"{r.host_peak_bytes / 2**30:,.1f} GiB",
            n,
        )
    console.print(t)
    if plan.capacity:
        console.print(
            Text(
                f"sessions / D node: the most concurrent sessions one decode node (with its share of "
                f"P) sustains with TTFT p90 <= {_s(c.ttft_target)}.",
                style="dim",
            )
        )


__all__ = ["Capacity", "ClusterPlan", "capacity", "per_turn_records", "plan_cluster", "render_cluster"]
