"""kvlease: fast multi-turn agents on vLLM prefill/decode disaggregation."""

from __future__ import annotations

from kvlease import protocol
from kvlease.protocol import InvalidConversationId, ProtocolError, ReuseStatus

__version__ = "0.1.0"

__all__ = [
    "InvalidConversationId",
    "ProtocolError",
    "ReuseStatus",
    "__version__",
    "protocol",
]
