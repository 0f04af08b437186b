"""Test helpers: a fake vLLM prefill/decode pair (vLLM is outside the project), the real router in
front of it, and a real redis-server.

Imports are lazy: the reply model and the request record (:mod:`._replies`, :mod:`._record`) need
no server extra, so the SDK-only test venv's fake router shares them with the fake P/D.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvlease_stack.testing._cluster import (
        chat_request,
        control_info,
        pair_settings,
        parse_sse,
        placeholder_settings,
        reply_text,
        serve,
    )
    from kvlease_stack.testing._record import Recorded
    from kvlease_stack.testing._redis import RedisServer
    from kvlease_stack.testing._replies import Reply, render_chat
    from kvlease_stack.testing._router import RouterOnFakePair
    from kvlease_stack.testing.fake_vllm import FakeConfig, FakeNode, FakePair

_HOME = {
    "FakeConfig": "fake_vllm",
    "FakeNode": "fake_vllm",
    "FakePair": "fake_vllm",
    "Recorded": "_record",
    "RedisServer": "_redis",
    "Reply": "_replies",
    "RouterOnFakePair": "_router",
    "render_chat": "_replies",
    "chat_request": "_cluster",
    "control_info": "_cluster",
    "placeholder_settings": "_cluster",
    "pair_settings": "_cluster",
    "parse_sse": "_cluster",
    "reply_text": "_cluster",
    "serve": "_cluster",
}

__all__ = [
    "FakeConfig",
    "FakeNode",
    "FakePair",
    "Recorded",
    "RedisServer",
    "Reply",
    "RouterOnFakePair",
    "chat_request",
    "control_info",
    "pair_settings",
    "parse_sse",
    "placeholder_settings",
    "render_chat",
    "reply_text",
    "serve",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
