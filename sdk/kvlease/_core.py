"""The SDK's shared, IO-free core: conversations, turn records and per-request decisions.

The sync and async transports are thin shells over :class:`Tracker`: ``begin`` decides what one
outgoing request becomes (body with ``conversation_id``, the reuse opt-out header, a repaired history
under ``reasoning="keep"``), ``response`` reads the kvlease response headers, and ``finish`` turns what
the response stream showed into a :class:`Turn`, feeds the strip detector and hands the lease to the
keeper. Times are passed in; nothing here sleeps or does IO (the turn log write is the caller's
callback).
"""

from __future__ import annotations

import json
import logging
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, Protocol

from kvlease import protocol
from kvlease._errors import ReuseOffWarning
from kvlease._observe import ResponseObserver
from kvlease._strip import HistoryClass, ReasoningPolicy, StripDetector, Verdict
from kvlease.protocol import ReuseStatus

__all__ = ["ConversationState", "LeaseSink", "Pending", "Tracker", "Turn", "inject_conversation_id"]

log = logging.getLogger("kvlease")

#: Headers that make a lease request authorized like the chat request (copied to renew/release).
AUTH_HEADERS: Final = ("authorization", "api-key", protocol.DEFAULT_TENANT_HEADER.lower())
_BODY_KEY: Final = b'"' + protocol.BODY_CONVERSATION_ID.encode() + b'"'
_CHAT_SUFFIX: Final = "/chat/completions"
_COMPLETIONS_SUFFIX: Final = "/completions"


@dataclass(frozen=True, slots=True)
class Turn:
    """One completed turn (a 2xx completion response read to its end or closed).

    Times: ``started_at`` / ``ended_at`` are epoch seconds; ``ttft_s`` is seconds from sending to the
    first generated token of a stream, or to the response headers of a non-streaming call.
    ``status``, ``reused_tokens`` and ``ttl_s`` come from the kvlease response headers and are
    ``None`` when the server sent none (plain vLLM). ``prompt_tokens`` / ``completion_tokens`` come
    from the usage the server returned (``None`` when absent, e.g. a stream without
    ``stream_options={"include_usage": True}``).
    """

    index: int
    conversation_id: str
    started_at: float
    ended_at: float
    ttft_s: float | None
    prompt_tokens: int | None
    completion_tokens: int | None
    status: ReuseStatus | None
    reused_tokens: int | None
    ttl_s: float | None
    history: HistoryClass
    reuse_forced_off: bool
    reasoning_reattached: bool = False
    gap_s: float | None = None
    stream: bool = False


class ConversationState:
    """Everything the SDK remembers about one conversation (shared by the sync and async shells)."""

    __slots__ = ("closed", "detector", "explicit", "id", "last_ended_at", "turns", "warned")

    def __init__(self, conversation_id: str, policy: ReasoningPolicy, *, explicit: bool) -> None:
        self.id = conversation_id
        self.explicit = explicit  # opened with conversation(); else auto-registered from a header
        self.detector = StripDetector(policy)
        self.turns: list[Turn] = []
        self.warned = False
        self.closed = False
        self.last_ended_at: float | None = None


class LeaseSink(Protocol):
    """Where finished turns that carry a lease (an ``X-KVLease-TTL`` header) go: the lease keeper."""

    def activate(
        self, conversation_id: str, root: str, ttl: float, headers: Mapping[str, str], *, explicit: bool
    ) -> None: ...


class Pending:
    """One tracked request between ``begin`` and ``finish``."""

    __slots__ = (
        "body",
        "done",
        "header_at",
        "headers",
        "observer",
        "origin",
        "path",
        "reuse_off",
        "reused_tokens",
        "started_at",
        "state",
        "status",
        "status_code",
        "t0",
        "ttl",
        "verdict",
    )

    def __init__(
        self,
        state: ConversationState,
        verdict: Verdict | None,
        body: bytes,
        origin: str,
        path: str,
        headers: Mapping[str, str],
        t0: float,
        started_at: float,
    ) -> None:
        self.state = state
        self.verdict = verdict
        self.body = body
        self.reuse_off = verdict is not None and verdict.reuse_off
        self.origin = origin
        self.path = path
        self.headers = headers  # the request's headers: lease requests copy its authorization
        self.t0 = t0
        self.started_at = started_at
        self.status_code = 0
        self.status: ReuseStatus | None = None
        self.reused_tokens: int | None = None
        self.ttl: float | None = None
        self.observer: ResponseObserver | None = None
        self.done = False
        self.header_at = t0


