"""The wrapped client against a real local HTTP server: what goes over the wire, what is recorded."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import openai
import pytest
from _sdk_support import FAST_RETRY
from fakes.openai_server import FakeOpenAIServer
from openai import AsyncOpenAI, OpenAI

import kvlease
from kvlease import HistoryClass, ReuseOffWarning, ReuseStatus, protocol

CHAT = protocol.CHAT_COMPLETIONS_PATH
USER = {"role": "user", "content": "What is the answer?"}


def _chat(srv: FakeOpenAIServer) -> list[Any]:
    return srv.requests_to(CHAT)


def _assistant(r: Any) -> dict[str, Any]:
    """What a typical client appends: role and content only (reasoning stripped)."""
    return {"role": "assistant", "content": r.choices[0].message.content}


# --------------------------------------------------------------------------------------- basics


def test_identity_travels_in_header_and_body(
    kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer
) -> None:
    with kc.conversation(id="thread-42") as conv:
        assert conv.id == "thread-42"
        r = conv.chat.completions.create(model="m", messages=[USER])
        assert r.choices[0].message.content == fake_server.content
    (req,) = _chat(fake_server)
    assert req.header(protocol.HEADER_CONVERSATION_ID) == "thread-42"
    assert req.body[protocol.BODY_CONVERSATION_ID] == "thread-42"
    assert req.body["messages"] == [USER] and req.body["model"] == "m"
    assert req.header(protocol.HEADER_REUSE) is None
    assert req.header("authorization") == "Bearer sk-test"


def test_minted_ids_are_valid_and_distinct(kc: kvlease.KVLeaseClient) -> None:
    ids = {kc.conversation().id for _ in range(50)}
    assert len(ids) == 50
    assert all(protocol.validate_conversation_id(i) for i in ids)


@pytest.mark.parametrize("bad", ["", "a b", "x" * 129, "a/b"])
def test_bad_id_raises_before_any_request(
    kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer, bad: str
) -> None:
    with pytest.raises(ValueError) as e:
        kc.conversation(id=bad)
    assert isinstance(e.value, kvlease.InvalidConversationId)
    assert fake_server.requests == []


def test_turn_record_from_response_headers(kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer) -> None:
    fake_server.ttl = 45.0
    with kc.conversation() as conv:
        r1 = conv.chat.completions.create(model="m", messages=[USER])
        msgs = [USER, _assistant(r1), {"role": "user", "content": "More?"}]
        conv.chat.completions.create(model="m", messages=msgs)
        t0, t1 = conv.turns
    assert (t0.index, t0.status, t0.reused_tokens, t0.ttl_s) == (0, ReuseStatus.FIRST, 0, 45.0)
    assert t0.history is HistoryClass.FIRST_TURN and not t0.reuse_forced_off and t0.gap_s is None
    assert t0.prompt_tokens == r1.usage.prompt_tokens and t0.completion_tokens == r1.usage.completion_tokens  # type: ignore[union-attr]
    assert t1.status is ReuseStatus.HIT and t1.reused_tokens == t0.prompt_tokens
    assert t1.history is HistoryClass.EXACT
    assert t0.started_at <= t0.ended_at <= t1.started_at <= t1.ended_at
    assert t1.gap_s == pytest.approx(t1.started_at - t0.ended_at, abs=1e-6)
    assert t0.ttft_s is not None and 0 <= t0.ttft_s <= t0.ended_at - t0.started_at + 1e-3
    assert not t0.stream and t1.conversation_id == conv.id


def test_plain_server_without_headers_records_unknown(
    fake_server: FakeOpenAIServer, kc: kvlease.KVLeaseClient
) -> None:
    fake_server.kvlease_headers = False
    with kc.conversation() as conv:
        conv.chat.completions.create(model="m", messages=[USER])
        (t,) = conv.turns
    assert (t.status, t.reused_tokens, t.ttl_s) == (None, None, None)
    assert t.prompt_tokens is not None
    # no lease was announced, so nothing is renewed or released
    assert len(kc.keeper) == 0
    assert fake_server.requests_to(protocol.conversation_path(conv.id), "DELETE") == []


def test_streaming_turn(kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer) -> None:
    fake_server.reply = "reasoning_content"
    with kc.conversation() as conv:
        stream = conv.chat.completions.create(
            model="m", messages=[USER], stream=True, stream_options={"include_usage": True}
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == fake_server.content
        (t,) = conv.turns
    assert t.stream and t.status is ReuseStatus.FIRST and t.ttft_s is not None and t.ttft_s > 0
    assert t.prompt_tokens is not None and t.completion_tokens is not None
    assert _chat(fake_server)[0].body["stream_options"] == {"include_usage": True}


def test_streaming_without_usage_is_not_changed(
    kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer
) -> None:
    with kc.conversation() as conv:
        chunks = list(conv.chat.completions.create(model="m", messages=[USER], stream=True))
        assert all(c.choices for c in chunks)
        (t,) = conv.turns
    assert "stream_options" not in _chat(fake_server)[0].body
    assert t.prompt_tokens is None and t.completion_tokens is None and t.status is ReuseStatus.FIRST


def test_abandoned_stream_records_a_turn_with_unknown_reply(
    kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer
) -> None:
    with kc.conversation() as conv:
        stream = conv.chat.completions.create(model="m", messages=[USER], stream=True)
        next(iter(stream))
        stream.close()
        assert len(conv.turns) == 1
        msgs = [USER, {"role": "assistant", "content": "whatever"}, USER]
        conv.chat.completions.create(model="m", messages=msgs)
        assert conv.turns[-1].history is HistoryClass.UNKNOWN
        assert _chat(fake_server)[-1].header(protocol.HEADER_REUSE) is None


def test_legacy_completions(kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer) -> None:
    with kc.conversation() as conv:
        r = conv.completions.create(model="m", prompt="Say hi")
        assert r.choices[0].text == fake_server.content
        s = "".join(
            c.choices[0].text for c in conv.completions.create(model="m", prompt="Say hi", stream=True)
        )
        assert s == fake_server.content
        assert [t.stream for t in conv.turns] == [False, True]
    reqs = fake_server.requests_to(protocol.COMPLETIONS_PATH)
    assert [r.body[protocol.BODY_CONVERSATION_ID] for r in reqs] == [conv.id, conv.id]


def test_requests_without_conversation_pass_through(
    kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer
) -> None:
    kc.openai.chat.completions.create(model="m", messages=[USER])
    (req,) = _chat(fake_server)
    assert protocol.BODY_CONVERSATION_ID not in req.body
    assert req.header(protocol.HEADER_CONVERSATION_ID) is None
    assert kc.conversation_ids() == []


def test_router_errors_surface_as_openai_exceptions(kc: kvlease.KVLeaseClient) -> None:
    with kc.conversation() as conv, pytest.raises(openai.NotFoundError):
        conv.client.post("/no/such/route", cast_to=object, body={})
    # an id the router rejects through a header set by other code: the router's 400, unchanged
    with pytest.raises(openai.BadRequestError):
        kc.openai.chat.completions.create(
            model="m", messages=[USER], extra_headers={protocol.HEADER_CONVERSATION_ID: "bad id"}
        )
    assert kc.conversation_ids() == []


# --------------------------------------------------------------------------------------- strip detection


def test_stripped_reasoning_turns_reuse_off_and_warns_once(
    kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer
) -> None:
    fake_server.reply = "reasoning_content"
    with kc.conversation() as conv, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        msgs: list[Any] = [USER]
        for _ in range(3):
            r = conv.chat.completions.create(model="m", messages=msgs)
            msgs = [*msgs, _assistant(r), {"role": "user", "content": "go on"}]
        turns = conv.turns
        assert conv.reuse_off_turns == 2
    reqs = _chat(fake_server)
    assert [r.header(protocol.HEADER_REUSE) for r in reqs] == [None, protocol.REUSE_OFF, protocol.REUSE_OFF]
    assert [t.history for t in turns] == [HistoryClass.FIRST_TURN] + [HistoryClass.REASONING_STRIPPED] * 2
    assert [t.status for t in turns[1:]] == [ReuseStatus.DISABLED] * 2
    ours = [w for w in caught if issubclass(w.category, ReuseOffWarning)]
    assert len(ours) == 1
    text = str(ours[0].message)
    assert "reasoning_content" in text and 'reasoning="keep"' in text
    # the id is an attribute, not in the text (one registry entry per kind), and the warning points
    # at the caller's line, not at kvlease's transport
    assert conv.id not in text
    warning = ours[0].message
    assert isinstance(warning, ReuseOffWarning) and warning.conversation_id == conv.id
    assert warning.history is HistoryClass.REASONING_STRIPPED and warning.reuse_off
    assert ours[0].filename == __file__
    assert kc.reuse_off_turns == 2


@pytest.mark.parametrize("reply", ["reasoning_content", "reasoning", "think"])
def test_keep_policy_reattaches_reasoning_on_the_wire(
    openai_client: OpenAI, fake_server: FakeOpenAIServer, reply: str
) -> None:
    fake_server.reply = reply
    with kvlease.wrap(openai_client, reasoning="keep", heartbeat=False) as kc, kc.conversation() as conv:
        msgs: list[Any] = [USER]
        with warnings.catch_warnings():
            warnings.simplefilter("error", ReuseOffWarning)  # keep fixes it: no warning
            for _ in range(3):
                r = conv.chat.completions.create(model="m", messages=msgs)
                visible = r.choices[0].message.content or ""
                if reply == "think":
                    visible = visible.split("</think>")[-1].strip()  # what a UI would keep
                msgs = [*msgs, {"role": "assistant", "content": visible}, {"role": "user", "content": "more"}]
        turns = conv.turns
    reqs = _chat(fake_server)
    assert all(r.header(protocol.HEADER_REUSE) is None for r in reqs)
    assert [t.reasoning_reattached for t in turns] == [False, True, True]
    for req in reqs[1:]:
        for m in req.body["messages"]:
            if m["role"] == "assistant":
                if reply == "think":
                    assert m["content"].startswith("<think>")
                else:
                    assert m[reply] == fake_server.reasoning
    assert reqs[2].body[protocol.BODY_CONVERSATION_ID] == conv.id


def test_edited_history_and_tool_calls(kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer) -> None:
    fake_server.reply = "tool_calls"
    with kc.conversation() as conv:
        r = conv.chat.completions.create(model="m", messages=[USER], tools=_TOOLS)
        call = r.choices[0].message.tool_calls[0]  # type: ignore[index]
        exact = [USER, r.choices[0].message.model_dump(exclude_none=True), _tool_result(call.id)]
        fake_server.reply = "plain"
        conv.chat.completions.create(model="m", messages=exact, tools=_TOOLS)
        with pytest.warns(ReuseOffWarning, match="content differs"):
            conv.chat.completions.create(
                model="m", messages=[*exact, {"role": "assistant", "content": "x"}, USER]
            )
        changed = [USER, {"role": "assistant", "content": None, "tool_calls": []}, _tool_result(call.id)]
        with pytest.warns(ReuseOffWarning, match="earlier message 1"):  # another kind: warned too
            conv.chat.completions.create(model="m", messages=changed)
        hist = [t.history for t in conv.turns]
    assert hist == [
        HistoryClass.FIRST_TURN,
        HistoryClass.EXACT,
        HistoryClass.CONTENT_EDITED,
        HistoryClass.HISTORY_REWRITTEN,
    ]
    assert [r.header(protocol.HEADER_REUSE) for r in _chat(fake_server)] == [None, None, "off", "off"]
    fake_server.reply = "tool_calls"
    with kc.conversation() as conv2:
        r = conv2.chat.completions.create(model="m", messages=[USER], tools=_TOOLS)
        msg = r.choices[0].message.model_dump(exclude_none=True)
        compact = json.dumps(json.loads(msg["tool_calls"][0]["function"]["arguments"]), separators=(",", ":"))
        msg["tool_calls"][0]["function"]["arguments"] = compact  # as pydantic-ai resends them
        with warnings.catch_warnings():
            warnings.simplefilter("error", ReuseOffWarning)  # renders to the same tokens: exact
            conv2.chat.completions.create(
                model="m", messages=[USER, msg, _tool_result(call.id)], tools=_TOOLS
            )
        assert conv2.turns[-1].history is HistoryClass.EXACT
    with kc.conversation() as conv3:
        fake_server.reply = "tool_calls"
        r = conv3.chat.completions.create(model="m", messages=[USER], tools=_TOOLS)
        msg = r.choices[0].message.model_dump(exclude_none=True)
        msg["tool_calls"][0]["function"]["arguments"] = '{"other": 1}'
        with pytest.warns(ReuseOffWarning, match="tool calls"):
            conv3.chat.completions.create(
                model="m", messages=[USER, msg, _tool_result(call.id)], tools=_TOOLS
            )
        assert conv3.turns[-1].history is HistoryClass.TOOL_CALLS_CHANGED


_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _tool_result(call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": "sunny"}


def test_detection_off_sends_no_opt_out(openai_client: OpenAI, fake_server: FakeOpenAIServer) -> None:
    fake_server.reply = "reasoning"
    with kvlease.wrap(openai_client, reasoning="off", heartbeat=False) as kc, kc.conversation() as conv:
        r = conv.chat.completions.create(model="m", messages=[USER])
        conv.chat.completions.create(model="m", messages=[USER, _assistant(r), USER])
        assert conv.turns[-1].history is HistoryClass.UNKNOWN
    assert all(r.header(protocol.HEADER_REUSE) is None for r in _chat(fake_server))
    assert all(r.body[protocol.BODY_CONVERSATION_ID] == conv.id for r in _chat(fake_server))


# --------------------------------------------------------------------------------------- the openai client for other frameworks


def test_header_only_code_is_tracked(kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer) -> None:
    """Code that only knows an openai client and sets the header (as a framework adapter does)."""

    def framework_call(client: OpenAI, thread: str, messages: list[Any]) -> Any:
        return client.chat.completions.create(
            model="m", messages=messages, extra_headers={protocol.HEADER_CONVERSATION_ID: thread}
        )

    fake_server.reply = "reasoning_content"
    r = framework_call(kc.openai, "lg-thread-7", [USER])
    with pytest.warns(ReuseOffWarning):
        framework_call(kc.openai, "lg-thread-7", [USER, _assistant(r), USER])
    conv = kc.get_conversation("lg-thread-7")
    assert conv is not None and [t.status for t in conv.turns] == [ReuseStatus.FIRST, ReuseStatus.DISABLED]
    reqs = _chat(fake_server)
    assert [q.body[protocol.BODY_CONVERSATION_ID] for q in reqs] == ["lg-thread-7"] * 2
    assert reqs[1].header(protocol.HEADER_REUSE) == protocol.REUSE_OFF
    assert "lg-thread-7" in kc.keeper  # its lease is kept too
    assert kc.get_conversation("unknown-thread") is None
    kc.close()
    assert fake_server.requests_to(protocol.conversation_path("lg-thread-7"), "DELETE")


def test_conv_client_for_other_frameworks(kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer) -> None:
    with kc.conversation(id="c-1") as conv:
        assert isinstance(conv.client, OpenAI)
        conv.client.chat.completions.create(model="m", messages=[USER])
        assert len(conv.turns) == 1
    assert _chat(fake_server)[0].header(protocol.HEADER_CONVERSATION_ID) == "c-1"


# --------------------------------------------------------------------------------------- turn log


def test_turn_log_lines(openai_client: OpenAI, fake_server: FakeOpenAIServer, tmp_path: Path) -> None:
    path = tmp_path / "logs" / "turns.jsonl"
    with (
        kvlease.wrap(openai_client, heartbeat=False, turn_log=path) as kc,
        kc.conversation(id="a") as a,
        kc.conversation(id="b") as b,
    ):
        r = a.chat.completions.create(model="m", messages=[USER])
        b.chat.completions.create(model="m", messages=[USER])
        a.chat.completions.create(model="m", messages=[USER, _assistant(r), USER])
        turns = a.turns
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["conversation_id"] for x in lines] == ["a", "b", "a"]
    for x in lines:
        assert list(x)[: len(protocol.TURN_LOG_FIELDS)] == list(protocol.TURN_LOG_FIELDS)
    first, _, second = lines
    assert first["status"] == "first" and second["status"] == "hit" and first["gap_s"] is None
    assert second["gap_s"] == pytest.approx(turns[1].started_at - turns[0].ended_at, abs=1e-5)
    assert second["ts"] == pytest.approx(turns[1].started_at, abs=1e-5)
    assert second["prompt_tokens"] == turns[1].prompt_tokens and second["history"] == "exact"


def test_turn_log_object(openai_client: OpenAI, tmp_path: Path) -> None:
    log = kvlease.TurnLog(tmp_path / "t.jsonl")
    with kvlease.wrap(openai_client, heartbeat=False, turn_log=log) as kc, kc.conversation() as conv:
        conv.chat.completions.create(model="m", messages=[USER], stream=True).close()
    assert len(log.path.read_text().splitlines()) == 1


@pytest.mark.parametrize("full", [True, False])
def test_turn_log_line_is_the_protocol_record(full: bool) -> None:
    from kvlease._turnlog import _encode, _record

    turn = kvlease.Turn(
        index=3,
        conversation_id="c-1",
        started_at=1796101769.4956539,
        ended_at=1796101770.0,
        ttft_s=0.0000123456 if full else None,
        prompt_tokens=10 if full else None,
        completion_tokens=40 if full else None,
        status=ReuseStatus.HIT if full else None,
        reused_tokens=12 if full else None,
        ttl_s=30.0,
        history=HistoryClass.EXACT,
        reuse_forced_off=not full,
        gap_s=0.020272731 if full else None,
    )
    record = protocol.TurnLogRecord(
        conversation_id=turn.conversation_id,
        ts=round(turn.started_at, 6),
        prompt_tokens=turn.prompt_tokens,
        completion_tokens=turn.completion_tokens,
        ttft_s=None if turn.ttft_s is None else round(turn.ttft_s, 6),
        status=None if turn.status is None else turn.status.value,
        reused_tokens=turn.reused_tokens,
        gap_s=None if turn.gap_s is None else round(turn.gap_s, 6),
        extra={"turn": turn.index, "history": turn.history.value, "reuse_off": turn.reuse_forced_off},
    )
    line = _encode(_record(turn))
    assert line == json.dumps(record.to_json(), separators=(",", ":"))
    assert list(json.loads(line))[: len(protocol.TURN_LOG_FIELDS)] == list(protocol.TURN_LOG_FIELDS)


# --------------------------------------------------------------------------------------- async


async def test_async_client_sync_twin(akc: kvlease.AsyncKVLeaseClient, fake_server: FakeOpenAIServer) -> None:
    fake_server.reply = "reasoning"
    async with akc.conversation(id="async-1") as conv:
        assert isinstance(conv.client, AsyncOpenAI)
        r = await conv.chat.completions.create(model="m", messages=[USER])
        msgs = [USER, _assistant(r), USER]
        with pytest.warns(ReuseOffWarning):
            stream = await conv.chat.completions.create(model="m", messages=msgs, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream])
        assert text == fake_server.content
        t0, t1 = conv.turns
        assert t0.status is ReuseStatus.FIRST and not t0.stream
        assert t1.stream and t1.history is HistoryClass.REASONING_STRIPPED and t1.reuse_forced_off
        assert t1.ttft_s is not None and t1.gap_s is not None
        assert "async-1" in akc.keeper
    reqs = _chat(fake_server)
    assert [r.body[protocol.BODY_CONVERSATION_ID] for r in reqs] == ["async-1"] * 2
    assert reqs[1].header(protocol.HEADER_REUSE) == protocol.REUSE_OFF
    assert fake_server.requests_to(protocol.conversation_path("async-1"), "DELETE")
    assert akc.get_conversation("async-1") is None


async def test_async_header_only_tracking(
    akc: kvlease.AsyncKVLeaseClient, fake_server: FakeOpenAIServer
) -> None:
    await akc.openai.completions.create(
        model="m", prompt="x", extra_headers={protocol.HEADER_CONVERSATION_ID: "t-async"}
    )
    conv = akc.get_conversation("t-async")
    assert conv is not None and conv.turns[0].status is ReuseStatus.FIRST
    with pytest.raises(kvlease.InvalidConversationId):
        akc.conversation(id="no spaces allowed")


def test_wrap_rejects_other_objects() -> None:
    with pytest.raises(TypeError):
        kvlease.wrap(object())  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="reasoning"):
        kvlease.wrap(
            OpenAI(api_key="k", base_url="http://127.0.0.1:9/v1"), reasoning="nope", retry=FAST_RETRY
        )  # type: ignore[arg-type]


def test_bound_resources_keep_the_real_openai_surface(
    kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer
) -> None:
    with kc.conversation(id="raw-1") as conv:
        raw = conv.chat.completions.with_raw_response.create(
            model="m", messages=[USER], extra_headers={"X-Other": "kept"}
        )
        assert raw.headers.get(protocol.HEADER_STATUS) == "first"
        assert raw.parse().choices[0].message.content == fake_server.content
        assert conv.turns[0].status is ReuseStatus.FIRST
    (req,) = _chat(fake_server)
    assert req.header(protocol.HEADER_CONVERSATION_ID) == "raw-1" and req.header("x-other") == "kept"


# ------------------------------------------------------------- the user's own http client settings


def test_the_users_event_hooks_and_auth_still_apply(fake_server: FakeOpenAIServer) -> None:
    """Tracked and untracked requests go through the user's client's own ``send``: its hooks and auth
    run exactly as they would without kvlease."""
    from kvlease._http import hx

    seen: list[str] = []

    class Tag(hx.Auth):
        def auth_flow(self, request: Any) -> Any:
            request.headers["x-user-auth"] = "yes"
            yield request

    http = openai.DefaultHttpxClient(
        event_hooks={"request": [lambda r: seen.append(r.url.path)], "response": []}, auth=Tag()
    )
    kc = kvlease.wrap(
        OpenAI(base_url=fake_server.base_url, api_key="sk-test", http_client=http), heartbeat=False
    )
    try:
        with kc.conversation() as conv:
            conv.chat.completions.create(model="m", messages=[USER])
        kc.openai.chat.completions.create(model="m", messages=[USER])  # untracked: passes through
    finally:
        kc.close()
    assert [p for p in seen if p == CHAT] == [CHAT, CHAT]  # (and the lease release, which uses it too)
    assert [r.header("x-user-auth") for r in _chat(fake_server)] == ["yes", "yes"]


async def test_the_users_event_hooks_apply_async(fake_server: FakeOpenAIServer) -> None:
    seen: list[str] = []

    async def hook(r: Any) -> None:
        seen.append(r.url.path)

    http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [hook], "response": []})
    kc = kvlease.wrap(AsyncOpenAI(base_url=fake_server.base_url, api_key="sk-test", http_client=http))
    try:
        async with kc.conversation() as conv:
            await conv.chat.completions.create(model="m", messages=[USER])
    finally:
        await kc.aclose()
    assert [p for p in seen if p == CHAT] == [CHAT]
