"""The wrapped client's HTTP client: it hands requests straight to the user's client, and what
``httpx.Client.send`` would have done on the way (cookies, timing, settings put on it) still holds."""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator
from typing import Any

import pytest
from fakes.openai_server import FakeOpenAIServer
from openai import AsyncOpenAI, OpenAI

import kvlease
from kvlease import protocol
from kvlease._http import hx

USER = {"role": "user", "content": "hi"}
REPLY = {
    "id": "c",
    "object": "chat.completion",
    "created": 1,
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}


def _history(turns: int, reply: str = "ok") -> list[dict[str, str]]:
    """The messages of turn ``turns`` (from 1) of a conversation that appends each reply."""
    msgs = [USER]
    for _ in range(turns - 1):
        msgs += [{"role": "assistant", "content": reply}, USER]
    return msgs


async def _chunks(data: bytes) -> Any:
    yield data


class Upstream:
    """A MockTransport handler: records each request's cookie header; the first answer sets one."""

    def __init__(self, *, asynchronous: bool = False) -> None:
        self.cookies: list[str | None] = []
        self.asynchronous = asynchronous

    def __call__(self, request: hx.Request) -> hx.Response:
        self.cookies.append(request.headers.get("cookie"))
        headers = {"content-type": "application/json", protocol.HEADER_TTL: "30"}
        if len(self.cookies) == 1:
            headers["set-cookie"] = "sticky=node-2; Path=/"
        # a streamed body (bytes would be read when the response is made, as no real server's are)
        data = json.dumps(REPLY).encode()
        return hx.Response(200, headers=headers, content=_chunks(data) if self.asynchronous else iter([data]))


@pytest.fixture
def upstream() -> Upstream:
    return Upstream()


@pytest.fixture
def mocked(upstream: Upstream) -> Iterator[kvlease.KVLeaseClient]:
    inner = hx.Client(transport=hx.MockTransport(upstream), cookies={"user": "set"})
    with kvlease.wrap(
        OpenAI(base_url="http://router/v1", api_key="k", max_retries=0, http_client=inner), heartbeat=False
    ) as kc:
        yield kc


def test_conversation_methods_look_like_the_openai_methods(kc: kvlease.KVLeaseClient) -> None:
    conv = kc.conversation()
    create = conv.chat.completions.create
    plain = kc.openai.chat.completions.create
    assert create.__wrapped__ == plain
    assert create.__name__ == plain.__name__ and create.__qualname__ == plain.__qualname__
    assert create.__doc__ == plain.__doc__
    assert inspect.signature(create) == inspect.signature(plain)
    assert callable(conv.chat.completions.with_raw_response.create)


def test_the_callers_extra_headers_are_kept(kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer) -> None:
    with kc.conversation(id="c-1") as conv:
        conv.chat.completions.create(model="m", messages=_history(1), extra_headers={"x-mine": "1"})
        conv.chat.completions.create(model="m", messages=_history(2, fake_server.content), extra_headers=None)
    first, second = fake_server.chat_requests()
    assert first.header("x-mine") == "1" and first.header(protocol.HEADER_CONVERSATION_ID) == "c-1"
    assert second.header(protocol.HEADER_CONVERSATION_ID) == "c-1"


def test_cookies_travel_as_from_the_users_client(mocked: kvlease.KVLeaseClient, upstream: Upstream) -> None:
    """The user's cookies go out, and a cookie the server sets (a sticky session) comes back on
    the next request, tracked or not."""
    with mocked.conversation() as conv:
        conv.chat.completions.create(model="m", messages=_history(1))
        conv.chat.completions.create(model="m", messages=_history(2))
    mocked.openai.chat.completions.create(model="m", messages=[USER])
    assert upstream.cookies[0] == "user=set"
    assert all(c is not None and "sticky=node-2" in c and "user=set" in c for c in upstream.cookies[1:])
    assert len(conv.turns) == 2


def test_a_jar_given_to_the_http_client_later_still_gets_the_cookies(
    mocked: kvlease.KVLeaseClient, upstream: Upstream
) -> None:
    mocked.http_client.cookies = {"mine": "1"}
    with mocked.conversation() as conv:
        conv.chat.completions.create(model="m", messages=_history(1))
        conv.chat.completions.create(model="m", messages=_history(2))
    assert upstream.cookies[0] == "mine=1"
    assert upstream.cookies[1] is not None and "sticky=node-2" in upstream.cookies[1]


def test_settings_put_on_the_http_client_apply(mocked: kvlease.KVLeaseClient, upstream: Upstream) -> None:
    seen: list[str] = []

    class Tag(hx.Auth):
        def auth_flow(self, request: Any) -> Any:
            request.headers["x-tag"] = "yes"
            yield request

    mocked.http_client.event_hooks = {"request": [lambda r: seen.append(r.url.path)], "response": []}
    mocked.http_client.auth = Tag()
    with mocked.conversation() as conv:
        r = conv.chat.completions.with_raw_response.create(model="m", messages=[USER])
    assert r.http_request.headers["x-tag"] == "yes"
    assert seen == [protocol.CHAT_COMPLETIONS_PATH]
    assert len(conv.turns) == 1 and conv.turns[0].ttl_s == 30


def test_tracked_responses_are_timed_and_a_closed_client_refuses(mocked: kvlease.KVLeaseClient) -> None:
    conv = mocked.conversation()
    http = mocked.http_client
    body = {"model": "m", "messages": _history(1)}
    r = http.post(
        "http://router/v1/chat/completions", json=body, headers={protocol.HEADER_CONVERSATION_ID: conv.id}
    )
    assert r.json()["choices"][0]["message"]["content"] == "ok"
    assert r.elapsed.total_seconds() >= 0
    assert len(conv.turns) == 1
    body = {"model": "m", "messages": _history(2)}
    with http.stream(
        "POST",
        "http://router/v1/chat/completions",
        json=body,
        headers={protocol.HEADER_CONVERSATION_ID: conv.id},
    ) as s:
        assert not s.is_closed
        s.read()
    assert len(conv.turns) == 2
    mocked.close()
    with pytest.raises(RuntimeError):
        http.post("http://router/v1/chat/completions", json=body)


async def test_async_cookies_timing_and_settings() -> None:
    upstream = Upstream(asynchronous=True)
    inner = hx.AsyncClient(transport=hx.MockTransport(upstream), cookies={"user": "set"})
    kc = kvlease.wrap(
        AsyncOpenAI(base_url="http://router/v1", api_key="k", max_retries=0, http_client=inner),
        heartbeat=False,
    )
    seen: list[str] = []

    async def hook(r: Any) -> None:
        seen.append(r.url.path)

    try:
        async with kc.conversation() as conv:
            await conv.chat.completions.create(model="m", messages=_history(1))
            kc.http_client.event_hooks = {"request": [hook], "response": []}
            await conv.chat.completions.create(model="m", messages=_history(2))
            r = await kc.http_client.post(
                "http://router/v1/chat/completions",
                json={"model": "m", "messages": _history(3)},
                headers={protocol.HEADER_CONVERSATION_ID: conv.id},
            )
            assert r.elapsed.total_seconds() >= 0
            assert len(conv.turns) == 3
    finally:
        await kc.aclose()
        await inner.aclose()
    assert upstream.cookies[0] == "user=set"
    assert all(c is not None and "sticky=node-2" in c for c in upstream.cookies[1:])
    assert seen == [protocol.CHAT_COMPLETIONS_PATH] * 2
