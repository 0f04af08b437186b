"""kvlease_langchain: a LangChain chat model on the kvlease SDK.

``from kvlease_langchain import ChatKVLease``. The package imports without LangChain installed
(``ChatKVLease`` is loaded on first access), so ``import kvlease_langchain`` never fails on its own.
Reading path: ``_chat_model.py`` (the model), ``_conversation.py`` (which conversation a call
belongs to), ``_reasoning.py`` (reasoning text between vLLM and LangChain).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvlease_langchain._chat_model import ChatKVLease

__all__ = ["ChatKVLease"]


def __getattr__(name: str) -> Any:
    if name == "ChatKVLease":
        from kvlease_langchain._chat_model import ChatKVLease

        return ChatKVLease
    raise AttributeError(f"module 'kvlease_langchain' has no attribute {name!r}")
