"""``ChatKVLease`` end to end over real HTTP against the fake router (the SDK underneath is real).

What the server received (headers, bodies) is the evidence: conversation ids, the reuse opt-out,
reasoning sent back; what the caller got (messages, content blocks, usage, turn records) the rest.
"""

from __future__ import annotations

import asyncio
import json
import math
import warnings
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from fakes.openai_server import FakeOpenAIServer as FakeRouter
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, ToolMessage
from langgraph.graph import START, MessagesState, StateGraph
from pydantic import BaseModel, ValidationError

import kvlease
from kvlease import protocol as p
from kvlease_langchain import ChatKVLease
from kvlease_stack.testing import Reply


@pytest.fixture
def router() -> Iterator[FakeRouter]:
    # echo replies ("echo: <user text>", reasoning "thinking about <it>"); hits reuse 16 tokens a turn
    with FakeRouter(reply="echo", reused_per_turn=16) as srv:
        yield srv


@pytest.fixture
def make_model(router: FakeRouter) -> Iterator[Any]:
    made: list[ChatKVLease] = []

    def make(**kwargs: Any) -> ChatKVLease:
        model = ChatKVLease(**{"model": "fake-model", "base_url": router.base_url, **kwargs})
        made.append(model)
        return model

    yield make
    for model in made:
        model.close()


def _sent_ids(router: FakeRouter) -> list[str | None]:
    return [r.headers.get(p.HEADER_CONVERSATION_ID.lower()) for r in router.chat_requests()]


def _collect(chunks: Iterator[AIMessageChunk]) -> AIMessageChunk:
    full: AIMessageChunk | None = None
    for c in chunks:
        full = c if full is None else full + c
    assert full is not None
    return full


async def _acollect(chunks: AsyncIterator[AIMessageChunk]) -> AIMessageChunk:
    full: AIMessageChunk | None = None
    async for c in chunks:
        full = c if full is None else full + c
    assert full is not None
    return full


# -- conversation ids ---------------------------------------------------------------------------------

CFG = {"configurable": {"thread_id": "t1"}}


def test_thread_id_of_the_config_is_the_conversation_sync(router: FakeRouter, make_model: Any) -> None:
    model = make_model()
    model.invoke("hi", config=CFG)
    _collect(model.stream("hi", config=CFG))
    model.batch(
        ["a", "b"], config=[{"configurable": {"thread_id": "b1"}}, {"configurable": {"thread_id": "b2"}}]
    )
    assert _sent_ids(router)[:2] == ["t1", "t1"]
    assert sorted(_sent_ids(router)[2:]) == ["b1", "b2"]
    # the SDK added the body field the router also accepts
    assert all(
        r.body[p.BODY_CONVERSATION_ID] == r.headers["x-conversation-id"] for r in router.chat_requests()
    )
    # the two calls sent unrelated histories: the SDK saw it and recomputed the second turn
    assert [t.status for t in model.get_conversation("t1").turns] == [
        p.ReuseStatus.FIRST,
        p.ReuseStatus.DISABLED,
    ]


async def test_thread_id_of_the_config_is_the_conversation_async(router: FakeRouter, make_model: Any) -> None:
    model = make_model(reasoning_policy="keep")
    first = await model.ainvoke("hi", config=CFG)
    await _acollect(model.astream([HumanMessage("hi"), first, HumanMessage("more")], config=CFG))
    await model.abatch(["a"], config={"configurable": {"thread_id": "ab"}})
    assert _sent_ids(router) == ["t1", "t1", "ab"]
    assert model.get_conversation("t1").turns[-1].status is p.ReuseStatus.HIT
    await model.aclose()


def test_thread_id_inside_a_langgraph_node(router: FakeRouter, make_model: Any) -> None:
    model = make_model()

    def call_model(state: MessagesState) -> dict[str, list[BaseMessage]]:
        return {"messages": [model.invoke(state["messages"])]}  # no config passed: LangGraph's is current

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_edge(START, "model")
    app = graph.compile()
    app.invoke({"messages": [("user", "hi")]}, config={"configurable": {"thread_id": "graph-7"}})
    assert _sent_ids(router) == ["graph-7"]


