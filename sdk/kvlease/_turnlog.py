"""The turn log: one JSON line per completed turn, in the format the analyzer reads."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

from kvlease.protocol import TurnLogKey, TurnLogRecord

if TYPE_CHECKING:
    from kvlease._core import Turn

__all__ = ["TurnLog"]


class TurnLog:
    """Append-only JSONL writer of :class:`~kvlease.Turn` records (thread-safe, flushed per line).

    Each line has the keys of :data:`kvlease.protocol.TURN_LOG_FIELDS` (``ts`` is the turn's start,
    ``gap_s`` the time since the previous turn of that conversation ended), then ``turn``,
    ``history`` and ``reuse_off``, and, when known, ``verified`` (the router's prefill node
    verifies tokens) and ``verified_reuse`` (the history changed and reuse was left on:
    ``reused_tokens`` is the verified prefix still reused).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._fh: IO[str] | None = None

    def write(self, turn: Turn) -> None:
        line = _encode(_record(turn)) + "\n"
        with self._lock:
            if self._fh is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fh = self.path.open("a", encoding="utf-8")
            self._fh.write(line)
            self._fh.flush()

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None

    def __enter__(self) -> TurnLog:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


#: ``json.dumps(..., separators=(",", ":"))`` without building an encoder per line
_encode = json.JSONEncoder(separators=(",", ":")).encode


def _record(turn: Turn) -> dict[str, Any]:
    """The line of ``turn``: the keys of :data:`kvlease.protocol.TURN_LOG_FIELDS`, then ``turn``,
    ``history`` and ``reuse_off``."""
    return TurnLogRecord(
        conversation_id=turn.conversation_id,
        ts=round(turn.started_at, 6),
        prompt_tokens=turn.prompt_tokens,
        completion_tokens=turn.completion_tokens,
        ttft_s=None if turn.ttft_s is None else round(turn.ttft_s, 6),
        status=None if turn.status is None else turn.status.value,
        reused_tokens=turn.reused_tokens,
        gap_s=None if turn.gap_s is None else round(turn.gap_s, 6),
        extra=_extra(turn),
    ).to_json()


def _extra(turn: Turn) -> dict[str, Any]:
    extra: dict[str, Any] = {
        TurnLogKey.TURN: turn.index,
        TurnLogKey.HISTORY: turn.history.value,
        TurnLogKey.REUSE_OFF: turn.reuse_forced_off,
    }
    if turn.verified is not None:
        extra[TurnLogKey.VERIFIED] = turn.verified
    if turn.verified_reuse:
        extra[TurnLogKey.VERIFIED_REUSE] = True
    return extra
