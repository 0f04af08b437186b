"""Render ``benchmarks/results.json`` as ``benchmarks/RESULTS.md`` (tables) and PNG plots beside it.

``python benchmarks/run.py`` calls :func:`write_report` after its benchmarks; rendering alone, from
the stored results, needs no benchmark run:

    python benchmarks/_report.py            # or: python benchmarks/run.py --report-only

Each benchmark's section is a table of its headline figures: the figure, its goal, the anchor it is
compared against, and the measured value, under the command, date and machine that produced it. A
benchmark without a dedicated summary below gets its scalar results listed. The raw result stays
in ``results.json`` (and, one line per benchmark, folded at the end of ``RESULTS.md``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
Row = tuple[str, str, str, str]  # figure, goal, anchor, measured
R = Mapping[str, Any]


def _n(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def _ok(met: object) -> str:
    return " (met)" if met is True else " (missed)" if met is False else ""


def _sdk(r: R) -> list[Row]:
    rows = []
    for mode in ("non_streaming", "streaming", "agent_non_streaming"):
        m = r.get(mode)
        if m is None:  # results stored before the agent workload existed
            continue
        spread = m.get("overhead_pct_p25_p75")
        cpu = m.get("client_cpu_overhead_pct")
        measured = (
            f"{m['overhead_pct']:+.2f} % ({m['wrapped_ms_per_call']:.2f} ms, {m['added_us_per_call']:+.0f} µs"
        )
        measured += f"; p25..p75 {spread[0]:+.2f} .. {spread[1]:+.2f} %" if spread else ""
        measured += f"; client CPU {cpu:+.2f} %" if cpu is not None else ""
        aa = m.get("aa_pct")
        measured += f"; A/A {aa:+.2f} %" if aa is not None else ""
        no_id = m.get("vs_no_id_overhead_pct")
        measured += f"; vs a raw client sending no id {no_id:+.2f} %" if no_id is not None else ""
        # results stored before the raw_id arm compared the wrapped client with the raw one
        base = m.get("raw_id_ms_per_call")
        baseline = (
            f"raw openai client, same conversation id: {base:.2f} ms/call"
            if base is not None
            else f"raw openai client: {m['raw_ms_per_call']:.2f} ms/call"
        )
        rows.append(
            (
                f"SDK overhead per call, {mode.replace('_', '-')}",
                "<= 3 %",
                baseline,
                measured + ")" + _ok(m["overhead_pct"] <= 3),
            )
        )
    return rows


def _keeper(r: R) -> list[Row]:
    n = r["conversations"]
    return [
        (
            f"client memory, {_n(n)} open conversations",
            "<= 50 MB",
            "—",
            f"{r['client_memory_mb_tracemalloc']:.1f} MB ({_n(r['bytes_per_conversation'])} B each)"
            + _ok(r["client_memory_mb_tracemalloc"] <= 50),
        ),
        (
            "renew requests per renewal period",
            "1 per router",
            f"{_n(n)} conversations",
            f"{r['renew_requests_per_period']:g} ({_n(r['ids_per_request'])} ids each)"
            + _ok(r["renew_requests_per_period"] <= 1),
        ),
        ("one renewal round, all conversations", "—", "—", f"{r['one_round_all_ids_ms']:.1f} ms"),
        (
            "conversations still leased / renew failures",
            f"{_n(n)} / 0",
            "—",
            f"{_n(r['conversations_still_leased'])} / {r['renew_failures']}",
        ),
    ]


def _router(r: R) -> list[Row]:
    added = r["router_added_latency_unloaded"]
    loaded = r["loaded_64_conversations"]
    base = next((v for k, v in loaded.items() if k not in ("router", "direct_pd", "direct_d")), None)
    rows = [
        (
            "added latency, 1 conversation (p50 / p99)",
            "p50 <= 1 ms, p99 <= 5 ms",
            "client calling P and D itself",
            f"+{added['p50_ms']:.2f} ms / +{added['p99_ms']:.2f} ms" + _ok(added.get("goal_met")),
        ),
        (
            "throughput, 64 conversations",
            "above the baseline proxy",
            "FastAPI + httpx proxy" + (f": {base['turns_per_s']:.1f} turns/s" if base else ""),
            f"{loaded['router']['turns_per_s']:.1f} turns/s ({r['router_vs_baseline_throughput_x']:.1f}x)",
        ),
        (
            "throughput, 64 conversations, vs no router",
            "—",
            f"client calling P and D itself: {loaded['direct_pd']['turns_per_s']:.1f} turns/s",
            f"{r['router_vs_direct_pd_throughput_x']:.2f}x",
        ),
    ]
    p99, p99_base = r["router_p99_vs_baseline_p99_ms"]
    rows.append(("p99 latency, 64 conversations", "—", f"baseline proxy: {p99_base:.0f} ms", f"{p99:.0f} ms"))
    return rows


def _soak(r: R) -> list[Row]:
    growth = r["router_rss_growth_mib_per_round"]
    return [
        (
            "turns completed",
            "all, exactly once",
            f"{_n(r['turns_expected'])} expected",
            f"{_n(r['turns_completed'])}, {r['wrong_or_crossed_answers']} wrong or crossed",
        ),
        (
            "mid-stream hang-ups survived",
            "—",
            f"{_n(r['client_attempts'])} attempts",
            _n(r["mid_stream_disconnects"]),
        ),
        (
            "router RSS growth per round",
            "flat after the first round",
            f"{r['router_rss_mib_before']:.0f} MiB after warm-up",
            " / ".join(f"+{g:.1f} MiB" for g in growth),
        ),
        (
            "open streams / in flight after",
            "0 / 0",
            "—",
            f"{r['fake_open_streams_after']} / {r['router_in_flight_after']:g}",
        ),
        ("throughput", "—", "—", f"{r['turns_per_s']:.0f} turns/s"),
    ]


def _analyze(r: R) -> list[Row]:
    return [
        (
            f"analyzer throughput ({_n(r['lines'])} lines)",
            f">= {_n(r['goal_lines_per_s'])} lines/s",
            f"stdlib json: {_n(r['json']['lines_per_s'])} lines/s",
            f"{_n(r['orjson']['lines_per_s'])} lines/s (orjson)" + _ok(r.get("goal_met")),
        ),
        (
            "peak RSS",
            "flat in the log's length",
            f"2x the lines: {r['peak_rss_mib_2x_lines']:.1f} MiB",
            f"{r['peak_rss_mib']:.1f} MiB",
        ),
    ]


def _plugin(r: R) -> list[Row]:
    return [
        (
            f"plugin overhead per streamed request ({r['chunks_per_request']} chunks)",
            "—",
            f"stock vLLM generator: {r['stock_us_per_request']:.0f} µs",
            f"+{r['added_us_per_request']:.0f} µs (+{r['added_us_per_chunk']:.2f} µs per chunk)",
        ),
        ("final-chunk injection", "—", "—", f"{r['final_chunk_injection_us']:.1f} µs"),
    ]


def _ttft(r: R) -> list[Row]:
    res, ratio = r["results"], r.get("pull_vs_upstream", {})
    rows = []
    for size in map(str, r["sizes"]):
        k = res["kvlease/prefix_cache=off"][size]
        up = res["nixl/prefix_cache=off"][size]
        q = ratio.get("prefix_cache=off", {}).get(size)
        rows.append(
            (
                f"turn-2 prefill, {_n(int(size))}-token history: kvlease pull",
                "within 10 % of upstream's pull",
                f"upstream pull {up['pull']:.0f} ms; recompute {k['recompute']:.0f} ms",
                f"{k['pull']:.0f} ms ({k['recompute'] / k['pull']:.1f}x faster than recompute"
                + (f", {q:.2f}x upstream)" if q is not None else ")")
                + (_ok(q <= 1.10) if q is not None else ""),
            )
        )
        if "edited" in k:
            rows.append(
                (
                    f"turn-2 prefill, {_n(int(size))}-token history, an early token edited",
                    "below recompute",
                    f"recompute {k['recompute']:.0f} ms",
                    f"{k['edited']:.0f} ms (pulls the verified blocks)" + _ok(k["edited"] < k["recompute"]),
                )
            )
    return rows


def _trace(r: R) -> list[Row]:
    arms = r["arms"]
    anchor = arms.get("fixed-ttl")
    rows = []
    for name, a in arms.items():
        rows.append(
            (
                f"{name}: share of follow-up turns reusing KV",
                "all, pauses past the TTL included" if name == "heartbeats" else "—",
                f"fixed TTL: {_pct(anchor['reuse_share'])}" if anchor and name != "fixed-ttl" else "—",
                f"{_pct(a['reuse_share'])} ({_pct(a['reuse_share_after_long_pause'])} after pauses past the TTL)",
            )
        )
    for name, a in arms.items():
        rows.append(
            (
                f"{name}: median TTFT",
                "—",
                f"no reuse: {arms['no-reuse']['median_ttft_ms'] / 1000:.1f} s" if "no-reuse" in arms else "—",
                f"{a['median_ttft_ms'] / 1000:.1f} s",
            )
        )
    return rows


def _gpu_pull(r: R) -> list[Row]:
    """One H200, real NIXL: a vLLM-shaped pull per token count, by path (``gpu_nixl_pull.py``)."""
    rows = []
    for row in r["rows"]:
        k, coalesced = row["tokens"] / 1024, row["coalesced_ms"]
        best = min(row["staged_ms"], row["staged_pregathered_ms"])
        goal = "<= 3x coalesced" + (", <= ~20 ms" if row["tokens"] >= 24 * 1024 else "")
        met = best <= 3 * coalesced and (row["tokens"] < 24 * 1024 or best <= 20)
        rows.append(
            (
                f"{k:.0f}k tokens ({_n(row['descriptors_per_block'])} per-block descriptors): staged pull",
                goal,
                f"per-block {row['per_block_ms']:.1f} ms; coalesced {coalesced:.1f} ms; "
                f"torch copy {row['torch_copy_ms']:.2f} ms",
                f"staged {row['staged_ms']:.1f} ms, pre-gathered {row['staged_pregathered_ms']:.1f} ms "
                f"({best / coalesced:.1f}x coalesced)" + _ok(met),
            )
        )
    return rows


def _fragmentation(r: R) -> list[Row]:
    rows = []
    for field, what in (
        ("descriptors", "descriptors per pull"),
        ("local_runs", "P's block-id runs per pull"),
        ("remote_runs", "D's block-id runs per pull"),
    ):
        h = r[field]
        mean = "—" if h["mean"] is None else f"{h['mean']:,.1f}"
        buckets = ", ".join(f"<= {le}: {int(n)}" for le, n in h["cumulative_buckets"].items())
        rows.append(
            (
                f"{what}, mean over {h['pulls']} pulls",
                "—",
                "1 run: one READ per region",
                f"{mean} ({buckets})",
            )
        )
    return rows


#: The hostile-load attacks, in the benchmark's order, as a reader names them.
HOSTILE_ATTACKS = {
    "baseline": "none (victim alone)",
    "renew_flood": "renew flood: 2 tenants, 10,000 unknown ids a request",
    "renew_rotating_tokens": "renew flood, a new bearer token every request",
    "anon_renew": "anonymous renew, 101 ids a second",
    "slow_clients": "slow clients: 300 trickled heads + 50 stalled bodies",
    "stalled_streams": "stalled streams: 50 readers that never read",
    "fuzz": "fuzz: garbage requests, 8 in flight",
}


def _hostile_phases(r: R) -> list[tuple[str, Mapping[str, Any]]]:
    phases = r["phases"]
    known = [a for a in HOSTILE_ATTACKS if a in phases]
    return [(a, phases[a]) for a in known + [a for a in phases if a not in HOSTILE_ATTACKS]]


def _server_errors(attacker: Mapping[str, Any]) -> int:
    """The router's 5xx answers among an attacker's counts (``http 503``, ``raw 500``, ``5xx``)."""
    return sum(
        int(n)
        for k, n in attacker.items()
        if k == "5xx" or (k.startswith(("http 5", "raw 5")) and isinstance(n, (int, float)))
    )


def _hostile(r: R) -> list[Row]:
    """Headlines of ``hostile_load.py`` against the issue's goals; the per-attack table is
    :func:`hostile_table`."""
    phases = dict(_hostile_phases(r))
    windows = [w for p in phases.values() for w in p.values() if isinstance(w, Mapping)]
    failed = sum(w["turns_failed"] for w in windows)
    rows: list[Row] = [
        (
            "victim's failed turns, every window",
            "0",
            f"{_n(sum(w['turns_completed'] for w in windows))} turns",
            f"{failed}" + _ok(failed == 0),
        )
    ]
    stalled = phases.get("stalled_streams")
    if stalled and "under_attack" in stalled:
        alone, under = stalled["victim_alone"]["p99_ms"], stalled["under_attack"]["p99_ms"]
        rows.append(
            (
                "victim's p99 under 50 stalled stream readers",
                "<= 2x its p99 alone",
                f"alone: {alone:,.0f} ms",
                f"{under:,.0f} ms ({under / alone:.1f}x)" + _ok(under <= 2 * alone),
            )
        )
    fuzz = phases.get("fuzz", {}).get("under_attack", {}).get("attacker")
    if fuzz is not None:
        errors = _server_errors(fuzz)
        rows.append(
            (
                "router 5xx to garbage",
                "0",
                f"{_n(fuzz.get('requests', 0))} garbage requests",
                f"{errors}" + _ok(errors == 0),
            )
        )
    return rows


def _under(alone: Mapping[str, Any], under: Mapping[str, Any]) -> str:
    ratio = under["p99_ms"] / alone["p99_ms"]
    return f"{under['p50_ms']:,.1f} / {under['p99_ms']:,.1f} ({ratio:.1f}x p99)"


def _hits(w: Mapping[str, Any]) -> str:
    n, share = w["follow_up_turns"], w["follow_up_hit_share"]
    return "—" if not n else f"{_pct(share)} of {_n(n)}"


def _answers(attacker: Mapping[str, Any]) -> str:
    """The attacker's counts, largest first (how the router answered, or what the attack held)."""
    counts = [(k, v) for k, v in attacker.items() if k != "ms_total" and isinstance(v, (int, float))]
    return ", ".join(f"{k}: {_n(v)}" for k, v in sorted(counts, key=lambda kv: -kv[1]))


