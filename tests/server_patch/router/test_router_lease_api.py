"""Lease API: batched renew per decode node, release, tenant scoping; decode affinity; status/metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import orjson
import pytest
from _router_cluster import Cluster, ClusterFactory, assistant_text

from kvlease.protocol import (
    CONVERSATIONS_PATH,
    ERROR_RATE_LIMITED,
    ERROR_STORE_UNAVAILABLE,
    HEADER_RETRY_AFTER,
    HEADER_STATUS,
    KV,
    KV_TRANSFER_PARAMS,
    METRICS_PATH,
    RENEW_MAX_IDS,
    RENEW_PATH,
    STATUS_PATH,
    ErrorBody,
    ProtocolError,
    RenewRequest,
    RenewResponse,
)
from kvlease_router import ConversationRecord, MemoryStore, StoreError
from kvlease_router._store import PutItem
from kvlease_stack.testing import FakeConfig


async def _first_turn(
    cluster: Cluster, cid: str, headers: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    msgs = [{"role": "user", "content": f"{cid} " * 40}]
    r, b = await cluster.chat(msgs, cid=cid, headers=headers)
    assert r.status == 200
    return [
        *msgs,
        {"role": "assistant", "content": assistant_text(b, False)},
        {"role": "user", "content": "next"},
    ]


async def _renew(cluster: Cluster, ids: list[str], headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with cluster.client.post(
        cluster.url + RENEW_PATH, json={"conversation_ids": ids}, headers=headers
    ) as r:
        return r.status, orjson.loads(await r.read())


async def test_renew_is_one_batched_call_per_decode_node(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster(n_decode=2)
    ids = [f"c{i}" for i in range(6)]
    for cid in ids:
        await _first_turn(cluster, cid)
    per_node = [len(d.retained) for d in cluster.pair.decodes]
    assert per_node[0] > 0 and per_node[1] > 0  # least-loaded spread the first turns
    status, body = await _renew(cluster, [*ids, "never-seen"])
    assert status == 200
    leases = RenewResponse.from_json(body).leases
    assert leases["never-seen"] is None
    for cid in ids:
        assert leases[cid] is not None and 0 < leases[cid] <= cluster.router.ttl
    for d, n in zip(cluster.pair.decodes, per_node):
        assert d.stats["renew_calls"] == 1 and len(d.renew_batches[0]) == n
    # the renewal asked D for more than the router's TTL (D outlives the router's lease)
    assert cluster.router.metrics.renewals["renewed"]._value.get() == 6


async def test_renew_extends_an_otherwise_expiring_lease(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster(FakeConfig(ttl=6.0), ttl_margin=5.0)  # router TTL 1 s, D TTL 6 s
    msgs = await _first_turn(cluster, "keep")
    for _ in range(3):
        await asyncio.sleep(0.5)
        status, body = await _renew(cluster, ["keep"])
        assert status == 200 and body["leases"]["keep"]["expires_in"] > 0.5
    r, _ = await cluster.chat(msgs, cid="keep")  # 1.5 s later: past the unrenewed router TTL
    assert r.headers[HEADER_STATUS] == "hit"


async def test_renew_of_a_lease_d_no_longer_holds_is_unknown(cluster: Cluster) -> None:
    await _first_turn(cluster, "lost")
    cluster.pair.decode.retained.clear()
    _, body = await _renew(cluster, ["lost"])
    assert body["leases"]["lost"] == {"status": "unknown"}


async def test_renew_with_d_control_down_reports_remaining_time(cluster: Cluster) -> None:
    await _first_turn(cluster, "down")
    await cluster.pair.decode.stop()
    status, body = await _renew(cluster, ["down"])
    assert status == 200 and 0 < body["leases"]["down"]["expires_in"] <= cluster.router.ttl
    assert cluster.router.metrics.renewals["failed"]._value.get() == 1


async def test_release_frees_d_and_next_turn_is_first(cluster: Cluster) -> None:
    msgs = await _first_turn(cluster, "rel")
    assert len(cluster.pair.decode.retained) == 1
    async with cluster.client.delete(cluster.url + CONVERSATIONS_PATH + "/rel") as r:
        body = orjson.loads(await r.read())
    assert r.status == 200 and body == {"conversation_id": "rel", "known": True, "released": True}
    assert cluster.pair.decode.retained == {}
    r2, _ = await cluster.chat(msgs, cid="rel")
    assert r2.headers[HEADER_STATUS] == "first"
    async with cluster.client.delete(cluster.url + CONVERSATIONS_PATH + "/rel") as r:
        assert orjson.loads(await r.read())["known"] is False or r.status == 200


async def test_tenants_are_isolated_for_turns_renew_and_release(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster()
    alice = {"Authorization": "Bearer alice-key"}
    mallory = {"Authorization": "Bearer mallory-key"}
    msgs = await _first_turn(cluster, "shared-id", alice)
    r, _ = await cluster.chat(msgs, cid="shared-id", headers=mallory)  # same id, other tenant
    assert r.headers[HEADER_STATUS] == "first"
    # mallory's turn sent no handle to P: nothing of alice's reached her
    assert cluster.pair.prefill.requests[-1][KV_TRANSFER_PARAMS][KV.REMOTE_BLOCK_IDS] is None
    _, body = await _renew(cluster, ["shared-id"], mallory)
    assert body["leases"]["shared-id"] is not None  # mallory's own conversation
    async with cluster.client.delete(
        cluster.url + CONVERSATIONS_PATH + "/shared-id", headers=mallory
    ) as resp:
        assert resp.status == 200
    r2, _ = await cluster.chat(msgs, cid="shared-id", headers=alice)
    assert r2.headers[HEADER_STATUS] == "hit"  # alice's lease survived mallory's release


async def test_tenant_header_when_configured(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster(tenant_header="X-Tenant")
    msgs = await _first_turn(cluster, "t", {"X-Tenant": "acme", "Authorization": "Bearer k1"})
    r, _ = await cluster.chat(msgs, cid="t", headers={"X-Tenant": "acme", "Authorization": "Bearer k2"})
    assert r.headers[HEADER_STATUS] == "hit"  # tenant is the header, not the token
    r, _ = await cluster.chat(msgs, cid="t", headers={"X-Tenant": "other"})
    assert r.headers[HEADER_STATUS] == "first"


async def test_decode_affinity_and_failover(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster(n_decode=2)
    convs = {}
    for i in range(4):
        convs[f"a{i}"] = await _first_turn(cluster, f"a{i}")
    first_d = {cid: cluster.pair.decodes.index(_holder(cluster, cid)) for cid in convs}
    assert set(first_d.values()) == {0, 1}
    for cid, msgs in convs.items():
        r, b = await cluster.chat(msgs, cid=cid)
        assert r.headers[HEADER_STATUS] == "hit"
        assert cluster.pair.decodes.index(_holder(cluster, cid)) == first_d[cid]  # same D again
        convs[cid] = [
            *msgs,
            {"role": "assistant", "content": assistant_text(b, False)},
            {"role": "user", "content": "3"},
        ]
    # D0 goes away: its conversations move to D1 (miss: their blocks were on D0), nothing fails
    await cluster.pair.decodes[0].stop()
    cluster.router.upstreams.mark_down(
        cluster.router.upstreams.decode.nodes[0], asyncio.get_running_loop().time()
    )
    cluster.router.upstreams.decode.nodes[0].down_until = float("inf")
    for cid, msgs in convs.items():
        r, _ = await cluster.chat(msgs, cid=cid)
        assert r.status == 200
        assert r.headers[HEADER_STATUS] == ("miss" if first_d[cid] == 0 else "hit")


def _holder(cluster: Cluster, cid: str) -> Any:
    """The decode node that served the conversation's last turn (from the router's state)."""
    store = cluster.router.store
    key = cluster.router.keyer.key("anonymous", cid)
    state = store._data[key][1]  # type: ignore[attr-defined]
    return next(d for d in cluster.pair.decodes if d.url == state.decode)


async def test_status_health_metrics(cluster: Cluster) -> None:
    await _first_turn(cluster, "m")
    async with cluster.client.get(cluster.url + STATUS_PATH) as r:
        status = orjson.loads(await r.read())
    assert status["mode"] == "kvlease" and status["renewals"] is True and status["store"] == "memory"
    assert status["decode_ttl_s"] == 120.0 and status["ttl_s"] == 115.0
    assert status["model"] == "fake-model" and status["vllm_version"] == "0.32.0"
    # each node as its /info says now (refreshed by the status): D holds the first turn's lease
    (d,) = status["decode"]
    assert d["placement"] == "device"
    assert d["tier"]["kvlease_device_blocks_held"] > 0, d
    assert d["tier"]["kvlease_host_bytes_used"] == 0.0
    async with cluster.client.get(cluster.url + "/health") as r:
        assert r.status == 200
    async with cluster.client.get(cluster.url + METRICS_PATH) as r:
        text = (await r.read()).decode()
    assert 'kvlease_router_turns_total{status="first"} 1.0' in text
    assert "kvlease_router_prefill_seconds_bucket" in text and "kvlease_router_decode_seconds_bucket" in text
    assert "kvlease_router_store_errors_total 0.0" in text


# ---- renew at bounded cost (issue 15, item 3) ------------------------------------------------


class FailingStore(MemoryStore):
    """A memory store whose every call fails while ``down`` (a Redis blip)."""

    down = False

    def _check(self) -> None:
        if self.down:
            raise StoreError("redis: ConnectionError: down")

    async def get(self, key: str) -> ConversationRecord | None:
        self._check()
        return await super().get(key)

    async def get_many(self, keys: Sequence[str]) -> list[ConversationRecord | None]:
        self._check()
        return await super().get_many(keys)

    async def put_many(self, items: Sequence[PutItem]) -> None:
        self._check()
        await super().put_many(items)

    async def delete(self, key: str) -> ConversationRecord | None:
        self._check()
        return await super().delete(key)


async def test_a_store_error_is_503_with_retry_after_never_unknown(make_cluster: ClusterFactory) -> None:
    store = FailingStore(100)
    cluster = await make_cluster(store=store)
    msgs = await _first_turn(cluster, "blip")
    store.down = True
    async with cluster.client.post(cluster.url + RENEW_PATH, json={"conversation_ids": ["blip"]}) as r:
        body = orjson.loads(await r.read())
        assert r.status == 503 and int(r.headers[HEADER_RETRY_AFTER]) >= 1
    assert ErrorBody.from_json(body).type == ERROR_STORE_UNAVAILABLE
    async with cluster.client.delete(cluster.url + CONVERSATIONS_PATH + "/blip") as r:
        assert r.status == 503 and HEADER_RETRY_AFTER in r.headers
    store.down = False  # the blip is over: the lease was never reported gone, and still holds
    status, body = await _renew(cluster, ["blip"])
    assert status == 200 and body["leases"]["blip"]["expires_in"] > 0
    r, _ = await cluster.chat(msgs, cid="blip")
    assert r.headers[HEADER_STATUS] == "hit"


async def test_renews_have_a_per_tenant_budget(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster(renew_ids_per_s=1000.0, renew_burst_ids=2000)
    greedy = {"Authorization": "Bearer greedy"}
    ids = [f"x{i}" for i in range(900)]
    assert (await _renew(cluster, ids, greedy))[0] == 200  # 900 + 100 of 2000
    assert (await _renew(cluster, ids, greedy))[0] == 200
    async with cluster.client.post(
        cluster.url + RENEW_PATH, json={"conversation_ids": ids}, headers=greedy
    ) as r:
        assert r.status == 429 and int(r.headers[HEADER_RETRY_AFTER]) >= 1
        assert ErrorBody.from_json(orjson.loads(await r.read())).type == ERROR_RATE_LIMITED
    assert (await _renew(cluster, ids, {"Authorization": "Bearer other"}))[0] == 200  # not others'


async def test_the_renew_cap_is_the_sdk_batch_size() -> None:
    """The keeper batches by the same protocol constant the router caps at."""
    from kvlease._renewal import RenewalSchedule

    table = RenewalSchedule(max_idle=1e9)
    for i in range(RENEW_MAX_IDS + 5):
        table.activate(f"c{i}", "http://r", 300.0, {}, 0.0, explicit=False)
    batches, _ = table.due(1e6, force=True)
    assert [len(b.conversation_ids) for b in batches] == [RENEW_MAX_IDS, 5]
    RenewRequest.from_json({"conversation_ids": [f"c{i}" for i in range(RENEW_MAX_IDS)]})
    with pytest.raises(ProtocolError):
        RenewRequest.from_json({"conversation_ids": [f"c{i}" for i in range(RENEW_MAX_IDS + 1)]})
    with pytest.raises(ProtocolError):  # the fast path still refuses an id holding a newline
        RenewRequest.from_json({"conversation_ids": ["a\nb"]})


async def test_renew_sends_d_an_opaque_tenant_tag(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster()
    seen: list[str | None] = []
    leases = cluster.pair.decode.retained
    renew = leases.renew

    def spy(body: object) -> Any:
        req, answer = renew(body)
        seen.append(req.tenant)
        return req, answer

    leases.renew = spy  # type: ignore[method-assign]
    for who in ("alice", "bob", "alice"):
        h = {"Authorization": f"Bearer {who}-key"}
        await _first_turn(cluster, f"{who}-conv", h)
        await _renew(cluster, [f"{who}-conv"], h)
    assert len(seen) == 3 and seen[0] == seen[2] != seen[1]
    assert all(t and "alice" not in t and "bob" not in t and len(t) <= 64 for t in seen)


@pytest.mark.redis
async def test_one_mget_per_renew_on_redis(make_cluster: ClusterFactory, redis_server: Any) -> None:
    from kvlease_router import RedisStore, redis_client_from_url

    store = RedisStore(redis_client_from_url(redis_server.url, 1.0), secret="test-key-secret", timeout=1.0)
    cluster = await make_cluster(store=store)
    for cid in ("m1", "m2"):
        await _first_turn(cluster, cid)
    probe = redis_client_from_url(redis_server.url, 1.0)
    ids = ["m1", "m2", *(f"unknown{i}" for i in range(500))]
    await _renew(cluster, ids)  # loads the read script (EVALSHA, NOSCRIPT, SCRIPT LOAD)
    await probe.config_resetstat()
    status, body = await _renew(cluster, ids)
    assert status == 200 and body["leases"]["m1"]["expires_in"] > 0
    stats = await probe.info("commandstats")
    # one command reads the batch: the read script (its GETs run inside Redis), no MGET, no
    # GET of its own, nothing per id from the router
    assert stats["cmdstat_evalsha"]["calls"] == 1 and "cmdstat_mget" not in stats
    assert stats["cmdstat_get"]["calls"] == len(ids)  # inside the one script
    assert stats["cmdstat_set"]["calls"] == 2  # the two renewed records, in one pipeline
    await probe.aclose()


@pytest.mark.redis
async def test_renew_on_redis_without_scripting_falls_back_to_one_mget(
    make_cluster: ClusterFactory, redis_server: Any
) -> None:
    from kvlease_router import RedisStore, redis_client_from_url

    store = RedisStore(redis_client_from_url(redis_server.url, 1.0), secret="test-key-secret", timeout=1.0)
    cluster = await make_cluster(store=store)
    for cid in ("f1", "f2"):
        await _first_turn(cluster, cid)

    def refuse(script: str) -> Any:
        async def run(keys: Any = (), args: Any = ()) -> Any:
            from redis.exceptions import ResponseError

            raise ResponseError("NOPERM this user has no permissions to run the 'evalsha' command")

        return run

    store._client.register_script = refuse  # a Redis whose ACL forbids scripts
    probe = redis_client_from_url(redis_server.url, 1.0)
    await probe.config_resetstat()
    ids = ["f1", "f2", *(f"unknown{i}" for i in range(500))]
    for _ in range(2):
        status, body = await _renew(cluster, ids)
        assert status == 200 and body["leases"]["f1"]["expires_in"] > 0
    stats = await probe.info("commandstats")
    assert stats["cmdstat_mget"]["calls"] == 2 and "cmdstat_get" not in stats
    assert not store._scripts_ok  # not tried again, and no back-off (the store stayed up)
    await probe.aclose()


@pytest.mark.redis
async def test_an_anonymous_renew_flood_leaves_other_tenants_reuse_alone(
    make_cluster: ClusterFactory, redis_server: Any
) -> None:
    """Issue 15's victim: one anonymous renew of 101 unknown ids a second switched reuse off for
    every tenant (101 concurrent GETs, a pool of 100, a 1 s back-off). Here ten such renews a second
    run beside a victim's 20 turns, on a pool of 8 connections."""
    from kvlease_router import RedisStore, redis_client_from_url

    store = RedisStore(
        redis_client_from_url(redis_server.url, 1.0, max_connections=8), secret="test-key-secret", timeout=1.0
    )
    cluster = await make_cluster(store=store)
    stop = asyncio.Event()
    attack_statuses: list[int] = []

    async def attacker() -> None:
        ids = [f"nope{i}" for i in range(101)]
        while not stop.is_set():
            attack_statuses.append((await _renew(cluster, ids))[0])
            await asyncio.sleep(0.1)

    task = asyncio.create_task(attacker())
    victim = {"Authorization": "Bearer victim"}
    msgs = [{"role": "user", "content": "victim " * 40}]
    statuses = []
    for _ in range(20):
        r, b = await cluster.chat(msgs, cid="victim-conv", headers=victim)
        statuses.append(r.headers[HEADER_STATUS])
        msgs += [
            {"role": "assistant", "content": assistant_text(b, False)},
            {"role": "user", "content": "go"},
        ]
        await asyncio.sleep(0.05)
    stop.set()
    await task
    assert statuses.count("hit") == 19 and statuses[0] == "first", statuses
    assert len(attack_statuses) >= 5 and set(attack_statuses) <= {200, 429}
    assert cluster.router.metrics.store_errors._value.get() == 0
