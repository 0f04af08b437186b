"""The strip detector, table-driven: what came back, what was resent, what the verdict is."""

from __future__ import annotations

from typing import Any

import pytest

from kvlease import AssistantReply, HistoryClass, StripDetector, ToolCall
from kvlease._strip import split_think

H = HistoryClass
USER1 = {"role": "user", "content": "What is the weather in Paris?"}
USER2 = {"role": "user", "content": "And tomorrow?"}
SYSTEM = {"role": "system", "content": "You are terse."}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
IMAGE_USER = {
    "role": "user",
    "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ],
}

# What the server returned on turn 1 (choice 0 message).
PLAIN = {"role": "assistant", "content": "Sunny, 21 C."}
QWEN_THINK = {"role": "assistant", "content": "<think>\nThe user asks about Paris.\n</think>\n\nSunny, 21 C."}
R1_THINK = {
    "role": "assistant",
    "content": "The user asks about Paris.\n</think>\n\nSunny, 21 C.",
}  # no opening tag
REASONING_CONTENT = {"role": "assistant", "content": "Sunny, 21 C.", "reasoning_content": "The user asks."}
REASONING = {"role": "assistant", "content": "Sunny, 21 C.", "reasoning": "The user asks."}
TOOLS = {"role": "assistant", "content": None, "tool_calls": [CALL]}


def _a(**fields: Any) -> dict[str, Any]:
    return {"role": "assistant", **fields}