#: Below this many attack requests in a window, the router CPU per request is mostly the noise of
#: subtracting the victim's share (a few hundred ms of CPU in a 5 s window over a handful of requests).
FEW_REQUESTS = 100


def _per_request(cpu_ms: float, rate: float | None, window: float | None) -> str:
    sent = None if rate is None or window is None else round(rate * window)
    shown = f"{cpu_ms:.3g} ms"
    return shown + (f" ({sent} requests: noise)" if sent is not None and sent < FEW_REQUESTS else "")


def hostile_table(r: R) -> list[str]:
    """One row per attack (Markdown lines): the victim's latency alone and under attack, the
    follow-up hits it kept, its failed turns, and what the attack cost the router."""
    head = [
        "attack",
        "victim p50 / p99 alone (ms)",
        "under attack (ms)",
        "hits kept under attack",
        "failed turns (alone / under)",
        "attack requests/s",
        "router CPU per attack request",
        "router CPU, cores (alone / under)",
        "attacker's tally",
    ]
    rows = []
    for attack, p in _hostile_phases(r):
        alone, under = p["victim_alone"], p.get("under_attack")
        cpu = p.get("router_cpu_ms_per_attack_request")
        rate = p.get("attack_requests_per_s")
        base_cpu = alone.get("router_cpu_cores")
        rows.append(
            [
                HOSTILE_ATTACKS.get(attack, attack),
                f"{alone['p50_ms']:,.1f} / {alone['p99_ms']:,.1f}",
                "—" if under is None else _under(alone, under),
                "—" if under is None else _hits(under),
                f"{alone['turns_failed']}" + ("" if under is None else f" / {under['turns_failed']}"),
                "—" if rate is None else _n(rate),
                "—" if cpu is None else _per_request(cpu, rate, r.get("window_s")),
                f"{base_cpu:.2f}" + ("" if under is None else f" / {under.get('router_cpu_cores', 0):.2f}"),
                "—" if under is None else _answers(under.get("attacker", {})) or "—",
            ]
        )
    window = r.get("window_s")
    return [
        f"The victim: one conversation at a time, turns back to back, in windows of {window:g} s "
        "(each attack: a window alone, then one under attack). Router CPU per attack request: the "
        "router's CPU in the attack window less the victim's share (its CPU per turn alone), per "
        "request the attacker sent; — where the attack holds connections rather than sending "
        "requests. Every figure of every window is in `results.json`.",
        "",
        *_table(head, rows),
        "",
    ]