def test_id_resolution_order(router: FakeRouter, make_model: Any) -> None:
    fixed = make_model(conversation_id="fixed-1")
    fixed.invoke("a", config=CFG)  # the field beats the thread id
    fixed.invoke("b", config=CFG, conversation_id="per-call")  # a per-call id beats the field
    minted = make_model()
    minted.invoke("c")
    minted.invoke("d")
    other = make_model()
    other.invoke("e")
    sent = _sent_ids(router)
    assert sent[:2] == ["fixed-1", "per-call"]
    assert sent[2] == sent[3] == minted.default_conversation_id  # one minted id per instance
    assert sent[4] == other.default_conversation_id != sent[2]


def test_thread_ids_that_are_not_conversation_ids_are_mapped(router: FakeRouter, make_model: Any) -> None:
    model = make_model()
    model.invoke("a", config={"configurable": {"thread_id": "user 42's chat"}})
    model.invoke("b", config={"configurable": {"thread_id": "user 42's chat"}})
    sent = _sent_ids(router)
    assert sent[0] == sent[1]
    assert sent[0] is not None and p.validate_conversation_id(sent[0]).startswith("thread-")


def test_bad_explicit_ids_are_errors(router: FakeRouter, make_model: Any) -> None:
    with pytest.raises(ValidationError, match="conversation id"):
        make_model(conversation_id="has space")
    model = make_model()
    with pytest.raises(p.InvalidConversationId):
        model.invoke("a", conversation_id="x" * 129)
    assert router.chat_requests() == []  # nothing was sent


def test_missing_base_url_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVLEASE_BASE_URL", raising=False)
    monkeypatch.delenv("OPENAI_API_BASE", raising=False)
    with pytest.raises(ValidationError, match="base_url"):
        ChatKVLease(model="m")


# -- reasoning ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_reasoning_is_surfaced(field: str, make_model: Any, router: FakeRouter) -> None:
    router.reasoning_field = field
    model = make_model()
    msg = model.invoke("hi")
    streamed = _collect(model.stream("hi"))
    for m in (msg, streamed):
        assert m.additional_kwargs["reasoning_content"] == "thinking about hi"
        assert m.response_metadata["reasoning_field"] == field
        assert m.content_blocks[0] == {"type": "reasoning", "reasoning": "thinking about hi"}
        assert [b["type"] for b in m.content_blocks] == ["reasoning", "text"]
        assert m.text == "echo: hi"


def test_no_reasoning_no_reasoning_block(make_model: Any, router: FakeRouter) -> None:
    router.reasoning_field = None
    msg = make_model().invoke("hi")
    assert "reasoning_content" not in msg.additional_kwargs
    assert [b["type"] for b in msg.content_blocks] == ["text"]


def _two_turns_sync(model: ChatKVLease, stream: bool) -> None:
    history: list[Any] = [HumanMessage("hi")]
    first = _collect(model.stream(history, config=CFG)) if stream else model.invoke(history, config=CFG)
    history += [first, HumanMessage("and then?")]
    if stream:
        _collect(model.stream(history, config=CFG))
    else:
        model.invoke(history, config=CFG)


async def _two_turns_async(model: ChatKVLease, stream: bool) -> None:
    history: list[Any] = [HumanMessage("hi")]
    first = await (
        _acollect(model.astream(history, config=CFG)) if stream else model.ainvoke(history, config=CFG)
    )
    history += [first, HumanMessage("and then?")]
    if stream:
        await _acollect(model.astream(history, config=CFG))
    else:
        await model.ainvoke(history, config=CFG)


@pytest.mark.parametrize("stream", [False, True], ids=["invoke", "stream"])
@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_keep_sends_reasoning_back_and_reuse_stays_on(
    stream: bool, field: str, make_model: Any, router: FakeRouter
) -> None:
    router.reasoning_field = field
    model = make_model(reasoning_policy="keep")
    with warnings.catch_warnings():
        warnings.simplefilter("error", kvlease.ReuseOffWarning)
        _two_turns_sync(model, stream)
    second = router.chat_requests()[1]
    assistant = second.body["messages"][1]
    assert assistant == {"role": "assistant", "content": "echo: hi", field: "thinking about hi"}
    assert p.HEADER_REUSE.lower() not in second.headers
    turn = model.get_conversation("t1").turns[-1]
    assert (turn.status, turn.history, turn.reuse_forced_off) == (
        p.ReuseStatus.HIT,
        kvlease.HistoryClass.EXACT,
        False,
    )
    assert not turn.reasoning_reattached  # the model sent it; the SDK had nothing to repair


