"""The public face of the SDK: ``kvlease.wrap``, the wrapped clients and conversations.

``wrap(OpenAI(...))`` builds an openai client (``.openai``) whose HTTP client sends through
:class:`~kvlease._transport.KVTransport` over the original client's own HTTP client, so everything
kvlease does travels with that openai client, also when it is handed to another framework that only
sets the ``X-Conversation-Id`` header. A :class:`Conversation` is that client with the header set.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import TracebackType
from typing import Any, overload

import openai

from kvlease._base import BaseClient, BaseConversation
from kvlease._core import ConversationState
from kvlease._http import hx, inner_http_client
from kvlease._keeper import AsyncLeaseKeeper, LeaseKeeper
from kvlease._renewal import RetryPolicy
from kvlease._strip import ReasoningPolicy
from kvlease._transport import AsyncKVClient, AsyncKVTransport, KVClient, KVTransport
from kvlease._turnlog import TurnLog

__all__ = ["AsyncConversation", "AsyncKVLeaseClient", "Conversation", "KVLeaseClient", "wrap"]


class Conversation(BaseConversation[openai.OpenAI]):
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


class AsyncConversation(BaseConversation[openai.AsyncOpenAI]):
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


class KVLeaseClient(BaseClient[Conversation]):
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
        self.keeper = self._lease_sink(
            LeaseKeeper(inner, max_idle=max_idle, heartbeat=heartbeat, retry=retry, on_drop=self._dropped)
        )
        self._http: hx.Client = KVClient(KVTransport(inner, self._tracker))
        #: The openai client to use (or hand to other frameworks): every request carrying
        #: ``X-Conversation-Id`` is tracked.
        self.openai: openai.OpenAI = client.with_options(http_client=self._http)

    @property
    def http_client(self) -> hx.Client:
        """The HTTP client carrying kvlease (an ``httpx2.Client`` under openai 3.x, ``httpx.Client``
        under 2.x), for frameworks that take an HTTP client rather than an openai client: pass it
        with a default ``X-Conversation-Id`` header (``kvlease.protocol.HEADER_CONVERSATION_ID``).
        It sends through your openai client's own HTTP client; :meth:`close` closes it."""
        return self._http

    def _new_conversation(self, state: ConversationState) -> Conversation:
        return Conversation(self, state)

    def _close_conversation(self, conversation_id: str) -> None:
        self._forget(conversation_id)
        self.keeper.release(conversation_id)

    def close(self) -> None:
        """Stop the lease keeper and release every open conversation. The openai client passed to
        :func:`wrap` stays open (it is the caller's)."""
        self.keeper.close()
        self._forget_all()
        self._http.close()
        self._close_turn_log()

    def __enter__(self) -> KVLeaseClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncKVLeaseClient(BaseClient[AsyncConversation]):
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
        self.keeper = self._lease_sink(
            AsyncLeaseKeeper(
                inner, max_idle=max_idle, heartbeat=heartbeat, retry=retry, on_drop=self._dropped
            )
        )
        self._http: hx.AsyncClient = AsyncKVClient(AsyncKVTransport(inner, self._tracker))
        self.openai: openai.AsyncOpenAI = client.with_options(http_client=self._http)

    @property
    def http_client(self) -> hx.AsyncClient:
        """The async HTTP client carrying kvlease (see :attr:`KVLeaseClient.http_client`)."""
        return self._http

    def _new_conversation(self, state: ConversationState) -> AsyncConversation:
        return AsyncConversation(self, state)

    async def _close_conversation(self, conversation_id: str) -> None:
        self._forget(conversation_id)
        await self.keeper.release(conversation_id)

    async def close(self) -> None:
        """Stop the keeper and release every open conversation; works from any event loop (as
        ``AsyncOpenAI.close`` does). The openai client passed to :func:`wrap` stays open."""
        await self.keeper.close()
        self._forget_all()
        await self._http.aclose()
        self._close_turn_log()

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
      (stripped reasoning, edited content or tool calls, rewritten history) and warns once per kind
      (:class:`~kvlease.ReuseOffWarning`); behind a router whose prefill node verifies tokens reuse
      stays on (the verified prefix is reused), else that turn is sent with reuse off
      (:data:`~kvlease.protocol.HEADER_REUSE`); ``"keep"`` also re-attaches stripped reasoning under the
      field name the server used; ``"off"`` disables detection.
    - ``heartbeat``: renew open leases from a background thread (task) before they expire.
    - ``max_idle``: seconds without a turn after which a conversation is no longer renewed, and
      released.
    - ``turn_log``: a path or :class:`~kvlease.TurnLog` receiving one JSON line per turn.
    - ``retry``: the retry policy of lease renewals.
    """
    # keyword arguments, not a dict display: "reasoning" is also a wire key (REASONING_FIELDS)
    options: Mapping[str, Any] = dict(
        reasoning=reasoning, heartbeat=heartbeat, max_idle=max_idle, turn_log=turn_log, retry=retry
    )
    if isinstance(client, openai.AsyncOpenAI):
        return AsyncKVLeaseClient(client, **options)
    if isinstance(client, openai.OpenAI):
        return KVLeaseClient(client, **options)
    raise TypeError(f"kvlease.wrap expects openai.OpenAI or openai.AsyncOpenAI, not {type(client).__name__}")