SUMMARIES: dict[str, Callable[[R], list[Row]]] = {
    "sdk": _sdk,
    "keeper": _keeper,
    "router": _router,
    "soak": _soak,
    "analyze": _analyze,
    "plugin": _plugin,
    "ttft": _ttft,
    "trace": _trace,
    "gpu_pull": _gpu_pull,
    "fragmentation": _fragmentation,
    "hostile": _hostile,
}
#: Sections with a table of their own under the figures (Markdown lines).
TABLES: dict[str, Callable[[R], list[str]]] = {"hostile": hostile_table}
#: Titles of results that ``run.py`` does not run (measured by their own script elsewhere).
OTHER_TITLES = {
    "gpu_pull": "GPU pull on one H200 (real NIXL): per-block vs coalesced vs staged, 32B-class layout",
}


def _generic(r: Any, prefix: str = "") -> list[Row]:
    """Scalars of a result without a dedicated summary (nested keys joined by ``.``)."""
    if not isinstance(r, Mapping):
        return [(prefix or "result", "—", "—", json.dumps(r, default=str))]
    rows: list[Row] = []
    goal = r.get("goal")
    for k, v in r.items():
        if k in ("goal", "goal_met"):
            continue
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            rows += _generic(v, key)
        elif isinstance(v, (int, float, str, bool)) or v is None:
            shown = f"{v:,.4g}" if isinstance(v, float) else str(v)
            rows.append((key, "—", "—", shown))
    if goal is not None:
        rows.insert(0, (f"{prefix or 'goal'}", str(goal), "—", _ok(r.get("goal_met")).strip(" ()") or "—"))
    return rows


