"""The router's opaque tenant tag on P's and D's requests (kvlease mode only), and D's per-tenant
retention quota on the fake P/D (its real lease table), with no renewal at all."""

from __future__ import annotations

from typing import Any

import pytest
from _router_cluster import Cluster, ClusterFactory, assistant_text

from kvlease.protocol import (
    CONTROL_AUTH_HEADER,
    CONTROL_INFO_PATH,
    HEADER_AUTHORIZATION,
    HEADER_STATUS,
    KV,
    KV_TRANSFER_PARAMS,
    ControlInfo,
    TenantLeases,
    TransferParams,
)
from kvlease_router._identity import tenant_from
from kvlease_stack.testing import FakeConfig

TOKEN_A, TOKEN_B = "Bearer tenant-a", "Bearer tenant-b"


def tag_of(cluster: Cluster, auth: str | None) -> str:
    headers = {HEADER_AUTHORIZATION: auth} if auth else {}
    return cluster.router.keyer.tenant_tag(tenant_from(headers, cluster.settings.tenant_header))


def sent(body: dict[str, Any]) -> Any:
    kv = body.get(KV_TRANSFER_PARAMS)
    return kv.get(KV.TENANT) if isinstance(kv, dict) else None


async def two_turns(cluster: Cluster, auth: str, cid: str, stream: bool = False, **body: Any) -> list[str]:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "tell me about tenants " * 6}]
    statuses = []
    for i in range(2):
        r, out = await cluster.chat(
            msgs, cid=cid, stream=stream, headers={HEADER_AUTHORIZATION: auth}, **body
        )
        assert r.status == 200
        statuses.append(r.headers[HEADER_STATUS])
        msgs += [
            {"role": "assistant", "content": assistant_text(out, stream)},
            {"role": "user", "content": f"{i}"},
        ]
    return statuses


@pytest.mark.parametrize("stream", [False, True])
async def test_the_tag_reaches_p_and_d_on_every_turn(cluster: Cluster, stream: bool) -> None:
    pair = cluster.pair
    assert await two_turns(cluster, TOKEN_A, "conv-a", stream) == ["first", "hit"]
    tag = tag_of(cluster, TOKEN_A)
    assert [sent(b) for b in pair.prefill.requests] == [tag, tag]  # the plain request, then the pull
    assert [sent(b) for b in pair.decode.requests] == [tag, tag]
    # beside D's handle, outside its MAC: P still verified and pulled it (the second turn hit)
    pull = pair.prefill.requests[-1][KV_TRANSFER_PARAMS]
    assert TransferParams.from_json(pull).kvlease is not None and KV.TENANT not in pull[KV.KVLEASE]
    # another bearer token is another tenant, another tag; a turn without an id is tagged too
    assert await two_turns(cluster, TOKEN_B, "conv-a", stream) == ["first", "hit"]
    r, _ = await cluster.chat([{"role": "user", "content": "no id"}], headers={HEADER_AUTHORIZATION: TOKEN_B})
    assert r.headers[HEADER_STATUS] == "no-id"
    other = tag_of(cluster, TOKEN_B)
    assert other != tag and len(other) == 24
    assert {sent(b) for b in list(pair.decode.requests)[2:]} == {other}


async def test_stock_vllm_gets_no_tag(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster(FakeConfig(kvlease=False, plugin=False, ttl=120.0), node_ttl=120.0)
    assert await two_turns(cluster, TOKEN_A, "stock") == ["first", "hit"]
    received = [*cluster.pair.prefill.requests, *cluster.pair.decode.requests]
    assert len(received) == 4
    assert all(KV.TENANT not in b[KV_TRANSFER_PARAMS] for b in received)  # what it was sent before


@pytest.mark.parametrize("where", ["kv_transfer_params", "vllm_xargs"])
async def test_a_client_supplied_tag_is_dropped(cluster: Cluster, where: str) -> None:
    forged = {KV.TENANT: tag_of(cluster, TOKEN_B), KV.DO_REMOTE_DECODE: True}
    body = (
        {KV_TRANSFER_PARAMS: forged}
        if where == "kv_transfer_params"
        else {"vllm_xargs": {KV_TRANSFER_PARAMS: forged}}
    )
    assert await two_turns(cluster, TOKEN_A, "forger", **body) == ["first", "hit"]
    tag = tag_of(cluster, TOKEN_A)
    for b in [*cluster.pair.prefill.requests, *cluster.pair.decode.requests]:
        assert sent(b) == tag  # the router's tag of the caller, never the client's
        assert KV_TRANSFER_PARAMS not in (b.get("vllm_xargs") or {})
    status = await d_leases(cluster)
    assert status.tenant(tag_of(cluster, TOKEN_B)).leases == 0  # nothing counted under B


async def d_leases(cluster: Cluster) -> Any:
    d = cluster.pair.decode
    auth = {CONTROL_AUTH_HEADER: "Bearer " + d.config.control_secret}
    async with cluster.client.get(f"{d.control}{CONTROL_INFO_PATH}", headers=auth) as r:
        assert r.status == 200
        info = ControlInfo.from_json(await r.json())
    assert info.leases is not None
    return info.leases


async def test_fake_d_tags_leases_and_a_tenant_filling_the_cap_pushes_out_its_own(
    make_cluster: ClusterFactory,
) -> None:
    # D holds 40 blocks (quota 20); each one-turn conversation leases its prompt and answer
    cluster = await make_cluster(FakeConfig(capacity_blocks=40))
    d, tag_a, tag_b = cluster.pair.decode, tag_of(cluster, TOKEN_A), tag_of(cluster, TOKEN_B)
    msgs = [{"role": "user", "content": "tenant b, the older conversation " * 3}]
    r, _ = await cluster.chat(msgs, cid="b-0", headers={HEADER_AUTHORIZATION: TOKEN_B})
    assert r.status == 200
    b = (await d_leases(cluster)).tenant(tag_b)
    assert b.leases == 1 and b.blocks > 0  # tagged when D created it: B never renews
    for i in range(40):  # bounded: each lease holds at least one block of the 40
        msgs = [{"role": "user", "content": f"tenant a fills the cap, conversation {i} " * 3}]
        r, _ = await cluster.chat(msgs, cid=f"a-{i}", headers={HEADER_AUTHORIZATION: TOKEN_A})
        assert r.status == 200
        status = await d_leases(cluster)
        assert status.tenant(tag_b) == b, (i, status)  # B's older lease is never the one to go
        if status.tenant(tag_a).leases <= i:  # one of A's leases went early
            break
    else:
        pytest.fail(f"tenant A's leases never pressed the cap: {status}")
    assert status.retained_blocks <= 40 and status.untagged == TenantLeases(None, 0, 0)
    assert d.stats["renew_calls"] == 0  # no renewal named any tag: D's requests did
