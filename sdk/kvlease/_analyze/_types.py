"""The analyzer's result types: what was read, every figure, the recommendation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


def ratio(part: int, whole: int) -> float | None:
    return part / whole if whole > 0 else None


@dataclass(frozen=True)
class InputSummary:
    """What the reader saw: format, lines, records accepted, malformed lines (first few kept)."""

    format: str = "records"
    source: str = ""
    bytes_read: int = 0
    lines: int = 0
    records: int = 0
    malformed: int = 0
    malformed_examples: tuple[tuple[int, str], ...] = ()
    truncated: str | None = None  # set when the reader had to stop early (broken JSON array)
    passes: int = 1  # 2 when turns arrived out of the reorder window and an exact pass sorted them


@dataclass(frozen=True)
class TurnIndexFigures:
    """Repeated share of the follow-up turns with one turn index (2 = second turn)."""

    index: int
    turns: int
    prompt_tokens: int
    repeated_lower_bound: float | None
    repeated_estimate: float | None


@dataclass(frozen=True)
class Recommendation:
    verdict: str  # "kvlease" | "prefix-caching" | "no-data"
    text: str
    suggested_ttl: float | None = None
    suggested_max_idle: float | None = None


@dataclass(frozen=True)
class AnalysisReport:
    """Every figure of one analysis; ``to_json()`` is the ``--json`` output."""

    input: InputSummary
    ttl: float
    max_idle: float
    conversations: int
    turns: int
    follow_up_turns: int
    one_turn_conversations: int
    max_turns_in_conversation: int
    late_turns: int  # arrived more than reorder_window turns out of order: counted, not paired
    token_turns: int  # follow-up turns with both prompt sizes known
    completion_known_turns: int  # ... of which the previous response's size is known
    prompt_tokens: int
    repeated_tokens_lower_bound: int
    repeated_tokens_estimate: int
    repeated_share_lower_bound: float | None
    repeated_share_estimate: float | None
    turns_within_ttl: int
    turns_beyond_ttl: int
    turns_recovered_by_leases: int
    turns_beyond_max_idle: int
    share_beyond_ttl: float | None
    share_recovered_by_leases: float | None
    share_beyond_max_idle: float | None
    span_s: float
    saved_tokens_fixed_ttl: int
    saved_tokens_leases: int
    saved_tokens_per_hour_fixed_ttl: float | None
    saved_tokens_per_hour_leases: float | None
    gap_p50_s: float | None
    gap_p90_s: float | None
    gap_p99_s: float | None
    gap_percentiles_exact: bool
    gap_histogram: tuple[tuple[float, float, int], ...]
    per_turn_index: tuple[TurnIndexFigures, ...]
    statuses: dict[str, int]
    reused_tokens_observed: int
    recommendation: Recommendation = field(default_factory=lambda: Recommendation("no-data", ""))

    def to_json(self) -> dict[str, Any]:
        def num(v: float) -> float | None:
            return None if math.isinf(v) or math.isnan(v) else v

        return {
            "input": {
                "format": self.input.format,
                "source": self.input.source,
                "bytes_read": self.input.bytes_read,
                "lines": self.input.lines,
                "records": self.input.records,
                "malformed": self.input.malformed,
                "malformed_examples": [{"line": n, "error": m} for n, m in self.input.malformed_examples],
                "truncated": self.input.truncated,
                "passes": self.input.passes,
            },
            "settings": {"ttl_s": self.ttl, "max_idle_s": self.max_idle},
            "conversations": self.conversations,
            "turns": self.turns,
            "follow_up_turns": self.follow_up_turns,
            "one_turn_conversations": self.one_turn_conversations,
            "max_turns_in_conversation": self.max_turns_in_conversation,
            "late_turns": self.late_turns,
            "repeated": {
                "token_turns": self.token_turns,
                "completion_known_turns": self.completion_known_turns,
                "prompt_tokens": self.prompt_tokens,
                "tokens_lower_bound": self.repeated_tokens_lower_bound,
                "tokens_estimate": self.repeated_tokens_estimate,
                "share_lower_bound": self.repeated_share_lower_bound,
                "share_estimate": self.repeated_share_estimate,
            },
            "gaps": {
                "within_ttl": self.turns_within_ttl,
                "beyond_ttl": self.turns_beyond_ttl,
                "recovered_by_leases": self.turns_recovered_by_leases,
                "beyond_max_idle": self.turns_beyond_max_idle,
                "share_beyond_ttl": self.share_beyond_ttl,
                "share_recovered_by_leases": self.share_recovered_by_leases,
                "share_beyond_max_idle": self.share_beyond_max_idle,
                "p50_s": self.gap_p50_s,
                "p90_s": self.gap_p90_s,
                "p99_s": self.gap_p99_s,
                "percentiles_exact": self.gap_percentiles_exact,
                "histogram": [{"lo_s": lo, "hi_s": num(hi), "turns": c} for lo, hi, c in self.gap_histogram],
            },
            "saved_prefill": {
                "span_s": self.span_s,
                "tokens_fixed_ttl": self.saved_tokens_fixed_ttl,
                "tokens_leases": self.saved_tokens_leases,
                "tokens_per_hour_fixed_ttl": self.saved_tokens_per_hour_fixed_ttl,
                "tokens_per_hour_leases": self.saved_tokens_per_hour_leases,
            },
            "per_turn_index": [
                {
                    "index": t.index,
                    "turns": t.turns,
                    "prompt_tokens": t.prompt_tokens,
                    "share_lower_bound": t.repeated_lower_bound,
                    "share_estimate": t.repeated_estimate,
                }
                for t in self.per_turn_index
            ],
            "observed": {"statuses": dict(self.statuses), "reused_tokens": self.reused_tokens_observed},
            "recommendation": {
                "verdict": self.recommendation.verdict,
                "text": self.recommendation.text,
                "suggested_ttl_s": self.recommendation.suggested_ttl,
                "suggested_max_idle_s": self.recommendation.suggested_max_idle,
            },
        }
