"""What the fake vLLM says: ChatML rendering, byte "tokens" and scripted assistant replies.

A :class:`Reply` is one assistant answer as vLLM returns it: content, reasoning under a reasoning
field (``reasoning`` or ``reasoning_content``), tool calls and a finish reason; :meth:`Reply.message`
is the JSON message and :meth:`Reply.deltas` the streamed pieces (tool calls like vLLM: id, type and
name first, then the arguments in pieces). Scripted replies are queued on a fake node
(``FakeNode.script``) and used in order before its default answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import orjson

__all__ = ["WORDS", "Reply", "pieces", "render_chat", "tokens"]

WORDS = ("alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu")


def render_chat(messages: object) -> str:
    """ChatML rendering with the generation prompt (what the tiny model's template does)."""
    out = []
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, dict):
                content = m.get("content")
                text = (
                    content
                    if isinstance(content, str)
                    else ("" if content is None else orjson.dumps(content).decode())
                )
                out.append(f"<|im_start|>{m.get('role')}\n{text}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out)


def tokens(text: str) -> list[int]:
    """The fake's tokenizer: UTF-8 bytes, so an edited history changes the blocks after the edit."""
    return list(text.encode("utf-8", "surrogatepass"))


def pieces(text: str) -> list[str]:
    """``text`` as streamed: word by word, each but the first with its leading space."""
    if not text:
        return []
    words = text.split(" ")
    return [w if i == 0 else " " + w for i, w in enumerate(words)]


@dataclass(frozen=True)
class Reply:
    content: str = ""
    reasoning: str | None = None
    reasoning_field: str = "reasoning"  # vLLM's name; some servers say "reasoning_content"
    #: ``[{"name": ..., "arguments": {...} | "<raw JSON string>", "id": optional}]``
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def finish(self) -> str:
        return self.finish_reason or ("tool_calls" if self.tool_calls else "stop")

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.reasoning is not None:
            msg[self.reasoning_field] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": _call_id(tc, i),
                    "type": "function",
                    "function": {"name": tc["name"], "arguments": _arguments(tc)},
                }
                for i, tc in enumerate(self.tool_calls)
            ]
        return msg

    def deltas(self) -> list[dict[str, Any]]:
        """The streamed deltas after the first ``{"role": "assistant", "content": ""}``."""
        out: list[dict[str, Any]] = [{self.reasoning_field: w} for w in pieces(self.reasoning or "")]
        out += [{"content": w} for w in pieces(self.content)]
        for i, tc in enumerate(self.tool_calls):
            head = {"index": i, "id": _call_id(tc, i), "type": "function", "function": {"name": tc["name"]}}
            out.append({"tool_calls": [head]})
            raw = _arguments(tc)
            for j in range(0, len(raw), 8):
                out.append({"tool_calls": [{"index": i, "function": {"arguments": raw[j : j + 8]}}]})
        return out

    def text(self) -> str:
        """What the model generated as it is rendered back into the next prompt (its content)."""
        return self.content


def _call_id(tool_call: dict[str, Any], i: int) -> str:
    return str(tool_call.get("id") or f"call_{i}")


def _arguments(tool_call: dict[str, Any]) -> str:
    """A scripted tool call's arguments: a string is sent as it is, anything else as JSON."""
    arguments = tool_call.get("arguments", {})
    return arguments if isinstance(arguments, str) else json.dumps(arguments)
