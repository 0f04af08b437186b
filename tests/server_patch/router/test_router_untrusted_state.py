"""Stored state is untrusted (issue 15, item 2): whatever sits in Redis (garbage, records without a
valid MAC, records moved between keys, records naming another host) costs reuse only: never a 5xx,
and never a request (with the control secret) to a host that is not configured."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import orjson
import pytest
from _router_cluster import SECRET, Cluster, ClusterFactory, assistant_text
from aiohttp import web

from kvlease.protocol import (
    CONTROL_RELEASE_PATH,
    CONTROL_RENEW_PATH,
    CONVERSATIONS_PATH,
    HEADER_STATUS,
    RENEW_PATH,
)
from kvlease_router import ConversationRecord, MemoryStore, RedisStore, redis_client_from_url
from kvlease_router._identity import ANONYMOUS_TENANT
from kvlease_router._store import RecordSeal
from kvlease_stack.testing import RedisServer, serve

KEY_SECRET = "test-key-secret"  # the cluster fixture's key secret


@pytest.fixture
async def thief() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """A host on 127.0.0.1 that records every control call it gets (it must get none)."""
    seen: list[dict[str, Any]] = []

    async def record(request: web.Request) -> web.Response:
        seen.append({"path": request.path, "auth": request.headers.get("Authorization")})
        return web.json_response({"expires_in": {}, "released": 0})

    app = web.Application()
    for path in (CONTROL_RENEW_PATH, CONTROL_RELEASE_PATH):
        app.router.add_post(path, record)
    runner, url = await serve(app)
    try:
        yield url, seen
    finally:
        await runner.cleanup()


async def _turn(cluster: Cluster, cid: str) -> list[dict[str, Any]]:
    msgs = [{"role": "user", "content": f"{cid} " * 40}]
    r, b = await cluster.chat(msgs, cid=cid)
    assert r.status == 200
    return [
        *msgs,
        {"role": "assistant", "content": assistant_text(b, False)},
        {"role": "user", "content": "more"},
    ]


async def _renew(cluster: Cluster, ids: list[str]) -> tuple[int, Any]:
    async with cluster.client.post(cluster.url + RENEW_PATH, json={"conversation_ids": ids}) as r:
        return r.status, orjson.loads(await r.read())


async def test_a_stored_control_url_outside_the_configuration_gets_nothing(
    make_cluster: ClusterFactory, thief: tuple[str, list[dict[str, Any]]]
) -> None:
    """A record (or D's handle) naming another control URL: renew and release send it nothing;
    the lease is renewed on the configured endpoint of the D that served the turn, if any."""
    url, seen = thief
    store = MemoryStore(100)
    cluster = await make_cluster(store=store)
    msgs = await _turn(cluster, "victim")
    key = cluster.router.keyer.key(ANONYMOUS_TENANT, "victim")
    good = await store.get(key)
    assert good is not None and good.control == cluster.pair.decode.control
    # the record now names the thief, and a decode URL no router knows
    await store.put(key, replace(good, control=url, decode="http://10.9.9.9:1"), 60)
    status, body = await _renew(cluster, ["victim"])
    assert status == 200 and body["leases"]["victim"] == {"status": "unknown"}
    async with cluster.client.delete(f"{cluster.url}{CONVERSATIONS_PATH}/victim") as r:
        assert r.status == 200
    r, _ = await cluster.chat(msgs, cid="victim")
    assert r.status == 200
    assert seen == []  # the control secret never left for an unconfigured host
    # a record naming the thief but the real D: renewed there, on D's configured endpoint
    msgs = await _turn(cluster, "second")
    key = cluster.router.keyer.key(ANONYMOUS_TENANT, "second")
    good = await store.get(key)
    assert good is not None
    await store.put(key, replace(good, control=url), 60)
    status, body = await _renew(cluster, ["second"])
    assert status == 200 and body["leases"]["second"]["expires_in"] > 0
    assert seen == [] and cluster.pair.decode.stats["renew_calls"] >= 1


def test_the_seal_refuses_forged_moved_and_garbled_records() -> None:
    seal = RecordSeal(KEY_SECRET)
    rec = ConversationRecord("http://d", {"remote_block_ids": [1]}, "l", "http://c", 3, 1.0)
    raw = seal.seal("k1", rec)
    assert seal.open("k1", raw) == rec and seal.open("k1", None) is None
    assert seal.open("k2", raw) is None  # moved to another conversation's (or tenant's) key
    assert RecordSeal("another secret").open("k1", raw) is None
    assert seal.open("k1", rec.dumps()) is None  # the pre-MAC format: plain JSON
    assert seal.open("k1", raw[:-3] + b"999") is None
    for junk in (b"", b"v1.", b"\xff" * 80, b"v1." + b"0" * 32 + b".{}", "ünïcode"):
        assert seal.open("k1", junk) is None
    assert seal.rejected == 8
    assert KEY_SECRET.encode() not in raw


@pytest.mark.redis
async def test_garbage_and_forged_records_in_redis_cost_reuse_only(
    make_cluster: ClusterFactory, redis_server: RedisServer, thief: tuple[str, list[dict[str, Any]]]
) -> None:
    url, seen = thief
    client = redis_client_from_url(redis_server.url, 1.0)
    store = RedisStore(redis_client_from_url(redis_server.url, 1.0), secret=KEY_SECRET, timeout=1.0)
    cluster = await make_cluster(store=store)
    keyer = cluster.router.keyer
    convs = {f"g{i}": await _turn(cluster, f"g{i}") for i in range(6)}
    keys = {cid: keyer.key(ANONYMOUS_TENANT, cid) for cid in convs}
    good = await store.get(keys["g0"])
    assert good is not None
    forged = replace(good, control=url, decode="http://10.9.9.9:1")
    planted = [
        b"\x00\xff garbage",
        b"{not json",
        orjson.dumps(
            {"decode": 1, "params": [], "lease_id": {}, "control": 2, "tokens": "x", "expires_at": None}
        ),
        forged.dumps(),  # a well-formed record without the MAC: what a Redis writer could plant
        RecordSeal("a guessed secret").seal(keys["g4"], forged),
    ]
    for cid, raw in zip(convs, planted):
        await client.set("kvlease:conv:" + keys[cid], raw, px=60_000)
    # g5's valid record copied to g0's key: the MAC binds it to its own key
    await client.set("kvlease:conv:" + keys["g0"], await client.get("kvlease:conv:" + keys["g5"]), px=60_000)
    status, body = await _renew(cluster, list(convs))
    assert status == 200
    assert [cid for cid, v in body["leases"].items() if v == {"status": "unknown"}] == [
        "g0",
        "g1",
        "g2",
        "g3",
        "g4",
    ]
    for cid, msgs in convs.items():
        r, _ = await cluster.chat(msgs, cid=cid)
        assert r.status == 200
        assert r.headers[HEADER_STATUS] == ("hit" if cid == "g5" else "first")
    for cid in ("g1", "g3"):
        async with cluster.client.delete(f"{cluster.url}{CONVERSATIONS_PATH}/{cid}") as r:
            assert r.status == 200
    assert seen == []
    assert store.rejected >= 5
    # no key secret, and no clear-text secret of any kind, in Redis
    for k in await client.keys("*"):
        assert KEY_SECRET.encode() not in (await client.get(k) or b"")
        assert SECRET.encode() not in (await client.get(k) or b"")
    await client.aclose()
