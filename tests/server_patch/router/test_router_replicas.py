"""Replicas (issue 15, item 10): two and three routers on one real Redis in front of one fake P/D
pair, a conversation alternating between them. Hits, renewals and releases work from any replica;
a replica killed mid-stream costs that turn only; a Redis restart costs reuse, then reuse resumes."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
from _router_cluster import Cluster, ClusterFactory, assistant_text

from kvlease.protocol import CHAT_COMPLETIONS_PATH, CONVERSATIONS_PATH, HEADER_STATUS, RENEW_PATH
from kvlease_router import RedisStore, redis_client_from_url
from kvlease_stack.testing import FakeConfig, FakePair, RedisServer

pytestmark = pytest.mark.redis

KEY_SECRET = "test-key-secret"  # every replica's (the cluster fixture's)


async def _replicas(make_cluster: ClusterFactory, redis: RedisServer, n: int, **config: Any) -> list[Cluster]:
    pair = await FakePair(FakeConfig(**config)).__aenter__()
    out = []
    for _ in range(n):
        store = RedisStore(redis_client_from_url(redis.url, 1.0), secret=KEY_SECRET, timeout=1.0, backoff=0.3)
        out.append(await make_cluster(pair=pair, store=store))
    return out


def _next(msgs: list[dict[str, Any]], body: Any, stream: bool) -> list[dict[str, Any]]:
    return [
        *msgs,
        {"role": "assistant", "content": assistant_text(body, stream)},
        {"role": "user", "content": "go on"},
    ]


async def _renew(c: Cluster, ids: list[str]) -> dict[str, Any]:
    async with c.client.post(c.url + RENEW_PATH, json={"conversation_ids": ids}) as r:
        assert r.status == 200
        return dict(orjson.loads(await r.read())["leases"])


@pytest.mark.parametrize("n", [2, 3])
async def test_a_conversation_alternating_between_replicas_hits_renews_and_releases(
    make_cluster: ClusterFactory, redis_server: RedisServer, n: int
) -> None:
    routers = await _replicas(make_cluster, redis_server, n)
    msgs = [{"role": "user", "content": "alternate " * 30}]
    statuses = []
    for turn in range(2 * n + 1):
        r, b = await routers[turn % n].chat(msgs, cid="alt", stream=turn % 2 == 1)
        assert r.status == 200
        statuses.append(r.headers[HEADER_STATUS])
        msgs = _next(msgs, b, turn % 2 == 1)
        # renewed by the next replica: the lease moves forward wherever the renew lands
        leases = await _renew(routers[(turn + 1) % n], ["alt"])
        assert leases["alt"]["expires_in"] > 0
    assert statuses[0] == "first" and set(statuses[1:]) == {"hit"}, statuses
    decode = routers[0].pair.decode
    assert len(decode.retained) == 1
    async with routers[-1].client.delete(f"{routers[-1].url}{CONVERSATIONS_PATH}/alt") as r:
        assert r.status == 200 and orjson.loads(await r.read())["released"] is True
    assert len(decode.retained) == 0
    r, _ = await routers[0].chat(msgs, cid="alt")
    assert r.headers[HEADER_STATUS] == "first"  # released on one replica: gone on every one


async def test_a_replica_killed_mid_stream_costs_that_turn_only(
    make_cluster: ClusterFactory, redis_server: RedisServer
) -> None:
    a, b, c = await _replicas(make_cluster, redis_server, 3, token_delay=0.05, default_max_tokens=40)
    msgs = [{"role": "user", "content": "survive " * 30}]
    r, body = await a.chat(msgs, cid="k", max_tokens=4)
    assert r.status == 200
    msgs = _next(msgs, body, False)
    payload = {"model": "fake-model", "messages": msgs, "stream": True}
    got = b""
    with pytest.raises((aiohttp.ClientError, asyncio.IncompleteReadError)):
        async with a.client.post(
            a.url + CHAT_COMPLETIONS_PATH, json=payload, headers={"X-Conversation-Id": "k"}
        ) as resp:
            assert resp.status == 200
            got += await resp.content.readany()
            await a.runner.cleanup()  # the replica dies with the stream open
            while chunk := await resp.content.readany():
                got += chunk
            raise aiohttp.ClientPayloadError("stream ended without [DONE]")  # a cut stream, cleanly closed
    assert got.startswith(b"data: ")
    # the conversation goes on on the other replicas: that turn is redone, later ones hit
    statuses = []
    for router in (b, c, b):
        r, body = await router.chat(msgs, cid="k", max_tokens=4)
        assert r.status == 200
        statuses.append(r.headers[HEADER_STATUS])
        msgs = _next(msgs, body, False)
    assert b"[DONE]" not in got  # the stream was cut
    assert statuses[0] in {"miss", "hit", "expired", "error"} and statuses[-2:] == ["hit", "hit"], statuses


async def test_a_redis_restart_costs_reuse_then_reuse_resumes_on_every_replica(
    make_cluster: ClusterFactory, redis_server: RedisServer
) -> None:
    routers = await _replicas(make_cluster, redis_server, 2)
    msgs = [{"role": "user", "content": "restart " * 30}]
    statuses = []
    for turn in range(8):
        if turn == 3:
            redis_server.kill()
        if turn == 5:
            redis_server.restart()
            await asyncio.sleep(0.4)  # past the stores' back-off
        r, body = await routers[turn % 2].chat(msgs, cid="rr")
        assert r.status == 200  # never a failed turn
        statuses.append(r.headers[HEADER_STATUS])
        msgs = _next(msgs, body, False)
        if turn in (3, 4):  # Redis down: a renew is 503 (retry later), never "unknown"
            async with routers[turn % 2].client.post(
                routers[turn % 2].url + RENEW_PATH, json={"conversation_ids": ["rr"]}
            ) as resp:
                assert resp.status == 503
    assert statuses[:3] == ["first", "hit", "hit"], statuses
    assert statuses[3:5] == ["error", "error"], statuses
    assert statuses[5] == "first" and statuses[6:] == ["hit", "hit"], statuses  # an empty Redis
