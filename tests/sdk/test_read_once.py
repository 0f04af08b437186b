"""A non-streamed call's body is observed once, after the caller's client read it (no wrapper on
its stream); a conversation's completion requests carry the id in openai's own body; turns are
built when first read."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from openai import OpenAI

import kvlease
from kvlease import HistoryClass, protocol
from kvlease._http import hx

USER = {"role": "user", "content": "hi"}


def _reply(content: str = "ok") -> dict[str, Any]:
    return {
        "id": "c",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }


class Upstream:
    """What the router answers (a MockTransport handler); records the requests."""

    def __init__(self, answer: Callable[[int], hx.Response]) -> None:
        self.answer = answer
        self.requests: list[hx.Request] = []

    def __call__(self, request: hx.Request) -> hx.Response:
        self.requests.append(request)
        return self.answer(len(self.requests))


def _wrapped(upstream: Upstream, **options: Any) -> kvlease.KVLeaseClient:
    inner = hx.Client(transport=hx.MockTransport(upstream))
    client = OpenAI(base_url="http://router/v1", api_key="k", max_retries=0, http_client=inner)
    return kvlease.wrap(client, heartbeat=False, **options)


def _json_answer(headers: dict[str, str] | None = None, body: bytes | None = None) -> hx.Response:
    data = json.dumps(_reply()).encode() if body is None else body
    return hx.Response(
        200, headers={"content-type": "application/json", **(headers or {})}, content=iter([data])
    )


def _two_turns(kc: kvlease.KVLeaseClient) -> kvlease.Conversation:
    conv = kc.conversation()
    conv.chat.completions.create(model="m", messages=[USER])
    conv.chat.completions.create(model="m", messages=[USER, {"role": "assistant", "content": "ok"}, USER])
    return conv


def test_a_compressed_body_is_read_for_the_next_turn() -> None:
    """The body the caller's client decoded (gzip here) is what the turn's reply is read from."""
    packed = gzip.compress(json.dumps(_reply()).encode())
    upstream = Upstream(
        lambda n: _json_answer({"content-encoding": "gzip", protocol.HEADER_TTL: "30"}, packed)
    )
    with _wrapped(upstream) as kc:
        conv = _two_turns(kc)
        assert [t.history for t in conv.turns] == [HistoryClass.FIRST_TURN, HistoryClass.EXACT]
        assert conv.turns[0].prompt_tokens == 3 and conv.turns[0].completion_tokens == 1
        assert conv.turns[0].stream is False


def test_an_event_stream_answering_a_plain_request_is_read_whole() -> None:
    """A server that streams although no stream was asked for: the turn is read from the events."""
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "o"}}]},
        {"choices": [{"index": 0, "delta": {"content": "k"}, "finish_reason": "stop"}]},
    ]
    sse = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    upstream = Upstream(
        lambda n: hx.Response(200, headers={"content-type": "text/event-stream"}, content=iter([sse]))
    )
    with _wrapped(upstream) as kc:
        headers = {protocol.HEADER_CONVERSATION_ID: "plain-1"}
        body = {"model": "m", "messages": [USER]}
        r = kc.http_client.post("http://router/v1/chat/completions", json=body, headers=headers)
        assert r.content == sse  # the caller reads what the server sent
        conv = kc.get_conversation("plain-1")
        assert conv is not None and conv.turns[0].stream is True
        body["messages"] = [USER, {"role": "assistant", "content": "ok"}, USER]
        kc.http_client.post("http://router/v1/chat/completions", json=body, headers=headers)
        assert conv.turns[1].history is HistoryClass.EXACT


def test_a_body_that_breaks_off_records_the_turn_with_no_reply() -> None:
    """The read fails part-way: the caller gets the error, the turn is recorded, and the next turn
    cannot be compared (unknown), rather than compared with half a reply."""

    def broken() -> Iterator[bytes]:
        yield json.dumps(_reply())[:40].encode()
        raise hx.ReadError("connection reset")

    upstream = Upstream(
        lambda n: (
            hx.Response(200, headers={"content-type": "application/json"}, content=broken())
            if n == 1
            else _json_answer()
        )
    )
    with _wrapped(upstream) as kc, kc.conversation() as conv:
        with pytest.raises(openai.APIConnectionError):
            conv.chat.completions.create(model="m", messages=[USER])
        assert len(conv.turns) == 1 and conv.turns[0].prompt_tokens is None
        conv.chat.completions.create(model="m", messages=[USER, {"role": "assistant", "content": "ok"}, USER])
        assert conv.turns[1].history is HistoryClass.UNKNOWN


@pytest.mark.filterwarnings("ignore::kvlease.ReuseOffWarning")  # (the same message, resent)
def test_the_id_travels_in_openais_own_body() -> None:
    """A conversation's completion requests carry ``conversation_id`` as openai serialized it (the
    caller's own ``extra_body`` kept, a ``conversation_id`` of its own winning); other methods of
    the same resource get no body."""
    upstream = Upstream(lambda n: _json_answer())
    with _wrapped(upstream) as kc, kc.conversation() as conv:
        conv.chat.completions.create(model="m", messages=[USER])
        conv.chat.completions.create(model="m", messages=[USER], extra_body={"top_k": 3})
        conv.chat.completions.with_raw_response.create(model="m", messages=[USER])
        conv.chat.completions.create(model="m", messages=[USER], extra_body={"conversation_id": "mine"})
        bodies = [json.loads(r.content) for r in upstream.requests]
        assert [b[protocol.BODY_CONVERSATION_ID] for b in bodies] == [conv.id, conv.id, conv.id, "mine"]
        assert bodies[1]["top_k"] == 3
        assert all(r.headers[protocol.HEADER_CONVERSATION_ID] == conv.id for r in upstream.requests)
        upstream.answer = lambda n: hx.Response(200, json={"object": "list", "data": [], "has_more": False})
        conv.chat.completions.list()
        assert upstream.requests[-1].method == "GET" and upstream.requests[-1].content == b""
        assert upstream.requests[-1].headers[protocol.HEADER_CONVERSATION_ID] == conv.id


def test_turns_are_built_once_and_a_turn_log_gets_each_as_it_ends(tmp_path: Any) -> None:
    upstream = Upstream(lambda n: _json_answer({protocol.HEADER_TTL: "30", protocol.HEADER_STATUS: "hit"}))
    with _wrapped(upstream) as kc:
        conv = _two_turns(kc)
        first = conv.turns
        assert [t.index for t in first] == [0, 1] and first[1].gap_s is not None and first[1].gap_s >= 0
        assert all(a is b for a, b in zip(first, conv.turns))  # the same objects on every read
        assert first[1].status is protocol.ReuseStatus.HIT and first[1].ttl_s == 30.0
        assert conv.reuse_off_turns == 0 and conv.last_history is HistoryClass.EXACT
    log = kvlease.TurnLog(tmp_path / "turns.jsonl")
    with _wrapped(Upstream(lambda n: _json_answer()), turn_log=log) as kc:
        conv = _two_turns(kc)
        assert [json.loads(line)["turn"] for line in (tmp_path / "turns.jsonl").read_text().splitlines()] == [
            0,
            1,
        ]