def rows_for(name: str, result: Any) -> list[Row]:
    summary = SUMMARIES.get(name)
    if summary is not None:
        try:
            return summary(result)
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            pass  # a result of another shape: list its figures instead
    return _generic(result)


def _own_table(name: str, result: Any) -> list[str]:
    table = TABLES.get(name)
    if table is None:
        return []
    try:
        return table(result)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return []  # a result of another shape: its figures are listed above


def _machine(m: Mapping[str, Any]) -> str:
    gpu = f", {m['gpu']}" if m.get("gpu") else ""
    return f"{m.get('cores', '?')} cores ({m.get('cpu') or 'unknown CPU'}){gpu}, {m.get('memory', '?')}, Python {m.get('python', '?')}"


def _cell(s: object) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]


# ---- plots -------------------------------------------------------------------------------------


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata={"Software": None})
    _plt().close(fig)


def plot_ttft(r: R, out: Path) -> list[tuple[str, str]]:
    """TTFT against history length, and pull against recompute, from the ``ttft`` result."""
    plt = _plt()
    sizes = [int(s) for s in r["sizes"]]
    res = r["results"]
    made = []
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    series = [
        ("kvlease/prefix_cache=off", "pull", "kvlease pull", "o-"),
        ("nixl/prefix_cache=off", "pull", "upstream NIXL pull", "s--"),
        ("kvlease/prefix_cache=off", "edited", "kvlease, early token edited", "^-"),
        ("kvlease/prefix_cache=off", "recompute", "recompute", "x-"),
    ]
    for arm, key, label, style in series:
        ys = [res.get(arm, {}).get(str(s), {}).get(key) for s in sizes]
        if all(y is not None for y in ys):
            ax.plot(sizes, [y / 1000 for y in ys], style, label=label)
    ax.set_xlabel("history length (tokens)")
    ax.set_ylabel("turn-2 prefill on P (s)")
    ax.set_title("Turn-2 TTFT against history length (P's prefix cache off)")
    ax.set_xticks(sizes)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, out / "ttft_history.png")
    made.append(("ttft_history.png", "Turn-2 TTFT against history length"))

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    width = 0.38
    xs = range(len(sizes))
    k = res["kvlease/prefix_cache=off"]
    pull = [k[str(s)]["pull"] / 1000 for s in sizes]
    rec = [k[str(s)]["recompute"] / 1000 for s in sizes]
    ax.bar([x - width / 2 for x in xs], pull, width, label="kvlease pull")
    ax.bar([x + width / 2 for x in xs], rec, width, label="recompute")
    for x, p, c in zip(xs, pull, rec):
        ax.annotate(f"{c / p:.0f}x", (x, c), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [f"{s:,}" for s in sizes])
    ax.set_xlabel("history length (tokens)")
    ax.set_ylabel("turn-2 prefill on P (s)")
    ax.set_title("Pull against recompute (label: recompute / pull)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, out / "pull_vs_recompute.png")
    made.append(("pull_vs_recompute.png", "Pull against recompute"))
    return made


def plot_trace(r: R, out: Path) -> list[tuple[str, str]]:
    """Hit rate against pause length (within / past D's TTL) per arm, from the ``trace`` result."""
    plt = _plt()
    n, long_n = r["follow_up_turns"], r["pauses_beyond_ttl"]
    short_n = n - long_n
    arms = r["arms"]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    width = 0.8 / max(len(arms), 1)
    for i, (name, a) in enumerate(arms.items()):
        long_share = a["reuse_share_after_long_pause"]
        short_share = (a["reuse_share"] * n - long_share * long_n) / short_n if short_n else 0.0
        xs = [j + (i - (len(arms) - 1) / 2) * width for j in range(2)]
        ax.bar(xs, [100 * short_share, 100 * long_share], width, label=name)
    ttl = r.get("d_ttl_s")
    ttl_s = f"{ttl:g} s" if isinstance(ttl, (int, float)) else "the TTL"
    ax.set_xticks([0, 1], [f"pause <= D's TTL ({short_n} turns)", f"pause > {ttl_s} ({long_n} turns)"])
    ax.set_ylabel("follow-up turns reusing KV (%)")
    ax.set_ylim(0, 105)
    ax.set_title("Hit rate against tool-pause length")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, out / "hit_rate_pause.png")
    return [("hit_rate_pause.png", "Hit rate against pause length")]


