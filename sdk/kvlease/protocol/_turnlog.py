"""The turn log: SDK (writer) -> analyzer (reader)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

# --------------------------------------------------------------------------------------------------
# Turn log (SDK -> analyzer)
# --------------------------------------------------------------------------------------------------

#: Keys of one turn-log JSON line, in order.
TURN_LOG_FIELDS: Final = (
    "conversation_id",
    "ts",
    "prompt_tokens",
    "completion_tokens",
    "ttft_s",
    "status",
    "reused_tokens",
    "gap_s",
)


@dataclass(frozen=True)
class TurnLogRecord:
    """One line of the SDK turn log (``ts`` is the turn's start, epoch seconds)."""

    conversation_id: str
    ts: float
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    status: str | None = None
    reused_tokens: int | None = None
    gap_s: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in TURN_LOG_FIELDS}
        out.update(self.extra)
        return out
