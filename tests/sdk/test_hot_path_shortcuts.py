"""Per-call shortcuts of the SDK (header lookups, URL targets, id splicing, lease updates, lookups
of ``conv.chat.completions.create``): each gives what the plain way gives, case by case."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

import kvlease
from kvlease import HistoryClass
from kvlease._http import header_bytes, header_text, hx
from kvlease._renewal import RenewalSchedule
from kvlease._strip import AssistantReply, StripDetector, ToolCall
from kvlease._transport import _target
from kvlease._wire import inject_conversation_id, parse_float

CID = "conv-1"


@pytest.mark.parametrize(
    "items",
    [
        [],
        [("A", "1")],
        [("X-Conversation-Id", "c1"), ("Authorization", "Bearer a")],
        [("X-Conversation-Id", "c1"), ("x-conversation-id", "c2"), ("X-CONVERSATION-ID", "c3")],
        [("Authorization", "a"), ("X-Other", "o"), ("authorization", "b")],
        [("X-Latin", b"\xe9"), ("x-latin", b"a")],
        [("X-Utf8", "\u00e9".encode()), ("Authorization", "")],
    ],
)
def test_header_values_are_what_get_returns(items: list[tuple[str, Any]]) -> None:
    h = hx.Headers(items)
    got = {name: header_text(value, h) for name, value in header_bytes(h).items()}
    assert got == {k.lower().encode(): h.get(k) for k, _ in items}


@pytest.mark.parametrize(
    ("url", "origin", "path"),
    [
        ("http://h:8000/v1/chat/completions", "http://h:8000", "/v1/chat/completions"),
        ("http://h:8000/v1/completions", "http://h:8000", "/v1/completions"),
        ("https://H.example/gw/v1/chat/completions?x=1", "https://h.example", "/gw/v1/chat/completions"),
        ("http://[::1]:9/p%20q", "http://[::1]:9", "/p q"),
        ("http://h", "http://h", "/"),
    ],
)
def test_request_targets_are_read_from_the_url(url: str, origin: str, path: str) -> None:
    u = hx.URL(url)
    assert _target(u) == (origin, path) == (f"{u.scheme}://{u.netloc.decode('ascii')}", u.path)


@pytest.mark.parametrize(
    "body",
    [b'{"a":1}', b'{"messages":[{"conversation_id":1}],"model":"m"}', b"{}", b' {"a":1}', b'{ "a":1}'],
)
def test_an_id_spliced_into_a_parsed_body_is_the_json_plus_the_id(body: bytes) -> None:
    out = inject_conversation_id(body, CID, has_key=False)
    assert out.lstrip().startswith(b'{"conversation_id":"conv-1"')
    assert json.loads(out) == {"conversation_id": CID, **json.loads(body)}
    assert inject_conversation_id(body, CID, has_key=True) == body


@pytest.mark.parametrize(
    ("text", "expected"),
    [("30", 30.0), (" 1.5 ", 1.5), ("0", 0.0), ("-2", -2.0), ("nan", None), ("inf", None)]
    + [("-inf", None), ("1e400", None), ("x", None), ("", None), (None, None)],
)
def test_ttl_header_values(text: str | None, expected: float | None) -> None:
    got = parse_float(text)
    assert got == expected and (got is None or math.isfinite(got))


def test_a_next_turn_updates_its_lease_in_place() -> None:
    table = RenewalSchedule(max_idle=100.0)
    table.activate("a", "r", 10.0, {"authorization": "x"}, 0.0, explicit=False)
    table.activate("b", "r", 10.0, {"authorization": "x"}, 1.0, explicit=True)
    table.activate("a", "r", 10.0, {"authorization": "y"}, 2.0, explicit=True)
    batches, idle = table.due(100.0, force=True)
    assert idle == [] and [b.conversation_ids for b in batches] == [("a", "b")]
    assert dict(batches[0].headers) == {"authorization": "y"}
    table.activate("a", "r", 10.0, {"authorization": "y"}, 150.0, explicit=True)
    # "b" was last active at 1.0, "a" at 150.0: only "b" is idle at 200
    batches, idle = table.due(200.0, force=True)
    assert [o.conversation_id for o in idle] == ["b"] and idle[0].explicit
    assert [b.conversation_ids for b in batches] == [("a",)]
    assert table.forget("a") is not None and table.forget("a") is None


REPLY = AssistantReply(content="done")
CALL = ToolCall("t1", "f", '{"x":1}')
TOOL_REPLY = AssistantReply(content=None, tool_calls=(CALL,))
CALL_MSG = {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}


@pytest.mark.parametrize(
    ("reply", "sent", "history"),
    [
        (REPLY, {"role": "assistant", "content": "done"}, HistoryClass.EXACT),
        (REPLY, {"role": "assistant", "content": " done\n"}, HistoryClass.EXACT),
        (REPLY, {"role": "assistant", "content": "done", "tool_calls": []}, HistoryClass.EXACT),
        (REPLY, {"role": "assistant", "content": "done", "tool_calls": None}, HistoryClass.EXACT),
        (REPLY, {"role": "assistant", "content": "done", "tool_calls": [1]}, HistoryClass.EXACT),
        (
            REPLY,
            {"role": "assistant", "content": "done", "tool_calls": [CALL_MSG]},
            HistoryClass.TOOL_CALLS_CHANGED,
        ),
        (REPLY, {"role": "assistant", "content": [{"type": "text", "text": "done"}]}, HistoryClass.EXACT),
        (REPLY, {"role": "assistant", "content": "Done"}, HistoryClass.CONTENT_EDITED),
        (REPLY, {"role": "assistant"}, HistoryClass.CONTENT_EDITED),
        (TOOL_REPLY, {"role": "assistant", "tool_calls": [CALL_MSG]}, HistoryClass.EXACT),
        (TOOL_REPLY, {"role": "assistant", "content": None}, HistoryClass.TOOL_CALLS_CHANGED),
        (TOOL_REPLY, {"role": "assistant", "tool_calls": []}, HistoryClass.TOOL_CALLS_CHANGED),
    ],
)
def test_resent_replies_are_classified(
    reply: AssistantReply, sent: dict[str, Any], history: HistoryClass
) -> None:
    det = StripDetector("warn")
    first = [{"role": "user", "content": "q"}]
    det.record(det.inspect(first), reply)
    verdict = det.inspect([*first, sent, {"role": "user", "content": "next"}])
    assert verdict.history is history
    assert verdict.reuse_off is history.breaks_prefix


def test_conversation_lookups_are_kept() -> None:
    from openai import OpenAI

    kc = kvlease.wrap(OpenAI(base_url="http://127.0.0.1:9/v1", api_key="k"), heartbeat=False)
    conv = kc.conversation()
    assert conv.chat is conv.chat
    assert conv.chat.completions is conv.chat.completions
    create = conv.chat.completions.create
    assert create is conv.chat.completions.create and create._cid == conv.id
    assert conv.completions is conv.completions
    assert repr(conv.chat).startswith(f"<conversation {conv.id!r}")
    kc.close()