PLOTS: dict[str, Callable[[R, Path], list[tuple[str, str]]]] = {"ttft": plot_ttft, "trace": plot_trace}
from _report_agents import agent_rows, plot_agents, section  # noqa: E402  (agent sessions at equal load)

SUMMARIES["agents"], PLOTS["agents"] = agent_rows, plot_agents
from _report_cluster import cluster_rows, cluster_table  # noqa: E402  (kvlease plan --cluster)

SUMMARIES["cluster"], TABLES["cluster"] = cluster_rows, cluster_table


# ---- the report --------------------------------------------------------------------------------


def render_markdown(
    results: Mapping[str, Any],
    titles: Mapping[str, str] | None = None,
    plots: Mapping[str, list[tuple[str, str]]] | None = None,
    real_stack: Collection[str] = ("ttft", "trace"),
    notes: Sequence[str] = (),
) -> str:
    """RESULTS.md for ``results`` (the content of results.json): ``titles`` name -> section title,
    ``plots`` name -> [(file, caption)], ``real_stack`` the names measured on the real vLLM stack,
    ``notes`` hand-written sections (``benchmarks/notes/*.md``: figures from runs outside
    ``run.py``, each with its command) appended after the generated ones."""
    titles = {**(titles or {}), **{k: v for k, v in OTHER_TITLES.items() if k not in (titles or {})}}
    plots = plots or {}
    order = [n for n in titles if n in results] + [n for n in results if n not in titles]
    lines = [
        "# kvlease benchmark results",
        "",
        "Generated by `python benchmarks/run.py` (or `python benchmarks/_report.py` from the stored",
        "`benchmarks/results.json`, which keeps every raw figure); do not edit by hand.",
        "",
    ]
    summary = []
    for name in order:
        e = results[name]
        for fig, goal, anchor, measured in rows_for(name, e.get("result")):
            if goal != "—":
                summary.append(
                    [
                        fig,
                        goal,
                        anchor,
                        measured,
                        f"`{e.get('command', '')}`",
                        e.get("when", ""),
                        _machine(e.get("machine", {})),
                    ]
                )
    if summary:
        lines += ["## Goals at a glance", ""]
        lines += _table(["figure", "goal", "anchor", "measured", "command", "date", "machine"], summary)
        lines.append("")
    for name in order:
        e = results[name]
        real = ", real vLLM CPU stack" if name in real_stack else ""
        lines += [f"## {titles.get(name, name)}", ""]
        lines += _table(
            ["command", "date", "machine", "wall time"],
            [
                [
                    f"`{e.get('command', '')}`",
                    e.get("when", ""),
                    _machine(e.get("machine", {})) + real,
                    f"{e.get('wall_s', 0):.0f} s",
                ]
            ],
        )
        lines.append("")
        lines += _table(
            ["figure", "goal", "anchor", "measured"], [list(r) for r in rows_for(name, e.get("result"))]
        )
        lines.append("")
        lines += _own_table(name, e.get("result"))
        lines += section(name, e.get("result"))
        for file, caption in plots.get(name, []):
            lines += [f"![{caption}]({file})", ""]
    for note in notes:
        lines += [note.rstrip(), ""]
    lines += ["<details><summary>Raw results (also in results.json)</summary>", ""]
    for name in order:
        lines += [f"- `{name}`: `{json.dumps(results[name].get('result'), default=str)}`"]
    lines += ["", "</details>", ""]
    return "\n".join(lines)


