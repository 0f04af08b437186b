"""The SDK's shared, IO-free core: conversations, turn records and per-request decisions.

The sync and async transports are thin shells over :class:`Tracker`: ``begin`` decides what one
outgoing request becomes (body with ``conversation_id``, the reuse opt-out header, a repaired history
under ``reasoning="keep"``), ``response`` reads the kvlease response headers, and ``finish`` turns what
the response stream showed into a :class:`Turn`, feeds the strip detector and hands the lease to the
keeper.

Verified partial reuse: each router says on every completion response whether its prefill node
verifies tokens (:data:`~kvlease.protocol.HEADER_VERIFIED`). Behind one that does, a history that
changed part-way (stripped reasoning, an edit) is sent with reuse left on: the kvlease connector
pulls only the token-verified common prefix, so everything before the first changed token is still
reused, and the turn records it (``Turn.verified_reuse``). Against stock vLLM, which pulls by length,
and before a router has said either, such a turn carries the reuse opt-out as before. Times are passed in; nothing here sleeps or does IO (the turn log write is the caller's
callback).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

from kvlease import _json, protocol
from kvlease._errors import ReuseOffWarning, warn_at_caller
from kvlease._http import header_bytes, hx
from kvlease._observe import ResponseObserver, json_reply, usage_tokens
from kvlease._strip import AssistantReply, HistoryClass, ReasoningPolicy, StripDetector, Verdict
from kvlease._wire import (
    BODY_NAME,
    CHAT_SUFFIX,
    COMPLETIONS_SUFFIX,
    REUSED_KEY,
    STATUS_KEY,
    TTL_KEY,
    VERIFIED_KEY,
    VERIFIED_VALUE,
    inject_conversation_id,
    parse_float,
    parse_int,
    reuse_status,
    router_root,
)
from kvlease.protocol import ReuseStatus

__all__ = [
    "ConversationState",
    "LeaseSink",
    "Pending",
    "Tracker",
    "Turn",
]

log = logging.getLogger("kvlease")

#: States of header-tracked conversations whose lease was dropped (idle, unknown to the router),
#: kept for their next turn: the strip detector and the turn records outlive the lease.
_RETIRED_MAX: Final = 4096


@dataclass(frozen=True, slots=True)
class Turn:
    """One completed turn (a 2xx completion response read to its end or closed).

    Times: ``started_at`` / ``ended_at`` are epoch seconds; ``ttft_s`` is seconds from sending to the
    first generated token of a stream, or to the response headers of a non-streaming call.
    ``status``, ``reused_tokens`` and ``ttl_s`` come from the kvlease response headers and are
    ``None`` when the server sent none (plain vLLM). ``prompt_tokens`` / ``completion_tokens`` come
    from the usage the server returned (``None`` when absent, e.g. a stream without
    ``stream_options={"include_usage": True}``).

    ``history`` is what the strip detector found. When it breaks the prefix, either
    ``reuse_forced_off`` (the SDK sent the reuse opt-out: stock vLLM, or a router whose mode was not
    known yet) or ``verified_reuse`` (reuse was left on because the router's prefill node verifies
    tokens: ``reused_tokens`` is the verified prefix still reused). ``verified``: what the router
    said on this response (:data:`~kvlease.protocol.HEADER_VERIFIED`); ``None`` without kvlease
    headers.
    """

    # (Tracker builds a turn from its fields in this order: ``Turn(*fields)``)
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
    verified: bool | None = None
    verified_reuse: bool = False


class ConversationState:
    """Everything the SDK remembers about one conversation (shared by the sync and async shells)."""

    __slots__ = ("body_prefix", "closed", "detector", "explicit", "id", "last_ended_at", "turns", "warned")

    def __init__(self, conversation_id: str, policy: ReasoningPolicy, *, explicit: bool) -> None:
        self.id = conversation_id
        self.explicit = explicit  # opened with conversation(); else auto-registered from a header
        self.detector = StripDetector(policy)
        # the start of the chat body the detector recorded last (its history): the next body that
        # begins with it is read from there on (set together with detector.record)
        self.body_prefix: _json.BodyPrefix | None = None
        #: completed turns, oldest first: a :class:`Turn`, or the tuple of its fields until it is
        #: first read (:meth:`turn_list`): most turns are never read, and a frozen dataclass costs
        #: a call per field to build
        self.turns: list[Turn | tuple[Any, ...]] = []
        self.warned = False
        self.closed = False
        self.last_ended_at: float | None = None

    def turn_list(self) -> list[Turn]:
        """The completed turns, oldest first (the state's own list, each turn built on first read)."""
        turns = self.turns
        for i, t in enumerate(turns):
            if type(t) is tuple:
                turns[i] = Turn(*t)
        return turns  # type: ignore[return-value]


class LeaseSink(Protocol):
    """Where finished turns that carry a lease (a :data:`~kvlease.protocol.HEADER_TTL` header) go: the lease keeper."""

    def activate(
        self, conversation_id: str, root: str, ttl: float, headers: Mapping[str, str], *, explicit: bool
    ) -> None: ...


class Pending:
    """One tracked request between ``begin`` and ``finish``."""

    __slots__ = (
        "auth",
        "body",
        "body_prefix",
        "done",
        "header_at",
        "observer",
        "reuse_off",
        "reused_tokens",
        "root",
        "sse",
        "started_at",
        "state",
        "status",
        "status_code",
        "t0",
        "ttl",
        "verdict",
        "verified",
        "verified_reuse",
    )

    def __init__(
        self,
        state: ConversationState,
        verdict: Verdict | None,
        body: bytes,
        auth: Mapping[str, str],
        t0: float,
        started_at: float,
        body_prefix: _json.BodyPrefix | None,
        root: str,
        reuse_off: bool,
        verified_reuse: bool,
    ) -> None:
        self.state = state
        self.verdict = verdict
        self.body = body
        self.body_prefix = body_prefix
        # a changed history: the opt-out (reuse_off), or reuse left on behind a router whose P
        # verifies tokens (verified_reuse)
        self.reuse_off = reuse_off
        self.verified_reuse = verified_reuse
        self.verified: bool | None = None
        self.root = root  # router_root(origin, path), computed once by the tracker
        self.auth = auth  # the request's authorization headers: lease requests copy them
        self.t0 = t0
        self.started_at = started_at
        self.status_code = 0
        self.status: ReuseStatus | None = None
        self.reused_tokens: int | None = None
        self.ttl: float | None = None
        self.observer: ResponseObserver | None = None  # (a streamed body's reader)
        self.sse = False
        self.done = False
        self.header_at = t0


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
        self._retired: OrderedDict[str, ConversationState] = OrderedDict()
        self._bad_ids_warned: set[str] = set()
        self._warned_kinds: set[tuple[HistoryClass, bool]] = set()
        #: router root -> its prefill node verifies tokens (the last completion response said so)
        self._verifies: dict[str, bool] = {}
        self.reuse_off_turns = 0

    # --------------------------------------------------------------------------- conversations

    def open(self, conversation_id: str, *, explicit: bool = True) -> ConversationState:
        protocol.validate_conversation_id(conversation_id)
        with self._lock:
            state = self._conversations.get(conversation_id)
            if state is None or state.closed:
                state = self._retired.pop(conversation_id, None)
                if state is not None:  # a dropped lease: the history it knows is still the history
                    state.closed = False
                    state.explicit = state.explicit or explicit
                else:
                    state = ConversationState(conversation_id, self.policy, explicit=explicit)
                self._conversations[conversation_id] = state
            elif explicit:
                state.explicit = True
            return state

    def get(self, conversation_id: str) -> ConversationState | None:
        return self._conversations.get(conversation_id)

    def forget(
        self, conversation_id: str, *, only_implicit: bool = False, retire: bool = False
    ) -> ConversationState | None:
        """Close a conversation. ``retire``: its lease was dropped, not closed by the caller: keep
        its state (bounded, oldest first out) for a next turn that carries the same id."""
        with self._lock:
            self._retired.pop(conversation_id, None)
            state = self._conversations.get(conversation_id)
            if state is None or (only_implicit and state.explicit):
                return None
            del self._conversations[conversation_id]
            state.closed = True
            if retire:
                self._retired[conversation_id] = state
                while len(self._retired) > _RETIRED_MAX:
                    self._retired.popitem(last=False)
            return state

    def verifies(self, root: str) -> bool | None:
        """Whether the router at ``root`` said its prefill node verifies tokens (``None``: not yet)."""
        return self._verifies.get(root)

    def states(self) -> list[ConversationState]:
        with self._lock:
            return list(self._conversations.values())

    # --------------------------------------------------------------------------- requests

    def begin(
        self,
        conversation_id: str,
        origin: str,
        path: str,
        auth: Mapping[str, str],
        body: bytes,
        t0: float,
        started_at: float,
    ) -> Pending | None:
        """Decide what a POST carrying ``X-Conversation-Id`` becomes; ``None``: send it unchanged.

        ``auth``: the request's :data:`AUTH_HEADERS` (lease requests of the conversation copy them).
        """
        chat = path.endswith(CHAT_SUFFIX)
        if not chat and not path.endswith(COMPLETIONS_SUFFIX):
            return None
        state = self._conversations.get(conversation_id)
        if state is None or state.closed:  # (an open conversation's id was validated when opened)
            state = self._open_from_header(conversation_id)
            if state is None:
                return None
        verdict: Verdict | None = None
        prefix: _json.BodyPrefix | None = None
        has_key: bool | None = None
        if chat and self.policy != "off":
            prev = state.body_prefix
            try:
                data, prefix, reused = _json.loads_request(body, prev)
            except ValueError:
                data = None
            if isinstance(data, dict):
                messages = data.get("messages")
                if isinstance(messages, list):
                    with self._lock:
                        # messages[:reused] are prev.messages: the history recorded last turn, unless
                        # another request of this conversation finished meanwhile (then compared)
                        known = prev.messages if prev is not None and reused else None
                        verdict = state.detector.inspect(messages, known_prefix=known)
                    if prefix is not None:
                        prefix.messages = verdict.raw  # what detector.record keeps as the history
                    if verdict.repaired:
                        data["messages"] = verdict.messages
                        data.setdefault(BODY_NAME, conversation_id)
                        body = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
                else:
                    prefix = None
                has_key = BODY_NAME in data
        body = inject_conversation_id(body, conversation_id, has_key=has_key)
        root = router_root(origin, path)
        breaks = verdict is not None and verdict.reuse_off
        # behind a router whose P verifies tokens, a changed history keeps reuse on (verified prefix)
        verifies = breaks and self._verifies.get(root) is True
        pending = Pending(
            state, verdict, body, auth, t0, started_at, prefix, root, breaks and not verifies, verifies
        )
        if breaks:
            assert verdict is not None
            self._report(state, verdict, reuse_off=not verifies)
        return pending

    def _open_from_header(self, conversation_id: str) -> ConversationState | None:
        """A request of a conversation not open here: opened (auto-registered) if its id is valid;
        a bad id is logged (once per id, for a few ids) and the request goes untracked."""
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
        return self.open(conversation_id, explicit=False)

    def _report(self, state: ConversationState, verdict: Verdict, *, reuse_off: bool) -> None:
        """A changed history: a ``logging`` record once per conversation (the id in ``extra``), and a
        :class:`~kvlease.ReuseOffWarning` once per kind (its text names no conversation: the
        warning registry keeps one entry per text), attributed to the caller's code."""
        if reuse_off:
            effect = (
                f"so KV reuse is off for this turn ({protocol.HEADER_REUSE}: {protocol.REUSE_OFF}) "
                "and the prompt is recomputed"
            )
        else:
            effect = (
                "but the router's prefill node verifies tokens, so the prefix before the first "
                "changed token is still reused on this turn"
            )
        if not state.warned:
            state.warned = True
            log.log(
                logging.WARNING if reuse_off else logging.INFO,
                "kvlease: conversation %s: %s, %s. Fix: %s",
                state.id,
                verdict.detail,
                effect,
                verdict.fix,
                # the turn log's names: a log formatter or filter sees the same keys
                extra={
                    protocol.TurnLogKey.CONVERSATION_ID: state.id,
                    protocol.TurnLogKey.HISTORY: verdict.history.value,
                },
            )
        kind = (verdict.history, reuse_off)
        with self._lock:
            if kind in self._warned_kinds:
                return
            self._warned_kinds.add(kind)
        warn_at_caller(
            ReuseOffWarning(
                f"kvlease: {verdict.detail}, {effect}. Fix: {verdict.fix}. (Warned once per kind; the "
                "conversation is the warning's conversation_id and is logged on the 'kvlease' logger.)",
                conversation_id=state.id,
                history=verdict.history,
                reuse_off=reuse_off,
            )
        )

    def response(
        self, p: Pending, status_code: int, headers: hx.Headers, now: float, *, stream: bool = True
    ) -> None:
        """The response headers of a tracked request arrived (``now``: the clock ``t0`` was read from).
        ``stream``: the body will be fed to ``p.observer`` as it is read (then :meth:`finish`); else
        it is read whole and handed to :meth:`finish_body`."""
        p.header_at = now
        p.status_code = status_code
        got = header_bytes(headers)
        status = got.get(STATUS_KEY)
        if status is not None:
            p.status = reuse_status(status)
        p.reused_tokens = parse_int(got.get(REUSED_KEY))
        p.ttl = parse_float(got.get(TTL_KEY))
        verified = got.get(VERIFIED_KEY)
        if verified is not None:
            p.verified = verified.strip().lower() == VERIFIED_VALUE
        if 200 <= status_code < 300:
            # a completion answered: what it says of P is the router's mode (no header: stock)
            verifies = p.verified is True
            known = self._verifies.get(p.root)
            if known is not verifies and (known is not None or len(self._verifies) < 256):
                self._verifies[p.root] = verifies
            sse = p.sse = got.get(b"content-type", b"").startswith(b"text/event-stream")
            if stream:
                encoding = got.get(b"content-encoding")
                p.observer = ResponseObserver(
                    sse=sse, content_encoding=None if encoding is None else encoding.decode("latin-1")
                )

    def finish(self, p: Pending, t_end: float, ended_at: float, *, complete: bool) -> None:
        """The response stream ended (``complete``) or was closed early. Idempotent."""
        # the observer has a reply only once it saw the whole of it ([DONE] / finish_reason);
        # openai's sync Stream closes right after [DONE] without draining, so `complete` is False
        # on every normal sync stream and cannot be the test here
        if self._answered(p) and p.observer is not None:
            self._observed(p, p.observer, ended_at)

    def finish_body(self, p: Pending, body: bytes | None, t_end: float, ended_at: float) -> None:
        """A response read whole (``body``, content-decoded; ``None``: the read failed). Idempotent."""
        if not self._answered(p):
            return
        if body is None:
            self._turn(p, None, None, None, p.header_at - p.t0, ended_at)
        elif p.sse:  # an event stream, read whole
            observer = ResponseObserver(sse=True)
            observer.feed(body, t_end)
            self._observed(p, observer, ended_at)
        else:
            reply, usage = json_reply(body) or (None, None)
            prompt_tokens, completion_tokens = usage_tokens(usage)
            self._turn(p, reply, prompt_tokens, completion_tokens, p.header_at - p.t0, ended_at)

    @staticmethod
    def _answered(p: Pending) -> bool:
        """Marks ``p`` finished; whether it is a completion answered (2xx) finished only now."""
        if p.done:
            return False
        p.done = True
        return 200 <= p.status_code < 300

    def _observed(self, p: Pending, observer: ResponseObserver, ended_at: float) -> None:
        """Record the turn an observer read (a stream: its time to the first token)."""
        obs = observer.result()
        if p.sse:
            ttft = None if obs.first_token_at is None else obs.first_token_at - p.t0
        else:
            ttft = p.header_at - p.t0
        self._turn(p, obs.reply, obs.prompt_tokens, obs.completion_tokens, ttft, ended_at)

    def _turn(
        self,
        p: Pending,
        reply: AssistantReply | None,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        ttft: float | None,
        ended_at: float,
    ) -> None:
        """Record a finished turn: the detector's history, the turn, its lease."""
        state = p.state
        verdict = p.verdict
        on_turn = self.on_turn
        with self._lock:
            if verdict is not None:
                state.detector.record(verdict, reply)
                state.body_prefix = p.body_prefix
            last_ended_at = state.last_ended_at
            fields = (  # Turn's fields, in order
                len(state.turns),
                state.id,
                p.started_at,
                ended_at,
                ttft,
                prompt_tokens,
                completion_tokens,
                p.status,
                p.reused_tokens,
                p.ttl,
                HistoryClass.UNKNOWN if verdict is None else verdict.history,
                p.reuse_off,
                verdict is not None and verdict.reattached,
                None if last_ended_at is None else max(0.0, p.started_at - last_ended_at),
                p.sse,
                p.verified,
                p.verified_reuse,
            )
            turn = None if on_turn is None else Turn(*fields)
            state.turns.append(fields if turn is None else turn)
            state.last_ended_at = ended_at
            if p.reuse_off:
                self.reuse_off_turns += 1
        if turn is not None:
            on_turn(turn)  # type: ignore[misc]
        ttl = p.ttl
        if ttl is not None and ttl > 0 and self.lease_sink is not None and not state.closed:
            self.lease_sink.activate(state.id, p.root, ttl, p.auth, explicit=state.explicit)
