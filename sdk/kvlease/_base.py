"""What the sync and async clients share, without their IO.

:class:`BaseConversation` is a conversation less its ``close``; :class:`BaseClient` is a client less
its HTTP client, keeper and ``close``: it mints or validates conversation ids, keeps one conversation
object per open conversation, and does the bookkeeping of closing one or all of them. The shells in
:mod:`kvlease._client` add the IO, and differ only in ``await``.
"""

from __future__ import annotations

import functools
import os
import secrets
import types
from collections.abc import Callable, Mapping
from typing import Any, Final, Generic, TypeAlias, TypeVar

import openai

from kvlease import protocol
from kvlease._core import ConversationState, LeaseSink, Tracker, Turn
from kvlease._strip import HistoryClass, ReasoningPolicy
from kvlease._turnlog import TurnLog
from kvlease._wire import BODY_NAME

__all__ = ["BaseClient", "BaseConversation", "mint_id"]

C = TypeVar("C", openai.OpenAI, openai.AsyncOpenAI)
ConvT = TypeVar("ConvT", bound="BaseConversation[Any]")
SinkT = TypeVar("SinkT", bound=LeaseSink)

#: What ``turn_log=`` accepts: a path, a :class:`~kvlease.TurnLog`, or ``None``.
_TurnLogArg: TypeAlias = str | os.PathLike[str] | TurnLog | None


def mint_id() -> str:
    return "kvl-" + secrets.token_urlsafe(18).replace("_", ".")


def _turn_log(turn_log: _TurnLogArg) -> TurnLog | None:
    if turn_log is None or isinstance(turn_log, TurnLog):
        return turn_log
    return TurnLog(turn_log)


class _Bound:
    """An openai resource (``chat``, ``chat.completions``, ``…with_raw_response``) whose methods send
    ``X-Conversation-Id``: the real openai methods, without an openai client copy per conversation
    (a few hundred bytes instead of a few kilobytes, for agents with thousands of conversations)."""

    __slots__ = ("__dict__", "_cid", "_target")

    def __init__(self, target: Any, conversation_id: str) -> None:
        self._target = target
        self._cid = conversation_id

    def __getattr__(self, name: str) -> Any:
        """The first lookup of ``name``: the bound resource or method is kept as an instance
        attribute (an agent looks up ``conv.chat.completions.create`` on every turn, and openai's
        resources and their methods do not change), so later lookups are plain attribute reads that
        do not come here."""
        value = getattr(self._target, name)
        if name.startswith("_") or isinstance(value, _PLAIN):
            return value
        if isinstance(value, _METHODS):
            child: Any = _Call(value, self._cid, body=name in _BODY_METHODS)
        else:
            child = _Bound(value, self._cid)
        if len(self.__dict__) < _MAX_CHILDREN:
            self.__dict__[name] = child
        return child

    def __repr__(self) -> str:
        return f"<conversation {self._cid!r} {self._target!r}>"


_PLAIN: Final = (str, bytes, int, float, bool, type(None), type)
_HEADER: Final = protocol.HEADER_CONVERSATION_ID
#: Bound names one resource remembers (openai's have a handful; ``getattr`` of arbitrary names is
#: not a way to grow a conversation without bound).
_MAX_CHILDREN: Final = 32
_METHODS: Final = (types.MethodType, types.FunctionType)
#: The methods of ``chat.completions`` and ``completions`` that POST a completion request: the id
#: also goes into their body, as openai's ``extra_body`` (openai writes it into the JSON it
#: serializes, so the transport need not rewrite the body; others get the header only)
_BODY_METHODS: Final = frozenset({"create", "parse", "stream"})


