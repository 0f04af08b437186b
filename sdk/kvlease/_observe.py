"""Reading a completion response as its bytes stream past: sans-IO, incremental, cheap.

:class:`ResponseObserver` is fed the raw body chunks (and the time each arrived) by the transport's
stream wrapper, so nothing is read that the caller does not read. It understands a JSON body and an
SSE stream (``text/event-stream``) of chat or legacy completions, and yields the first-token time,
the usage the server reported and the assistant reply of choice 0 (content, reasoning, tool calls).
A body it cannot read (unknown content encoding, malformed JSON) just yields less: never an error.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any

import orjson

from kvlease import _json, protocol
from kvlease._strip import AssistantReply, ToolCall
from kvlease.protocol import REASONING_FIELDS

__all__ = ["Observed", "ResponseObserver", "json_reply", "usage_tokens"]

_orjson_loads = orjson.loads
_OrjsonError = orjson.JSONDecodeError
_DONE = protocol.SSE_DONE_DATA.encode()
#: events parsed at once (a long reply read at its end is not held parsed all together)
_BATCH = 256


@dataclass(frozen=True, slots=True)
class Observed:
    reply: AssistantReply | None  # None: not (completely) seen
    prompt_tokens: int | None
    completion_tokens: int | None
    first_token_at: float | None  # the clock value passed to feed() with the first generated token


class _ToolAcc:
    __slots__ = ("args", "id", "name")

    def __init__(self) -> None:
        self.id: str | None = None
        self.name: str | None = None
        self.args: list[str] = []


class ResponseObserver:
    """Incremental reader of one completion response body (see the module docstring)."""

    __slots__ = (
        "_buf",
        "_chunks",
        "_complete",
        "_content",
        "_decoder",
        "_enabled",
        "_first",
        "_reasoning",
        "_reasoning_field",
        "_reply",
        "_tools",
        "_usage",
        "sink",
        "sse",
    )

    def __init__(self, *, sse: bool, content_encoding: str | None = None) -> None:
        self.sse = sse
        self._enabled = True
        self._decoder: Any = None
        enc = (content_encoding or "identity").strip().lower()
        if enc in ("gzip", "deflate", "x-gzip"):
            self._decoder = zlib.decompressobj(zlib.MAX_WBITS | 32)
        elif enc != "identity":
            self._enabled = False  # br, zstd, ...: timing only
        self._buf = b""
        self._chunks: list[bytes] = []
        self._first: float | None = None
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._reasoning_field: str | None = None
        self._tools: dict[int, _ToolAcc] = {}
        self._usage: Any = None
        self._complete = False
        self._reply: AssistantReply | None = None  # a JSON body's message, as result() gives it
        #: Once the first-token time is known, the rest of the body is only kept and read in
        #: result(): ``sink`` is then the list to append the later chunks to (instead of feed()),
        #: so a streamed reply costs one list append per chunk while the caller reads it.
        self.sink: list[bytes] | None = None

    def feed(self, chunk: bytes, now: float) -> None:
        if not chunk:
            return
        if self._first is not None:
            if self._enabled:
                self._chunks.append(chunk)
            return
        if not self.sse:
            self._first = now
            if self._enabled:
                self._chunks.append(chunk)
                self.sink = self._chunks
            return
        if not self._enabled:
            self._first = now
            return
        if self._decoder is not None:
            chunk = self._decoder.decompress(chunk)
        self._sse(self._buf + chunk if self._buf else chunk, now)
        if self._first is not None:
            self.sink = self._chunks

    def result(self) -> Observed:
        self.sink = None
        if self._chunks:
            chunks, self._chunks = self._chunks, []
            if self.sse:
                rest = b"".join(chunks)
                if self._decoder is not None:
                    rest = self._decoder.decompress(rest)
                self._sse(self._buf + rest if self._buf else rest, self._first or 0.0)
            else:
                self._json_body(b"".join(chunks))
        reply: AssistantReply | None = None
        if self._complete and self._reply is not None:
            reply = self._reply
        elif self._complete:
            reply = AssistantReply(
                content="".join(self._content) if self._content else None,
                reasoning="".join(self._reasoning) if self._reasoning else None,
                reasoning_field=self._reasoning_field,
                tool_calls=tuple(
                    ToolCall(t.id, t.name, "".join(t.args)) for _, t in sorted(self._tools.items())
                )
                if self._tools
                else (),
            )
        prompt_tokens, completion_tokens = usage_tokens(self._usage)
        return Observed(reply, prompt_tokens, completion_tokens, self._first)

    # ------------------------------------------------------------------------------------------ JSON

    def _json_body(self, body: bytes) -> None:
        if self._decoder is not None:
            body = self._decoder.decompress(body) + self._decoder.flush()
        got = json_reply(body)
        if got is None:
            return
        reply, self._usage = got
        if reply is not None:
            self._reply = reply
            self._complete = True

    # ------------------------------------------------------------------------------------------- SSE

    def _sse(self, buf: bytes, now: float) -> None:
        """Read the complete events in ``buf``; keep the incomplete rest for the next bytes.

        Their data is parsed in batches (``map`` of orjson over the payloads, each parsed alone),
        then read in order; in a batch where one is not what orjson reads, each is read on its own."""
        if b"\r" in buf:  # CRLF line ends; a pair split over two chunks meets again in the buffer
            buf = buf.replace(b"\r\n", b"\n")
        events = buf.split(b"\n\n")
        rest = self._buf = events.pop()
        payloads = [event[6:] for event in events if event.startswith(b"data: ")]
        # every event one "data: " line: the only newlines are the blank lines between them
        if len(payloads) != len(events) or buf.count(b"\n", 0, len(buf) - len(rest)) != 2 * len(events):
            payloads = []
            for event in events:
                if event.startswith(b"data: ") and b"\n" not in event:  # the common one-line event
                    data: bytes | None = event[6:]
                else:
                    data = _event_data(event)
                if data is not None:
                    payloads.append(data)
        if payloads and payloads[-1] == _DONE:  # (elsewhere, it is read on its own below)
            payloads.pop()
            self._complete = True
        for i in range(0, len(payloads), _BATCH):
            batch = payloads[i : i + _BATCH]
            try:
                objs = list(map(_orjson_loads, batch))
            except _OrjsonError:
                for data in batch:
                    self._data(data, now)
                continue
            self._read_all(objs, now)

    def _read_all(self, objs: list[Any], now: float) -> None:
        """Parsed events, in order. Once the first token is known, an event of the common shape
        (one choice, index 0, a delta of content alone, no finish reason, no usage) is read here
        (what :meth:`_read` does with it), the others by :meth:`_read`."""
        read = self._read
        if self._first is None:
            for obj in objs:
                read(obj, now)
            return
        append = self._content.append
        for obj in objs:
            if type(obj) is dict:
                choices = obj.get("choices")
                if type(choices) is list and len(choices) == 1:
                    choice = choices[0]
                    if type(choice) is dict and choice.get("index", 0) == 0:
                        delta = choice.get("delta")
                        if type(delta) is dict and len(delta) == 1 and not choice.get("finish_reason"):
                            text = delta.get("content")
                            if text and not obj.get("usage"):
                                append(text)
                                continue
            read(obj, now)

    def _data(self, data: bytes, now: float) -> None:
        """One event's data, parsed alone."""
        try:
            obj = _orjson_loads(data)
        except _OrjsonError:
            try:
                obj = json.loads(data)  # what orjson refuses and json reads (NaN, Infinity)
            except ValueError:
                return
        self._read(obj, now)

    def _read(self, obj: Any, now: float) -> None:
        """One parsed event (the hot path of a streamed reply: one call per event)."""
        if not isinstance(obj, dict):
            return
        usage = obj.get("usage")
        if usage:
            self._usage = usage
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                break
        else:
            return
        got = False
        delta = choice.get("delta")
        if isinstance(delta, dict):
            text = delta.get("content")
            if text:
                self._content.append(text)
                got = True
            if not text or len(delta) > 1:  # reasoning or tool calls can be in it
                for name in REASONING_FIELDS:
                    r = delta.get(name)
                    if r:
                        self._reasoning.append(r)
                        if self._reasoning_field is None:
                            self._reasoning_field = name
                        got = True
                        break
                calls = delta.get("tool_calls")
                if calls:
                    got = True
                    for call in calls:
                        self._tool_delta(call)
        else:
            text = choice.get("text")
            if text:
                self._content.append(text)
                got = True
        if got and self._first is None:
            self._first = now
        if choice.get("finish_reason"):
            self._complete = True

    def _tool_delta(self, call: Any) -> None:
        if not isinstance(call, dict):
            return
        idx = call.get("index", len(self._tools))
        acc = self._tools.get(idx)
        if acc is None:
            acc = self._tools[idx] = _ToolAcc()
        if isinstance(call.get("id"), str):
            acc.id = call["id"]
        fn = call.get("function")
        if isinstance(fn, dict):
            if isinstance(fn.get("name"), str):
                acc.name = fn["name"] if acc.name is None else acc.name + fn["name"]
            if isinstance(fn.get("arguments"), str):
                acc.args.append(fn["arguments"])


