"""``ChatKVLease`` on the real local stack: ``kvlease router`` in front of a vLLM CPU P/D pair.

Two parts: langchain-tests' standard integration suite (what every LangChain chat model must do),
and the point of the adapter, a LangChain conversation whose follow-up turns pull the decode
node's KV (``hit``), keyed by the RunnableConfig's thread id.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
from langchain_core.messages import AIMessageChunk, BaseMessage, HumanMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests

import kvlease
from kvlease_langchain import ChatKVLease
from kvlease_stack import Stack, StackSpec

from .test_router_real_stack import QUESTION, RouterProcess

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def router_endpoint(stack_factory: Callable[[StackSpec], Stack]) -> Iterator[tuple[str, str]]:
    """``(base_url, model)`` of a router over the default pair (tiny trained model, kvlease connector)."""
    stack = stack_factory(StackSpec())
    router = RouterProcess(stack)
    try:
        yield router.url + "/v1", stack.model_name
    finally:
        router.stop()


class TestChatKVLeaseStandardIntegration(ChatModelIntegrationTests):
    endpoint: ClassVar[tuple[str, str] | None] = None

    @pytest.fixture(autouse=True)
    def _router(self, router_endpoint: tuple[str, str]) -> None:
        # autouse fixtures run before the suite's `model` fixture, which reads chat_model_params
        TestChatKVLeaseStandardIntegration.endpoint = router_endpoint

    @property
    def chat_model_class(self) -> type[ChatKVLease]:
        return ChatKVLease

    @property
    def chat_model_params(self) -> dict[str, Any]:
        assert self.endpoint is not None
        base_url, model = self.endpoint
        # No heartbeats: the suite makes a model per test and never closes it, and each would keep
        # a lease keeper thread renewing against this module's router after it stopped.
        return {"model": model, "base_url": base_url, "api_key": "itest", "heartbeat": False}

    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        # 100 new tokens per call is slow on two shared CPU cores; 32 shows the same behaviour.
        # Greedy: the suite sets no temperature, and vLLM then samples from a generator seeded at
        # server start, so whether the tiny model's first sampled token is its end-of-turn token (an
        # empty answer, which the suite rejects) depended on which requests the pair served before.
        return {**super().standard_chat_model_params, "max_tokens": 32, "temperature": 0.0}

    # --- capabilities the local stack cannot show, declared (every one is covered elsewhere) ---

    @property
    def has_tool_calling(self) -> bool:
        # The stack's vLLM servers run without --enable-auto-tool-choice / --tool-call-parser and the
        # tiny model was never trained to emit tool calls. ChatKVLease's tool calling (bind_tools,
        # streamed tool-call chunks, arguments sent back byte-exact) is tested over real HTTP in
        # tests/integrations/test_chat_model.py; tool binding in the standard unit suite.
        return False

    @property
    def has_tool_choice(self) -> bool:
        return False  # same reason as has_tool_calling

    @property
    def has_structured_output(self) -> bool:
        # vLLM would enforce the JSON schema, but the tiny model fills the free-text fields until
        # max_tokens, so the JSON never closes; function_calling mode needs tool calling (above).
        # Covered in tests/integrations/test_chat_model.py::test_structured_output.
        return False

    @property
    def supports_json_mode(self) -> bool:
        return False  # same reason as has_structured_output

    @property
    def supports_model_override(self) -> bool:
        # A vLLM deployment serves one model; another `model=` is a 404 by design.
        return False

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    # Images, audio, video and PDFs (supports_*_inputs) stay at the suite's default False: the tiny
    # model is text-only.


def _collect(chunks: Iterator[AIMessageChunk]) -> AIMessageChunk:
    full: AIMessageChunk | None = None
    for c in chunks:
        full = c if full is None else full + c
    assert full is not None
    return full


@pytest.mark.parametrize("stream", [False, True], ids=["invoke", "stream"])
def test_langchain_conversation_reuses_the_decode_nodes_kv(
    router_endpoint: tuple[str, str], stream: bool
) -> None:
    base_url, model_name = router_endpoint
    model = ChatKVLease(
        model=model_name,
        base_url=base_url,
        api_key="itest",
        max_tokens=24,
        temperature=0,
        reasoning_policy="keep",
    )
    thread = f"lc-itest-{'stream' if stream else 'invoke'}"
    config: Any = {"configurable": {"thread_id": thread}}
    history: list[BaseMessage] = [HumanMessage(QUESTION)]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", kvlease.ReuseOffWarning)  # the history LangChain sends is exact
            for step in range(3):
                reply = (
                    _collect(model.stream(history, config=config))
                    if stream
                    else model.invoke(history, config=config)
                )
                assert reply.text
                assert reply.response_metadata["kvlease"]["conversation_id"] == thread
                assert reply.usage_metadata is not None and reply.usage_metadata["input_tokens"] > 0
                history += [reply, HumanMessage(f"Now improve it, step {step}.")]
        turns = model.get_conversation(thread).turns
    finally:
        model.close()
    statuses = [t.status.value if t.status else None for t in turns]
    # What the adapter controls: one conversation (the thread id), histories sent exactly as the
    # model produced them, so reuse is attempted on every follow-up and never opted out of.
    assert [t.history for t in turns[1:]] == [kvlease.HistoryClass.EXACT] * 2
    assert not any(t.reuse_forced_off for t in turns)
    # What the router reports: "hit" when P pulled D's blocks, "miss" when the connector declined
    # the pull because P's own prefix cache already covers all but fewer new tokens than the
    # recompute threshold (24 generated tokens < 64 here), "local_hit" when it covers all of what
    # verified (the answer did not re-tokenize alike). "mismatch" / "disabled" would mean the
    # prompt did not extend D's sequence or reuse was switched off: the adapter's failure.
    assert statuses[0] == "first" and set(statuses[1:]) <= {"hit", "miss", "local_hit"}, statuses
    assert all(t.reused_tokens for t in turns[1:] if t.status is not None and t.status.value == "hit")