@pytest.mark.parametrize("stream", [False, True], ids=["invoke", "stream"])
def test_warn_detects_the_stripped_reasoning_and_forces_a_full_prefill(
    stream: bool, make_model: Any, router: FakeRouter
) -> None:
    model = make_model(reasoning_policy="warn")
    with pytest.warns(kvlease.ReuseOffWarning, match="without its 'reasoning' field"):
        _two_turns_sync(model, stream)
    second = router.chat_requests()[1]
    assert "reasoning" not in second.body["messages"][1]
    assert second.headers[p.HEADER_REUSE.lower()] == p.REUSE_OFF
    turn = model.get_conversation("t1").turns[-1]
    assert (turn.status, turn.history, turn.reuse_forced_off) == (
        p.ReuseStatus.DISABLED,
        kvlease.HistoryClass.REASONING_STRIPPED,
        True,
    )


@pytest.mark.parametrize("stream", [False, True], ids=["ainvoke", "astream"])
@pytest.mark.parametrize(
    ("policy", "reuse_header", "history"),
    [
        ("keep", None, kvlease.HistoryClass.EXACT),
        ("warn", p.REUSE_OFF, kvlease.HistoryClass.REASONING_STRIPPED),
    ],
)
async def test_policies_async(
    stream: bool, policy: str, reuse_header: str | None, history: Any, make_model: Any, router: FakeRouter
) -> None:
    model = make_model(reasoning_policy=policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kvlease.ReuseOffWarning)
        await _two_turns_async(model, stream)
    second = router.chat_requests()[1]
    assert second.headers.get(p.HEADER_REUSE.lower()) == reuse_header
    assert model.get_conversation("t1").turns[-1].history is history
    await model.aclose()


