"""Rendering an :class:`AnalysisReport`: the rich table for people, JSON for machines."""

from __future__ import annotations

import json

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from kvlease._analyze._types import AnalysisReport
from kvlease.protocol import HEADER_REUSED_TOKENS

_VERDICT_STYLE = {"kvlease": "bold green", "prefix-caching": "bold yellow", "no-data": "bold"}


def to_json_text(report: AnalysisReport) -> str:
    return json.dumps(report.to_json(), indent=2, allow_nan=False)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _secs(x: float | None) -> str:
    if x is None:
        return "n/a"
    if x < 120:
        return f"{x:.1f} s"
    if x < 7200:
        return f"{x / 60:.1f} min"
    return f"{x / 3600:.1f} h"


def _int(x: int) -> str:
    return f"{x:,}"


def _rate(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.0f}"


def render_table(report: AnalysisReport) -> Table:
    r = report
    t = Table(
        title=Text(f"kvlease analyze: {r.input.source or 'input'} ({r.input.format})"), title_justify="left"
    )
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_column("notes", style="dim")
    t.add_row("records read", _int(r.input.records), f"{_int(r.input.malformed)} malformed, skipped")
    t.add_row("conversations", _int(r.conversations), f"{_int(r.one_turn_conversations)} with one turn")
    t.add_row("turns", _int(r.turns), f"longest conversation: {_int(r.max_turns_in_conversation)} turns")
    t.add_row("follow-up turns", _int(r.follow_up_turns), "turns after a conversation's first")
    if r.late_turns:
        t.add_row("late turns", _int(r.late_turns), "too far out of order: counted, not paired (--no-exact)")
    if r.input.passes > 1:
        t.add_row("passes", str(r.input.passes), "turns out of order: read again, sorted per conversation")
    t.add_section()
    t.add_row(
        "repeated prompt share, lower bound",
        _pct(r.repeated_share_lower_bound),
        "sum(min(prev prompt, prompt)) / sum(prompt)",
    )
    t.add_row(
        "repeated prompt share, estimate",
        _pct(r.repeated_share_estimate),
        f"counts the previous response where known ({_int(r.completion_known_turns)} turns)",
    )
    t.add_section()
    t.add_row("gap p50 / p90 / p99", f"{_secs(r.gap_p50_s)} / {_secs(r.gap_p90_s)} / {_secs(r.gap_p99_s)}",
              "exact" if r.gap_percentiles_exact else "from a log histogram (about 0.6%)")  # fmt: skip
    t.add_row(
        f"turns beyond the TTL ({_secs(r.ttl)})",
        _pct(r.share_beyond_ttl),
        f"{_int(r.turns_beyond_ttl)} turns",
    )
    t.add_row(
        "recovered by heartbeat leases",
        _pct(r.share_recovered_by_leases),
        f"{_int(r.turns_recovered_by_leases)} turns with TTL < gap <= max-idle ({_secs(r.max_idle)})",
    )
    t.add_row("beyond max-idle", _pct(r.share_beyond_max_idle), f"{_int(r.turns_beyond_max_idle)} turns")
    t.add_section()
    t.add_row("prefill tokens saved / hour, kvlease", _rate(r.saved_tokens_per_hour_leases),
              f"{_int(r.saved_tokens_leases)} tokens over {_secs(r.span_s)}")  # fmt: skip
    t.add_row("prefill tokens saved / hour, fixed TTL", _rate(r.saved_tokens_per_hour_fixed_ttl),
              f"{_int(r.saved_tokens_fixed_ttl)} tokens")  # fmt: skip
    if r.statuses:
        seen = ", ".join(f"{k} {v:,}" for k, v in sorted(r.statuses.items(), key=lambda kv: -kv[1]))
        t.add_section()
        t.add_row("observed statuses", "", seen)
        t.add_row("observed reused tokens", _int(r.reused_tokens_observed), f"from {HEADER_REUSED_TOKENS}")
    return t


def render(report: AnalysisReport, console: Console) -> None:
    """Print the table, the malformed-record warnings and the recommendation."""
    console.print(render_table(report))
    inp = report.input
    if inp.malformed:
        lines = [f"line {n}: {m}" for n, m in inp.malformed_examples]
        more = inp.malformed - len(inp.malformed_examples)
        if more > 0:
            lines.append(f"... and {more:,} more")
        console.print(
            Panel("\n".join(lines), title=f"{inp.malformed:,} malformed records skipped", style="yellow")
        )
    if inp.truncated:
        console.print(Text(f"warning: input read only in part: {inp.truncated}", style="bold yellow"))
    rec = report.recommendation
    console.print(
        Panel(
            Group(Text(rec.verdict, style=_VERDICT_STYLE.get(rec.verdict, "bold")), Text(rec.text)),
            title="recommendation",
        )
    )
