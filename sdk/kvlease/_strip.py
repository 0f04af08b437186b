"""Strip detection: is the history resent on this turn what the model actually produced?

Pure logic, no IO and no clock. A :class:`StripDetector` belongs to one conversation. It remembers the
messages the client sent on the last successful turn and what the model returned (content, reasoning
under ``reasoning`` / ``reasoning_content``, ``<think>…</think>`` inside content, tool calls). On the
next turn :meth:`StripDetector.inspect` finds that assistant message in the outgoing history and
classifies it; :meth:`StripDetector.record` commits the turn once the server answered.

Anything but exact means the new prompt is not a token prefix of what the decode node holds: the
caller switches KV reuse off for that turn (stock vLLM pulls by length), or, behind the kvlease
connector (which pulls only the token-verified common prefix), leaves it on, and warns once per kind. With
``policy="keep"`` stripped reasoning is put back under the field name the server used (or, for
``<think>`` in content, back into the content), and every later turn re-applies the same repair, so
the conversation stays exact.

Comparisons are of what the chat template renders. They ignore leading/trailing whitespace of
content and reasoning (chat templates trim them), treat ``None``, ``""`` and a missing ``content``
alike, and read list content made only of text parts as the concatenated text. Tool-call arguments
are compared the way vLLM renders them: it parses the argument string (``json.loads``; ``None`` or
``""`` become ``{}``) and the template writes it back with ``tojson`` (``json.dumps``, key order kept,
``null`` values kept). So ``{"city":"Paris"}`` (pydantic-ai), ``{"city": "Paris"}`` (LangChain) and an
indented or ASCII-escaped re-serialization are all exact, while reordered keys, a dropped
``null``-valued key or ``1`` for ``1.0`` are changes (they render to other tokens).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from kvlease import protocol
from kvlease.protocol import REASONING_FIELDS

__all__ = [
    "AssistantReply",
    "HistoryClass",
    "ReasoningPolicy",
    "StripDetector",
    "ToolCall",
    "Verdict",
    "rendered_arguments",
    "split_think",
]

ReasoningPolicy = Literal["warn", "keep", "off"]
THINK_OPEN: Final = "<think>"
THINK_CLOSE: Final = "</think>"


class HistoryClass(str, enum.Enum):
    """How the resent history of a turn relates to what the model produced."""

    FIRST_TURN = "first-turn"  # nothing remembered to compare against
    EXACT = "exact"
    REASONING_STRIPPED = "reasoning-stripped"
    CONTENT_EDITED = "content-edited"
    TOOL_CALLS_CHANGED = "tool-calls-changed"
    HISTORY_REWRITTEN = "history-rewritten"  # an earlier message changed or vanished
    UNKNOWN = "unknown"  # the previous reply was not observed (abandoned stream, unreadable body)

    @property
    def breaks_prefix(self) -> bool:
        """True when the new prompt cannot be a token prefix of the previous turn's sequence."""
        return self in _BREAKING


