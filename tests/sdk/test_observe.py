"""The response observer: JSON and SSE bodies, fed in arbitrary chunks, read once and incrementally."""

from __future__ import annotations

import gzip
import itertools
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlease import AssistantReply, ToolCall
from kvlease._observe import ResponseObserver


def _sse(events: list[dict[str, Any]], *, crlf: bool = False) -> bytes:
    sep = b"\r\n\r\n" if crlf else b"\n\n"
    return b"".join(b"data: " + json.dumps(e).encode() + sep for e in events) + b"data: [DONE]" + sep


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


STREAM = [
    _chunk({"role": "assistant", "content": ""}),
    _chunk({"reasoning_content": "Think"}),
    _chunk({"reasoning_content": "ing."}),
    _chunk({"content": "Hello"}),
    {"choices": [{"index": 1, "delta": {"content": "OTHER CHOICE"}, "finish_reason": None}]},
    _chunk({"content": " world"}),
    _chunk(
        {
            "tool_calls": [
                {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}
            ]
        }
    ),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]}),
    _chunk({}, "stop"),
    {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 7}},
]


def _feed_split(obs: ResponseObserver, body: bytes, cuts: list[int]) -> None:
    points = sorted({c % (len(body) + 1) for c in cuts})
    prev = 0
    for i, p in enumerate([*points, len(body)]):
        obs.feed(body[prev:p], float(i))
        prev = p


@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=40), crlf=st.booleans())
def test_sse_any_chunking_gives_the_same_reply(cuts: list[int], crlf: bool) -> None:
    obs = ResponseObserver(sse=True)
    _feed_split(obs, _sse(STREAM, crlf=crlf), cuts)
    out = obs.result()
    assert out.reply is not None
    assert out.reply.content == "Hello world"
    assert out.reply.reasoning == "Thinking." and out.reply.reasoning_field == "reasoning_content"
    assert out.reply.tool_calls == (ToolCall("c1", "f", '{"a": 1}'),)
    assert (out.prompt_tokens, out.completion_tokens) == (11, 7)
    assert out.first_token_at is not None


def test_sse_first_token_time_is_the_first_generated_piece() -> None:
    obs = ResponseObserver(sse=True)
    events = [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "A"}), _chunk({}, "stop")]
    for t, e in enumerate(events):
        obs.feed(b"data: " + json.dumps(e).encode() + b"\n\n", 10.0 + t)
    assert obs.result().first_token_at == 11.0


def test_sse_abandoned_stream_has_no_reply() -> None:
    obs = ResponseObserver(sse=True)
    obs.feed(_sse(STREAM[:4])[:-20], 1.0)
    body = _sse(STREAM[:4])
    obs2 = ResponseObserver(sse=True)
    obs2.feed(body[: body.index(b"[DONE]") - 6], 1.0)
    assert obs.result().reply is None and obs2.result().reply is None
    assert obs2.result().first_token_at == 1.0


def test_sse_garbage_events_are_ignored() -> None:
    obs = ResponseObserver(sse=True)
    obs.feed(b": comment\n\nevent: x\ndata: {not json\n\ndata: [1, 2]\n\n", 1.0)
    obs.feed(_sse([_chunk({"content": "ok"}, "stop")]), 2.0)
    out = obs.result()
    assert out.reply is not None and out.reply.content == "ok"


def test_legacy_completions_stream_and_json() -> None:
    obs = ResponseObserver(sse=True)
    events = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in ("a", "b")]
    obs.feed(_sse(events), 1.0)
    assert obs.result().reply is not None and obs.result().reply.content == "ab"  # type: ignore[union-attr]
    js = ResponseObserver(sse=False)
    js.feed(
        json.dumps({"choices": [{"index": 0, "text": "xyz"}], "usage": {"prompt_tokens": 3}}).encode(), 5.0
    )
    out = js.result()
    assert out.reply is not None and out.reply.content == "xyz" and out.prompt_tokens == 3


