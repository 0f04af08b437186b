"""Hostile and malformed input: clear 4xx or ignored, never a 5xx, never a handle to a client."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
from _router_cluster import Cluster, ClusterFactory, assistant_text, one_route_upstream

from kvlease.protocol import CONVERSATIONS_PATH, HEADER_STATUS, KV, KV_TRANSFER_PARAMS, RENEW_PATH
from kvlease_stack.testing import FakeConfig

CHAT = "/v1/chat/completions"
GOOD = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

CASES: list[tuple[str, str, Any, dict[str, str], set[int]]] = [
    # (name, path, raw body or object, headers, allowed statuses)
    ("malformed json", CHAT, b"{not json", {}, {400}),
    ("truncated json", CHAT, b'{"messages": [', {}, {400}),
    ("json array", CHAT, b"[1, 2]", {}, {400}),
    ("json string", CHAT, b'"hello"', {}, {400}),
    ("empty body", CHAT, b"", {}, {400}),
    ("invalid utf-8", CHAT, b'{"messages": "\xff\xfe"}', {}, {400}),
    ("stream not bool", CHAT, {**GOOD, "stream": "yes"}, {}, {400}),
    ("messages wrong type", CHAT, {"model": "m", "messages": "hi"}, {"X-Conversation-Id": "x"}, {400}),
    ("messages of numbers", CHAT, {"model": "m", "messages": [1, 2]}, {"X-Conversation-Id": "x"}, {200, 400}),
    ("id too long", CHAT, GOOD, {"X-Conversation-Id": "a" * 129}, {400}),
    ("id bad chars", CHAT, GOOD, {"X-Conversation-Id": "a b/c"}, {400}),
    ("id empty header", CHAT, GOOD, {"X-Conversation-Id": ""}, {400}),
    ("body id wrong type", CHAT, {**GOOD, "conversation_id": 12}, {}, {400}),
    ("body id object", CHAT, {**GOOD, "conversation_id": {"$ne": 1}}, {}, {400}),
    ("prompt_cache_key list", CHAT, {**GOOD, "prompt_cache_key": ["a"]}, {}, {400}),
    ("session id unicode", CHAT, GOOD, {"X-Session-Id": "ünïcode"}, {200}),  # hashed, not refused
    ("max_tokens string", CHAT, {**GOOD, "max_tokens": "lots"}, {"X-Conversation-Id": "x"}, {400}),
    (
        "client kv params",
        CHAT,
        {**GOOD, KV_TRANSFER_PARAMS: {"remote_block_ids": [1], "remote_engine_id": "evil"}},
        {},
        {200},
    ),
    ("client kv params junk", CHAT, {**GOOD, KV_TRANSFER_PARAMS: "junk"}, {"X-Conversation-Id": "x"}, {200}),
    ("huge body", CHAT, b'{"messages": "' + b"a" * (2 * 1024 * 1024) + b'"}', {}, {413}),
    ("renew not json", RENEW_PATH, b"nope", {}, {400}),
    ("renew wrong type", RENEW_PATH, {"conversation_ids": "abc"}, {}, {400}),
    ("renew bad id", RENEW_PATH, {"conversation_ids": ["ok", "not ok"]}, {}, {400}),
    ("renew too many", RENEW_PATH, {"conversation_ids": [f"c{i}" for i in range(10_001)]}, {}, {400, 413}),
    ("renew empty list", RENEW_PATH, {"conversation_ids": []}, {}, {200}),
]


@pytest.fixture
async def small_cluster(make_cluster: ClusterFactory) -> Cluster:
    return await make_cluster(max_body_bytes=1024 * 1024)


@pytest.mark.parametrize(("name", "path", "body", "headers", "allowed"), CASES, ids=[c[0] for c in CASES])
async def test_hostile_requests(
    small_cluster: Cluster, name: str, path: str, body: Any, headers: dict[str, str], allowed: set[int]
) -> None:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    h = {"Content-Type": "application/json", **headers}
    async with small_cluster.client.post(small_cluster.url + path, data=data, headers=h) as r:
        raw = await r.read()
    assert r.status in allowed, (r.status, raw[:300])
    assert KV_TRANSFER_PARAMS.encode() not in raw
    if r.status >= 400:
        assert b"message" in raw  # a clear message, OpenAI-style
    for req in small_cluster.pair.prefill.requests:  # the client's handle never reached P
        kv = req.get(KV_TRANSFER_PARAMS) or {}
        assert kv.get(KV.REMOTE_ENGINE_ID) != "evil"


@pytest.mark.parametrize("bad_id", ["a" * 200, "has space", "semi;colon", "%2F"])
async def test_release_with_bad_id_is_400(cluster: Cluster, bad_id: str) -> None:
    async with cluster.client.delete(cluster.url + CONVERSATIONS_PATH + "/" + bad_id) as r:
        assert r.status in (400, 404) and r.status < 500


async def test_handles_never_reach_the_client_in_any_byte(cluster: Cluster) -> None:
    msgs = [{"role": "user", "content": "strip " * 30}]
    for stream in (False, True, False, True):
        async with cluster.client.post(
            cluster.url + CHAT,
            json={
                "model": "m",
                "messages": msgs,
                "stream": stream,
                "stream_options": {"include_usage": True},
            },
            headers={"X-Conversation-Id": "strip"},
        ) as r:
            raw = await r.read()
        assert r.status == 200
        for needle in (
            KV_TRANSFER_PARAMS,
            cluster.pair.decode.engine_id,
            cluster.pair.prefill.engine_id,
            "remote_block_ids",
            "hashes",
        ):
            assert needle.encode() not in raw, needle
        assert all(needle not in str(v) for v in r.headers.values() for needle in ("remote_", "engine"))
        if stream:
            assert raw.endswith(b"data: [DONE]\n\n")
            text = "".join(
                orjson.loads(b[6:])["choices"][0]["delta"].get("content", "")
                for b in raw.split(b"\n\n")
                if b.startswith(b"data: {") and orjson.loads(b[6:])["choices"]
            )
        else:
            text = orjson.loads(raw)["choices"][0]["message"]["content"]
        msgs = [*msgs, {"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
    assert cluster.pair.decode.stats["reads_ok"] == 3  # the handles were captured and used


async def test_sse_split_across_reads_is_still_stripped(make_cluster: ClusterFactory) -> None:
    """D writes its events in tiny pieces: the router must still see and strip the whole event."""
    cluster = await make_cluster(FakeConfig(token_delay=0.001))
    from aiohttp import web

    async def dribble(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        kv = {
            "do_remote_decode": True,
            "remote_block_ids": [1],
            "remote_engine_id": "secret-engine",
            "remote_request_id": "r",
        }
        chunk = {
            "id": "x",
            "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}],
            KV_TRANSFER_PARAMS: kv,
        }
        payload = b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n"
        for i in range(0, len(payload), 7):
            await resp.write(payload[i : i + 7])
            await asyncio.sleep(0)
        assert body["stream"] is True
        return resp

    async with one_route_upstream(CHAT, dribble) as url:
        cluster.router.upstreams.decode.nodes[0].url = url
        r, events = await cluster.chat([{"role": "user", "content": "x"}], cid="dribble", stream=True)
        assert r.status == 200 and events[-1] == "[DONE]"
        assert events[0]["choices"][0]["delta"]["content"] == "hi"
        assert all(KV_TRANSFER_PARAMS not in e for e in events if isinstance(e, dict))


async def test_client_disconnect_mid_stream_closes_upstream(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster(FakeConfig(token_delay=0.05, default_max_tokens=100))
    d = cluster.pair.decode
    for _ in range(3):
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                cluster.url + CHAT,
                json={"model": "m", "messages": [{"role": "user", "content": "long"}], "stream": True},
                headers={"X-Conversation-Id": "gone"},
            ) as r,
        ):
            assert r.status == 200
            await r.content.readline()  # read a little, then hang up
    deadline = asyncio.get_running_loop().time() + 5
    while (
        d.stats["open_streams"] or d.stats["streams_aborted"] < 3
    ) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    assert d.stats["open_streams"] == 0 and d.stats["streams_aborted"] == 3
    assert cluster.router.metrics.in_flight._value.get() == 0
    # and the router still serves
    r, _ = await cluster.chat([{"role": "user", "content": "fine"}], cid="after")
    assert r.status == 200


async def test_upstream_down_is_502_with_message_not_a_crash(cluster: Cluster) -> None:
    await cluster.pair.prefill.stop()
    r, body = await cluster.chat([{"role": "user", "content": "x"}], cid="p-down")
    assert r.status == 502 and "prefill" in body["error"]["message"]


async def test_another_tenants_id_never_reuses(cluster: Cluster) -> None:
    msgs = [{"role": "user", "content": "tenant " * 30}]
    _, b = await cluster.chat(msgs, cid="same", headers={"Authorization": "Bearer A"})
    msgs += [{"role": "assistant", "content": assistant_text(b, False)}, {"role": "user", "content": "x"}]
    for token in ("B", "C", ""):
        h = {"Authorization": f"Bearer {token}"} if token else {}
        r, _ = await cluster.chat(msgs, cid="same", headers=h)
        assert r.headers[HEADER_STATUS] == "first"
    assert cluster.pair.decode.stats["reads_ok"] == 0


async def test_tenant_cache_salt_separates_tenants_and_hides_the_clients_salt(
    make_cluster: ClusterFactory,
) -> None:
    cluster = await make_cluster(tenant_cache_salt=True)
    msgs = [{"role": "user", "content": "salted " * 40}]
    sent = []
    for token, client_salt in (("A", None), ("A", None), ("B", None), ("A", "mine"), ("", None)):
        h = {"Authorization": f"Bearer {token}"} if token else {}
        extra = {"cache_salt": client_salt} if client_salt else {}
        r, _ = await cluster.chat(msgs, cid=f"salt-{token}", headers=h, **extra)
        assert r.status == 200
        p_req, d_req = cluster.pair.prefill.requests[-1], cluster.pair.decodes[0].requests[-1]
        assert p_req["cache_salt"] == d_req["cache_salt"]  # P and D hash blocks the same way
        sent.append(p_req["cache_salt"])
    a1, a2, b, a_mine, anon = sent
    assert a1 == a2  # one tenant keeps its prefix cache
    assert len({a1, b, a_mine, anon}) == 4  # other tenants and other client salts do not share it
    assert "mine" not in a_mine and len(a1) == 32
    r, body = await cluster.chat(msgs, cid="bad-salt", cache_salt=7)
    assert r.status == 400 and "cache_salt" in body["error"]["message"]


async def test_without_tenant_cache_salt_the_clients_salt_passes_unchanged(cluster: Cluster) -> None:
    r, _ = await cluster.chat([{"role": "user", "content": "x"}], cid="s", cache_salt="client-salt")
    assert r.status == 200 and cluster.pair.prefill.requests[-1]["cache_salt"] == "client-salt"
