"""Odd characters, huge ids, oversized bodies, JSON bombs and wrong types: a 4xx with a message (or a
normal answer when the input is merely unusual), never a 5xx, and the router keeps serving.

Complements the router's own table of malformed requests with the nastier shapes.
"""

from __future__ import annotations

import gzip
from typing import Any

import orjson
import pytest

from kvlease.protocol import (
    CHAT_COMPLETIONS_PATH,
    COMPLETIONS_PATH,
    CONVERSATIONS_PATH,
    HEADER_CONVERSATION_ID,
    HEADER_REUSE,
    HEADER_SESSION_ID,
    RENEW_PATH,
)
from security._cluster import Cluster

MSGS = [{"role": "user", "content": "hi"}]
GOOD: dict[str, Any] = {"model": "fake-model", "messages": MSGS}


def _nest(depth: int, open_: bytes = b"[", close: bytes = b"]") -> bytes:
    return open_ * depth + close * depth


def _with_messages(raw_messages: bytes) -> bytes:
    return b'{"model": "m", "messages": ' + raw_messages + b"}"


BODIES: list[tuple[str, str, bytes, dict[str, str]]] = [
    # (name, path, raw body, headers)
    ("nested arrays 300 deep", CHAT_COMPLETIONS_PATH, _with_messages(_nest(300)), {}),
    ("nested arrays 100k deep", CHAT_COMPLETIONS_PATH, _with_messages(_nest(100_000)), {}),
    (
        "nested objects 300 deep",
        CHAT_COMPLETIONS_PATH,
        b'{"model": "m", "messages": [], "x": ' + b'{"a":' * 300 + b"1" + b"}" * 300 + b"}",
        {},
    ),
    (
        "nested deep in a message",
        CHAT_COMPLETIONS_PATH,
        _with_messages(b'[{"role": "user", "content": ' + _nest(400) + b"}]"),
        {HEADER_CONVERSATION_ID: "deep"},
    ),
    (
        "nested 300 deep completions",
        COMPLETIONS_PATH,
        b'{"prompt": "x", "logit_bias": ' + _nest(300) + b"}",
        {},
    ),
    (
        "200k element array",
        CHAT_COMPLETIONS_PATH,
        _with_messages(b"[" + b"1," * 200_000 + b"1]"),
        {HEADER_CONVERSATION_ID: "wide"},
    ),
    (
        "100k tiny messages",
        CHAT_COMPLETIONS_PATH,
        orjson.dumps({"messages": [{"role": "user", "content": ""}] * 100_000}),
        {},
    ),
    ("100k keys", CHAT_COMPLETIONS_PATH, orjson.dumps({**GOOD, **{f"k{i}": i for i in range(100_000)}}), {}),
    (
        "integer beyond 64 bits",
        CHAT_COMPLETIONS_PATH,
        b'{"messages": [], "max_tokens": 1' + b"0" * 400 + b"}",
        {},
    ),
    ("float overflow", CHAT_COMPLETIONS_PATH, b'{"messages": [], "temperature": 1e400}', {}),
    ("NaN literal", CHAT_COMPLETIONS_PATH, b'{"messages": [], "temperature": NaN}', {}),
    ("lone surrogate", CHAT_COMPLETIONS_PATH, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', {}),
    ("byte order mark", CHAT_COMPLETIONS_PATH, b"\xef\xbb\xbf" + orjson.dumps(GOOD), {}),
    ("NUL bytes", CHAT_COMPLETIONS_PATH, b'{"messages": "\x00\x00"}', {}),
    ("trailing garbage", CHAT_COMPLETIONS_PATH, orjson.dumps(GOOD) + b"}}}", {}),
    ("just whitespace", CHAT_COMPLETIONS_PATH, b"   \n\t ", {}),
    ("json null", CHAT_COMPLETIONS_PATH, b"null", {}),
    (
        "id 10k chars in body",
        CHAT_COMPLETIONS_PATH,
        orjson.dumps({**GOOD, "conversation_id": "a" * 10_000}),
        {},
    ),
    ("id with newline in body", CHAT_COMPLETIONS_PATH, orjson.dumps({**GOOD, "conversation_id": "a\nb"}), {}),
    ("id with NUL in body", CHAT_COMPLETIONS_PATH, orjson.dumps({**GOOD, "conversation_id": "a\x00b"}), {}),
    ("id homoglyph", CHAT_COMPLETIONS_PATH, orjson.dumps({**GOOD, "prompt_cache_key": "\u0430bc"}), {}),
    (
        "id path traversal",
        CHAT_COMPLETIONS_PATH,
        orjson.dumps(GOOD),
        {HEADER_CONVERSATION_ID: "../../etc/passwd"},
    ),
    ("id redis glob", CHAT_COMPLETIONS_PATH, orjson.dumps(GOOD), {HEADER_SESSION_ID: "kvlease:conv:*"}),
    ("id 4k header", CHAT_COMPLETIONS_PATH, orjson.dumps(GOOD), {HEADER_CONVERSATION_ID: "x" * 4000}),
    ("id true", CHAT_COMPLETIONS_PATH, orjson.dumps({**GOOD, "conversation_id": True}), {}),
    ("id float", CHAT_COMPLETIONS_PATH, orjson.dumps({**GOOD, "prompt_cache_key": 1.5}), {}),
    ("id null is absent", CHAT_COMPLETIONS_PATH, orjson.dumps({**GOOD, "conversation_id": None}), {}),
    (
        "reuse header odd",
        CHAT_COMPLETIONS_PATH,
        orjson.dumps(GOOD),
        {HEADER_REUSE: "\u00ff" * 10, HEADER_CONVERSATION_ID: "r"},
    ),
    (
        "huge tenant token",
        CHAT_COMPLETIONS_PATH,
        orjson.dumps(GOOD),
        {"Authorization": "Bearer " + "t" * 7000, HEADER_CONVERSATION_ID: "t"},
    ),
    ("renew nested 300", RENEW_PATH, b'{"conversation_ids": ' + _nest(300) + b"}", {}),
    ("renew ids of objects", RENEW_PATH, orjson.dumps({"conversation_ids": [{"a": 1}]}), {}),
    ("renew ids of huge strings", RENEW_PATH, orjson.dumps({"conversation_ids": ["a" * 100_000]}), {}),
    ("renew 100k keys", RENEW_PATH, orjson.dumps({f"k{i}": i for i in range(100_000)}), {}),
    ("renew null", RENEW_PATH, b"null", {}),
]


def _message_of(raw: bytes) -> str:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw.decode("utf-8", "replace")
    err = obj.get("error") if isinstance(obj, dict) else None
    msg = (
        err.get("message")
        if isinstance(err, dict)
        else (obj.get("message") if isinstance(obj, dict) else None)
    )
    return str(msg or "")


async def _still_serving(cluster: Cluster) -> None:
    r, _ = await cluster.chat(MSGS, cid="after")
    assert r.status == 200


@pytest.mark.parametrize(("name", "path", "raw", "headers"), BODIES, ids=[b[0] for b in BODIES])
async def test_odd_bodies_are_4xx_with_a_message_never_5xx(
    cluster: Cluster, name: str, path: str, raw: bytes, headers: dict[str, str]
) -> None:
    r, out = await cluster.post(path, raw, headers)
    assert r.status < 500, (name, r.status, out[:300])
    if r.status >= 400:
        assert _message_of(out).strip(), (name, out[:300])
    await _still_serving(cluster)


WRONG = [None, True, -1, 2**63 - 1, 1.5, "x" * 3, "", [], [None], {}, {"a": [1]}]
FIELDS = [
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "stream_options",
    "temperature",
    "n",
    "stop",
    "tools",
    "tool_choice",
    "logit_bias",
    "min_tokens",
    "vllm_xargs",
    "prompt_cache_key",
    "conversation_id",
]


@pytest.mark.parametrize("field", FIELDS)
async def test_wrong_types_in_every_field(cluster: Cluster, field: str) -> None:
    for i, value in enumerate(WRONG):
        if field.startswith("max_") and value == 2**63 - 1:
            continue  # a valid type; vLLM refuses it as too long, the fake would try to generate it
        for stream in (False, True):
            body = {**GOOD, field: value, "stream": stream}
            r, out = await cluster.post(CHAT_COMPLETIONS_PATH, body, {HEADER_CONVERSATION_ID: f"w{i}"})
            assert r.status < 500, (field, value, r.status, out[:300])
            if r.status >= 400:
                assert _message_of(out).strip(), (field, value, out[:300])
    await _still_serving(cluster)


async def test_oversized_bodies_are_413(cluster: Cluster) -> None:
    limit = cluster.router.settings.max_body_bytes
    big = orjson.dumps({**GOOD, "pad": "a" * (limit + 1)})
    for path in (CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH, RENEW_PATH):
        r, out = await cluster.post(path, big)
        assert r.status == 413 and _message_of(out), (path, r.status, out[:200])
    # compressed: the limit applies to what the body inflates to
    bomb = gzip.compress(b'{"messages": "' + b"a" * (8 * limit) + b'"}')
    assert len(bomb) < limit
    r, out = await cluster.post(CHAT_COMPLETIONS_PATH, bomb, {"Content-Encoding": "gzip"})
    assert r.status in (400, 413), (r.status, out[:200])
    await _still_serving(cluster)


@pytest.mark.parametrize(
    "cid",
    ["a" * 129, "a" * 10_000, "a%20b", "%00", "a;b", "%F0%9F%98%80", "..", "a%2Fb", "*", "%ZZ"],
)
async def test_release_with_odd_ids(cluster: Cluster, cid: str) -> None:
    async with cluster.client.delete(cluster.url + CONVERSATIONS_PATH + "/" + cid) as r:
        raw = await r.read()
    assert 400 <= r.status < 500, (cid, r.status, raw[:200])


async def test_huge_headers_are_rejected_not_crashed(cluster: Cluster) -> None:
    for name in (HEADER_CONVERSATION_ID, "Authorization", "X-Anything"):
        r, _out = await cluster.post(CHAT_COMPLETIONS_PATH, GOOD, {name: "h" * 100_000})
        assert 400 <= r.status < 500, (name, r.status)
    await _still_serving(cluster)