@pytest.mark.parametrize("encoding", [None, "gzip"])
def test_json_body_in_pieces(encoding: str | None) -> None:
    body = json.dumps(
        {
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "<think>r</think>c", "tool_calls": None},
                }
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2},
        }
    ).encode()
    if encoding == "gzip":
        body = gzip.compress(body)
    obs = ResponseObserver(sse=False, content_encoding=encoding)
    for i in range(0, len(body), 7):
        obs.feed(body[i : i + 7], 3.0)
    out = obs.result()
    assert out.reply is not None and out.reply.content == "<think>r</think>c"
    assert (out.prompt_tokens, out.completion_tokens, out.first_token_at) == (5, 2, 3.0)


def test_unknown_encoding_and_bad_json_yield_no_reply() -> None:
    br = ResponseObserver(sse=True, content_encoding="br")
    br.feed(b"\x8b\x00garbage", 1.0)
    assert br.result().reply is None and br.result().first_token_at == 1.0
    bad = ResponseObserver(sse=False)
    bad.feed(b"{oops", 1.0)
    assert bad.result().reply is None


def test_hot_path_json_accepts_what_the_standard_library_accepts() -> None:
    import math

    from kvlease import _json

    assert _json.loads(b'{"a": [1, "\\u00e9"]}') == {"a": [1, "\u00e9"]}
    assert math.isnan(_json.loads(b'{"x": NaN}')["x"])  # orjson refuses it; json does not
    with pytest.raises(ValueError):
        _json.loads(b"{not json")


