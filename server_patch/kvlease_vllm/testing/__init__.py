"""Test helpers that fake components outside the project (a vLLM prefill/decode pair)."""

from __future__ import annotations

from kvlease_vllm.testing.fake_vllm import FakeConfig, FakeNode, FakePair, render_chat

__all__ = ["FakeConfig", "FakeNode", "FakePair", "render_chat"]