def write_report(
    results: Mapping[str, Any],
    out: Path = HERE,
    titles: Mapping[str, str] | None = None,
    real_stack: Collection[str] = ("ttft", "trace"),
) -> Path:
    """Write ``out/RESULTS.md`` and the PNGs for ``results``; return the Markdown's path."""
    plots: dict[str, list[tuple[str, str]]] = {}
    for name, plot in PLOTS.items():
        entry = results.get(name)
        if entry is None:
            continue
        try:
            plots[name] = plot(entry["result"], out)
        except ImportError:
            print("matplotlib is not installed: RESULTS.md without plots", file=sys.stderr)
            break
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            print(f"no plot for {name}: {type(e).__name__}: {e}", file=sys.stderr)
    notes = [f.read_text() for f in sorted((out / "notes").glob("*.md"))]
    path = out / "RESULTS.md"
    path.write_text(render_markdown(results, titles, plots, real_stack, notes))
    return path


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Render benchmarks/results.json as RESULTS.md and PNGs.")
    ap.add_argument("--results", type=Path, default=HERE / "results.json")
    ap.add_argument("--out", type=Path, default=None, help="folder (default: beside results.json)")
    a = ap.parse_args(argv)
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    from run import BENCHMARKS  # titles and which benchmarks need the real stack

    titles = {n: spec[1] for n, spec in BENCHMARKS.items()}
    real = {n for n, spec in BENCHMARKS.items() if spec[2]}
    out = a.out or a.results.parent
    out.mkdir(parents=True, exist_ok=True)
    print(write_report(json.loads(a.results.read_text()), out, titles, real))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
