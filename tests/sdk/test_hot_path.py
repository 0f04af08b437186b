"""The SDK's per-call shortcuts on the request side: they must give exactly what the plain way gives.

Request bodies read incrementally (the history up to the previous turn's last message is not parsed
again), the conversation id spliced into the body bytes, requests changed in place, headers read in
one pass.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest
from fakes.openai_server import FakeOpenAIServer
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlease
from kvlease import HistoryClass, protocol
from kvlease._http import header_bytes, header_text, hx
from kvlease._json import loads_request
from kvlease._wire import inject_conversation_id

CID = "conv-1"
KEY = protocol.BODY_CONVERSATION_ID
USER = {"role": "user", "content": "hi"}


def _plain(body: bytes) -> tuple[str, Any]:
    try:
        return "ok", json.loads(body)
    except ValueError as e:
        return "error", type(e).__name__


def _ours(body: bytes, prev: Any = None) -> tuple[str, Any]:
    try:
        return "ok", loads_request(body, prev)[0]
    except ValueError as e:
        return "error", type(e).__name__


# ------------------------------------------------------------------------------ request bodies


@pytest.mark.parametrize(
    "body",
    [
        b"{}",
        b" { } ",
        b'{"messages":[]}',
        b'{"messages":[{"role":"user","content":"a"}],"model":"m"}',
        b' {\n "model" : "x" ,\t"messages" : [ 1 , 2 ] , "x" : [1, {"b": null}] }\r\n',
        '{"messages":[{"content":"\u00e9\u4e2d\U0001f600"}],"n":123456789012345678901234567890}'.encode(),
        b'{"a":NaN,"messages":[Infinity,-Infinity]}',
        b'{"messages":1,"messages":[2]}',
        b'{"messages":[2],"model":1,"messages":[3],"model":2}',
        b'{"a":"\\ud800"}',
        b"\xef\xbb\xbf" + b'{"a":1}',
        '{"messages":[1]}'.encode("utf-16"),
        b"[1,2]",
        b'"text"',
        b"",
        b"  ",
        b"\xff",
        b'{"a":1,}',
        b'{"a" 1}',
        b'{"a":1}x',
        b'{"messages":[1,],"a":2}',
        b'{"messages":[1]',
        b'{"messages":[1] "a":2}',
        b'{"a":"\x01"}',
        b"{a:1}",
        b'{"a":1 "b":2}',
        b'{"messages":[1 2]}',
    ],
)
def test_request_bodies_parse_like_json_loads(body: bytes) -> None:
    assert repr(_ours(body)) == repr(_plain(body))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": st.text()})
    | json_values,
    min_size=1,
    max_size=4,
)


@settings(max_examples=100, deadline=None)
@given(
    before=st.dictionaries(st.text(max_size=6).filter(lambda k: k != "messages"), json_values, max_size=2),
    after=st.dictionaries(st.text(max_size=6).filter(lambda k: k != "messages"), json_values, max_size=2),
    first=messages,
    added=messages,
    indent=st.sampled_from([None, 1]),
    ascii_only=st.booleans(),
    change_after=st.booleans(),
)
def test_a_growing_history_is_read_incrementally(
    before: dict[str, Any],
    after: dict[str, Any],
    first: list[Any],
    added: list[Any],
    indent: int | None,
    ascii_only: bool,
    change_after: bool,
) -> None:
    def body(msgs: list[Any], tail: dict[str, Any]) -> bytes:
        doc = {**before, "messages": msgs, **tail}
        return json.dumps(doc, indent=indent, ensure_ascii=ascii_only).encode()

    b1 = body(first, after)
    data1, prefix, reused = loads_request(b1)
    assert data1 == json.loads(b1) and list(data1) == list(json.loads(b1)) and reused == 0
    assert prefix is not None and prefix.messages == first
    tail = {**after, "zz": [1, 2]} if change_after else after
    b2 = body(first + added, tail)
    data2, prefix2, reused2 = loads_request(b2, prefix)
    assert data2 == json.loads(b2) and list(data2) == list(json.loads(b2))
    assert reused2 == len(first)
    assert data2["messages"][: len(first)] == prefix.messages
    assert prefix2 is not None and prefix2.messages == first + added
    # another body parses as itself; the same history without a new message is read in full
    for other in (body(first, after), body(added, after), b'{"messages":[]}'):
        assert loads_request(other, prefix)[0] == json.loads(other)
    assert loads_request(body(first, after), prefix)[2] == 0


def test_a_prefix_only_counts_when_a_new_message_follows_it() -> None:
    _, prefix, _ = loads_request(b'{"messages":[1,2]}')
    # "2" continued as "23": the same text, another number
    assert loads_request(b'{"messages":[1,23]}', prefix) == ({"messages": [1, 23]}, prefix_like([1, 23]), 0)
    data, _, reused = loads_request(b'{"messages":[1,2 ,3]}', prefix)
    assert data == {"messages": [1, 2, 3]} and reused == 2
    with pytest.raises(ValueError):
        loads_request(b'{"messages":[1,2,]}', prefix)
    with pytest.raises(ValueError):
        loads_request(b'{"messages":[1,2,3] x}', prefix)
    # a second "messages" key after the array wins, as in json.loads
    assert loads_request(b'{"messages":[1,2,3],"messages":[9]}', prefix)[0:3:2] == ({"messages": [9]}, 0)


@pytest.mark.parametrize(
    ("body", "reused"),
    [
        (b'{"messages":[1,2,3],"m":1}', 2),
        (b'{"messages":[1,2,3 ],"m":1}', 2),
        (b'{"messages":[1,2, 3,\n [4, {"a": "]"}] \n],"m":1}', 2),
        (b'{"messages":[1,2,"],\\"m\\":1"],"m":1}', 2),
        (b'{"messages":[1,2,"],"m":1"],"m":1}', None),
        (b'{"messages":[1,2,3],"m":1,"messages":[5],"m":1}', 0),
        (b'{"messages":[1,2,3]],"m":1}', None),
        (b'{"messages":[1,2,],"m":1}', None),
        (b'{"messages":[1,2,3,],"m":1}', None),
        (b'{"messages":[1,2,3 4],"m":1}', None),
        (b'{"messages":[1,2,],"x":[3],"m":1}', None),
        (b'{"messages":[1,2,3],"x":[4],"m":1}', 2),
        (b'{"messages":[1,2,NaN],"m":1}', 2),
    ],
)
def test_the_new_messages_of_a_turn_read_as_json_loads_reads_them(body: bytes, reused: int | None) -> None:
    """The common turn (a comma, the new messages, the same keys after them) is read as one array:
    the same data as ``json.loads``, and the same error where it fails."""
    _, prefix, _ = loads_request(b'{"messages":[1,2],"m":1}')
    assert repr(_ours(body, prefix)) == repr(_plain(body))
    if reused is not None:
        assert loads_request(body, prefix)[2] == reused


class prefix_like:
    """Compares equal to a BodyPrefix with these messages (test helper)."""

    def __init__(self, msgs: list[Any]) -> None:
        self.msgs = msgs

    def __eq__(self, other: object) -> bool:
        return getattr(other, "messages", None) == self.msgs


# ------------------------------------------------------------------------------ the id in the body


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"model":"m"}', b'{"conversation_id":"conv-1","model":"m"}'),
        (b"{}", b'{"conversation_id":"conv-1"}'),
        (b"{ }", b'{"conversation_id":"conv-1" }'),
        (b'{\n  "model": "m"\n}', b'{"conversation_id":"conv-1",\n  "model": "m"\n}'),
        (b'  \n{"a":1}', b'{"conversation_id":"conv-1","a":1}'),
        ('{"c":"\u00e9\u4e2d"}'.encode(), '{"conversation_id":"conv-1","c":"\u00e9\u4e2d"}'.encode()),
        (b'{"conversation_id":"other","a":1}', b'{"conversation_id":"other","a":1}'),  # kept
        (b"[1,2]", b"[1,2]"),
        (b"x{}", b"x{}"),
        (b"not json", b"not json"),
        (b"", b""),
    ],
)
def test_conversation_id_is_spliced_into_the_bytes(body: bytes, expected: bytes) -> None:
    out = inject_conversation_id(body, CID)
    assert out == expected
    if out != body:
        assert json.loads(out) == {KEY: CID, **json.loads(body)}
        assert next(iter(json.loads(out))) == KEY


@settings(max_examples=100, deadline=None)
@given(doc=st.dictionaries(st.text(max_size=6).filter(lambda k: k != KEY), json_values, max_size=4))
def test_spliced_bodies_are_the_same_json_plus_the_id(doc: dict[str, Any]) -> None:
    for body in (json.dumps(doc).encode(), json.dumps(doc, indent=2, ensure_ascii=False).encode()):
        out = json.loads(inject_conversation_id(body, CID))
        assert out == {KEY: CID, **doc} and list(out) == [KEY, *doc]


def test_the_id_goes_in_a_chat_body_that_only_mentions_the_key_nested(
    kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer
) -> None:
    """The parsed body's top level decides, not a byte search: a message whose text is the key's
    name (or a nested object with that key) does not stop the id from being added."""
    mention = {"role": "user", "content": KEY, "name": "u"}
    nested = {"role": "user", "content": [{"type": "text", "text": "x", KEY: "nested"}]}
    with kc.conversation() as conv:
        conv.chat.completions.create(model="m", messages=[mention])
        conv.chat.completions.create(model="m", messages=[nested])
    for rec in fake_server.completions():
        assert json.loads(rec.raw)[KEY] == conv.id


def test_a_body_the_caller_parsed_is_searched_no_further() -> None:
    body = b'{"messages":[],"model":"m"}'
    assert inject_conversation_id(body, CID, has_key=True) is body
    assert json.loads(inject_conversation_id(body, CID, has_key=False))[KEY] == CID
    nested = b'{"a":{"' + KEY.encode() + b'":"x"}}'
    assert inject_conversation_id(nested, CID) == nested  # unparsed: any occurrence keeps it as is
    assert json.loads(inject_conversation_id(nested, CID, has_key=False))[KEY] == CID


# ------------------------------------------------------------------------------ headers


def test_header_values_read_like_get() -> None:
    h = hx.Headers(
        [
            ("Authorization", "Bearer a"),
            ("X-Conversation-Id", "c1"),
            ("x-conversation-id", "c2"),
            ("X-Other", "\u00e9".encode()),
            ("X-Latin", b"\xe9"),
        ]
    )
    got = header_bytes(h)
    assert set(got) == {b"authorization", b"x-conversation-id", b"x-other", b"x-latin"}
    for key, value in got.items():
        assert header_text(value, h) == h.get(key.decode())
    assert header_bytes(hx.Headers({"A": "1"})) == {b"a": b"1"}
    # the public-API fallback (for an httpx without the lower-cased list) reads the same items
    from kvlease import _http

    assert _http._items_of(h) == _http._lowered_list(h)


# ------------------------------------------------------------------------------ over the wire


def test_sent_request_is_what_response_request_shows(
    kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer
) -> None:
    fake_server.reply = "reasoning_content"
    with kc.conversation() as conv, warnings.catch_warnings():
        warnings.simplefilter("ignore", kvlease.ReuseOffWarning)
        r = conv.chat.completions.with_raw_response.create(model="m", messages=[USER])
        msgs = [USER, {"role": "assistant", "content": r.parse().choices[0].message.content}, USER]
        r2 = conv.chat.completions.with_raw_response.create(model="m", messages=msgs)
    first, second = fake_server.completions()
    for raw, rec in ((r, first), (r2, second)):
        req = raw.http_request
        assert req.content == rec.raw  # the body as sent, id included
        assert req.headers["content-length"] == str(len(rec.raw))
        assert json.loads(rec.raw)[KEY] == conv.id
    assert second.header(protocol.HEADER_REUSE) == protocol.REUSE_OFF
    assert r2.http_request.headers[protocol.HEADER_REUSE] == protocol.REUSE_OFF


def test_long_conversation_reads_each_turn_incrementally(
    kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer
) -> None:
    with kc.conversation() as conv:
        msgs: list[Any] = [{"role": "system", "content": "s\u00e9"}]
        for turn in range(5):
            msgs.append({"role": "user", "content": f"q{turn}"})
            r = conv.chat.completions.create(model="m", messages=msgs, temperature=0.5)
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})
            state = kc._tracker.get(conv.id)
            assert state is not None and state.body_prefix is not None
            assert state.body_prefix.messages is state.detector._raw
        # a rewritten history after incremental turns is still caught
        with pytest.warns(kvlease.ReuseOffWarning, match="earlier message 1"):
            conv.chat.completions.create(
                model="m", messages=[msgs[0], USER, *msgs[2:], USER], temperature=0.5
            )
        hist = [t.history for t in conv.turns]
    assert hist == [HistoryClass.FIRST_TURN] + [HistoryClass.EXACT] * 4 + [HistoryClass.HISTORY_REWRITTEN]
    bodies = [json.loads(rec.raw) for rec in fake_server.completions()]
    assert all(b[KEY] == conv.id and b["temperature"] == 0.5 for b in bodies)


def test_streamed_request_bodies_pass_through(
    kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer
) -> None:
    """A request whose body is a stream (not read) is not a completion kvlease understands."""

    def gen() -> Any:
        yield b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'

    http = kc.openai._client
    req = http.build_request(
        "POST",
        fake_server.base_url + "/chat/completions",
        headers={protocol.HEADER_CONVERSATION_ID: "streamed-1", "content-type": "application/json"},
        content=gen(),
    )
    r = http.send(req)
    (rec,) = fake_server.completions()
    assert rec.header("transfer-encoding") == "chunked"  # sent as it was (the fake reads no chunks)
    assert r.status_code == 400 and kc.get_conversation("streamed-1") is None