# (name, returned message, resent assistant message, expected class, [keep policy: repaired message or None])
CASES: list[tuple[str, dict[str, Any], dict[str, Any], HistoryClass, dict[str, Any] | None]] = [
    ("plain exact", PLAIN, _a(content="Sunny, 21 C."), H.EXACT, None),
    ("plain trailing whitespace", PLAIN, _a(content="Sunny, 21 C.\n"), H.EXACT, None),
    ("plain edited", PLAIN, _a(content="Rainy."), H.CONTENT_EDITED, None),
    ("plain as text parts", PLAIN, _a(content=[{"type": "text", "text": "Sunny, 21 C."}]), H.EXACT, None),
    (
        "plain as split text parts",
        PLAIN,
        _a(content=[{"type": "text", "text": "Sunny, "}, {"type": "text", "text": "21 C."}]),
        H.EXACT,
        None,
    ),
    (
        "assistant content with an image part",
        PLAIN,
        _a(
            content=[
                {"type": "text", "text": "Sunny, 21 C."},
                {"type": "image_url", "image_url": {"url": "x"}},
            ]
        ),
        H.CONTENT_EDITED,
        None,
    ),
    ("qwen3 <think> kept", QWEN_THINK, _a(content=QWEN_THINK["content"]), H.EXACT, None),
    ("qwen3 <think> stripped", QWEN_THINK, _a(content="Sunny, 21 C."), H.REASONING_STRIPPED, QWEN_THINK),
    ("qwen3 <think> stripped, content edited", QWEN_THINK, _a(content="Cloudy."), H.CONTENT_EDITED, None),
    (
        "deepseek-r1 </think> only, stripped",
        R1_THINK,
        _a(content="Sunny, 21 C."),
        H.REASONING_STRIPPED,
        R1_THINK,
    ),
    ("deepseek-r1 </think> only, kept", R1_THINK, _a(content=R1_THINK["content"]), H.EXACT, None),
    ("reasoning_content kept", REASONING_CONTENT, dict(REASONING_CONTENT), H.EXACT, None),
    (
        "reasoning_content stripped",
        REASONING_CONTENT,
        _a(content="Sunny, 21 C."),
        H.REASONING_STRIPPED,
        REASONING_CONTENT,
    ),
    (
        "reasoning_content edited",
        REASONING_CONTENT,
        _a(content="Sunny, 21 C.", reasoning_content="Other."),
        H.CONTENT_EDITED,
        None,
    ),
    ("reasoning kept", REASONING, dict(REASONING), H.EXACT, None),
    ("reasoning stripped", REASONING, _a(content="Sunny, 21 C."), H.REASONING_STRIPPED, REASONING),
    (
        "reasoning sent as reasoning_content",
        REASONING,
        _a(content="Sunny, 21 C.", reasoning_content="The user asks."),
        H.EXACT,
        None,
    ),
    ("tool calls exact", TOOLS, _a(content=None, tool_calls=[CALL]), H.EXACT, None),
    ("tool calls exact, empty content", TOOLS, _a(content="", tool_calls=[CALL]), H.EXACT, None),
    ("tool calls dropped", TOOLS, _a(content=""), H.TOOL_CALLS_CHANGED, None),
    (
        # vLLM parses the arguments and the template re-dumps them: the same prompt tokens
        "tool call arguments re-serialized compactly",
        TOOLS,
        _a(
            content=None,
            tool_calls=[{**CALL, "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}],
        ),
        H.EXACT,
        None,
    ),
    (
        "tool call arguments changed",
        TOOLS,
        _a(
            content=None,
            tool_calls=[{**CALL, "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}],
        ),
        H.TOOL_CALLS_CHANGED,
        None,
    ),
    (
        "tool call id changed",
        TOOLS,
        _a(content=None, tool_calls=[{**CALL, "id": "call_9"}]),
        H.TOOL_CALLS_CHANGED,
        None,
    ),
]


@pytest.mark.parametrize(
    ("name", "returned", "resent", "expected", "repaired"), CASES, ids=[c[0] for c in CASES]
)
@pytest.mark.parametrize("first_user", [USER1, IMAGE_USER], ids=["text", "multimodal"])
def test_classify_resent_assistant_message(
    name: str,
    returned: dict[str, Any],
    resent: dict[str, Any],
    expected: HistoryClass,
    repaired: dict[str, Any] | None,
    first_user: dict[str, Any],
) -> None:
    for policy in ("warn", "keep"):
        det = StripDetector(policy)  # type: ignore[arg-type]
        turn1 = [SYSTEM, first_user]
        v1 = det.inspect(turn1)
        assert v1.history is H.FIRST_TURN and not v1.reuse_off
        det.record(v1, AssistantReply.from_message(returned))
        turn2 = [*turn1, resent, USER2]
        v2 = det.inspect(turn2)
        assert v2.history is expected, (policy, v2.detail)
        assert v2.reuse_off == (expected is not H.EXACT and not (policy == "keep" and repaired is not None))
        if expected is not H.EXACT:
            assert v2.detail and v2.fix
        if policy == "keep" and repaired is not None:
            assert v2.repaired and v2.reattached
            sent = v2.messages[2]
            for key in ("content", "reasoning", "reasoning_content"):
                if key in repaired:
                    assert sent[key] == repaired[key]
            assert v2.messages[:2] == turn1 and v2.messages[3:] == [USER2]
        else:
            assert not v2.repaired
            assert v2.messages == turn2


def test_keep_repairs_every_later_turn_and_stays_exact() -> None:
    det = StripDetector("keep")
    msgs: list[Any] = [USER1]
    det.record(det.inspect(msgs), AssistantReply.from_message(REASONING_CONTENT))
    msgs = [USER1, _a(content="Sunny, 21 C."), USER2]  # the client strips reasoning_content
    v2 = det.inspect(msgs)
    assert v2.history is H.REASONING_STRIPPED and v2.reattached
    assert v2.messages[1]["reasoning_content"] == "The user asks."
    det.record(v2, AssistantReply.from_message(PLAIN))
    # turn 3: the user's history still lacks reasoning on turn 1; the wire keeps the repair
    msgs3 = [*msgs, _a(content="Sunny, 21 C."), {"role": "user", "content": "Thanks"}]
    v3 = det.inspect(msgs3)
    assert v3.history is H.EXACT and not v3.reuse_off
    assert v3.repaired and not v3.reattached
    assert v3.messages[1]["reasoning_content"] == "The user asks."
    assert v3.messages[2:] == msgs3[2:]
    assert v3.raw == msgs3


@pytest.mark.parametrize(
    ("name", "turn2", "detail"),
    [
        (
            "earlier user message edited",
            [{"role": "user", "content": "Weather in Rome?"}, PLAIN, USER2],
            "changed",
        ),
        ("earlier message vanished", [PLAIN, USER2], "changed"),
        ("history truncated", [], "vanished"),
        ("reply not appended", [SYSTEM, USER1, USER2], "missing"),
        ("same request again (regenerate)", [SYSTEM, USER1], "not appended"),
    ],
)
def test_history_rewritten(name: str, turn2: list[Any], detail: str) -> None:
    det = StripDetector()
    det.record(det.inspect([SYSTEM, USER1]), AssistantReply.from_message(PLAIN))
    msgs = turn2 if not turn2 or turn2[0] is SYSTEM else [SYSTEM, *turn2]
    v = det.inspect(msgs)
    assert v.history is H.HISTORY_REWRITTEN and v.reuse_off
    assert detail in v.detail


def test_unknown_reply_does_not_force_reuse_off() -> None:
    det = StripDetector()
    det.record(det.inspect([USER1]), None)  # e.g. an abandoned stream
    v = det.inspect([USER1, _a(content="partial"), USER2])
    assert v.history is H.UNKNOWN and not v.reuse_off


def test_tool_loop_with_tool_result_messages() -> None:
    det = StripDetector()
    det.record(det.inspect([USER1]), AssistantReply.from_message(TOOLS))
    msgs = [USER1, _a(content=None, tool_calls=[CALL]), TOOL_RESULT]
    v = det.inspect(msgs)
    assert v.history is H.EXACT
    det.record(v, AssistantReply.from_message(PLAIN))
    v3 = det.inspect([*msgs, _a(content="Sunny, 21 C."), USER2])
    assert v3.history is H.EXACT


@pytest.mark.parametrize(
    ("content", "reasoning", "rest"),
    [
        ("<think>R</think>C", "R", "C"),
        ("  <think>R</think>\n\nC", "R", "\n\nC"),
        ("R</think>C", "R", "C"),
        ("no think here", None, "no think here"),
        ("text <think>R</think>C", None, "text <think>R</think>C"),
        ("", None, ""),
        (None, None, ""),
    ],
)
def test_split_think(content: str | None, reasoning: str | None, rest: str) -> None:
    assert split_think(content) == (reasoning, rest)


def test_reply_from_message_prefers_reasoning_and_parses_tool_calls() -> None:
    r = AssistantReply.from_message({"content": "c", "reasoning": "r", "tool_calls": [CALL, "junk"]})
    assert r.reasoning == "r" and r.reasoning_field == "reasoning"
    assert r.tool_calls == (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)


def test_bad_policy_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="reasoning policy"):
        StripDetector("strip")  # type: ignore[arg-type]


def test_known_prefix_skips_only_the_recorded_history() -> None:
    det = StripDetector()
    v1 = det.inspect([USER1])
    det.record(v1, AssistantReply(content="ok"))
    msgs = [USER1, {"role": "assistant", "content": "ok"}, USER1]
    assert det.inspect(msgs, known_prefix=v1.raw).history is HistoryClass.EXACT
    # a list that is not the recorded history is no promise: compared as usual
    changed = [{"role": "user", "content": "other"}, *msgs[1:]]
    assert det.inspect(changed, known_prefix=[USER1]).history is HistoryClass.HISTORY_REWRITTEN
