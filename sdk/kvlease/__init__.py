"""kvlease: fast multi-turn agents on vLLM prefill/decode disaggregation.

The client SDK::

    import kvlease
    from openai import OpenAI

    kc = kvlease.wrap(OpenAI(base_url="http://router:8000/v1", api_key="..."))
    with kc.conversation() as conv:
        r = conv.chat.completions.create(model="m", messages=msgs)
        conv.turns[-1].status

The SDK names load on first use, so ``import kvlease.protocol`` (the router, the vLLM connector)
does not import openai.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvlease import protocol
from kvlease.protocol import InvalidConversationId, ProtocolError, ReuseStatus

if TYPE_CHECKING:
    from kvlease._analyze import AnalysisReport, AnalyzeError, analyze
    from kvlease._client import AsyncConversation, AsyncKVLeaseClient, Conversation, KVLeaseClient, wrap
    from kvlease._core import Turn
    from kvlease._errors import ConfigError, KVLeaseError, KVLeaseWarning, LeaseError, ReuseOffWarning
    from kvlease._keeper import AsyncLeaseKeeper, LeaseKeeper
    from kvlease._renewal import RetryPolicy
    from kvlease._strip import AssistantReply, HistoryClass, StripDetector, ToolCall, Verdict
    from kvlease._turnlog import TurnLog

__version__ = "0.2.0"

__all__ = [
    "AnalysisReport",
    "AnalyzeError",
    "AssistantReply",
    "AsyncConversation",
    "AsyncKVLeaseClient",
    "AsyncLeaseKeeper",
    "ConfigError",
    "Conversation",
    "HistoryClass",
    "InvalidConversationId",
    "KVLeaseClient",
    "KVLeaseError",
    "KVLeaseWarning",
    "LeaseError",
    "LeaseKeeper",
    "ProtocolError",
    "RetryPolicy",
    "ReuseOffWarning",
    "ReuseStatus",
    "StripDetector",
    "ToolCall",
    "Turn",
    "TurnLog",
    "Verdict",
    "__version__",
    "analyze",
    "protocol",
    "wrap",
]

_LAZY: dict[str, str] = {
    "AsyncConversation": "kvlease._client",
    "AsyncKVLeaseClient": "kvlease._client",
    "Conversation": "kvlease._client",
    "KVLeaseClient": "kvlease._client",
    "wrap": "kvlease._client",
    "Turn": "kvlease._core",
    "ConfigError": "kvlease._errors",
    "KVLeaseError": "kvlease._errors",
    "KVLeaseWarning": "kvlease._errors",
    "LeaseError": "kvlease._errors",
    "ReuseOffWarning": "kvlease._errors",
    "AsyncLeaseKeeper": "kvlease._keeper",
    "LeaseKeeper": "kvlease._keeper",
    "RetryPolicy": "kvlease._renewal",
    "AssistantReply": "kvlease._strip",
    "HistoryClass": "kvlease._strip",
    "StripDetector": "kvlease._strip",
    "ToolCall": "kvlease._strip",
    "Verdict": "kvlease._strip",
    "TurnLog": "kvlease._turnlog",
    "AnalysisReport": "kvlease._analyze",
    "AnalyzeError": "kvlease._analyze",
    "analyze": "kvlease._analyze",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvlease' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
