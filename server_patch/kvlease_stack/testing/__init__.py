"""Test helpers: a fake vLLM prefill/decode pair (vLLM is outside the project) and a real redis-server."""

from __future__ import annotations

from kvlease_stack.testing._redis import RedisServer
from kvlease_stack.testing.fake_vllm import FakeConfig, FakeNode, FakePair, render_chat

__all__ = ["FakeConfig", "FakeNode", "FakePair", "RedisServer", "render_chat"]
