"""The public face of the SDK: ``kvlease.wrap``, the wrapped clients and conversations.

``wrap(OpenAI(...))`` builds an openai client (``.openai``) whose HTTP client sends through
:class:`~kvlease._transport.KVTransport` over the original client's own HTTP client, so everything
kvlease does travels with that openai client, also when it is handed to another framework that only
sets the ``X-Conversation-Id`` header. A :class:`Conversation` is that client with the header set.
"""

from __future__ import annotations

import functools
import inspect
import os
import secrets
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Generic, TypeVar, overload

import openai

from kvlease import protocol
from kvlease._core import ConversationState, Tracker, Turn
from kvlease._http import hx, inner_http_client
from kvlease._keeper import AsyncLeaseKeeper, LeaseKeeper
from kvlease._renewal import RetryPolicy
from kvlease._strip import HistoryClass, ReasoningPolicy
from kvlease._transport import AsyncKVTransport, KVTransport
from kvlease._turnlog import TurnLog

__all__ = ["AsyncConversation", "AsyncKVLeaseClient", "Conversation", "KVLeaseClient", "wrap"]

C = TypeVar("C", openai.OpenAI, openai.AsyncOpenAI)


def _mint_id() -> str:
    return "kvl-" + secrets.token_urlsafe(18).replace("_", ".")


def _turn_log(turn_log: str | os.PathLike[str] | TurnLog | None) -> TurnLog | None:
    if turn_log is None or isinstance(turn_log, TurnLog):
        return turn_log
    return TurnLog(turn_log)


class _Bound:
    """An openai resource (``chat``, ``chat.completions``, ``…with_raw_response``) whose methods send
    ``X-Conversation-Id``: the real openai methods, without an openai client copy per conversation
    (a few hundred bytes instead of a few kilobytes, for agents with thousands of conversations)."""

    __slots__ = ("_cid", "_target")

    def __init__(self, target: Any, conversation_id: str) -> None:
        self._target = target
        self._cid = conversation_id

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if name.startswith("_") or isinstance(value, (str, bytes, int, float, bool, type(None), type)):
            return value
        if inspect.ismethod(value) or inspect.isfunction(value):
            cid = self._cid

            @functools.wraps(value)
            def call(*args: Any, **kwargs: Any) -> Any:
                extra = kwargs.get("extra_headers") or {}
                kwargs["extra_headers"] = {**extra, protocol.HEADER_CONVERSATION_ID: cid}
                return value(*args, **kwargs)

            return call
        return _Bound(value, self._cid)

    def __repr__(self) -> str:
        return f"<conversation {self._cid!r} {self._target!r}>"


class _ConversationBase(Generic[C]):
    """What sync and async conversations share: id, turn records, the bound openai client."""

    def __init__(self, base: C, state: ConversationState) -> None:
        self._base: C = base
        self._state = state
        self._client: C | None = None

    @property
    def id(self) -> str:
        return self._state.id

    @property
    def client(self) -> C:
        """The wrapped openai client with ``X-Conversation-Id`` set on every request: hand it to other
        frameworks to keep them in this conversation."""
        if self._client is None:
            self._client = self._base.with_options(default_headers={protocol.HEADER_CONVERSATION_ID: self.id})
        return self._client

    @property
    def chat(self) -> Any:
        """``conv.chat.completions.create(...)``: the openai method, in this conversation."""
        return _Bound(self._base.chat, self._state.id)

    @property
    def completions(self) -> Any:
        """``conv.completions.create(...)``: legacy completions, in this conversation."""
        return _Bound(self._base.completions, self._state.id)

    @property
    def turns(self) -> list[Turn]:
        """Completed turns, oldest first (a copy)."""
        return list(self._state.turns)

    @property
    def reuse_off_turns(self) -> int:
        """Turns sent with reuse off (:data:`~kvlease.protocol.HEADER_REUSE`) because the history was not exact."""
        return sum(1 for t in self._state.turns if t.reuse_forced_off)

    @property
    def last_history(self) -> HistoryClass | None:
        return self._state.turns[-1].history if self._state.turns else None

    @property
    def closed(self) -> bool:
        return self._state.closed

    def __repr__(self) -> str:
        return f"<{type(self).__name__} id={self.id!r} turns={len(self._state.turns)}>"


