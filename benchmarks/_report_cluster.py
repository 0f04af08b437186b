"""RESULTS.md's cluster-simulator section, from ``benchmarks/plan_cluster.py``'s result: headline rows
(the speed goal and the two capacity goals, reported against), the per-policy table at equal offered
load, and every cost the simulation used with its value, unit and source. ``_report.py`` hooks
:func:`cluster_rows` and :func:`cluster_table` in; ``plan_cluster.print_table`` prints the table."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

R = Mapping[str, Any]
Row = tuple[str, str, str, str]  # figure, goal, anchor, measured
SOURCES = ("device", "host", "p_local", "miss")


def _s(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x * 1e3:,.0f} ms" if x < 1 else f"{x:,.1f} s"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x * 100:.0f} %"


def _met(m: object) -> str:
    return " (met)" if m is True else " (missed)" if m is False else ""


def _cell(s: object) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def value(v: float, unit: str) -> str:
    """A cost's value in the unit a reader expects (GB, GB/s, ms)."""
    if unit == "B":
        return f"{v / 1e9:,.1f} GB"
    if unit == "B/s":
        return f"{v / 1e9:,.1f} GB/s"
    if unit == "s":
        return f"{v * 1e3:.3g} ms" if v < 1 else f"{v:.3g} s"
    return f"{v:,.0f} {unit}"


def _cap(p: Mapping[str, Any]) -> str:
    n = p.get("sessions_per_decode_node")
    return "—" if n is None else f"{n:,}" + ("+" if p.get("sessions_per_decode_node_capped") else "")


def cluster_rows(r: R) -> list[Row]:
    """Headline rows: the speed goal and the two capacity goals (measured, not asserted)."""
    sp, g = r["speed"], r["goals"]
    target = _s(r["settings"]["ttft_target_p90_s"])
    host = next(
        (value(c["value"], c["unit"]) for c in r["costs"] if c["name"] == "host arena per D node"), "?"
    )
    tt, lh = g["auto_vs_ttl"], g["auto_vs_lru_host"]
    sized = f"{sp['sessions']:,} sessions" + ("" if sp["sessions"] >= sp["goal_sessions"] else " (--quick)")
    return [
        (
            f"cluster sim: {sized}, every policy + sweep, one core",
            f"< {sp['goal_s']:.0f} s for {sp['goal_sessions']:,}",
            "—",
            f"{sp['total_s']:.1f} s (load {sp['load_avg_1m']} on {sp['cores']} cores){_met(sp['goal_met'])}",
        ),
        (
            f"cluster sim: sessions / D node (TTFT p90 <= {target}), auto vs upstream TTL",
            tt["goal"],
            f"TTL: {tt['ttl']}",
            f"auto {tt['auto']}"
            + ("" if tt["ratio"] is None else f" ({tt['ratio']:.1f}x)")
            + _met(tt["met"]),
        ),
        (
            "cluster sim: sessions / D node, auto vs LRU host offload",
            f"{lh['goal']} ({host} host / D node)",
            f"LRU host: {lh['lru_host']}",
            f"auto {lh['auto']}"
            + ("" if lh["ratio"] is None else f" ({lh['ratio']:.2f}x)")
            + _met(lh["met"]),
        ),
    ]


def cluster_table(r: R) -> list[str]:
    """The per-policy table, the costs with their sources and the speed (Markdown lines)."""
    t, s, sp = r["trace"], r["settings"], r["speed"]
    labels = r.get("policy_labels", {})
    lines = [
        f"Cluster: {r['cluster']} ({r['model']}). Trace: {t['generator']}: {t['sessions']:,} sessions, "
        f"{t['turns']:,} turns, mean session {t['mean_session_s']:,.0f} s; offered load: {t['load_note']}"
        + (" (--quick: a smaller trace)." if t.get("quick") else "."),
        "",
        "| policy | TTFT p50 / p90 / p99 | follow-ups: device / host / P-local / miss | HBM retained GiB·s "
        "| host peak / D node | sessions / D node |",
        "|---|---|---|---|---|---|",
    ]
    for name, p in r["policies"].items():
        q = p["ttft"]
        hits = " / ".join(_pct(p["hit_rate_by_source"].get(k)) for k in SOURCES)
        lines.append(
            f"| {_cell(labels.get(name, name))} | {_s(q['p50_s'])} / {_s(q['p90_s'])} / {_s(q['p99_s'])} "
            f"| {hits} | {p['hbm_retained_gib_s']:,.0f} | {p['host_peak_gib']:,.1f} GiB | {_cap(p)} |"
        )
    lines += [
        "",
        f"Sessions / D node: the most concurrent sessions one decode node (with its share of P) sustains "
        f"with TTFT p90 <= {_s(s['ttft_target_p90_s'])} (bisected to 5 %). Settings: upstream TTL "
        f"{s['ttl_s']:g} s, lease max-idle {s['max_idle_s']:g} s, leases in HBM capped at "
        f"{s['retained_fraction']:.0%} of the KV cache, {s['device_pull']} device pulls. Each policy's "
        "model is in `sdk/kvlease/_analyze/_cluster.py`'s docstring; upstream's TTL retention is not "
        "evictable there (it leaves HBM only at its deadline), so turns wait for D's memory behind it. "
        "The costs (raw values and units in results.json):",
        "",
        "| cost | value | source |",
        "|---|---|---|",
    ]
    lines += [
        f"| {_cell(c['name'])} | {value(c['value'], c['unit'])} | {_cell(c['source'])} |" for c in r["costs"]
    ]
    lines += [
        "",
        f"Speed: {sp['sessions']:,} sessions ({sp['turns']:,} turns) in {sp['total_s']:.1f} s wall, "
        f"{sp['total_cpu_s']:.1f} s CPU, {sp['processes']} process"
        + (f" ({sp['note']})" if sp.get("note") else "")
        + f": build "
        f"{sp['build_sessions_s']:.1f} s, five policies at load {sp['policies_at_load_s']:.1f} s, sweeps "
        f"{sp['sweep_s']:.1f} s; 1-minute load average {sp['load_avg_1m']} on {sp['cores']} cores. "
        f"Goal: under {sp['goal_s']:.0f} s for {sp['goal_sessions']:,} sessions"
        + ("." if sp["goal_met"] is None else f"{_met(sp['goal_met'])}."),
        "",
    ]
    return lines


__all__ = ["cluster_rows", "cluster_table", "value"]
