"""``--plot FILE.png``: inter-turn gaps against the TTL and max-idle, and repeated share per turn
index. matplotlib (the ``[analyze]`` extra) is imported only here, only when a plot is asked for."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvlease._analyze._formats import AnalyzeError
from kvlease._analyze._model import MAX_TURN_INDEX
from kvlease._analyze._types import AnalysisReport


class PlotUnavailableError(AnalyzeError):
    """matplotlib is not installed."""


def _matplotlib() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotUnavailableError("--plot needs matplotlib: pip install 'kvlease[analyze]'") from e
    return plt


def _coarse_bins(report: AnalysisReport, per_decade: int = 10) -> tuple[list[float], list[int]]:
    """Re-bin the report's fine gap histogram to ``per_decade`` log bins (edges, counts)."""
    buckets: dict[int, int] = {}
    zero = 0
    for lo, _, count in report.gap_histogram:
        if lo <= 0:
            zero += count
            continue
        k = math.floor(math.log10(lo) * per_decade + 1e-9)
        buckets[k] = buckets.get(k, 0) + count
    if not buckets:
        return [], []
    lo_k, hi_k = min(buckets), max(buckets)
    edges = [10 ** (k / per_decade) for k in range(lo_k, hi_k + 2)]
    counts = [buckets.get(k, 0) for k in range(lo_k, hi_k + 1)]
    counts[0] += zero  # gaps under a millisecond share the first bar
    return edges, counts


def plot_report(report: AnalysisReport, path: str | Path) -> Path:
    """Write a two-panel PNG; return its path."""
    plt = _matplotlib()
    fig, (ax_gap, ax_share) = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    edges, counts = _coarse_bins(report)
    if counts:
        ax_gap.stairs(counts, edges, fill=True, color="#4c72b0", alpha=0.8, label="follow-up turns")
        ax_gap.set_xscale("log")
    else:
        ax_gap.text(0.5, 0.5, "no follow-up turns", ha="center", va="center", transform=ax_gap.transAxes)
    ax_gap.axvline(report.ttl, color="#c44e52", linestyle="--", label=f"TTL {report.ttl:g} s")
    ax_gap.axvline(report.max_idle, color="#dd8452", linestyle=":", label=f"max-idle {report.max_idle:g} s")
    ax_gap.axvspan(
        report.ttl, report.max_idle, color="#dd8452", alpha=0.15, zorder=0, label="recovered by leases"
    )
    ax_gap.set_xlabel("gap before a follow-up turn (s, log scale)")
    ax_gap.set_ylabel("turns")
    ax_gap.set_title(
        f"Inter-turn gaps: {100 * (report.share_beyond_ttl or 0):.0f}% beyond TTL, "
        f"{100 * (report.share_recovered_by_leases or 0):.0f}% recovered"
    )
    ax_gap.legend(loc="best", fontsize="small")

    idx = [t.index for t in report.per_turn_index]
    if idx:
        lower = [100 * (t.repeated_lower_bound or 0) for t in report.per_turn_index]
        est = [100 * (t.repeated_estimate or 0) for t in report.per_turn_index]
        ax_share.plot(idx, est, marker="o", color="#55a868", label="estimate (counts responses)")
        ax_share.plot(idx, lower, marker="s", color="#8172b2", label="lower bound (previous prompt)")
        ax_share.legend(loc="lower right", fontsize="small")
    else:
        ax_share.text(0.5, 0.5, "no token counts", ha="center", va="center", transform=ax_share.transAxes)
    ax_share.set_ylim(0, 100)
    capped = bool(idx) and idx[-1] == MAX_TURN_INDEX
    ax_share.set_xlabel(
        f"turn index (2 = second turn{f'; {MAX_TURN_INDEX} gathers later turns' if capped else ''})"
    )
    ax_share.set_ylabel("repeated prompt share (%)")
    ax_share.set_title("Repeated prompt share per turn index")
    ax_share.grid(alpha=0.3)
    fig.suptitle(f"kvlease analyze: {report.recommendation.verdict}")
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