class Conversation(_ConversationBase[openai.OpenAI]):
    """One conversation of a :class:`KVLeaseClient`; leaving the ``with`` block releases its lease."""

    def __init__(self, owner: KVLeaseClient, state: ConversationState) -> None:
        super().__init__(owner.openai, state)
        self._owner = owner

    def close(self) -> None:
        """Release the lease (``DELETE /v1/kvlease/conversations/{id}``) and forget the conversation."""
        self._owner._close_conversation(self.id)

    def __enter__(self) -> Conversation:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncConversation(_ConversationBase[openai.AsyncOpenAI]):
    """One conversation of an :class:`AsyncKVLeaseClient` (``async with``; ``await conv.aclose()``)."""

    def __init__(self, owner: AsyncKVLeaseClient, state: ConversationState) -> None:
        super().__init__(owner.openai, state)
        self._owner = owner

    async def aclose(self) -> None:
        await self._owner._close_conversation(self.id)

    close = aclose

    async def __aenter__(self) -> AsyncConversation:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class _ClientBase:
    def __init__(
        self,
        reasoning: ReasoningPolicy,
        turn_log: str | os.PathLike[str] | TurnLog | None,
    ) -> None:
        self.turn_log = _turn_log(turn_log)
        self._tracker = Tracker(reasoning, on_turn=self.turn_log.write if self.turn_log is not None else None)
        self._conversations: dict[str, Any] = {}

    @property
    def reasoning(self) -> ReasoningPolicy:
        return self._tracker.policy

    @property
    def reuse_off_turns(self) -> int:
        """Turns of this client sent with the reuse opt-out (all conversations)."""
        return self._tracker.reuse_off_turns

    def _dropped(self, conversation_id: str) -> None:
        """The keeper stopped renewing a conversation (idle or unknown): forget auto-registered ones."""
        if self._tracker.forget(conversation_id, only_implicit=True) is not None:
            self._conversations.pop(conversation_id, None)

    def _state_for(self, id: str | None) -> ConversationState:
        cid = _mint_id() if id is None else protocol.validate_conversation_id(id)
        return self._tracker.open(cid, explicit=True)

    def conversation_ids(self) -> list[str]:
        """Ids of the open conversations (explicit and auto-registered)."""
        return [s.id for s in self._tracker.states()]