def inject_conversation_id(body: bytes, conversation_id: str) -> bytes:
    """``body`` (a JSON object) with ``conversation_id`` added first, without re-serializing it.

    The id is validated (``[A-Za-z0-9._:-]``), so it needs no escaping. A body that already names the
    key, or is not a JSON object, is returned unchanged.
    """
    start = body.find(b"{")
    if start < 0 or body[:start].strip() or _BODY_KEY in body:
        return body
    rest = body[start + 1 :]
    head = _BODY_KEY + b':"' + conversation_id.encode("ascii") + b'"'
    return b"{" + head + (rest if rest.lstrip().startswith(b"}") else b"," + rest)


def router_root(origin: str, path: str) -> str:
    """Where a router's lease API lives, from a completion request's origin and path.

    ``http://h:8000`` + ``/v1/chat/completions`` -> ``http://h:8000`` (lease paths start with ``/v1``);
    a gateway prefix before ``/v1`` is kept.
    """
    for full in (protocol.CHAT_COMPLETIONS_PATH, protocol.COMPLETIONS_PATH):
        if path.endswith(full):
            return origin + path[: -len(full)]
    for suffix in (_CHAT_SUFFIX, _COMPLETIONS_SUFFIX):
        if path.endswith(suffix):
            return origin + path[: -len(suffix)]
    return origin


