"""The SDK's strip detector on generated conversations (hypothesis).

A conversation of several turns is generated (user messages, assistant replies with content,
reasoning under either field name, ``<think>`` blocks, tool calls); every exact resend must be
``exact``, and one known mutation on the last turn must get the matching verdict.
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvlease._strip import AssistantReply, HistoryClass, StripDetector

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

words = st.text(alphabet="abcdefgh xyz.,!", min_size=1, max_size=30).filter(lambda s: s.strip() != "")


@st.composite
def replies(draw: st.DrawFn) -> dict[str, Any]:
    """A ``choices[0].message`` as a server returns it."""
    kind = draw(st.sampled_from(["plain", "reasoning", "think", "tools"]))
    msg: dict[str, Any] = {"role": "assistant", "content": draw(words)}
    if kind == "reasoning":
        msg[draw(st.sampled_from(["reasoning", "reasoning_content"]))] = draw(words)
    elif kind == "think":
        msg["content"] = f"<think>{draw(words)}</think>{msg['content']}"
    elif kind == "tools":
        msg["content"] = draw(st.sampled_from([None, "", msg["content"]]))
        msg["tool_calls"] = [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {
                    "name": draw(st.sampled_from(["search", "read", "run"])),
                    "arguments": draw(words),
                },
            }
            for i in range(draw(st.integers(1, 3)))
        ]
    return msg


def resend(reply: dict[str, Any]) -> dict[str, Any]:
    """How a careful client appends the reply: the same fields, as returned."""
    return copy.deepcopy(reply)


@st.composite
def conversations(draw: st.DrawFn) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(user messages, replies), one pair per turn."""
    n = draw(st.integers(1, 4))
    users = [{"role": "user", "content": draw(words)} for _ in range(n)]
    if draw(st.booleans()):
        users[0] = {"role": "system", "content": "sys"}
        users.insert(1, {"role": "user", "content": draw(words)})
        users = users[: n + 1]
    return users, [draw(replies()) for _ in users]


