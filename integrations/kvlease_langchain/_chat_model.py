"""``ChatKVLease``: langchain-openai's ``BaseChatOpenAI`` on kvlease-wrapped openai clients.

Reading path: the class docstring (how it is used), then the hooks in the order a call meets them:
the Runnable entry points (thread id of the ``RunnableConfig``), ``_get_request_payload``
(conversation header, reasoning sent back), ``_create_chat_result`` /
``_convert_chunk_to_generation_chunk`` (reasoning and kvlease status surfaced). Everything that
touches HTTP (identity header handling, strip detection, heartbeats, turn records) is the SDK's.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, Literal

import openai
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.chat_models import LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.utils import count_tokens_approximately
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import RunnableConfig
from langchain_core.runnables.config import ensure_config
from langchain_core.tools import BaseTool
from langchain_core.utils import from_env, secret_from_env
from langchain_openai.chat_models.base import BaseChatOpenAI
from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator
from typing_extensions import Self

import kvlease
from kvlease.protocol import HEADER_CONVERSATION_ID, REASONING_FIELDS, TurnLogKey, validate_conversation_id
from kvlease_langchain import _reasoning
from kvlease_langchain._conversation import (
    mint_conversation_id,
    resolve_conversation_id,
    thread_conversation_id,
)

_reasoning.register()

#: Per-call keyword naming the conversation (``model.invoke(msgs, conversation_id="c1")``).
CONVERSATION_KWARG = "conversation_id"

#: ``response_metadata`` key of the SDK's turn record summary (status, reused tokens, ttft).
KVLEASE_METADATA_KEY = "kvlease"

ReasoningPolicy = Literal["warn", "keep", "off"]


class ChatKVLease(BaseChatOpenAI):
    """Chat model for an OpenAI-compatible kvlease router (or a plain vLLM server).

    Reasoning models: LangChain drops reasoning from the history; by default (``"warn"``) the kvlease
    connector reuses the verified prefix up to it, stock vLLM recomputes; ``"keep"`` sends it back.

    Every request carries a conversation id (the router hands D's KV of the previous turn to P);
    heartbeats keep leases alive; changed histories are detected. All of it is the kvlease SDK's.

    Setup:
        Install ``kvlease[langchain]`` and start a router (``kvlease router --prefill URL --decode URL``)
        or point at any OpenAI-compatible vLLM server.

        ```bash
        pip install 'kvlease[langchain]'
        export KVLEASE_BASE_URL=http://127.0.0.1:8000/v1   # optional, else pass base_url=
        export KVLEASE_API_KEY=...                         # optional, vLLM without auth ignores it
        ```

    Key init args — completion params:
        model: str
            Served model name.
        temperature: float | None
            Sampling temperature.
        max_tokens: int | None
            Max number of tokens to generate.
        stream_usage: bool
            Ask for token usage on streams (default ``True``; vLLM supports it).

    Key init args — client params:
        base_url: str
            Router (or vLLM) URL ending in ``/v1``; default ``$KVLEASE_BASE_URL``.
        api_key: str
            Bearer token; default ``$KVLEASE_API_KEY``, else ``"EMPTY"``.
        timeout, max_retries, http_client, http_async_client, default_headers:
            As for ``ChatOpenAI``.

    Key init args — kvlease:
        conversation_id: str | None
            Fixed conversation id for every call of this instance. When unset, the id is the
            ``configurable.thread_id`` of the call's ``RunnableConfig`` (LangGraph threads), else one
            minted for this instance (``model.default_conversation_id``). A call may also pass
            ``conversation_id=...`` as a keyword, which wins over all of these.
        reasoning_policy: "warn" | "keep" | "off"
            ``"keep"`` sends each assistant message's reasoning back on the next turn under the field
            name the server used, so the prompt extends the previous one token for token. ``"warn"``
            (default) sends histories as they are; the SDK detects a stripped trace and warns once
            (reuse of the verified prefix, or off on stock vLLM). ``"off"``: no detection.
        heartbeat: bool
            Renew the leases of open conversations in the background (default ``True``).
        max_idle: float
            Seconds after a conversation's last turn when heartbeats stop (default 1800).
        turn_log: str | None
            Path of a JSONL turn log (input of ``kvlease analyze``).

    Instantiate:
        ```python
        from kvlease_langchain import ChatKVLease

        model = ChatKVLease(model="Qwen/Qwen3-8B", base_url="http://127.0.0.1:8000/v1", temperature=0)
        ```

    Invoke:
        ```python
        msg = model.invoke([("system", "You are terse."), ("user", "2 + 2?")])
        msg.content                                # '4'
        msg.additional_kwargs.get("reasoning_content")   # thinking, when the server returns it
        [b["type"] for b in msg.content_blocks]    # ['reasoning', 'text']
        msg.response_metadata["kvlease"]           # {'conversation_id': 'lc-…', 'status': 'first', …}
        ```

    Conversations (LangGraph threads map to conversations):
        ```python
        model.invoke(messages, config={"configurable": {"thread_id": "user-42"}})
        model.get_conversation("user-42").turns[-1].status    # 'hit' on a follow-up turn
        ```

    Stream:
        ```python
        for chunk in model.stream("Tell me a joke"):
            print(chunk.text, end="")
        ```

    Async:
        ```python
        msg = await model.ainvoke("Hello")
        async for chunk in model.astream("Hello"):
            ...
        await model.aclose()
        ```

    Tool calling:
        ```python
        def get_weather(city: str) -> str:
            \"\"\"Weather in a city.\"\"\"
            return "sunny"

        msg = model.bind_tools([get_weather]).invoke("Weather in Paris?")
        msg.tool_calls   # needs a server started with --enable-auto-tool-choice and a tool parser
        ```

    Structured output:
        ```python
        from pydantic import BaseModel

        class Answer(BaseModel):
            value: int

        model.with_structured_output(Answer, method="json_schema").invoke("2 + 2?")
        ```

    Token usage:
        ```python
        msg = model.invoke("Hello")
        msg.usage_metadata   # {'input_tokens': 9, 'output_tokens': 12, 'total_tokens': 21, ...}
        ```
        ``get_num_tokens_from_messages`` estimates locally (no tokenizer is downloaded): characters / 4,
        scaled by the usage the server last reported; pass ``custom_get_token_ids`` for exact counts.

    Closing:
        ``model.close()`` / ``await model.aclose()`` stop the heartbeats and release the leases this
        instance holds on the router.
    """

    model_name: str = Field(alias="model")
    """Served model name."""

    openai_api_key: SecretStr | Callable[[], str] | None = Field(
        alias="api_key",
        default_factory=secret_from_env(["KVLEASE_API_KEY", "OPENAI_API_KEY"], default="EMPTY"),
    )
    """Bearer token for the router; vLLM without ``--api-key`` accepts any value."""

    openai_api_base: str | None = Field(
        alias="base_url", default_factory=from_env("KVLEASE_BASE_URL", default=None)
    )
    """Base URL of the router or vLLM server, ending in ``/v1``."""

    stream_usage: bool | None = True
    """Include token usage in streams (``stream_options.include_usage``)."""

    use_responses_api: bool | None = False
    """Always Chat Completions: the router relays ``/v1/chat/completions``."""

    conversation_id: str | None = None
    """Fixed conversation id of this instance (else thread id, else minted)."""

    reasoning_policy: ReasoningPolicy = "warn"
    """What happens to reasoning on the next turn: ``keep`` | ``warn`` | ``off``."""

    heartbeat: bool = True
    """Renew leases in the background between turns."""

    max_idle: float = Field(default=1800.0, gt=0)
    """Seconds after a conversation's last turn when heartbeats stop."""

    turn_log: str | None = None
    """Path of a JSONL turn log, or ``None``."""

    _minted_conversation_id: str = PrivateAttr(default_factory=mint_conversation_id)
    _kvlease_sync: Any = PrivateAttr(default=None)
    _kvlease_async: Any = PrivateAttr(default=None)
    _reasoning_field: str | None = PrivateAttr(default=None)
    _own_http_sync: Any = PrivateAttr(default=None)
    _own_http_async: Any = PrivateAttr(default=None)

    @field_validator("conversation_id")
    @classmethod
    def _validate_conversation_id(cls, value: str | None) -> str | None:
        return None if value is None else validate_conversation_id(value)

    @model_validator(mode="after")
    def validate_environment(self) -> Self:
        """Build the openai clients as ``ChatOpenAI`` does, then wrap them with the kvlease SDK."""
        if not self.openai_api_base:
            raise ValueError(
                "ChatKVLease needs the router's URL: pass base_url='http://HOST:PORT/v1' "
                "or set KVLEASE_BASE_URL"
            )
        if (self.client is not None and self.root_client is None) or (
            self.async_client is not None and self.root_async_client is None
        ):
            raise ValueError(
                "ChatKVLease builds its own openai clients on the kvlease SDK; pass http_client / "
                "http_async_client to customise the HTTP layer instead of client / async_client"
            )
        if self.openai_proxy is None:
            # langchain-openai shares one cached HTTP client per (base_url, timeout) among all its
            # models; an asyncio one then carries pooled connections from one event loop into the
            # next ("Event loop is closed"). Each ChatKVLease owns its pools (closed by close()).
            if self.http_client is None:
                self.http_client = self._own_http_sync = openai.DefaultHttpxClient()
            if self.http_async_client is None:
                self.http_async_client = self._own_http_async = openai.DefaultAsyncHttpxClient()
        super().validate_environment()
        options: dict[str, Any] = {
            "reasoning": self.reasoning_policy,
            "heartbeat": self.heartbeat,
            "max_idle": self.max_idle,
            "turn_log": self.turn_log,
        }
        if self.root_client is not None and self._kvlease_sync is None:
            self._kvlease_sync = kvlease.wrap(self.root_client, **options)
            self.root_client = self._kvlease_sync.openai
            self.client = self.root_client.chat.completions
        if self.root_async_client is not None and self._kvlease_async is None:
            self._kvlease_async = kvlease.wrap(self.root_async_client, **options)
            self.root_async_client = self._kvlease_async.openai
            self.async_client = self.root_async_client.chat.completions
        return self

    # -- identity ----------------------------------------------------------------------------------

    @property
    def _llm_type(self) -> str:
        return "chat-kvlease"

    @property
    def lc_secrets(self) -> dict[str, str]:
        return {"openai_api_key": "KVLEASE_API_KEY"}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "kvlease"
        return params

    @property
    def default_conversation_id(self) -> str:
        """The id used when a call names none: the ``conversation_id`` field, else the minted one."""
        return self.conversation_id or self._minted_conversation_id

    @property
    def kvlease_client(self) -> Any:
        """The SDK client behind the sync calls (``kvlease.wrap(OpenAI(...))``)."""
        return self._kvlease_sync

    @property
    def kvlease_async_client(self) -> Any:
        """The SDK client behind the async calls (``kvlease.wrap(AsyncOpenAI(...))``)."""
        return self._kvlease_async

    def get_conversation(self, conversation_id: str | None = None) -> Any:
        """The SDK ``Conversation`` (turn records: status, reused tokens, TTFT…) or ``None``.

        Looks in the sync and the async SDK client; with both used, the one with the later turn.
        """
        cid = conversation_id or self.default_conversation_id
        found = [
            kc.get_conversation(cid) for kc in (self._kvlease_sync, self._kvlease_async) if kc is not None
        ]
        found = [c for c in found if c is not None]
        if not found:
            return None
        return max(found, key=lambda c: len(c.turns))

    # -- Runnable entry points: the thread id of the call's RunnableConfig -------------------------

    def _with_thread_conversation(
        self, config: RunnableConfig | None, kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """Add ``conversation_id`` from ``configurable.thread_id`` unless the call or instance names one.

        ``ensure_config`` also reads the config of an enclosing runnable or LangGraph node.
        """
        if kwargs.get(CONVERSATION_KWARG) is not None or self.conversation_id is not None:
            return kwargs
        cid = thread_conversation_id(ensure_config(config))
        return kwargs if cid is None else {**kwargs, CONVERSATION_KWARG: cid}

    def invoke(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AIMessage:
        return super().invoke(input, config, stop=stop, **self._with_thread_conversation(config, kwargs))

    async def ainvoke(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AIMessage:
        return await super().ainvoke(
            input, config, stop=stop, **self._with_thread_conversation(config, kwargs)
        )

    def stream(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> Iterator[AIMessageChunk]:
        yield from super().stream(input, config, stop=stop, **self._with_thread_conversation(config, kwargs))

    async def astream(
        self,
        input: LanguageModelInput,
        config: RunnableConfig | None = None,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[AIMessageChunk]:
        async for chunk in super().astream(
            input, config, stop=stop, **self._with_thread_conversation(config, kwargs)
        ):
            yield chunk

    # -- request -----------------------------------------------------------------------------------

    def _get_request_payload(
        self,
        input_: LanguageModelInput,
        *,
        stop: list[str] | None = None,
        **kwargs: Any,
    ) -> dict:
        cid = resolve_conversation_id(
            per_call=kwargs.pop(CONVERSATION_KWARG, None),
            field=self.conversation_id,
            config=ensure_config(),
            minted=self._minted_conversation_id,
        )
        payload = super()._get_request_payload(input_, stop=stop, **kwargs)
        payload["extra_headers"] = {**(payload.get("extra_headers") or {}), HEADER_CONVERSATION_ID: cid}
        wire_messages = payload.get("messages")
        if isinstance(wire_messages, list):
            _reasoning.flatten_assistant_text(wire_messages)
            messages = self._convert_input(input_).to_messages()
            _reasoning.restore_tool_arguments(wire_messages, messages)
            if self.reasoning_policy == "keep":
                _reasoning.attach_reasoning(
                    wire_messages, messages, self._reasoning_field or REASONING_FIELDS[0]
                )
        return payload

    # -- generation: the SDK's turn record on the returned message ---------------------------------

    def _call_conversation_id(self, kwargs: dict[str, Any]) -> str:
        return resolve_conversation_id(
            per_call=kwargs.get(CONVERSATION_KWARG),
            field=self.conversation_id,
            config=ensure_config(),
            minted=self._minted_conversation_id,
        )

    def _turn_metadata(self, kvlease_client: Any, kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """``response_metadata["kvlease"]``: the SDK's record of the turn that just finished."""
        if kvlease_client is None:
            return None
        cid = self._call_conversation_id(kwargs)
        conversation = kvlease_client.get_conversation(cid)
        turns = conversation.turns if conversation is not None else []
        return _turn_summary(cid, turns[-1] if turns else None)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        result = super()._generate(messages, stop=stop, run_manager=run_manager, **kwargs)
        _annotate(result, self._turn_metadata(self._kvlease_sync, kwargs))
        return result

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        result = await super()._agenerate(messages, stop=stop, run_manager=run_manager, **kwargs)
        _annotate(result, self._turn_metadata(self._kvlease_async, kwargs))
        return result

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        yield from super()._stream(messages, stop=stop, run_manager=run_manager, **kwargs)
        # the response stream is closed here, so the SDK has recorded the turn
        if (meta := self._turn_metadata(self._kvlease_sync, kwargs)) is not None:
            yield _metadata_chunk(meta)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        async for chunk in super()._astream(messages, stop=stop, run_manager=run_manager, **kwargs):
            yield chunk
        if (meta := self._turn_metadata(self._kvlease_async, kwargs)) is not None:
            yield _metadata_chunk(meta)

    # -- response ----------------------------------------------------------------------------------

    def _create_chat_result(
        self,
        response: dict | openai.BaseModel,
        generation_info: dict | None = None,
    ) -> ChatResult:
        result = super()._create_chat_result(response, generation_info)
        if isinstance(response, dict):
            wire_choices = response.get("choices") or []
        else:
            wire_choices = [
                c.message.model_dump(exclude={"parsed"}, warnings=False)
                for c in getattr(response, "choices", None) or []
            ]
            wire_choices = [{"message": m} for m in wire_choices]
        for generation, choice in zip(result.generations, wire_choices):
            message = generation.message
            message.response_metadata["model_provider"] = _reasoning.MODEL_PROVIDER
            wire_message = choice.get("message") if isinstance(choice, dict) else None
            if isinstance(wire_message, dict) and (
                raw := _reasoning.raw_tool_arguments(wire_message.get("tool_calls"))
            ):
                message.additional_kwargs[_reasoning.RAW_TOOL_ARGUMENTS_KEY] = raw
            found = _reasoning.reasoning_from_wire(wire_message)
            if found is not None:
                field, text = found
                self._reasoning_field = field
                message.additional_kwargs[_reasoning.LC_REASONING_KEY] = text
                message.response_metadata[_reasoning.REASONING_FIELD_KEY] = field
        if result.llm_output is not None:
            result.llm_output["model_provider"] = _reasoning.MODEL_PROVIDER
        return result

    def _convert_chunk_to_generation_chunk(
        self,
        chunk: dict,
        default_chunk_class: type,
        base_generation_info: dict | None,
    ) -> ChatGenerationChunk | None:
        generation = super()._convert_chunk_to_generation_chunk(
            chunk, default_chunk_class, base_generation_info
        )
        if generation is None:
            return None
        message = generation.message
        message.response_metadata["model_provider"] = _reasoning.MODEL_PROVIDER
        choices = chunk.get("choices") or (chunk.get("chunk") or {}).get("choices") or []
        if choices and isinstance(message, AIMessageChunk):
            delta = choices[0].get("delta") or {}
            if raw := _reasoning.raw_tool_arguments(delta.get("tool_calls")):
                message.additional_kwargs[_reasoning.RAW_TOOL_ARGUMENTS_KEY] = raw
            found = _reasoning.reasoning_from_wire(delta)
            if found is not None:
                field, text = found
                self._reasoning_field = field
                message.additional_kwargs[_reasoning.LC_REASONING_KEY] = text
            # merged chunks concatenate strings: name the field once, on the finishing chunk
            if choices[0].get("finish_reason") and self._reasoning_field is not None:
                message.response_metadata[_reasoning.REASONING_FIELD_KEY] = self._reasoning_field
        return generation

    # -- token counting without tiktoken downloads -------------------------------------------------

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids from ``custom_get_token_ids``; the served model's tokenizer is not known here."""
        if self.custom_get_token_ids is not None:
            return self.custom_get_token_ids(text)
        raise NotImplementedError(
            "ChatKVLease does not know the served model's tokenizer; pass "
            "custom_get_token_ids=<the model's tokenizer>.encode for token ids"
        )

    def get_num_tokens(self, text: str) -> int:
        """Exact with ``custom_get_token_ids``, else an estimate of one token per four characters."""
        if self.custom_get_token_ids is not None:
            return len(self.custom_get_token_ids(text))
        return math.ceil(len(text) / 4.0)

    def get_num_tokens_from_messages(
        self,
        messages: Sequence[BaseMessage],
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool] | None = None,
        *,
        allow_fetching_images: bool = True,
    ) -> int:
        """Estimate a prompt's tokens locally (``ChatOpenAI``'s count needs tiktoken downloads).

        With ``custom_get_token_ids``: the sum over messages of their rendered text. Otherwise
        langchain-core's approximation, scaled by the usage the server reported on the latest
        AI message, so counts track the served tokenizer as a conversation goes on.
        """
        del allow_fetching_images  # images are counted at a fixed cost, never fetched
        if self.custom_get_token_ids is not None:
            return super(BaseChatOpenAI, self).get_num_tokens_from_messages(list(messages), tools=tools)
        tool_list = [t for t in tools or [] if isinstance(t, (BaseTool, dict))] or None
        return count_tokens_approximately(messages, tools=tool_list, use_usage_metadata_scaling=True)

    # -- lifecycle ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the sync client's heartbeats and release its leases (idempotent)."""
        if self._kvlease_sync is not None:
            self._kvlease_sync.close()
        if self._own_http_sync is not None:
            self._own_http_sync.close()

    async def aclose(self) -> None:
        """Close both SDK clients (the async one needs the running loop)."""
        self.close()
        if self._kvlease_async is not None:
            await self._kvlease_async.close()
        if self._own_http_async is not None:
            await self._own_http_async.aclose()


def _turn_summary(conversation_id: str, turn: Any) -> dict[str, Any]:
    """JSON-safe summary of an SDK ``Turn`` (checkpointers serialize ``response_metadata``)."""
    if turn is None:
        return {TurnLogKey.CONVERSATION_ID: conversation_id}
    status = getattr(turn.status, "value", turn.status)
    history = getattr(turn.history, "value", turn.history)
    return {  # the turn log's keys, and ``reuse_forced_off`` (the log's ``reuse_off``)
        TurnLogKey.CONVERSATION_ID: conversation_id,
        TurnLogKey.TURN: turn.index,
        TurnLogKey.STATUS: status,
        TurnLogKey.REUSED_TOKENS: turn.reused_tokens,
        TurnLogKey.TTFT_S: turn.ttft_s,
        TurnLogKey.HISTORY: history,
        "reuse_forced_off": turn.reuse_forced_off,
    }


def _annotate(result: ChatResult, meta: dict[str, Any] | None) -> None:
    if meta is not None and result.generations:
        result.generations[0].message.response_metadata[KVLEASE_METADATA_KEY] = meta


def _metadata_chunk(meta: dict[str, Any]) -> ChatGenerationChunk:
    """An empty closing chunk carrying the turn record (merges into the streamed message)."""
    return ChatGenerationChunk(
        message=AIMessageChunk(content="", response_metadata={KVLEASE_METADATA_KEY: meta})
    )
