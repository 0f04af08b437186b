"""The kvlease vLLM plugin on the real stack: streamed responses carry ``kv_transfer_params``.

Stock vLLM 0.32 returns the P/D block handle only in non-streaming responses. With the plugin, the
last JSON chunk before ``data: [DONE]`` of a streamed chat or text completion carries it, so a router
can capture D's new handle (bidirectional mode) from a streamed decode.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvlease.protocol import (
    CHAT_COMPLETIONS_PATH,
    COMPLETIONS_PATH,
    KV,
    KV_TRANSFER_PARAMS,
    prefill_request_params,
)
from kvlease_stack import Stack, StackSpec

pytestmark = pytest.mark.integration

TIMEOUT = httpx.Timeout(300.0, connect=10.0)
#: Logged by kvlease_vllm.plugin.register() in the servers' engine processes.
REGISTERED_LOG_LINE = "kvlease plugin: streamed responses of"
PROMPT = "def parse(argv):\n    '''Parse the command line arguments and return the options.'''\n" * 6


def stream_events(url: str, body: dict[str, Any]) -> list[dict[str, Any] | str]:
    """POST a streaming request; the SSE data payloads in order (JSON objects, then ``"[DONE]"``)."""
    events: list[dict[str, Any] | str] = []
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=TIMEOUT) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line.removeprefix("data: ")
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def handles(events: list[dict[str, Any] | str]) -> list[tuple[int, dict[str, Any]]]:
    """``(position, kv_transfer_params)`` of every chunk that carries the field."""
    return [
        (i, e[KV_TRANSFER_PARAMS])
        for i, e in enumerate(events)
        if isinstance(e, dict) and KV_TRANSFER_PARAMS in e
    ]


def prefill_handle(stack: Stack, body: dict[str, Any], path: str) -> dict[str, Any]:
    """Run the prefill turn on P (non-streaming, as a router does) and return P's handle."""
    req = {**body, "max_tokens": 1, KV_TRANSFER_PARAMS: prefill_request_params()}
    response = httpx.post(stack.prefill.url + path, json=req, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    handle = response.json()[KV_TRANSFER_PARAMS]
    assert handle[KV.DO_REMOTE_PREFILL] is True
    return dict(handle)


def assert_final_chunk_handle(events: list[dict[str, Any] | str]) -> dict[str, Any]:
    """Exactly one chunk carries a handle, and it is the last JSON chunk before ``[DONE]``."""
    assert events[-1] == "[DONE]"
    found = handles(events)
    assert [pos for pos, _ in found] == [len(events) - 2], f"handle positions {found} in {len(events)} events"
    return found[0][1]


def chat_body(stack: Stack, content: str) -> dict[str, Any]:
    return {
        "model": stack.model_name,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0.0,
    }


@pytest.fixture
def plugin_stack(stack_factory: Callable[[StackSpec], Stack]) -> Stack:
    # The default spec (plugin on): shared with the other integration tests, no extra servers.
    return stack_factory(StackSpec())


def test_streamed_chat_decode_returns_decode_handle(plugin_stack: Stack) -> None:
    """P -> D with a streamed decode: D's final chunk carries D's new (bidirectional) handle."""
    body = chat_body(plugin_stack, PROMPT + "# chat decode")
    p_handle = prefill_handle(plugin_stack, body, CHAT_COMPLETIONS_PATH)

    events = stream_events(
        plugin_stack.decode.url + CHAT_COMPLETIONS_PATH,
        {**body, "max_tokens": 8, KV_TRANSFER_PARAMS: p_handle},
    )

    d_handle = assert_final_chunk_handle(events)
    assert d_handle[KV.DO_REMOTE_DECODE] is True  # D offers its blocks back to P for the next turn
    assert d_handle[KV.REMOTE_ENGINE_ID] != p_handle[KV.REMOTE_ENGINE_ID]
    assert d_handle[KV.REMOTE_BLOCK_IDS], d_handle
    assert isinstance(d_handle[KV.REMOTE_BLOCKS_EXPIRY_TIME], (int, float))
    text = "".join(
        c["delta"].get("content") or "" for e in events if isinstance(e, dict) for c in e.get("choices", [])
    )
    assert text, "the decode streamed no text"


def test_streamed_text_completions_carry_handles_on_both_sides(plugin_stack: Stack) -> None:
    """Text completions: P's streamed prefill and D's streamed decode (with include_usage)."""
    body = {"model": plugin_stack.model_name, "prompt": PROMPT + "# text completion", "temperature": 0.0}

    p_events = stream_events(
        plugin_stack.prefill.url + COMPLETIONS_PATH,
        {**body, "max_tokens": 1, KV_TRANSFER_PARAMS: prefill_request_params()},
    )
    p_handle = assert_final_chunk_handle(p_events)
    assert p_handle[KV.DO_REMOTE_PREFILL] is True
    assert p_handle[KV.REMOTE_BLOCK_IDS], p_handle

    d_events = stream_events(
        plugin_stack.decode.url + COMPLETIONS_PATH,
        {
            **body,
            "max_tokens": 6,
            "stream_options": {"include_usage": True},
            KV_TRANSFER_PARAMS: p_handle,
        },
    )
    d_handle = assert_final_chunk_handle(d_events)
    final = d_events[-2]
    assert isinstance(final, dict) and final["choices"] == [] and final["usage"]["completion_tokens"] == 6
    assert d_handle[KV.DO_REMOTE_DECODE] is True
    assert d_handle[KV.REMOTE_ENGINE_ID] != p_handle[KV.REMOTE_ENGINE_ID]


def test_plugin_registered_in_both_servers(plugin_stack: Stack) -> None:
    for server in (plugin_stack.prefill, plugin_stack.decode):
        assert REGISTERED_LOG_LINE in server.log_text(), server.log_path


def test_streams_without_kv_transfer_params_are_untouched(plugin_stack: Stack) -> None:
    events = stream_events(
        plugin_stack.decode.url + CHAT_COMPLETIONS_PATH,
        {**chat_body(plugin_stack, PROMPT + "# plain"), "max_tokens": 4},
    )
    assert events[-1] == "[DONE]" and len(events) >= 3
    assert handles(events) == []


@pytest.mark.slow
def test_without_the_plugin_streams_carry_no_handle(stack_factory: Callable[[StackSpec], Stack]) -> None:
    """Stock vLLM (plugin filtered out by ``VLLM_PLUGINS``): the same streamed decode has no handle,
    while the non-streamed response still has one (so the difference is the plugin's)."""
    stack = stack_factory(StackSpec(plugin=False))
    body = chat_body(stack, PROMPT + "# stock")
    p_handle = prefill_handle(stack, body, CHAT_COMPLETIONS_PATH)

    events = stream_events(
        stack.decode.url + CHAT_COMPLETIONS_PATH, {**body, "max_tokens": 8, KV_TRANSFER_PARAMS: p_handle}
    )
    assert events[-1] == "[DONE]"
    assert handles(events) == []

    p_events = stream_events(
        stack.prefill.url + COMPLETIONS_PATH,
        {
            "model": stack.model_name,
            "prompt": PROMPT,
            "max_tokens": 1,
            KV_TRANSFER_PARAMS: prefill_request_params(),
        },
    )
    assert handles(p_events) == []
    assert REGISTERED_LOG_LINE not in stack.decode.log_text()
