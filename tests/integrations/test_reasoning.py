"""Reasoning between vLLM's wire format and LangChain messages: table-driven tests."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage

from kvlease_langchain import _reasoning as r


@pytest.mark.parametrize(
    ("wire", "expected"),
    [
        ({"content": "a", "reasoning": "why"}, ("reasoning", "why")),
        ({"content": "a", "reasoning_content": "why"}, ("reasoning_content", "why")),
        ({"reasoning_content": "", "reasoning": "why"}, ("reasoning", "why")),  # empty counts as absent
        ({"reasoning": None}, None),
        ({"reasoning": 3}, None),
        ({"content": "a"}, None),
        ({}, None),
        (None, None),
    ],
)
def test_reasoning_from_wire(wire: dict | None, expected: tuple[str, str] | None) -> None:
    assert r.reasoning_from_wire(wire) == expected


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (AIMessage("a", additional_kwargs={"reasoning_content": "why"}), "why"),
        (AIMessage([{"type": "reasoning", "reasoning": "w"}, {"type": "text", "text": "a"}]), "w"),
        (
            AIMessage([{"type": "reasoning", "reasoning": "w1"}, {"type": "reasoning", "reasoning": "w2"}]),
            "w1w2",
        ),
        (AIMessage("a"), None),
        (AIMessage("a", additional_kwargs={"reasoning_content": ""}), None),
    ],
)
def test_reasoning_of(message: BaseMessage, expected: str | None) -> None:
    assert r.reasoning_of(message) == expected


def _ai(text: str, reasoning: str | None = None, field: str | None = None) -> AIMessage:
    kwargs: dict[str, Any] = {"reasoning_content": reasoning} if reasoning else {}
    meta = {r.REASONING_FIELD_KEY: field} if field else {}
    return AIMessage(text, additional_kwargs=kwargs, response_metadata=meta)


@pytest.mark.parametrize(
    ("message", "wire", "default", "expected_wire", "count"),
    [
        # the field the server used wins over the default
        (_ai("a", "why", "reasoning_content"), {"role": "assistant", "content": "a"}, "reasoning",
         {"role": "assistant", "content": "a", "reasoning_content": "why"}, 1),
        (_ai("a", "why", "reasoning"), {"role": "assistant", "content": "a"}, "reasoning_content",
         {"role": "assistant", "content": "a", "reasoning": "why"}, 1),
        # unknown field: the default
        (_ai("a", "why"), {"role": "assistant", "content": "a"}, "reasoning",
         {"role": "assistant", "content": "a", "reasoning": "why"}, 1),
        # already present: left alone
        (_ai("a", "why", "reasoning"), {"role": "assistant", "content": "a", "reasoning": "x"}, "reasoning",
         {"role": "assistant", "content": "a", "reasoning": "x"}, 0),
        # nothing to attach
        (_ai("a"), {"role": "assistant", "content": "a"}, "reasoning", {"role": "assistant", "content": "a"}, 0),
        # not an AI message
        (HumanMessage("h"), {"role": "user", "content": "h"}, "reasoning", {"role": "user", "content": "h"}, 0),
    ],
)  # fmt: skip
def test_attach_reasoning(
    message: BaseMessage, wire: dict, default: str, expected_wire: dict, count: int
) -> None:
    wires = [dict(wire)]
    assert r.attach_reasoning(wires, [message], default) == count
    assert wires == [expected_wire]


@pytest.mark.parametrize(
    ("wire", "expected_content"),
    [
        (
            {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            "ab",
        ),
        ({"role": "assistant", "content": "ab"}, "ab"),
        ({"role": "assistant", "content": None}, None),
        # a non-text part keeps the list as it is
        (
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}],
            },
            [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}],
        ),
        # only assistant messages are touched
        ({"role": "user", "content": [{"type": "text", "text": "a"}]}, [{"type": "text", "text": "a"}]),
    ],
)
def test_flatten_assistant_text(wire: dict, expected_content: object) -> None:
    wires = [wire]
    r.flatten_assistant_text(wires)
    assert wires[0]["content"] == expected_content


def test_translator_puts_reasoning_first() -> None:
    r.register()
    msg = AIMessage(
        "answer",
        additional_kwargs={"reasoning_content": "why"},
        response_metadata={"model_provider": r.MODEL_PROVIDER},
        tool_calls=[{"name": "f", "args": {"x": 1}, "id": "c1", "type": "tool_call"}],
    )
    blocks = msg.content_blocks
    assert [b["type"] for b in blocks] == ["reasoning", "text", "tool_call"]
    assert blocks[0]["reasoning"] == "why"


def test_translator_on_chunks_and_without_reasoning() -> None:
    r.register()
    chunk = AIMessageChunk(
        "",
        additional_kwargs={"reasoning_content": "thi"},
        response_metadata={"model_provider": r.MODEL_PROVIDER},
    )
    assert chunk.content_blocks == [{"type": "reasoning", "reasoning": "thi"}]
    plain = AIMessage("a", response_metadata={"model_provider": r.MODEL_PROVIDER})
    assert [b["type"] for b in plain.content_blocks] == ["text"]


@pytest.mark.parametrize(
    ("tool_calls", "expected"),
    [
        ([{"id": "a", "function": {"name": "f", "arguments": '{"x":1}'}}], {"0": '{"x":1}'}),
        ([{"index": 1, "function": {"arguments": '"y"}'}}], {"1": '"y"}'}),  # a stream delta
        ([{"index": 0, "id": "a", "function": {"name": "f"}}], {}),  # head delta: no arguments yet
        ([{"function": {"arguments": ""}}], {}),
        (None, {}),
        ("x", {}),
    ],
)
def test_raw_tool_arguments(tool_calls: object, expected: dict) -> None:
    assert r.raw_tool_arguments(tool_calls) == expected


def _call_msg(args: dict, raw: str | None) -> AIMessage:
    kwargs = {r.RAW_TOOL_ARGUMENTS_KEY: {"0": raw}} if raw is not None else {}
    return AIMessage("", additional_kwargs=kwargs, tool_calls=[{"name": "f", "args": args, "id": "c0"}])


def _wire(arguments: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "f", "arguments": arguments}}]}  # fmt: skip


@pytest.mark.parametrize(
    ("message", "sent", "expected", "count"),
    [
        (_call_msg({"x": 1}, '{"x":1}'), '{"x": 1}', '{"x":1}', 1),  # restored
        (_call_msg({"x": 2}, '{"x":1}'), '{"x": 2}', '{"x": 2}', 0),  # edited args stay edited
        (_call_msg({"x": 1}, "not json"), '{"x": 1}', '{"x": 1}', 0),
        (_call_msg({"x": 1}, None), '{"x": 1}', '{"x": 1}', 0),
        (_call_msg({"x": 1}, '{"x": 1}'), '{"x": 1}', '{"x": 1}', 0),  # already identical
    ],
)
def test_restore_tool_arguments(message: AIMessage, sent: str, expected: str, count: int) -> None:
    wires = [_wire(sent)]
    assert r.restore_tool_arguments(wires, [message]) == count
    assert wires[0]["tool_calls"][0]["function"]["arguments"] == expected
