"""JSON on the SDK's hot path.

Responses: :func:`loads` parses with orjson (several times faster on the small SSE events a streamed
reply is made of), falling back to the standard library for what orjson refuses (``NaN``,
``Infinity``), so both accept the same documents. Read-only use: orjson reads integers beyond 64 bits
as floats, so request bodies, which the SDK may write back, are parsed with the standard library.

Requests: :func:`loads_request` parses a request body exactly as :func:`json.loads` does, and reads
the ``messages`` of a chat request incrementally: a conversation resends its whole history every
turn, so when the body starts with the same text as the previous turn's body up to that body's last
message (a :class:`BodyPrefix`), only what follows it is parsed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from json.decoder import JSONDecodeError, JSONDecoder
from typing import Any, Final, cast

import orjson

__all__ = ["BodyPrefix", "loads", "loads_request"]


def loads(data: bytes | str) -> Any:
    """Parse ``data``; :class:`ValueError` when it is not JSON."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


# --------------------------------------------------------------------------------------- requests

#: json.decoder's whitespace (the pattern always matches, maybe empty); most JSON has none between
#: tokens, so the parser looks at one character before it calls the pattern
_ws = cast(Callable[[str, int], "re.Match[str]"], re.compile(r"[ \t\n\r]*").match)
_WS: Final = frozenset(" \t\n\r")
#: the C scanner json.loads uses: one JSON value at an offset, and one string (after its quote)
_scan: Callable[[str, int], tuple[Any, int]] = JSONDecoder().scan_once  # type: ignore[attr-defined]
_scanstring: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]


class BodyPrefix:
    """What a chat request body began with, up to the end of its last message.

    ``data`` is that part of the body (bytes); ``head`` the keys before ``messages``; ``messages``
    the parsed messages (callers may replace the list by an equal one, e.g. the history the strip
    detector recorded); ``rest_text`` / ``rest`` the body after the ``messages`` array and its keys.
    """

    __slots__ = ("data", "head", "messages", "rest", "rest_text")

    def __init__(
        self,
        data: bytes,
        head: dict[str, Any],
        messages: list[Any],
        rest_text: str,
        rest: list[tuple[str, Any]],
    ) -> None:
        self.data = data
        self.head = head
        self.messages = messages
        self.rest_text = rest_text
        self.rest = rest


def loads_request(body: bytes, prev: BodyPrefix | None = None) -> tuple[Any, BodyPrefix | None, int]:
    """``(data, prefix, reused)`` of a request body.

    ``data`` is what ``json.loads(body)`` returns (the same :class:`ValueError` when ``body`` is not
    JSON). ``prefix`` describes a JSON object with one ``messages`` array of at least one element,
    for the next call (else ``None``). ``reused``: how many messages were taken from ``prev`` without
    parsing them again (``data["messages"]`` then starts with the elements of ``prev.messages``).
    """
    if prev is not None and body.startswith(prev.data):
        # the bytes up to the previous body's last message are the same: decode and parse the rest
        # (prev.data ends with the last character of a JSON value, an ASCII one: a character boundary)
        got = _resume(body, prev)
        if got is not None:
            return got
    if not (body.startswith(b"{") and body[1:2] != b"\x00"):  # else not UTF-8 as json.loads tells it
        if json.detect_encoding(body) != "utf-8":
            return json.loads(body), None, 0
        text = body.decode("utf-8", "surrogatepass")  # what json.loads does with utf-8 bytes
        start = _ws(text, 0).end()
        if not text.startswith("{", start):
            return json.loads(text), None, 0
        return _object(body, text, start, 0, None)
    return _object(body, body.decode("utf-8", "surrogatepass"), 0, 0, None)


def _resume(body: bytes, prev: BodyPrefix) -> tuple[dict[str, Any], BodyPrefix | None, int] | None:
    """The body after ``prev.data``, when more messages follow there (else ``None``)."""
    base = len(prev.data)
    text = body[base:].decode("utf-8", "surrogatepass")
    rest_text = prev.rest_text
    close = len(text) - len(rest_text) - 1
    if close > 1 and text.startswith(",") and text[close] == "]" and text.endswith(rest_text):
        # the common turn: "," new messages "]" and the same keys after them as last time; the new
        # messages are read as one array (in C), which must end exactly at that "]"
        try:
            added, end = _scan("[" + text[1 : close + 1], 0)
        except (StopIteration, ValueError):
            added = end = None
        if added and end == close + 1:
            items = prev.messages + added
            last = close  # the end of the last message: before the "]" and any whitespace
            while text[last - 1] in _WS:
                last -= 1
            data = dict(prev.head)
            data["messages"] = items
            data.update(prev.rest)
            prefix = BodyPrefix(body[: base + _utf8_len(text, last)], prev.head, items, rest_text, prev.rest)
            return data, prefix, len(prev.messages)
    q = 0
    if text[:1] in _WS:
        q = _ws(text, 0).end()
    if not text.startswith(",", q):  # no further message: parse the whole body
        return None
    items = list(prev.messages)
    head = prev.head
    reused = len(items)
    q += 1
    if text[q : q + 1] in _WS:
        q = _ws(text, q).end()
    p, last = _array(text, q, items, more=True)
    rest_text = prev.rest_text
    if text.endswith(rest_text) and len(text) - len(rest_text) == p:
        # the same keys after the messages as last time (model, tools, options ...)
        data = dict(head)
        data["messages"] = items
        data.update(prev.rest)
        prefix = BodyPrefix(body[: base + _utf8_len(text, last)], head, items, rest_text, prev.rest)
        return data, prefix, reused
    data = dict(head)
    data["messages"] = items
    return _object(body, text, p, base, (data, head, items, last, reused))