def _sse_body() -> bytes:
    events = [{"choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]} for w in "abc"]
    events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    events.append({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}})
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("encoding", [None, "gzip"])
def test_sse_read_after_the_first_token_gives_the_same_result(encoding: str | None) -> None:
    body = _sse_body()
    if encoding:
        body = gzip.compress(body)
    obs = ResponseObserver(sse=True, content_encoding=encoding)
    for i in range(0, len(body), 5):
        obs.feed(body[i : i + 5], float(i))
    first = obs.result()
    assert first == obs.result()  # result() can be asked again
    assert first.reply is not None and first.reply.content == "abc"
    assert (first.prompt_tokens, first.completion_tokens) == (4, 3)
    assert first.first_token_at is not None
    if not encoding:  # the time of the piece that completed the first event
        assert first.first_token_at == (_sse_body().index(b"\n\n") + 1) // 5 * 5
    whole = ResponseObserver(sse=True, content_encoding=encoding)
    whole.feed(body, first.first_token_at)
    assert whole.result() == first


def test_json_result_is_stable() -> None:
    obs = ResponseObserver(sse=False)
    obs.feed(b'{"choices":[{"index":0,"message":{"content":"x"}}]', 1.0)
    obs.feed(b"}", 2.0)
    assert obs.result() == obs.result() and obs.result().reply == AssistantReply(content="x")


def test_json_message_reads_like_a_stream() -> None:
    """A JSON body's message gives the reply a stream of the same message would give."""
    message = {
        "role": "assistant",
        "content": "",
        "reasoning": "r",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    js = ResponseObserver(sse=False)
    js.feed(json.dumps({"choices": [{"index": 0, "message": message}]}).encode(), 1.0)
    deltas = [{"content": ""}, {"reasoning": "r"}, {"tool_calls": [{"index": 0, **message["tool_calls"][0]}]}]
    sse = ResponseObserver(sse=True)
    sse.feed(_sse([_chunk(d) for d in deltas] + [_chunk({}, "stop")]), 1.0)
    assert (
        js.result().reply
        == sse.result().reply
        == AssistantReply(
            content=None, reasoning="r", reasoning_field="reasoning", tool_calls=(ToolCall("c1", "f", "{}"),)
        )
    )


@pytest.mark.parametrize("sse", [True, False])
def test_sink_takes_the_chunks_after_the_first_token(sse: bool) -> None:
    """What the transport does: feed() until ``sink`` is set, then append to it."""
    body = (
        _sse(STREAM) if sse else json.dumps({"choices": [{"index": 0, "message": {"content": "x"}}]}).encode()
    )
    whole = ResponseObserver(sse=sse)
    whole.feed(body, 1.0)
    obs = ResponseObserver(sse=sse)
    pieces = [body[i : i + 9] for i in range(0, len(body), 9)]
    fed = 0
    for piece in pieces:
        if obs.sink is not None:
            obs.sink.append(piece)
        else:
            obs.feed(piece, 1.0)
            fed += 1
    assert obs.sink is not None and fed < len(pieces) // 2
    assert obs.result() == whole.result()
    assert obs.sink is None
    br = ResponseObserver(sse=sse, content_encoding="br")  # not read: timing only, no sink
    br.feed(b"abc", 1.0)
    assert br.sink is None and br.result().first_token_at == 1.0


# one event of each kind a stream can carry, and what it adds to the reply (content, reasoning)
_EVENT_KINDS: list[tuple[bytes, str, str]] = [
    (b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}', "a", ""),
    (b'data: {"choices":[{"index":0,"delta":{"content":"\\u00e9\\n\\"q\\""}}]}', '\u00e9\n"q"', ""),
    (b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":"b"}}]}', "b", ""),
    (b'data: {"choices":[{"index":0,"delta":{"reasoning":"r"}}]}', "", "r"),
    (b'data: {"choices":[{"index":1,"delta":{"content":"X"}}]}', "", ""),
    (b'data: {"choices":[{"index":1,"delta":{"content":"X"}},{"index":0,"delta":{"content":"c"}}]}', "c", ""),
    (b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}', "", ""),
    (b'data: {"choices":[{"index":0,"delta":{"content":"d"}}],"usage":{"prompt_tokens":6}}', "d", ""),
    (b'data: {"choices":[{"index":0,"delta":{"content":"e"}}],"x":NaN}', "e", ""),
    (b'data: {"choices":[{"index":0,"delta":{"content":', "", ""),  # not JSON: ignored
    (b"data: [1,2]", "", ""),
    (b'data: {"choices":[{"index":0,\ndata: "delta":{"content":"f"}}]}', "f", ""),  # two data lines
    (b': a comment\ndata: {"choices":[{"index":0,"delta":{"content":"g"}}]}', "g", ""),
    (b"event: ping", "", ""),
    (b'data:{"choices":[{"index":0,"delta":{"content":"h"}}]}', "h", ""),  # no space after "data:"
    (b"data: [DONE]", "", ""),  # in the middle too: later events are still read
]


@given(
    kinds=st.lists(st.integers(min_value=0, max_value=len(_EVENT_KINDS) - 1), min_size=1, max_size=30),
    cuts=st.lists(st.integers(min_value=0, max_value=4_000), max_size=12),
)
def test_every_kind_of_event_reads_the_same_however_the_stream_is_cut(
    kinds: list[int], cuts: list[int]
) -> None:
    """Events are parsed in batches with the common content delta read inline; whatever a stream
    mixes (other choices, usage, NaN, broken or multi-line events, [DONE] part-way), the reply is
    the events' contributions in order, fed whole or in pieces."""
    first = [b'data: {"choices":[{"index":0,"delta":{"content":"0"}}]}']  # a first token
    events = (
        first
        + [_EVENT_KINDS[k][0] for k in kinds]
        + [b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}']
    )
    body = b"".join(e + b"\n\n" for e in events)
    content = "0" + "".join(_EVENT_KINDS[k][1] for k in kinds)
    reasoning = "".join(_EVENT_KINDS[k][2] for k in kinds)
    usage = [k for k in kinds if _EVENT_KINDS[k][0].count(b"usage")]
    for feed in ((body,), _pieces(body, cuts)):
        obs = ResponseObserver(sse=True)
        for i, piece in enumerate(feed):
            obs.feed(piece, float(i))
        out = obs.result()
        assert out.reply is not None
        assert out.reply.content == content and (out.reply.reasoning or "") == reasoning
        if usage:
            assert out.prompt_tokens == (5 if _EVENT_KINDS[usage[-1]][0].count(b"completion") else 6)
        # the time of the piece in which the first event is complete
        ends = [sum(map(len, feed[: i + 1])) for i in range(len(feed))]
        assert out.first_token_at == float(next(i for i, e in enumerate(ends) if e >= len(first[0]) + 2))


def _pieces(body: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(body) + 1) for c in cuts} | {0, len(body)})
    return [body[a:b] for a, b in itertools.pairwise(points)]
