"""kvlease_langchain: a LangChain chat model on the kvlease SDK."""

from __future__ import annotations

__all__: list[str] = []