def _utf8_len(text: str, end: int) -> int:
    """The length in UTF-8 bytes of ``text[:end]``."""
    return end if text.isascii() else len(text[:end].encode("utf-8", "surrogatepass"))


def _error(msg: str, text: str, pos: int) -> JSONDecodeError:
    return JSONDecodeError(msg, text, pos)


def _object(
    body: bytes,
    text: str,
    p: int,
    base: int,
    resume: tuple[dict[str, Any], dict[str, Any], list[Any], int, int] | None,
) -> tuple[dict[str, Any], BodyPrefix | None, int]:
    """The JSON object ``text`` holds from ``p`` (its ``{``) to its end, parsed as json.loads would
    (a duplicate key: the last value at the first one's place); ``text`` is ``body`` decoded from
    byte ``base`` on. ``resume``: continue after the ``messages`` array of an object begun as
    ``(data so far, head, messages, end of the last message, reused)``, ``p`` just after that array."""
    head: dict[str, Any] | None = None  # the keys before "messages"
    items: list[Any] | None = None
    last = rest_start = -1
    rest: list[tuple[str, Any]] = []
    messages_keys = reused = 0
    value: Any
    done = False
    if resume is not None:
        data, head, items, last, reused = resume
        messages_keys = 1
        rest_start = p
        after_value = True
    else:
        data = {}
        after_value = False
        p += 1
        if text[p : p + 1] in _WS:
            p = _ws(text, p).end()
        if text.startswith("}", p):  # an empty object
            p += 1
            done = True
    while not done:
        if after_value:
            if text[p : p + 1] in _WS:
                p = _ws(text, p).end()
            c = text[p : p + 1]
            if c == "}":
                p += 1
                break
            if c != ",":
                raise _error("Expecting ',' delimiter", text, p)
            p += 1
            if text[p : p + 1] in _WS:
                p = _ws(text, p).end()
        if not text.startswith('"', p):
            raise _error("Expecting property name enclosed in double quotes", text, p)
        key, p = _scanstring(text, p + 1)
        if text[p : p + 1] in _WS:
            p = _ws(text, p).end()
        if not text.startswith(":", p):
            raise _error("Expecting ':' delimiter", text, p)
        p += 1
        if text[p : p + 1] in _WS:
            p = _ws(text, p).end()
        if key == "messages":
            messages_keys += 1
            if text.startswith("[", p):
                head = dict(data)
                items = []
                p, last = _array(text, p + 1, items, more=False)
                value = items
                rest_start = p
                rest = []
                reused = 0
            else:
                value, p = _value(text, p)
                items = None
        else:
            value, p = _value(text, p)
            if rest_start >= 0:
                rest.append((key, value))
        data[key] = value
        after_value = True
    if p != len(text) and _ws(text, p).end() != len(text):
        raise _error("Extra data", text, p)
    if messages_keys != 1 or items is None or head is None or last < 0:
        return data, None, 0
    prefix = BodyPrefix(body[: base + _utf8_len(text, last)], head, items, text[rest_start:], rest)
    return data, prefix, reused


def _value(text: str, p: int) -> tuple[Any, int]:
    try:
        return _scan(text, p)
    except StopIteration as e:
        raise _error("Expecting value", text, e.value) from None


def _array(text: str, p: int, items: list[Any], *, more: bool) -> tuple[int, int]:
    """Parse array elements from ``p`` (just after ``[``, or at the element after a ``,`` when
    ``more``) into ``items``; ``(the offset after "]", the end of the last element or -1)``."""
    last = -1
    if not more:
        if text[p : p + 1] in _WS:
            p = _ws(text, p).end()
        if text.startswith("]", p):
            return p + 1, last
    append = items.append
    while True:
        try:
            value, p = _scan(text, p)
        except StopIteration as e:
            raise _error("Expecting value", text, e.value) from None
        append(value)
        last = p
        if text[p : p + 1] in _WS:
            p = _ws(text, p).end()
        c = text[p : p + 1]
        if c == "]":
            return p + 1, last
        if c != ",":
            raise _error("Expecting ',' delimiter", text, p)
        p += 1
        if text[p : p + 1] in _WS:
            p = _ws(text, p).end()
