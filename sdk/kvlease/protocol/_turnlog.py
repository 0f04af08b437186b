"""The turn log: SDK (writer) -> analyzer (reader)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

# --------------------------------------------------------------------------------------------------
# Turn log (SDK -> analyzer)
# --------------------------------------------------------------------------------------------------


class TurnLogKey:
    """Keys of one turn-log JSON line."""

    CONVERSATION_ID: Final = "conversation_id"
    TS: Final = "ts"
    PROMPT_TOKENS: Final = "prompt_tokens"
    COMPLETION_TOKENS: Final = "completion_tokens"
    TTFT_S: Final = "ttft_s"
    STATUS: Final = "status"  # a ReuseStatus value
    REUSED_TOKENS: Final = "reused_tokens"
    GAP_S: Final = "gap_s"
    # written by the SDK after the fields above (in ``TurnLogRecord.extra``); the analyzer skips them
    TURN: Final = "turn"  # the turn's index in its conversation
    HISTORY: Final = "history"  # how the history compared with the previous turn's
    REUSE_OFF: Final = "reuse_off"  # the SDK sent the per-turn reuse opt-out
    # optional (written only when known / true)
    VERIFIED: Final = "verified"  # the router said P verifies tokens (``X-KVLease-Verified``)
    #: the history changed (``history`` says how) and reuse was left on: ``reused_tokens`` is the
    #: token-verified prefix that was still reused
    VERIFIED_REUSE: Final = "verified_reuse"


#: Keys of one turn-log JSON line, in order (the SDK's extras follow them).
TURN_LOG_FIELDS: Final = (
    TurnLogKey.CONVERSATION_ID,
    TurnLogKey.TS,
    TurnLogKey.PROMPT_TOKENS,
    TurnLogKey.COMPLETION_TOKENS,
    TurnLogKey.TTFT_S,
    TurnLogKey.STATUS,
    TurnLogKey.REUSED_TOKENS,
    TurnLogKey.GAP_S,
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
