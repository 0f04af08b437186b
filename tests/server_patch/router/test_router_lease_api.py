"""Lease API: batched renew per decode node, release, tenant scoping; decode affinity; status/metrics."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from conftest import Cluster, ClusterFactory, assistant_text

from kvlease.protocol import (
    CONVERSATIONS_PATH,
    HEADER_STATUS,
    KV,
    KV_TRANSFER_PARAMS,
    METRICS_PATH,
    RENEW_PATH,
    STATUS_PATH,
    RenewResponse,
)
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
    async with cluster.client.get(cluster.url + "/health") as r:
        assert r.status == 200
    async with cluster.client.get(cluster.url + METRICS_PATH) as r:
        text = (await r.read()).decode()
    assert 'kvlease_router_turns_total{status="first"} 1.0' in text
    assert "kvlease_router_prefill_seconds_bucket" in text and "kvlease_router_decode_seconds_bucket" in text
    assert "kvlease_router_store_errors_total 0.0" in text