_BREAKING: Final = frozenset(
    {
        HistoryClass.REASONING_STRIPPED,
        HistoryClass.CONTENT_EDITED,
        HistoryClass.TOOL_CALLS_CHANGED,
        HistoryClass.HISTORY_REWRITTEN,
    }
)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call; ``arguments`` is the JSON string as sent (a dict or list is JSON-encoded).
    Two calls are compared by :attr:`rendered`, not by the argument bytes."""

    id: str | None
    name: str | None
    arguments: str

    @property
    def rendered(self) -> tuple[str | None, str | None, str]:
        """``(id, name, arguments as the chat template renders them)``."""
        return self.id, self.name, rendered_arguments(self.arguments)


def rendered_arguments(arguments: object) -> str:
    """Tool-call arguments as vLLM's chat template renders them: parsed (empty or ``None``: ``{}``),
    then ``json.dumps`` (the ``tojson`` filter: key order kept, ``ensure_ascii=False``). Arguments
    that are not JSON are compared as they are."""
    value = arguments
    if isinstance(arguments, str):
        if not arguments.strip():
            value = {}
        else:
            try:
                value = json.loads(arguments)
            except ValueError:
                return arguments
    elif arguments is None:
        value = {}
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)


@dataclass(frozen=True, slots=True)
class AssistantReply:
    """What the model returned on one turn (choice 0)."""

    content: str | None = None
    reasoning: str | None = None
    reasoning_field: str | None = None  # "reasoning" or "reasoning_content": the name the server used
    tool_calls: tuple[ToolCall, ...] = ()

    @classmethod
    def from_message(cls, message: Mapping[str, Any]) -> AssistantReply:
        """Parse a ``choices[0].message`` object of a chat completion."""
        content = message.get("content")
        reasoning: str | None = None
        reasoning_field: str | None = None
        for name in REASONING_FIELDS:
            value = message.get(name)
            if value and isinstance(value, str):
                reasoning, reasoning_field = value, name
                break
        calls = message.get("tool_calls")
        return cls(
            content if isinstance(content, str) else None,
            reasoning,
            reasoning_field,
            normalize_tool_calls(calls) if calls else (),
        )


@dataclass(slots=True)
class Verdict:
    """The classification of one outgoing history, and what to send. Read-only by contract (not
    frozen: one is built for every tracked request, and a frozen dataclass costs a call per field)."""

    history: HistoryClass
    detail: str = ""  # the cause, for the warning ("" when exact)
    fix: str = ""  # what the user should change
    messages: list[Any] = field(default_factory=list)  # the messages to send (repaired under "keep")
    repaired: bool = False  # ``messages`` differs from what the caller passed: re-serialize the body
    reattached: bool = False  # reasoning was re-attached on this turn's assistant message
    raw: list[Any] = field(default_factory=list)  # the messages as the caller passed them

    @property
    def reuse_off(self) -> bool:
        """Send the reuse opt-out: the history breaks the prefix and was not repaired."""
        return self.history.breaks_prefix and not self.reattached


def split_think(content: str | None) -> tuple[str | None, str]:
    """``(reasoning, rest)`` of content carrying a ``<think>…</think>`` block, else ``(None, content)``.

    Handles the DeepSeek-R1 / Qwen3 forms: ``<think>R</think>C`` and ``R</think>C`` (the opening tag
    was part of the generation prompt).
    """
    if not content:
        return None, content or ""
    end = content.find(THINK_CLOSE)
    if end < 0:
        return None, content
    head = content[:end]
    start = head.find(THINK_OPEN)
    if start >= 0:
        if head[:start].strip():
            return None, content
        head = head[start + len(THINK_OPEN) :]
    elif THINK_OPEN in content[end:]:
        return None, content
    return head, content[end + len(THINK_CLOSE) :]


def normalize_tool_calls(value: object) -> tuple[ToolCall, ...]:
    if not value:  # (most messages have none: no ABC check for them)
        return ()
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        return ()
    out: list[ToolCall] = []
    for item in value:
        if not isinstance(item, Mapping):
            continue
        fn = item.get("function")
        fn = fn if isinstance(fn, Mapping) else {}
        args = fn.get("arguments")
        if isinstance(args, (Mapping, list)):  # vLLM accepts parsed arguments too
            try:
                args = json.dumps(args, ensure_ascii=False)
            except (TypeError, ValueError):
                args = ""
        ident = item.get("id")
        name = fn.get("name")
        out.append(
            ToolCall(
                id=ident if isinstance(ident, str) else None,
                name=name if isinstance(name, str) else None,
                arguments=args if isinstance(args, str) else "",
            )
        )
    return tuple(out)


def _same_tool_calls(sent: Sequence[ToolCall], returned: Sequence[ToolCall]) -> bool:
    """The resent tool calls render like the returned ones (same ids, names, rendered arguments)."""
    if len(sent) != len(returned):
        return False
    return all(a == b or a.rendered == b.rendered for a, b in zip(sent, returned))


_NON_TEXT: Final = object()


def _text_of(content: object) -> object:
    """Comparable text of a message's content, or a sentinel for content that is not only text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content.strip()
    if isinstance(content, Sequence):
        parts: list[str] = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                return _NON_TEXT
        return "".join(parts).strip()
    return _NON_TEXT


def _sent_reasoning(message: Mapping[str, Any]) -> str:
    for name in REASONING_FIELDS:
        value = message.get(name)
        if isinstance(value, str) and value.strip():
            return value.strip()
    return ""


_HEADER_NOTE: Final = f"{protocol.HEADER_REUSE}: {protocol.REUSE_OFF}"
_FIX_KEEP: Final = (
    'or turn on the "keep" reasoning policy to re-attach it automatically '
    '(kvlease.wrap(client, reasoning="keep"); ChatKVLease(reasoning_policy="keep"))'
)
_FIX_EDITED: Final = (
    "append the assistant message exactly as returned (e.g. messages.append(r.choices[0].message)) "
    "and put changes in new messages"
)
_FIX_TOOLS: Final = (
    "resend tool_calls as returned (same ids, names, and arguments with the same keys in the same order)"
)
_FIX_REWRITTEN: Final = "only append to the history; to change earlier turns, start a new conversation"