class KVLeaseClient(_ClientBase):
    """A sync openai client with kvlease behaviour (see :func:`wrap`)."""

    def __init__(
        self,
        client: openai.OpenAI,
        *,
        reasoning: ReasoningPolicy = "warn",
        heartbeat: bool = True,
        max_idle: float = 1800.0,
        turn_log: str | os.PathLike[str] | TurnLog | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        super().__init__(reasoning, turn_log)
        inner: hx.Client = inner_http_client(client)
        self.keeper = LeaseKeeper(
            inner, max_idle=max_idle, heartbeat=heartbeat, retry=retry, on_drop=self._dropped
        )
        self._tracker.lease_sink = self.keeper
        self._http = hx.Client(transport=KVTransport(inner, self._tracker), trust_env=False)
        #: The openai client to use (or hand to other frameworks): every request carrying
        #: ``X-Conversation-Id`` is tracked.
        self.openai: openai.OpenAI = client.with_options(http_client=self._http)

    def conversation(self, id: str | None = None) -> Conversation:
        """A conversation with a fresh id, or ``id`` (e.g. a thread id); a bad id raises
        :class:`~kvlease.InvalidConversationId` (a ``ValueError``) before any request."""
        state = self._state_for(id)
        conv = self._conversations.get(state.id)
        if conv is None or conv._state is not state:
            conv = self._conversations[state.id] = Conversation(self, state)
        return conv

    def get_conversation(self, id: str) -> Conversation | None:
        """The open conversation ``id`` (also one auto-registered from a header), or ``None``."""
        state = self._tracker.get(id)
        if state is None or state.closed:
            return None
        conv = self._conversations.get(id)
        if conv is None or conv._state is not state:
            conv = self._conversations[id] = Conversation(self, state)
        return conv

    def _close_conversation(self, conversation_id: str) -> None:
        self._tracker.forget(conversation_id)
        self._conversations.pop(conversation_id, None)
        self.keeper.release(conversation_id)

    def close(self) -> None:
        """Stop the lease keeper and release every open conversation. The openai client passed to
        :func:`wrap` stays open (it is the caller's)."""
        self.keeper.close()
        for state in self._tracker.states():
            self._tracker.forget(state.id)
        self._conversations.clear()
        self._http.close()
        if self.turn_log is not None:
            self.turn_log.close()

    def __enter__(self) -> KVLeaseClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncKVLeaseClient(_ClientBase):
    """An asyncio openai client with kvlease behaviour (see :func:`wrap`)."""

    def __init__(
        self,
        client: openai.AsyncOpenAI,
        *,
        reasoning: ReasoningPolicy = "warn",
        heartbeat: bool = True,
        max_idle: float = 1800.0,
        turn_log: str | os.PathLike[str] | TurnLog | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        super().__init__(reasoning, turn_log)
        inner: hx.AsyncClient = inner_http_client(client)
        self.keeper = AsyncLeaseKeeper(
            inner, max_idle=max_idle, heartbeat=heartbeat, retry=retry, on_drop=self._dropped
        )
        self._tracker.lease_sink = self.keeper
        self._http = hx.AsyncClient(transport=AsyncKVTransport(inner, self._tracker), trust_env=False)
        self.openai: openai.AsyncOpenAI = client.with_options(http_client=self._http)

    def conversation(self, id: str | None = None) -> AsyncConversation:
        state = self._state_for(id)
        conv = self._conversations.get(state.id)
        if conv is None or conv._state is not state:
            conv = self._conversations[state.id] = AsyncConversation(self, state)
        return conv

    def get_conversation(self, id: str) -> AsyncConversation | None:
        state = self._tracker.get(id)
        if state is None or state.closed:
            return None
        conv = self._conversations.get(id)
        if conv is None or conv._state is not state:
            conv = self._conversations[id] = AsyncConversation(self, state)
        return conv

    async def _close_conversation(self, conversation_id: str) -> None:
        self._tracker.forget(conversation_id)
        self._conversations.pop(conversation_id, None)
        await self.keeper.release(conversation_id)

    async def close(self) -> None:
        await self.keeper.close()
        for state in self._tracker.states():
            self._tracker.forget(state.id)
        self._conversations.clear()
        await self._http.aclose()
        if self.turn_log is not None:
            self.turn_log.close()

    aclose = close

    async def __aenter__(self) -> AsyncKVLeaseClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


@overload
def wrap(
    client: openai.OpenAI,
    *,
    reasoning: ReasoningPolicy = ...,
    heartbeat: bool = ...,
    max_idle: float = ...,
    turn_log: str | os.PathLike[str] | TurnLog | None = ...,
    retry: RetryPolicy | None = ...,
) -> KVLeaseClient: ...
@overload
def wrap(
    client: openai.AsyncOpenAI,
    *,
    reasoning: ReasoningPolicy = ...,
    heartbeat: bool = ...,
    max_idle: float = ...,
    turn_log: str | os.PathLike[str] | TurnLog | None = ...,
    retry: RetryPolicy | None = ...,
) -> AsyncKVLeaseClient: ...
def wrap(
    client: openai.OpenAI | openai.AsyncOpenAI,
    *,
    reasoning: ReasoningPolicy = "warn",
    heartbeat: bool = True,
    max_idle: float = 1800.0,
    turn_log: str | os.PathLike[str] | TurnLog | None = None,
    retry: RetryPolicy | None = None,
) -> KVLeaseClient | AsyncKVLeaseClient:
    """Give an ``openai.OpenAI`` (or ``AsyncOpenAI``) client kvlease behaviour.

    - ``reasoning``: ``"warn"`` detects a resent history that is not what the model produced
      (stripped reasoning, edited content or tool calls, rewritten history), sends
      reuse off for that turn (:data:`~kvlease.protocol.HEADER_REUSE`) and warns once per conversation
      (:class:`~kvlease.ReuseOffWarning`); ``"keep"`` also re-attaches stripped reasoning under the
      field name the server used; ``"off"`` disables detection.
    - ``heartbeat``: renew open leases from a background thread (task) before they expire.
    - ``max_idle``: seconds without a turn after which a conversation is no longer renewed, and
      released.
    - ``turn_log``: a path or :class:`~kvlease.TurnLog` receiving one JSON line per turn.
    - ``retry``: the retry policy of lease renewals.
    """
    options: Mapping[str, Any] = {
        "reasoning": reasoning,
        "heartbeat": heartbeat,
        "max_idle": max_idle,
        "turn_log": turn_log,
        "retry": retry,
    }
    if isinstance(client, openai.AsyncOpenAI):
        return AsyncKVLeaseClient(client, **options)
    if isinstance(client, openai.OpenAI):
        return KVLeaseClient(client, **options)
    raise TypeError(f"kvlease.wrap expects openai.OpenAI or openai.AsyncOpenAI, not {type(client).__name__}")
