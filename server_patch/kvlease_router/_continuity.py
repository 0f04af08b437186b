"""Message-level continuity for stock vLLM (sans-IO).

Stock ``NixlConnector`` pulls D's blocks *by length*: if the new prompt is not a token-exact
extension of what D holds, the answer is silently wrong. Without the kvlease connector's token
hashes, the router offers a handle only when the new request extends the previous request's
messages plus the returned assistant message exactly (after a canonical form that ignores
``None``-valued fields). A returned message that carried reasoning is never offered (chat templates
usually drop reasoning from history, so D's tokens cannot match). This is necessary, not sufficient
(BPE re-tokenization can still differ); the kvlease connector's verified pull closes that gap.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from kvlease.protocol import REASONING_FIELDS

__all__ = ["Continuity", "chat_continuity", "chat_extends", "completion_continuity", "completion_extends"]

_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


@dataclass(frozen=True)
class Continuity:
    digest: str
    prefix_len: int


def _canon_tool_calls(calls: object) -> object:
    if not isinstance(calls, list):
        return calls
    out = []
    for c in calls:
        if isinstance(c, Mapping):
            fn = c.get("function")
            fn_out = (
                {"name": fn.get("name"), "arguments": fn.get("arguments")} if isinstance(fn, Mapping) else fn
            )
            out.append({"id": c.get("id"), "type": c.get("type") or "function", "function": fn_out})
        else:
            out.append(c)
    return out


def _canon_message(m: object) -> dict[str, Any] | None:
    if not isinstance(m, Mapping):
        return None
    out: dict[str, Any] = {}
    for k in _MESSAGE_KEYS:
        v = m.get(k)
        if v is None or v == "" or v == []:
            continue
        out[k] = _canon_tool_calls(v) if k == "tool_calls" else v
    return out


def _digest_messages(messages: Sequence[object]) -> str | None:
    canon = []
    for m in messages:
        c = _canon_message(m)
        if c is None:
            return None
        canon.append(c)
    try:
        raw = orjson.dumps(canon, option=orjson.OPT_SORT_KEYS)
    except (TypeError, orjson.JSONEncodeError):
        return None
    return hashlib.sha256(raw).hexdigest()


def chat_continuity(messages: object, returned: object) -> Continuity | None:
    """What D holds after a chat turn: the request's messages plus the returned assistant message.
    ``None`` when it cannot be checked later (malformed input, reasoning in the answer)."""
    if not isinstance(messages, list) or not isinstance(returned, Mapping):
        return None
    if any(returned.get(k) for k in REASONING_FIELDS):
        return None
    assistant = dict(returned)
    assistant.setdefault("role", "assistant")
    digest = _digest_messages([*messages, assistant])
    return None if digest is None else Continuity(digest, len(messages) + 1)


def chat_extends(messages: object, held: Continuity) -> bool:
    """True when ``messages`` starts with exactly what D holds and adds at least one message."""
    if not isinstance(messages, list) or len(messages) <= held.prefix_len:
        return False
    return _digest_messages(messages[: held.prefix_len]) == held.digest


def _prompt_text(prompt: object) -> str | None:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    return None


def _digest_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def completion_continuity(prompt: object, returned_text: object) -> Continuity | None:
    text = _prompt_text(prompt)
    if text is None or not isinstance(returned_text, str):
        return None
    held = text + returned_text
    return Continuity(_digest_text(held), len(held))


def completion_extends(prompt: object, held: Continuity) -> bool:
    text = _prompt_text(prompt)
    if text is None or len(text) <= held.prefix_len:
        return False
    return _digest_text(text[: held.prefix_len]) == held.digest