class StripDetector:
    """Classifier of one conversation's resent history (see the module docstring)."""

    __slots__ = ("_raw", "_reply", "_wire", "policy")

    def __init__(self, policy: ReasoningPolicy = "warn") -> None:
        if policy not in ("warn", "keep", "off"):
            raise ValueError(f'reasoning policy must be "warn", "keep" or "off", not {policy!r}')
        self.policy: ReasoningPolicy = policy
        self._raw: list[Any] | None = None  # messages the caller sent on the last recorded turn
        self._wire: list[Any] | None = None  # what went out (differs from _raw after a repair)
        self._reply: AssistantReply | None = None

    @property
    def last_reply(self) -> AssistantReply | None:
        return self._reply

    def inspect(self, messages: Sequence[Any], *, known_prefix: Sequence[Any] | None = None) -> Verdict:
        """Classify ``messages`` (the outgoing ``messages`` of a chat request) against the last turn.

        ``known_prefix``: a list the caller knows ``messages`` begins with, element for element; when
        it is the history recorded on the last turn (``verdict.raw``), that history is not compared
        again (a caller that parsed only the new messages of a resent history passes it).
        """
        msgs = list(messages)
        raw, wire = self._raw, self._wire
        if raw is None or wire is None:
            return Verdict(HistoryClass.FIRST_TURN, messages=msgs, raw=msgs)
        n = len(raw)
        if len(msgs) <= n or (known_prefix is not raw and msgs[:n] != raw):
            return self._rewritten(msgs, raw)
        repaired_prefix = wire is not raw
        tail = msgs[n:]
        if self._reply is None:
            out = wire + tail if repaired_prefix else msgs
            return Verdict(HistoryClass.UNKNOWN, messages=out, repaired=repaired_prefix, raw=msgs)
        sent = tail[0]
        if not isinstance(sent, Mapping) or sent.get("role") != "assistant":
            return Verdict(
                HistoryClass.HISTORY_REWRITTEN,
                detail=f"the model's reply to the previous turn is missing (message {n} is not an assistant message)",
                fix=_FIX_REWRITTEN,
                messages=msgs,
                raw=msgs,
            )
        history, detail, fix, fixed = self._compare(sent, self._reply)
        if fixed is not None:
            out = (wire if repaired_prefix else msgs[:n]) + [fixed] + tail[1:]
            return Verdict(history, detail, fix, out, repaired=True, reattached=True, raw=msgs)
        if repaired_prefix:
            return Verdict(history, detail, fix, wire + tail, repaired=True, raw=msgs)
        return Verdict(history, detail, fix, msgs, raw=msgs)

    def record(self, verdict: Verdict, reply: AssistantReply | None) -> None:
        """Commit a turn that the server answered: what was sent, and what came back (or ``None``)."""
        self._raw = verdict.raw
        self._wire = verdict.messages if verdict.repaired else verdict.raw
        self._reply = reply

    def _rewritten(self, msgs: list[Any], raw: list[Any]) -> Verdict:
        i = next((k for k, (a, b) in enumerate(zip(msgs, raw)) if a != b), min(len(msgs), len(raw)))
        if i < len(raw) and i < len(msgs):
            role = raw[i].get("role") if isinstance(raw[i], Mapping) else None
            detail = f"earlier message {i} ({role}) changed"
        elif len(msgs) < len(raw):
            detail = f"earlier messages vanished ({len(raw)} were sent last turn, {len(msgs)} now)"
        else:
            detail = "the model's reply to the previous turn was not appended"
        return Verdict(HistoryClass.HISTORY_REWRITTEN, detail, _FIX_REWRITTEN, msgs, raw=msgs)

    def _compare(
        self, sent: Mapping[str, Any], reply: AssistantReply
    ) -> tuple[HistoryClass, str, str, dict[str, Any] | None]:
        """``(class, detail, fix, repaired message or None)`` for the resent assistant message."""
        sent_calls = sent.get("tool_calls")
        # (no tool calls on either side, most turns: the same, without normalizing nothing)
        if (sent_calls or reply.tool_calls) and not _same_tool_calls(
            normalize_tool_calls(sent_calls), reply.tool_calls
        ):
            if not sent_calls:
                detail = "the tool calls the model made were dropped from the resent message"
            else:
                detail = "the resent tool calls differ from what the model returned"
            return HistoryClass.TOOL_CALLS_CHANGED, detail, _FIX_TOOLS, None
        content = sent.get("content")
        sent_text = content.strip() if isinstance(content, str) else _text_of(content)
        returned = (reply.content or "").strip()
        if sent_text == returned:
            if reply.reasoning is None:
                return HistoryClass.EXACT, "", "", None
            sent_reasoning = _sent_reasoning(sent)
            if sent_reasoning == reply.reasoning.strip():
                return HistoryClass.EXACT, "", "", None
            fld = reply.reasoning_field or REASONING_FIELDS[0]
            if sent_reasoning:
                return (
                    HistoryClass.CONTENT_EDITED,
                    f"the resent '{fld}' differs from what the model returned",
                    _FIX_EDITED,
                    None,
                )
            detail = f"the assistant message was resent without its '{fld}' field"
            fix = f"send the message back with its '{fld}' field, {_FIX_KEEP}"
            fixed = None
            if self.policy == "keep":
                fixed = dict(sent)
                fixed[fld] = reply.reasoning
            return HistoryClass.REASONING_STRIPPED, detail, fix, fixed
        think, rest = split_think(reply.content)
        if think is not None and sent_text == rest.strip():
            detail = "the <think>…</think> block was stripped from the resent assistant content"
            fix = f"send the content back unchanged, including its <think> block, {_FIX_KEEP}"
            fixed = None
            if self.policy == "keep":
                fixed = dict(sent)
                fixed["content"] = reply.content
            return HistoryClass.REASONING_STRIPPED, detail, fix, fixed
        if sent_text is _NON_TEXT:
            detail = "the resent assistant content is not plain text"
        else:
            detail = "the resent assistant content differs from what the model returned"
        return HistoryClass.CONTENT_EDITED, detail, _FIX_EDITED, None
