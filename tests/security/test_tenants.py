"""Tenant isolation: another tenant's use of a conversation id never reuses (or spends) the first
tenant's KV, and its status header says ``first``/``miss``, never ``hit``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvlease.protocol import (
    DEFAULT_TENANT_HEADER,
    HEADER_REUSED_TOKENS,
    HEADER_STATUS,
    KV,
    KV_TRANSFER_PARAMS,
)
from security._cluster import Cluster, reply_text, running_cluster

Ident = Callable[[str], dict[str, str]]


def bearer(t: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {t}"} if t else {}


def header(t: str) -> dict[str, str]:
    return {DEFAULT_TENANT_HEADER: t} if t else {}


def _offered_leases(cluster: Cluster, since: int) -> list[str]:
    """Lease ids of the handles P was offered in its requests number ``since`` onwards."""
    out = []
    for body in list(cluster.pair.prefill.requests)[since:]:
        kv = body.get(KV_TRANSFER_PARAMS) or {}
        if kv.get(KV.REMOTE_REQUEST_ID):
            out.append(kv[KV.REMOTE_REQUEST_ID])
    return out


@pytest.mark.parametrize(
    ("ident", "tenant_header", "a", "others"),
    [
        (bearer, None, "alice", ["bob", "", "alice2", "ALICE"]),
        (header, DEFAULT_TENANT_HEADER, "team-a", ["team-b", "", "TEAM-A", "team-a2"]),
    ],
    ids=["bearer-token", "tenant-header"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_same_id_other_tenant_never_reuses(
    ident: Ident, tenant_header: str | None, a: str, others: list[str], stream: bool
) -> None:
    overrides: dict[str, Any] = {"tenant_header": tenant_header} if tenant_header else {}
    async with running_cluster(**overrides) as cluster:
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "shared prefix " * 20}]
        r, raw = await cluster.chat(msgs, cid="shared-id", stream=stream, headers=ident(a))
        assert r.headers[HEADER_STATUS] == "first"
        a_leases = {d for d in (_lease_of_last_decode(cluster),) if d}
        history = [*msgs, {"role": "assistant", "content": reply_text(raw, stream)}]
        for other in others:
            seen = len(cluster.pair.prefill.requests)
            follow = [*history, {"role": "user", "content": f"from {other!r}"}]
            r, raw = await cluster.chat(follow, cid="shared-id", stream=stream, headers=ident(other))
            assert r.status == 200
            assert r.headers[HEADER_STATUS] in ("first", "miss"), (other, r.headers[HEADER_STATUS])
            assert r.headers[HEADER_REUSED_TOKENS] == "0"
            assert not set(_offered_leases(cluster, seen)) & a_leases  # A's handle was never offered
        # A's lease was neither reused nor spent by the others: A's next turn still hits
        seen = len(cluster.pair.prefill.requests)
        r, raw = await cluster.chat(
            [*history, {"role": "user", "content": "alice again"}],
            cid="shared-id",
            stream=stream,
            headers=ident(a),
        )
        assert r.headers[HEADER_STATUS] == "hit" and int(r.headers[HEADER_REUSED_TOKENS]) > 0
        assert set(_offered_leases(cluster, seen)) == a_leases
        assert cluster.pair.decode.stats["reads_ok"] == 1


def _lease_of_last_decode(cluster: Cluster) -> str | None:
    """The lease id D issued on its last decode (the fake names leases by its request id)."""
    d = cluster.pair.decode
    return max(d.retained, key=lambda rid: d.retained[rid][1]) if d.retained else None


async def test_tenant_header_and_bearer_do_not_collide() -> None:
    """With a tenant header configured, a request without it falls back to the bearer hash: a header
    value equal to someone's token must not name that token's tenant."""
    async with running_cluster(tenant_header=DEFAULT_TENANT_HEADER) as cluster:
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "collide " * 20}]
        r, raw = await cluster.chat(msgs, cid="c", headers={"Authorization": "Bearer tok"})
        assert r.headers[HEADER_STATUS] == "first"
        follow = [
            *msgs,
            {"role": "assistant", "content": reply_text(raw, False)},
            {"role": "user", "content": "x"},
        ]
        for h in (
            {DEFAULT_TENANT_HEADER: "Bearer tok"},
            {DEFAULT_TENANT_HEADER: "tok"},
            {DEFAULT_TENANT_HEADER: "anonymous"},
            {},
        ):
            r, _ = await cluster.chat(follow, cid="c", headers=h)
            assert r.headers[HEADER_STATUS] == "first", h
        r, _ = await cluster.chat(follow, cid="c", headers={"Authorization": "Bearer tok"})
        assert r.headers[HEADER_STATUS] == "hit"


async def test_renew_and_release_of_another_tenant_do_not_touch_the_lease(cluster: Cluster) -> None:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "mine " * 20}]
    _r, raw = await cluster.chat(msgs, cid="mine", headers=bearer("owner"))
    lease = _lease_of_last_decode(cluster)
    assert lease is not None
    deadline = cluster.pair.decode.retained[lease][1]
    r2, body = await cluster.post("/v1/kvlease/renew", {"conversation_ids": ["mine"]}, bearer("thief"))
    assert r2.status == 200 and b"unknown" in body
    async with cluster.client.delete(
        cluster.url + "/v1/kvlease/conversations/mine", headers=bearer("thief")
    ) as r3:
        assert r3.status == 200 and (await r3.json())["known"] is False
    assert cluster.pair.decode.retained[lease][1] == deadline  # neither renewed nor released
    assert cluster.pair.decode.stats["renew_calls"] == 0 and cluster.pair.decode.stats["release_calls"] == 0
    follow = [
        *msgs,
        {"role": "assistant", "content": reply_text(raw, False)},
        {"role": "user", "content": "x"},
    ]
    r4, _ = await cluster.chat(follow, cid="mine", headers=bearer("owner"))
    assert r4.headers[HEADER_STATUS] == "hit"
