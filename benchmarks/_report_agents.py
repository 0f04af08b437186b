"""RESULTS.md's "Agent sessions at equal load" section, from ``benchmarks/agent_load.py``'s result:
headline rows, the arm table (one row per arm and N, with failed turns), a plot of TTFT p90 against
N per arm and a plot of the blocks leases hold on D over time. ``_report.py`` calls it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

R = Mapping[str, Any]
Row = tuple[str, str, str, str]
NAME = "agents"


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:.0f}"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x * 100:.0f} %"


def _n(x: float | None) -> str:
    return "—" if x is None else f"{x:.0f}"


def _kv(u: Mapping[str, Any] | None) -> str:
    if not u or u.get("mean_share") is None:
        return "—"
    return f"{u['mean_share'] * 100:.0f}/{u['max_share'] * 100:.0f} %"


def fmt(x: float | None, scale: float = 1.0, fmt: str = ".0f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x * scale, fmt)


def run_line(r: dict[str, Any]) -> str:
    t = r["ttft_s"]
    return (
        f"TTFT p50/p90/p99 {fmt(t['p50'], 1e3)}/{fmt(t['p90'], 1e3)}/{fmt(t['p99'], 1e3)} ms, "
        f"hit {fmt(r['hit_rate'], 100)} %, reused {fmt(r['reused_token_share'], 100)} %, "
        f"round-trip {fmt(r['round_trip_rate'], 100)} %, lease block·s {fmt(r['lease_blocks']['block_s'])} "
        f"(max {fmt(r['lease_blocks']['max'])}), D KV used mean/max {fmt(r['d_kv_used']['mean_share'], 100)}/"
        f"{fmt(r['d_kv_used']['max_share'], 100)} %, preemptions {fmt(r['d_preemptions'])}, "
        f"{fmt(r['decode_tokens_per_s'], 1, '.1f')} tok/s, ITL p50/p99 {fmt(r['itl_s']['p50'], 1e3)}/"
        f"{fmt(r['itl_s']['p99'], 1e3)} ms, failed {r['failed_turns']}/{r['turns']}, {r['statuses']}"
    )


def print_table(res: dict[str, Any]) -> None:
    print(
        f"\n{res['sessions']} sessions ({res['sessions_file']}), {res['gap_note']}, run {res['duration_s']:g} s per N"
    )
    print(res["d_sizing"])
    if res.get("settings"):
        print(res["settings"])
    head = f"{'arm':16s} {'N':>3s} {'TTFT p50':>9s} {'p90':>7s} {'p99':>7s} {'hit %':>6s} {'reused %':>8s} {'pulled %':>8s} {'rt %':>5s} {'blk·s':>8s} {'max':>5s} {'preempt':>7s} {'tok/s':>6s} {'ITL p99':>8s} {'D KV %':>7s} {'failed':>7s}"
    print(head)
    print("-" * len(head))
    for name, a in res["arms"].items():
        if a.get("not_run"):
            print(f"{name:16s} not run: {a['not_run'][:200]}")
            continue
        for n, r in a["by_n"].items():
            t = r["ttft_s"]
            print(
                f"{name:16s} {n:>3s} {fmt(t['p50'], 1e3):>9s} {fmt(t['p90'], 1e3):>7s} {fmt(t['p99'], 1e3):>7s} "
                f"{fmt(r['hit_rate'], 100):>6s} {fmt(r['reused_token_share'], 100):>8s} {fmt((r.get('p_pulled') or {}).get('share_of_follow_up_prompts'), 100):>8s} {fmt(r['round_trip_rate'], 100):>5s} "
                f"{fmt(r['lease_blocks']['block_s']):>8s} {fmt(r['lease_blocks']['max']):>5s} {fmt(r['d_preemptions']):>7s} "
                f"{fmt(r['decode_tokens_per_s'], 1, '.1f'):>6s} {fmt(r['itl_s']['p99'], 1e3):>8s} {fmt(r['d_kv_used']['mean_share'], 100):>3s}/{fmt(r['d_kv_used']['max_share'], 100):<3s} {r['failed_turns']:>3d}/{r['turns']:<3d}"
            )
        print(
            f"{'':16s} supported sessions (TTFT p90 <= {res['ttft_target_s']:g} s): {a.get('supported_sessions')}; {a['connectors']}; {a['budgets']}"
        )
    print("\nStatuses of follow-up turns, connector counters (deltas over the run), TTFT source:")
    for name, a in res["arms"].items():
        for n, r in a.get("by_n", {}).items():
            e = r.get("ttft_estimate_error_s") or {}
            print(
                f"  {name} N={n}: {r['statuses']}; router TTL {r.get('router_ttl_s')}; TTFT {r.get('ttft_source')}"
                + (
                    f" (estimate error on these turns: median {fmt(e.get('median'), 1e3)} ms, p90 |err| {fmt(e.get('p90_abs'), 1e3)} ms)"
                    if e.get("n")
                    else ""
                )
            )
            for role, c in (r.get("connector_counters") or {}).items():
                print(f"    {role}: {c}")
    print("\nTTFT by recorded gap (p90 ms, n):")
    for name, a in res["arms"].items():
        for n, r in a.get("by_n", {}).items():
            cells = ", ".join(f"{b} {fmt(v['p90'], 1e3)} ({v['n']})" for b, v in r["ttft_by_gap_s"].items())
            print(f"  {name} N={n}: {cells}")


def agent_rows(r: R) -> list[Row]:
    """Headline figures: failed turns per arm (goal 0), supported sessions, kvlease auto vs upstream."""
    arms = r["arms"]
    rows: list[Row] = []
    for name, a in arms.items():
        if a.get("not_run"):
            rows.append((f"{name}", "runs", "—", f"not run: {a['not_run'][:120]}"))
            continue
        failed = sum(x["failed_turns"] for x in a["by_n"].values())
        turns = sum(x["turns"] for x in a["by_n"].values())
        rows.append((f"{name}: failed turns", "0", "—", f"{failed} of {turns}"))
        rows.append(
            (
                f"{name}: supported sessions (TTFT p90 <= {r['ttft_target_s']:g} s)",
                "—",
                f"N swept: {', '.join(map(str, r['ns']))}",
                str(a.get("supported_sessions")),
            )
        )
    auto, up = arms.get("kvlease-auto", {}), arms.get("upstream", {})
    if auto.get("supported_sessions") is not None and up.get("supported_sessions"):
        ratio = auto["supported_sessions"] / up["supported_sessions"]
        rows.append(("supported sessions, kvlease-auto / upstream", ">= 2x", "upstream", f"{ratio:.1f}x"))
    return rows


def section(name: str, r: Any) -> list[str]:
    """The arm table (Markdown lines) under the agents section; nothing for other sections."""
    if name != NAME or not isinstance(r, Mapping) or "arms" not in r:
        return []
    head = (
        "| arm | connectors | memory budgets | N | TTFT p50/p90/p99 ms | p90 by gap <10s/10-60s/60-480s/>480s ms "
        "| follow-up hit | reused tokens (router) | pulled by P (vLLM) | round trip | lease block·s (max) | D KV used mean/max | D preemptions "
        "| decode tok/s "
        "| ITL p50/p99 ms | failed turns |"
    )
    lines = [
        f"Sessions: {r.get('sessions')} from {r.get('sessions_file')}; {r.get('gap_note')}; "
        f"{r.get('duration_s')} s per N; replay: {r.get('replay')}.",
        "",
        f"{r.get('d_sizing')}.",
        "",
        *([f"{r['settings']}.", ""] if r.get("settings") else []),
        head,
        "|" + "---|" * head.count(" | ") + "---|",
    ]
    for arm, a in r["arms"].items():
        if a.get("not_run"):
            lines.append(f"| {arm} | not run | {a['not_run'][:200].replace('|', '/')} |" + " |" * 13)
            continue
        for n, x in a["by_n"].items():
            t, g = x["ttft_s"], x["ttft_by_gap_s"]
            gaps = "/".join(_ms(v.get("p90")) for v in g.values())
            lb = x["lease_blocks"]
            lines.append(
                f"| {arm} | {a['connectors']} | {a['budgets']} | {n} | {_ms(t['p50'])}/{_ms(t['p90'])}/{_ms(t['p99'])} "
                f"| {gaps} | {_pct(x['hit_rate'])} | {_pct(x['reused_token_share'])} "
                f"| {_pct((x.get('p_pulled') or {}).get('share_of_follow_up_prompts'))} | {_pct(x['round_trip_rate'])} "
                f"| {_n(lb['block_s'])} ({_n(lb['max'])}) | {_kv(x.get('d_kv_used'))} | {x['d_preemptions']:.0f} "
                f"| {x['decode_tokens_per_s'] or 0:.1f} | {_ms(x['itl_s']['p50'])}/{_ms(x['itl_s']['p99'])} "
                f"| {x['failed_turns']} of {x['turns']} |"
            )
    notes = []
    for arm, a in r["arms"].items():
        for n, x in a.get("by_n", {}).items():
            st = ", ".join(f"{k} {v}" for k, v in sorted(x.get("statuses", {}).items()))
            src = x.get("ttft_source", "")
            e = x.get("ttft_estimate_error_s") or {}
            err = (
                f"; the TTFT estimate on these streamed turns: median error {_ms(e.get('median'))} ms, "
                f"p90 |error| {_ms(e.get('p90_abs'))} ms"
                if e.get("n")
                else ""
            )
            reused = x.get("reused_source") or (
                "the router's upper bound: tokens D held"
                if "NixlConnector" in a.get("connectors", "")
                else ""
            )
            pp = x.get("p_pulled") or {}
            if pp:
                reused += (
                    f"; P loaded {pp['tokens']:.0f} tokens from D (vLLM's external_prefix_cache_hits on P, "
                    f"{_pct(pp.get('share_of_follow_up_prompts'))} of follow-up prompts) in {pp['nixl_reads']:.0f} NIXL reads"
                )
            lb = x.get("lease_blocks") or {}
            if lb.get("cached_max"):
                reused += f"; D's evictable device copies of host leases: {_n(lb['cached_block_s'])} block·s (max {_n(lb['cached_max'])})"
            notes.append(
                f"- {arm}, N={n}: follow-ups {st}; TTFT: {src}{err}"
                + (f"; reused tokens: {reused}" if reused else "")
                + "."
            )
    if notes:
        lines += ["", "Follow-up statuses and how TTFT was taken:", "", *notes]
    lines += [
        "",
        "Real traces: `pip install agentx-harness==1.0.12` (AIPerf 0.13.0), then `aiperf profile --endpoint-type "
        "chat --streaming --input-file semianalysis_claude_code.jsonl --custom-dataset-type mooncake_trace "
        "--session-header X-Session-ID --benchmark-duration 900` against the router (see "
        "`benchmarks/agent_load.py`).",
        "",
    ]
    return lines


def plot_agents(r: R, out: Path) -> list[tuple[str, str]]:
    """TTFT p90 against N per arm; lease-held blocks on D over time (the largest N of each arm)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: list[tuple[str, str]] = []
    ran = {k: a for k, a in r["arms"].items() if a.get("by_n")}
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for arm, a in ran.items():
        ns = sorted(int(n) for n in a["by_n"])
        ps = [a["by_n"][str(n)]["ttft_s"]["p90"] for n in ns]
        ax.plot(ns, [1e3 * p if p is not None else float("nan") for p in ps], marker="o", label=arm)
    ax.axhline(1e3 * r["ttft_target_s"], color="grey", ls="--", lw=1, label="target")
    ax.set_xlabel("live agent sessions N")
    ax.set_ylabel("TTFT p90 (ms)")
    ax.set_title("TTFT p90 against offered load")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "agents_ttft_p90.png", dpi=90, metadata={"Software": None})
    plt.close(fig)
    made.append(("agents_ttft_p90.png", "TTFT p90 against live sessions per arm"))
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    blocks = r.get("d_blocks") or 0
    for i, (arm, a) in enumerate(ran.items()):
        n = max(a["by_n"], key=int)
        color = f"C{i}"
        series = a["by_n"][n]["lease_blocks"]["series"]
        if series:
            ax.step(
                [s[0] for s in series],
                [s[1] for s in series],
                where="post",
                color=color,
                label=f"{arm} (N={n})",
            )
        used = (a["by_n"][n].get("d_kv_used") or {}).get("series") or []
        if used and blocks:
            ax.step(
                [s[0] for s in used],
                [s[1] * blocks for s in used],
                where="post",
                color=color,
                ls=":",
                lw=1,
                label=f"{arm}: D KV in use" if not series else None,
            )
    ax.set_xlabel("time into the run (s)")
    ax.set_ylabel("D KV blocks")
    ax.set_title("D's KV blocks: held by leases (solid), in use by all (dotted)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "agents_lease_blocks.png", dpi=90, metadata={"Software": None})
    plt.close(fig)
    made.append(("agents_lease_blocks.png", "Blocks leases hold on D over time"))
    return made