class Tracker:
    """Conversations of one wrapped client and the per-request decisions (see the module docstring)."""

    def __init__(
        self,
        policy: ReasoningPolicy,
        *,
        lease_sink: LeaseSink | None = None,
        on_turn: Callable[[Turn], None] | None = None,
    ) -> None:
        StripDetector(policy)  # validates the policy
        self.policy: ReasoningPolicy = policy
        self.lease_sink = lease_sink
        self.on_turn = on_turn
        self._lock = threading.Lock()
        self._conversations: dict[str, ConversationState] = {}
        self._bad_ids_warned: set[str] = set()
        self.reuse_off_turns = 0

    # --------------------------------------------------------------------------- conversations

    def open(self, conversation_id: str, *, explicit: bool = True) -> ConversationState:
        protocol.validate_conversation_id(conversation_id)
        with self._lock:
            state = self._conversations.get(conversation_id)
            if state is None or state.closed:
                state = ConversationState(conversation_id, self.policy, explicit=explicit)
                self._conversations[conversation_id] = state
            elif explicit:
                state.explicit = True
            return state

    def get(self, conversation_id: str) -> ConversationState | None:
        return self._conversations.get(conversation_id)

    def forget(self, conversation_id: str, *, only_implicit: bool = False) -> ConversationState | None:
        with self._lock:
            state = self._conversations.get(conversation_id)
            if state is None or (only_implicit and state.explicit):
                return None
            del self._conversations[conversation_id]
            state.closed = True
            return state

    def states(self) -> list[ConversationState]:
        with self._lock:
            return list(self._conversations.values())

    # --------------------------------------------------------------------------- requests

    def begin(
        self,
        conversation_id: str,
        origin: str,
        path: str,
        headers: Mapping[str, str],
        body: bytes,
        t0: float,
        started_at: float,
    ) -> Pending | None:
        """Decide what a POST carrying ``X-Conversation-Id`` becomes; ``None``: send it unchanged."""
        chat = path.endswith(_CHAT_SUFFIX)
        if not chat and not path.endswith(_COMPLETIONS_SUFFIX):
            return None
        try:
            protocol.validate_conversation_id(conversation_id)
        except protocol.InvalidConversationId as e:
            if conversation_id not in self._bad_ids_warned and len(self._bad_ids_warned) < 64:
                self._bad_ids_warned.add(conversation_id)
                log.warning(
                    "kvlease: not tracking a request with a bad %s header: %s",
                    protocol.HEADER_CONVERSATION_ID,
                    e,
                )
            return None
        state = self._conversations.get(conversation_id)
        if state is None or state.closed:
            state = self.open(conversation_id, explicit=False)
        verdict: Verdict | None = None
        if chat and self.policy != "off":
            try:
                data = json.loads(body)
            except ValueError:
                data = None
            messages = data.get("messages") if isinstance(data, dict) else None
            if isinstance(messages, list):
                with self._lock:
                    verdict = state.detector.inspect(messages)
                if verdict.repaired:
                    assert isinstance(data, dict)
                    data["messages"] = verdict.messages
                    data.setdefault(protocol.BODY_CONVERSATION_ID, conversation_id)
                    body = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        body = inject_conversation_id(body, conversation_id)
        pending = Pending(state, verdict, body, origin, path, headers, t0, started_at)
        if verdict is not None and verdict.reuse_off and not state.warned:
            state.warned = True
            warnings.warn(
                f"kvlease: conversation {conversation_id!r}: {verdict.detail}, so KV reuse is off for this "
                f"turn ({protocol.HEADER_REUSE}: {protocol.REUSE_OFF}) and the prompt is recomputed. "
                f"Fix: {verdict.fix}. (Warned once per conversation.)",
                ReuseOffWarning,
                stacklevel=2,
            )
        return pending

    def response(self, p: Pending, status_code: int, headers: Mapping[str, str], now: float) -> None:
        """The response headers of a tracked request arrived (``now``: the clock ``t0`` was read from)."""
        p.header_at = now
        p.status_code = status_code
        p.status = ReuseStatus.parse(headers.get(protocol.HEADER_STATUS))
        p.reused_tokens = _parse_int(headers.get(protocol.HEADER_REUSED_TOKENS))
        p.ttl = _parse_float(headers.get(protocol.HEADER_TTL))
        if 200 <= status_code < 300:
            content_type = headers.get("content-type") or ""
            p.observer = ResponseObserver(
                sse=content_type.startswith("text/event-stream"),
                content_encoding=headers.get("content-encoding"),
            )

    def finish(self, p: Pending, t_end: float, ended_at: float, *, complete: bool) -> Turn | None:
        """The response stream ended (``complete``) or was closed early. Idempotent."""
        if p.done:
            return None
        p.done = True
        if not 200 <= p.status_code < 300 or p.observer is None:
            return None
        obs = p.observer.result()
        sse = p.observer.sse
        state = p.state
        verdict = p.verdict
        history = verdict.history if verdict is not None else HistoryClass.UNKNOWN
        if sse:
            turn_ttft = None if obs.first_token_at is None else obs.first_token_at - p.t0
        else:
            turn_ttft = p.header_at - p.t0
        with self._lock:
            if verdict is not None:
                # the observer has a reply only once it saw the whole of it ([DONE] / finish_reason);
                # openai's sync Stream closes right after [DONE] without draining, so `complete`
                # is False on every normal sync stream and cannot be the test here
                state.detector.record(verdict, obs.reply)
            turn = Turn(
                index=len(state.turns),
                conversation_id=state.id,
                started_at=p.started_at,
                ended_at=ended_at,
                ttft_s=turn_ttft,
                prompt_tokens=obs.prompt_tokens,
                completion_tokens=obs.completion_tokens,
                status=p.status,
                reused_tokens=p.reused_tokens,
                ttl_s=p.ttl,
                history=history,
                reuse_forced_off=p.reuse_off,
                reasoning_reattached=verdict is not None and verdict.reattached,
                gap_s=None if state.last_ended_at is None else max(0.0, p.started_at - state.last_ended_at),
                stream=sse,
            )
            state.turns.append(turn)
            state.last_ended_at = ended_at
            if p.reuse_off:
                self.reuse_off_turns += 1
        if self.on_turn is not None:
            self.on_turn(turn)
        if p.ttl is not None and p.ttl > 0 and self.lease_sink is not None and not state.closed:
            auth = {name: v for name in AUTH_HEADERS if (v := p.headers.get(name)) is not None}
            root = router_root(p.origin, p.path)
            self.lease_sink.activate(state.id, root, p.ttl, auth, explicit=state.explicit)
        return turn


def _parse_int(v: str | None) -> int | None:
    if v is None:
        return None
    try:
        return int(v.strip())
    except ValueError:
        return None


def _parse_float(v: str | None) -> float | None:
    if v is None:
        return None
    try:
        f = float(v.strip())
    except ValueError:
        return None
    return f if f == f and f not in (float("inf"), float("-inf")) else None