def json_reply(body: bytes) -> tuple[AssistantReply | None, Any] | None:
    """``(reply, usage)`` of a (decoded) JSON completion body: the reply of choice 0 (a chat
    completion's message, or a legacy completion's ``text`` as content; ``None`` without a choice
    0) and the ``usage`` object as sent. ``None``: not a JSON object."""
    try:
        data = _json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    usage = data.get("usage")
    choice = _choice0(data.get("choices"))
    if choice is None:
        return None, usage
    message = choice.get("message")
    if isinstance(message, dict):
        reply = AssistantReply.from_message(message)
        if reply.content == "":  # as a stream reads it: no content
            reply = AssistantReply(None, reply.reasoning, reply.reasoning_field, reply.tool_calls)
        return reply, usage
    text = choice.get("text")
    return AssistantReply(content=text if isinstance(text, str) else None), usage


def usage_tokens(usage: object) -> tuple[int | None, int | None]:
    """``(prompt_tokens, completion_tokens)`` of a ``usage`` object (``None`` where absent, or not
    an integer)."""
    if not isinstance(usage, dict):
        return None, None
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    # (type is int: not a bool)
    return prompt if type(prompt) is int else None, completion if type(completion) is int else None


def _event_data(event: bytes) -> bytes | None:
    """The data of a multi-line event (its ``data:`` lines joined with newlines), or ``None``."""
    data: bytes | None = None
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            piece = line[5:].lstrip(b" ")
            data = piece if data is None else data + b"\n" + piece
    return data


def _choice0(choices: object) -> dict[str, Any] | None:
    if not isinstance(choices, list):
        return None
    for c in choices:
        if isinstance(c, dict) and c.get("index", 0) == 0:
            return c
    return None
