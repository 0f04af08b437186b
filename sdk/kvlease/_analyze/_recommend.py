"""The plain-language recommendation drawn from an :class:`AnalysisReport` (pure)."""

from __future__ import annotations

from typing import Final

from kvlease._analyze._types import AnalysisReport, Recommendation

#: Below this repeated share (estimate), pulling the previous turn's KV saves little.
LOW_REPEATED_SHARE: Final = 0.5
#: Above this share of follow-up turns beyond max-idle, leases would mostly hold blocks for nothing.
HIGH_BEYOND_IDLE_SHARE: Final = 0.5
#: Round suggestions up to one of these (seconds); gaps longer than the last are not worth holding.
NICE_SECONDS: Final = (60, 120, 180, 300, 600, 900, 1200, 1800, 2700, 3600, 7200, 10800, 14400)
MIN_SUGGESTED_TTL: Final = 60.0

SIMPLER: Final = "Prefix caching on a colocated node is the simpler answer."


def nice_ceil(seconds: float) -> float:
    """The smallest value of :data:`NICE_SECONDS` at least ``seconds`` (the largest if none)."""
    for v in NICE_SECONDS:
        if seconds <= v:
            return float(v)
    return float(NICE_SECONDS[-1])


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def _secs(x: float) -> str:
    if x < 10:
        return f"{x:.1f} s"
    if x < 120:
        return f"{x:.0f} s"
    return f"{x / 60:.1f} min" if x < 600 else f"{x / 60:.0f} min"


def recommend(r: AnalysisReport) -> Recommendation:
    if r.turns == 0:
        return Recommendation("no-data", "The input holds no turns: nothing to analyse.")
    if r.follow_up_turns == 0:
        return Recommendation(
            "no-data",
            "No conversation has a second turn, so nothing would be reused across turns: kvlease "
            "does not help this traffic. " + SIMPLER,
        )
    share = r.repeated_share_estimate
    beyond_idle = r.share_beyond_max_idle or 0.0
    if share is not None and share < LOW_REPEATED_SHARE:
        return Recommendation(
            "prefix-caching",
            f"Only {_pct(share)} of follow-up prompt tokens repeat the previous turn (lower bound "
            f"{_pct(r.repeated_share_lower_bound)}), so pulling the decode node's KV would save little "
            "prefill. " + SIMPLER,
        )
    if beyond_idle > HIGH_BEYOND_IDLE_SHARE:
        return Recommendation(
            "prefix-caching",
            f"{_pct(beyond_idle)} of follow-up turns arrive more than {_secs(r.max_idle)} after the "
            "previous one, longer than a lease should hold decode memory. " + SIMPLER,
        )
    p50 = r.gap_p50_s or 0.0
    p90 = r.gap_p90_s or 0.0
    ttl = max(MIN_SUGGESTED_TTL, min(r.ttl, nice_ceil(p50))) if r.ttl >= MIN_SUGGESTED_TTL else r.ttl
    max_idle = max(ttl, nice_ceil(p90))
    parts = []
    if share is None:
        parts.append("The input has no prompt sizes, so the repeated share is unknown; judging by gaps only.")
    else:
        parts.append(
            f"{_pct(share)} of follow-up prompt tokens repeat the previous turn (lower bound "
            f"{_pct(r.repeated_share_lower_bound)}): decode already holds most of each next prompt."
        )
    recovered = r.share_recovered_by_leases or 0.0
    if (r.share_beyond_ttl or 0.0) > 0:
        parts.append(
            f"{_pct(r.share_beyond_ttl)} of follow-up turns come after the fixed {_secs(r.ttl)} TTL; "
            f"heartbeat leases would recover {_pct(recovered)} of all follow-up turns."
        )
    else:
        parts.append(
            f"Every follow-up turn comes within the {_secs(r.ttl)} TTL, so leases add safety "
            "(verification, bounded retention) more than hits."
        )
    parts.append(
        f"Enable kvlease with a lease TTL of {_secs(ttl)} and max-idle of {_secs(max_idle)} "
        f"(half of gaps are under {_secs(p50)}, 90% under {_secs(p90)})."
    )
    return Recommendation("kvlease", " ".join(parts), suggested_ttl=ttl, suggested_max_idle=max_idle)
