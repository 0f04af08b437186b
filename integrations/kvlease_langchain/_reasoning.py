"""Reasoning text between vLLM's wire format and LangChain messages.

vLLM returns a reasoning model's thinking beside the answer, in ``message.reasoning`` (current
vLLM) or ``message.reasoning_content`` (older vLLM, DeepSeek-style servers); streaming puts it in
``delta.reasoning`` / ``delta.reasoning_content``. LangChain's convention is
``additional_kwargs["reasoning_content"]`` plus standard ``{"type": "reasoning"}`` content blocks.

On the way back, the assistant message is sent with its reasoning under the field name the server
used (recorded in ``response_metadata["reasoning_field"]``), so that the rendered prompt of the next
turn extends the previous one token for token and the decode node's KV stays reusable.

Tool calls get the same care: LangChain keeps parsed arguments and re-serializes them with
``json.dumps`` when the message goes back, which need not match the string the server produced
(spacing, key order, escapes). The raw argument strings are kept in
``additional_kwargs["tool_call_arguments"]`` (``{"<index>": "<arguments>"}``, which merges chunk by
chunk) and restored on the way out whenever they still parse to the same arguments.

The dict-level functions are pure; the translator at the bottom plugs into langchain-core's
``content_blocks`` registry under the provider name ``kvlease``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages import content as types
from langchain_core.messages.block_translators import register_translator
from langchain_core.messages.block_translators.openai import (
    translate_content as _openai_translate_content,
)
from langchain_core.messages.block_translators.openai import (
    translate_content_chunk as _openai_translate_content_chunk,
)

from kvlease.protocol import REASONING_FIELDS

#: Field names a server may use for reasoning text, in lookup order: ``protocol.REASONING_FIELDS``
#: reversed. When a server sends both, the one under LangChain's own key (``reasoning_content``,
#: :data:`LC_REASONING_KEY`) wins here: what lands in ``additional_kwargs`` is what that field said.
REASONING_LOOKUP: tuple[str, ...] = tuple(reversed(REASONING_FIELDS))

#: Where LangChain keeps reasoning text on a message.
LC_REASONING_KEY = "reasoning_content"

#: ``response_metadata`` key naming the server's field (``"reasoning"`` or ``"reasoning_content"``).
REASONING_FIELD_KEY = "reasoning_field"

#: ``additional_kwargs`` key of the raw tool-call argument strings, by tool-call index.
RAW_TOOL_ARGUMENTS_KEY = "tool_call_arguments"

#: ``response_metadata["model_provider"]`` of messages made by ``ChatKVLease``.
MODEL_PROVIDER = "kvlease"


def reasoning_from_wire(message: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """``(field, text)`` of the reasoning in a response message or stream delta, else ``None``.

    Empty strings count as absent (vLLM sends ``""`` or ``null`` on chunks without reasoning).
    """
    if not message:
        return None
    for name in REASONING_LOOKUP:
        value = message.get(name)
        if isinstance(value, str) and value:
            return name, value
    return None


def reasoning_of(message: BaseMessage) -> str | None:
    """The reasoning text a LangChain AI message carries, from ``additional_kwargs`` or v1 blocks."""
    value = message.additional_kwargs.get(LC_REASONING_KEY)
    if isinstance(value, str) and value:
        return value
    if isinstance(message.content, list):
        parts = [
            block["reasoning"]
            for block in message.content
            if isinstance(block, dict)
            and block.get("type") == "reasoning"
            and isinstance(block.get("reasoning"), str)
        ]
        if parts:
            return "".join(parts)
    return None


def attach_reasoning(
    wire_messages: Sequence[MutableMapping[str, Any]],
    messages: Sequence[BaseMessage],
    default_field: str,
) -> int:
    """Put each AI message's reasoning back on its outgoing dict; returns how many were attached.

    ``wire_messages[i]`` is the chat-completions dict of ``messages[i]``. A dict that already has a
    reasoning field is left alone. The field name is the one the server used for that message
    (``response_metadata["reasoning_field"]``), else ``default_field``.
    """
    attached = 0
    for wire, message in zip(wire_messages, messages):
        if not isinstance(message, AIMessage) or wire.get("role") != "assistant":
            continue
        if any(wire.get(name) for name in REASONING_FIELDS):
            continue
        text = reasoning_of(message)
        if text is None:
            continue
        field = message.response_metadata.get(REASONING_FIELD_KEY)
        wire[field if field in REASONING_FIELDS else default_field] = text
        attached += 1
    return attached


def raw_tool_arguments(tool_calls: object) -> dict[str, str]:
    """``{"<index>": "<arguments>"}`` of a response's ``tool_calls`` or of one stream delta's.

    Stream deltas carry ``index`` and a piece of the arguments; whole messages are indexed by position.
    """
    if not isinstance(tool_calls, list):
        return {}
    out: dict[str, str] = {}
    for position, call in enumerate(tool_calls):
        if not isinstance(call, Mapping):
            continue
        function = call.get("function")
        arguments = function.get("arguments") if isinstance(function, Mapping) else None
        index = call.get("index", position)
        if isinstance(arguments, str) and arguments and isinstance(index, int):
            out[str(index)] = arguments
    return out


def restore_tool_arguments(
    wire_messages: Sequence[MutableMapping[str, Any]], messages: Sequence[BaseMessage]
) -> int:
    """Send tool-call arguments back as the server wrote them; returns how many were restored.

    A raw string replaces LangChain's re-serialization only when it parses to the same arguments
    (so edited arguments are sent as edited).
    """
    restored = 0
    for wire, message in zip(wire_messages, messages):
        raw = message.additional_kwargs.get(RAW_TOOL_ARGUMENTS_KEY)
        calls = wire.get("tool_calls")
        if not isinstance(message, AIMessage) or not isinstance(raw, Mapping) or not isinstance(calls, list):
            continue
        for index, (call, parsed) in enumerate(zip(calls, message.tool_calls)):
            text = raw.get(str(index))
            function = call.get("function") if isinstance(call, MutableMapping) else None
            if not isinstance(text, str) or not isinstance(function, MutableMapping):
                continue
            try:
                same = json.loads(text) == parsed["args"]
            except ValueError:
                continue
            if same and function.get("arguments") != text:
                function["arguments"] = text
                restored += 1
    return restored


def flatten_assistant_text(wire_messages: Sequence[MutableMapping[str, Any]]) -> None:
    """Send assistant content made only of text blocks as the plain string the server returned.

    With ``output_version="v1"`` an answer comes back as ``[{"type": "text", ...}]``; sending that
    list re-renders differently from the string the server produced, which breaks the prefix.
    """
    for wire in wire_messages:
        content = wire.get("content")
        if wire.get("role") != "assistant" or not isinstance(content, list) or not content:
            continue
        if all(
            isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
            for b in content
        ):
            wire["content"] = "".join(b["text"] for b in content)


def _with_reasoning_block(blocks: list[types.ContentBlock], message: BaseMessage) -> list[types.ContentBlock]:
    if any(block.get("type") == "reasoning" for block in blocks):
        return blocks
    text = reasoning_of(message)
    if text is None:
        return blocks
    reasoning: types.ReasoningContentBlock = {"type": "reasoning", "reasoning": text}
    return [reasoning, *blocks]


def translate_content(message: AIMessage) -> list[types.ContentBlock]:
    """Standard content blocks of a ``ChatKVLease`` message: OpenAI's, led by the reasoning block."""
    return _with_reasoning_block(_openai_translate_content(message), message)


def translate_content_chunk(message: AIMessageChunk) -> list[types.ContentBlock]:
    """Standard content blocks of a ``ChatKVLease`` chunk (reasoning deltas become reasoning blocks)."""
    return _with_reasoning_block(_openai_translate_content_chunk(message), message)


def register() -> None:
    """Register the ``kvlease`` translator with langchain-core (idempotent)."""
    register_translator(MODEL_PROVIDER, translate_content, translate_content_chunk)