class _Call:
    """An openai method called with ``X-Conversation-Id`` added to its ``extra_headers`` (and, for a
    completion request, ``conversation_id`` to its ``extra_body``, unless the caller set one). It looks
    like the method as ``functools.wraps`` would show it (``__wrapped__``, so ``inspect.signature``
    gives the method's; ``__name__``, ``__qualname__``, ``__doc__``) at a fraction of the cost of
    building a wrapper function on every ``conv.chat.completions.create`` lookup."""

    __slots__ = ("__wrapped__", "_body", "_cid")

    def __init__(self, method: Callable[..., Any], conversation_id: str, *, body: bool = False) -> None:
        self.__wrapped__ = method
        self._cid = conversation_id
        self._body = body

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cid = self._cid
        extra = kwargs.get("extra_headers")
        kwargs["extra_headers"] = {**extra, _HEADER: cid} if extra else {_HEADER: cid}
        if self._body:
            body = kwargs.get("extra_body")
            if not body:
                kwargs["extra_body"] = {BODY_NAME: cid}
            elif isinstance(body, Mapping) and BODY_NAME not in body:
                kwargs["extra_body"] = {BODY_NAME: cid, **body}
        return self.__wrapped__(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # __name__, __qualname__, __self__, ...
        return getattr(self.__wrapped__, name)

    @property  # the method's docstring, not this class's
    def __doc__(self) -> str | None:  # type: ignore[override]
        return self.__wrapped__.__doc__

    def __repr__(self) -> str:
        return f"<conversation {self._cid!r} {self.__wrapped__!r}>"


class BaseConversation(Generic[C]):
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

    # cached_property: built on the first lookup, then an instance attribute (no call per turn)
    @functools.cached_property
    def chat(self) -> Any:
        """``conv.chat.completions.create(...)``: the openai method, in this conversation."""
        return _Bound(self._base.chat, self._state.id)

    @functools.cached_property
    def completions(self) -> Any:
        """``conv.completions.create(...)``: legacy completions, in this conversation."""
        return _Bound(self._base.completions, self._state.id)

    @property
    def turns(self) -> list[Turn]:
        """Completed turns, oldest first (a copy)."""
        return list(self._state.turn_list())

    @property
    def reuse_off_turns(self) -> int:
        """Turns sent with reuse off (:data:`~kvlease.protocol.HEADER_REUSE`) because the history was not exact."""
        return sum(1 for t in self._state.turn_list() if t.reuse_forced_off)

    @property
    def last_history(self) -> HistoryClass | None:
        return self._state.turn_list()[-1].history if self._state.turns else None

    @property
    def closed(self) -> bool:
        return self._state.closed

    def __repr__(self) -> str:
        return f"<{type(self).__name__} id={self.id!r} turns={len(self._state.turns)}>"


class BaseClient(Generic[ConvT]):
    """What sync and async clients share: the tracker, the turn log and the open conversations.
    A shell sets its keeper with :meth:`_lease_sink` and builds its conversations in
    :meth:`_new_conversation`."""

    def __init__(self, reasoning: ReasoningPolicy, turn_log: _TurnLogArg) -> None:
        self.turn_log = _turn_log(turn_log)
        self._tracker = Tracker(reasoning, on_turn=self.turn_log.write if self.turn_log is not None else None)
        self._conversations: dict[str, ConvT] = {}

    @property
    def reasoning(self) -> ReasoningPolicy:
        return self._tracker.policy

    @property
    def reuse_off_turns(self) -> int:
        """Turns of this client sent with the reuse opt-out (all conversations)."""
        return self._tracker.reuse_off_turns

    def conversation(self, id: str | None = None) -> ConvT:
        """A conversation with a fresh id, or ``id`` (e.g. a thread id); a bad id raises
        :class:`~kvlease.InvalidConversationId` (a ``ValueError``) before any request."""
        cid = mint_id() if id is None else protocol.validate_conversation_id(id)
        return self._bind(self._tracker.open(cid, explicit=True))

    def get_conversation(self, id: str) -> ConvT | None:
        """The open conversation ``id`` (also one auto-registered from a header), or ``None``."""
        state = self._tracker.get(id)
        if state is None or state.closed:
            return None
        return self._bind(state)

    def conversation_ids(self) -> list[str]:
        """Ids of the open conversations (explicit and auto-registered)."""
        return [s.id for s in self._tracker.states()]

    # ------------------------------------------------------------------ for the shells
    def _new_conversation(self, state: ConversationState) -> ConvT:
        raise NotImplementedError

    def _lease_sink(self, keeper: SinkT) -> SinkT:
        """Finished turns that carry a lease go to ``keeper``; returns it."""
        self._tracker.lease_sink = keeper
        return keeper

    def _bind(self, state: ConversationState) -> ConvT:
        conv = self._conversations.get(state.id)
        if conv is None or conv._state is not state:
            conv = self._conversations[state.id] = self._new_conversation(state)
        return conv

    def _dropped(self, conversation_id: str) -> None:
        """The keeper stopped renewing a conversation (idle or unknown): close auto-registered ones,
        keeping their state for a next turn with the same id (the strip detector outlives the lease)."""
        if self._tracker.forget(conversation_id, only_implicit=True, retire=True) is not None:
            self._conversations.pop(conversation_id, None)

    def _forget(self, conversation_id: str) -> None:
        """Before its lease is released: the conversation is closed."""
        self._tracker.forget(conversation_id)
        self._conversations.pop(conversation_id, None)

    def _forget_all(self) -> None:
        """After the keeper closed: every conversation is closed."""
        for state in self._tracker.states():
            self._tracker.forget(state.id)
        self._conversations.clear()

    def _close_turn_log(self) -> None:
        if self.turn_log is not None:
            self.turn_log.close()