def test_v1_output_round_trips_exactly(make_model: Any, router: FakeRouter) -> None:
    model = make_model(reasoning_policy="keep", output_version="v1")
    first = model.invoke("hi", config=CFG)
    assert [b["type"] for b in first.content] == ["reasoning", "text"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", kvlease.ReuseOffWarning)
        model.invoke([HumanMessage("hi"), first, HumanMessage("more")], config=CFG)
    # text blocks go back as the plain string the server produced, reasoning under its field
    assert router.chat_requests()[1].body["messages"][1] == {
        "role": "assistant",
        "content": "echo: hi",
        "reasoning": "thinking about hi",
    }
    assert model.get_conversation("t1").turns[-1].history is kvlease.HistoryClass.EXACT


# -- turn records, usage, tools, structured output ------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_turn_record_and_usage_on_the_message(stream: bool, make_model: Any) -> None:
    model = make_model(reasoning_policy="keep")
    first = _collect(model.stream("hi", config=CFG)) if stream else model.invoke("hi", config=CFG)
    follow = [HumanMessage("hi"), first, HumanMessage("more")]
    second = _collect(model.stream(follow, config=CFG)) if stream else model.invoke(follow, config=CFG)
    assert first.response_metadata["kvlease"]["status"] == "first"
    meta = second.response_metadata["kvlease"]
    assert (meta["conversation_id"], meta["turn"], meta["status"], meta["history"]) == (
        "t1",
        1,
        "hit",
        "exact",
    )
    assert meta["reused_tokens"] == 16 and meta["ttft_s"] >= 0
    json.dumps(meta)  # checkpointers serialize response_metadata
    assert second.usage_metadata is not None
    assert second.usage_metadata["input_tokens"] > 0 and second.usage_metadata["output_tokens"] > 0


def test_tool_calls_round_trip_without_breaking_the_prefix(make_model: Any, router: FakeRouter) -> None:
    def get_weather(city: str) -> str:
        """Weather in a city."""
        return "sunny"

    router.script(
        Reply(
            reasoning="need the tool", tool_calls=[{"name": "get_weather", "arguments": {"city": "Paris"}}]
        ),
        Reply(content="It is sunny.", reasoning="done"),
    )
    model = make_model(reasoning_policy="keep").bind_tools([get_weather])
    history: list[Any] = [HumanMessage("Weather in Paris?")]
    call = model.invoke(history, config=CFG)
    assert call.tool_calls == [
        {"name": "get_weather", "args": {"city": "Paris"}, "id": "call_0", "type": "tool_call"}
    ]
    history += [call, ToolMessage("sunny", tool_call_id="call_0")]
    with warnings.catch_warnings():
        warnings.simplefilter("error", kvlease.ReuseOffWarning)
        answer = model.invoke(history, config=CFG)
    assert answer.content == "It is sunny."
    first_body = router.chat_requests()[0].body
    assert first_body["tools"][0]["function"]["name"] == "get_weather"
    assert answer.response_metadata["kvlease"]["history"] == "exact"


@pytest.mark.parametrize("stream", [False, True])
def test_tool_arguments_go_back_as_the_server_wrote_them(
    stream: bool, make_model: Any, router: FakeRouter
) -> None:
    def lookup(query: str, limit: int) -> str:
        """Look something up."""
        return "found"

    raw = '{"query":"disk usage","limit":3}'  # compact: json.dumps would add spaces
    router.script(Reply(tool_calls=[{"name": "lookup", "arguments": raw}]), Reply(content="Done."))
    model = make_model(reasoning_policy="keep").bind_tools([lookup])
    history: list[Any] = [HumanMessage("check the disk")]
    call = _collect(model.stream(history, config=CFG)) if stream else model.invoke(history, config=CFG)
    assert call.tool_calls[0]["args"] == {"query": "disk usage", "limit": 3}
    assert call.additional_kwargs["tool_call_arguments"] == {"0": raw}
    history += [call, ToolMessage("found", tool_call_id="call_0")]
    with warnings.catch_warnings():
        warnings.simplefilter("error", kvlease.ReuseOffWarning)
        model.invoke(history, config=CFG)
    sent = router.chat_requests()[1].body["messages"][1]["tool_calls"][0]
    assert sent["function"] == {"name": "lookup", "arguments": raw}
    assert model.get_conversation("t1").turns[-1].history is kvlease.HistoryClass.EXACT


def test_structured_output(make_model: Any, router: FakeRouter) -> None:
    class Answer(BaseModel):
        value: int

    router.script(Reply(content='{"value": 4}'))
    result = make_model().with_structured_output(Answer, method="json_schema").invoke("2 + 2?")
    assert result == Answer(value=4)
    assert router.chat_requests()[0].body["response_format"]["type"] == "json_schema"


# -- token counting without downloads; lifecycle --------------------------------------------------------


@pytest.mark.disable_socket
def test_token_counting_needs_no_network() -> None:
    model = ChatKVLease(model="m", base_url="http://127.0.0.1:9/v1", heartbeat=False)
    msgs: list[BaseMessage] = [HumanMessage("x" * 400)]
    estimate = model.get_num_tokens_from_messages(msgs)
    assert 100 <= estimate <= 110
    assert model.get_num_tokens("abcdefgh") == 2
    with pytest.raises(NotImplementedError, match="custom_get_token_ids"):
        model.get_token_ids("abc")
    # calibrated by the usage the server reported on the latest AI message
    reply = AIMessage(
        "y" * 40,
        usage_metadata={"input_tokens": 400, "output_tokens": 20, "total_tokens": 420},
        response_metadata={"model_provider": "kvlease"},
    )
    follow = [*msgs, reply, HumanMessage("z" * 40)]
    unscaled = model.get_num_tokens_from_messages(
        [m.model_copy(update={"usage_metadata": None}) for m in follow]
    )
    scaled = model.get_num_tokens_from_messages(follow)
    assert unscaled < scaled <= math.ceil(1.25 * unscaled)  # langchain-core caps the scale at 1.25
    exact = ChatKVLease(
        model="m",
        base_url="http://127.0.0.1:9/v1",
        heartbeat=False,
        custom_get_token_ids=lambda t: list(t.encode()),
    )
    assert exact.get_token_ids("abc") == [97, 98, 99]
    assert exact.get_num_tokens("abcdefgh") == 8


def test_models_in_successive_event_loops(router: FakeRouter) -> None:
    """Each model owns its HTTP pools: no connection of a closed event loop is ever reused."""

    async def turn(model: ChatKVLease) -> None:
        await model.ainvoke("hi")
        await _acollect(model.astream("hi"))
        await model.aclose()

    for _ in range(3):
        asyncio.run(turn(ChatKVLease(model="fake-model", base_url=router.base_url)))
    assert len(router.chat_requests()) == 6


def test_close_releases_the_conversations(make_model: Any, router: FakeRouter) -> None:
    model = make_model()
    model.invoke("hi", config=CFG)
    model.close()
    deletes = [r.path for r in router.requests if r.method == "DELETE"]
    assert deletes == [p.conversation_path("t1")]