def play(
    det: StripDetector, users: list[dict[str, Any]], answers: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Run the conversation exactly; return the history before the next user message."""
    history: list[dict[str, Any]] = []
    for i, (user, reply) in enumerate(zip(users, answers)):
        history = [*history, user]
        v = det.inspect(history)
        assert v.history is (HistoryClass.FIRST_TURN if i == 0 else HistoryClass.EXACT), (i, v)
        assert not v.reuse_off
        det.record(v, AssistantReply.from_message(reply))
        history = [*history, resend(reply)]
    return history


@SETTINGS
@given(conv=conversations(), pad=st.sampled_from(["", " ", "\n", "  \n"]))
def test_exact_resends_are_exact(conv: tuple[list[dict[str, Any]], list[dict[str, Any]]], pad: str) -> None:
    users, answers = conv
    det = StripDetector()
    history = play(det, users, answers)
    last = dict(history[-1])
    if isinstance(last.get("content"), str):
        last["content"] = pad + last["content"] + pad  # templates trim: still exact
    elif last.get("content") is None:
        last["content"] = ""  # None and "" are alike
    v = det.inspect([*history[:-1], last, {"role": "user", "content": "next"}])
    assert v.history is HistoryClass.EXACT and not v.reuse_off


MUTATIONS = [
    "strip_reasoning",
    "edit_content",
    "change_tool_call",
    "drop_tool_calls",
    "alter_earlier",
    "drop_earlier",
    "omit_reply",
]
EXPECTED = {
    "strip_reasoning": HistoryClass.REASONING_STRIPPED,
    "edit_content": HistoryClass.CONTENT_EDITED,
    "change_tool_call": HistoryClass.TOOL_CALLS_CHANGED,
    "drop_tool_calls": HistoryClass.TOOL_CALLS_CHANGED,
    "alter_earlier": HistoryClass.HISTORY_REWRITTEN,
    "drop_earlier": HistoryClass.HISTORY_REWRITTEN,
    "omit_reply": HistoryClass.HISTORY_REWRITTEN,
}


def mutate(history: list[dict[str, Any]], mutation: str, index: int) -> list[dict[str, Any]] | None:
    """Apply one mutation to the history (last message = the latest reply); None if not applicable."""
    out = copy.deepcopy(history)
    last = out[-1]
    if mutation == "strip_reasoning":
        fields = [f for f in ("reasoning", "reasoning_content") if f in last]
        if fields:
            del last[fields[0]]
        elif isinstance(last.get("content"), str) and "</think>" in last["content"]:
            last["content"] = last["content"].split("</think>", 1)[1]
        else:
            return None
    elif mutation == "edit_content":
        if last.get("tool_calls"):
            return None
        last["content"] = (last.get("content") or "") + " (edited)"
    elif mutation == "change_tool_call":
        if not last.get("tool_calls"):
            return None
        call = last["tool_calls"][index % len(last["tool_calls"])]
        part = ["id", "name", "arguments"][index % 3]
        if part == "id":
            call["id"] += "x"
        else:
            call["function"][part] += "x"
    elif mutation == "drop_tool_calls":
        if not last.get("tool_calls"):
            return None
        del last["tool_calls"]
    elif mutation in ("alter_earlier", "drop_earlier"):
        if len(out) < 3:
            return None
        i = index % (len(out) - 1)
        if mutation == "drop_earlier":
            del out[i]
        else:
            out[i] = {**out[i], "content": str(out[i].get("content")) + " (rewritten)"}
    elif mutation == "omit_reply":
        out = out[:-1]
    return out


@SETTINGS
@given(conv=conversations(), mutation=st.sampled_from(MUTATIONS), index=st.integers(0, 50))
def test_each_mutation_gets_its_verdict(
    conv: tuple[list[dict[str, Any]], list[dict[str, Any]]], mutation: str, index: int
) -> None:
    users, answers = conv
    det = StripDetector()
    history = play(det, users, answers)
    mutated = mutate(history, mutation, index)
    assume(mutated is not None)
    assert mutated is not None
    v = det.inspect([*mutated, {"role": "user", "content": "next"}])
    assert v.history is EXPECTED[mutation], (mutation, v.history, v.detail)
    assert v.reuse_off and v.detail and v.fix


@SETTINGS
@given(conv=conversations(), more=st.integers(1, 3))
def test_keep_policy_repairs_stripped_reasoning_for_good(
    conv: tuple[list[dict[str, Any]], list[dict[str, Any]]], more: int
) -> None:
    """Under ``keep`` a client that always strips reasoning still sends an exact history."""
    users, answers = conv
    assume(any("reasoning" in a or "reasoning_content" in a for a in answers))
    det = StripDetector(policy="keep")
    sent: list[dict[str, Any]] = []  # what the careless client keeps (reasoning stripped)
    for i, (user, reply) in enumerate(zip(users, answers)):
        sent = [*sent, user]
        v = det.inspect(sent)
        assert not v.reuse_off, (i, v.history)
        # the repaired messages carry every reasoning the model returned so far
        for earlier in answers[:i]:
            for f in ("reasoning", "reasoning_content"):
                if f in earlier:
                    assert any(m.get(f) == earlier[f] for m in v.messages)
        det.record(v, AssistantReply.from_message(reply))
        stripped = {k: v2 for k, v2 in reply.items() if k not in ("reasoning", "reasoning_content")}
        sent = [*sent, stripped]
    for j in range(more):
        sent = [*sent, {"role": "user", "content": f"more {j}"}]
        v = det.inspect(sent)
        assert not v.reuse_off
        det.record(v, AssistantReply.from_message({"role": "assistant", "content": f"ok {j}"}))
        sent = [*sent, {"role": "assistant", "content": f"ok {j}"}]
