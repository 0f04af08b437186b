"""The router's tenant tag on the connector (stand-in vLLM, as ``test_connector_scheduler``): D tags
the lease it creates from D's request, P sends the tag of P's request with its claims; a bad tag is
ignored (untagged), never an error, and the handle D returns is what it was without a tag."""

from __future__ import annotations

import time
from typing import Any

import pytest
from test_connector_scheduler import (  # the stand-in vLLM and its fixtures
    D_TOKENS,
    NEW_TURN,
    SECRET,
    _Request,
    ask,
    connector,
    d_handle,
    scheduler,
)

from kvlease.protocol import KV, TENANT_TAG_MAX_LEN, TenantLeases, mac_ok, tenant_tag_of
from kvlease_vllm._control import ClaimResult

__all__ = ["connector"]  # a fixture, imported for the tests below


@pytest.fixture
def claims(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str | None, str | None]]:
    """The claims P sends: (lease id, claimant, tenant tag)."""
    seen: list[tuple[str, str | None, str | None]] = []

    def fake_claim(
        url: str,
        lease_id: str,
        hold: float,
        secret: Any,
        timeout: float,
        claimant: Any = None,
        tenant: Any = None,
    ) -> ClaimResult:
        seen.append((lease_id, claimant, tenant))
        return ClaimResult(29.0, 4321.0)

    import kvlease_vllm._control as control

    monkeypatch.setattr(control, "claim", fake_claim)
    return seen


TAG = "a1b2c3d4e5f6a1b2c3d4e5f6"  # what the router's Keyer.tenant_tag gives: 24 hex characters


@pytest.mark.parametrize(
    ("params", "tag"),
    [
        ({KV.DO_REMOTE_PREFILL: False, KV.TENANT: TAG}, TAG),
        ({KV.TENANT: "t" * TENANT_TAG_MAX_LEN}, "t" * TENANT_TAG_MAX_LEN),
        ({KV.TENANT: "t" * (TENANT_TAG_MAX_LEN + 1)}, None),  # too long: ignored
        ({KV.TENANT: ""}, None),
        ({KV.TENANT: 7}, None),
        ({KV.TENANT: [TAG]}, None),
        ({KV.TENANT: None}, None),
        ({KV.DO_REMOTE_PREFILL: False}, None),  # an older router, or stock requests: untagged
        (None, None),
    ],
)
def test_d_tags_the_lease_at_creation(connector: Any, params: Any, tag: str | None) -> None:
    conn = scheduler(connector, role="kv_consumer", control_secret=SECRET)
    sched = conn.connector_scheduler
    try:
        _, out = sched.request_finished(_Request("d-1", D_TOKENS, kv_transfer_params=params), [[1]])
        # the handle is D's as ever: MAC'd over the same fields, no tag in it (it reaches the router)
        assert out is not None and mac_ok(SECRET, out)
        assert KV.TENANT not in out and KV.TENANT not in out[KV.KVLEASE]
        status = sched.desk.status()
        blocks = len(out[KV.REMOTE_BLOCK_IDS][0])
        if tag is None:
            assert status.tenants == () and status.untagged == TenantLeases(None, 1, blocks)
        else:
            assert status.tenants == (TenantLeases(tag, 1, blocks),) and status.untagged.leases == 0
    finally:
        sched.shutdown()


def test_d_tenant_filling_the_cap_pushes_out_its_own_lease(connector: Any) -> None:
    """No renewal, no claim: the tags D's requests carried decide which lease goes early."""
    # 1000 blocks x 0.03 = a cap of 30: two 11-block leases fit, a third does not (quota 15)
    conn = scheduler(connector, role="kv_consumer", control_secret=SECRET, max_retained_fraction=0.03)
    sched = conn.connector_scheduler
    try:
        for rid, tag in (("b-1", "tag-b"), ("a-1", "tag-a"), ("a-2", "tag-a")):
            _, out = sched.request_finished(_Request(rid, D_TOKENS, {KV.TENANT: tag}), [[1]])
            assert out is not None and KV.KVLEASE in out
        status = sched.desk.status()
        assert status.tenant("tag-b") == TenantLeases("tag-b", 1, 11)  # b-1, the oldest, stays
        assert status.tenant("tag-a") == TenantLeases("tag-a", 1, 11)  # a-1 went for a-2
        assert "a-1" in sched.desk.take_updates()  # released: the workers free it
    finally:
        sched.shutdown()


def test_p_claims_and_reclaims_under_the_tag_of_its_request(connector: Any, claims: list) -> None:
    conn = scheduler(connector, control_secret=SECRET)
    sched = conn.connector_scheduler
    try:
        params = {**d_handle(), KV.TENANT: TAG}  # the router adds the tag beside D's handle
        req = _Request("p-1", D_TOKENS + NEW_TURN, params)
        assert ask(sched, req) == (len(D_TOKENS), True)  # the handle's MAC still holds
        assert claims == [("d-1", "p-1", TAG)]
        sched.update_state_after_alloc(req, None, len(D_TOKENS))
        sched._reclaim_waiting(time.perf_counter() + sched.cfg.claim_hold_s)  # the read still waits
        for _ in range(200):  # bounded: the re-claim runs in the claim pool
            if len(claims) > 1:
                break
            time.sleep(0.01)
        assert claims[1] == ("d-1", "p-1", TAG)
    finally:
        sched.shutdown()


def test_p_with_a_bad_tag_claims_untagged(connector: Any, claims: list) -> None:
    conn = scheduler(connector, control_secret=SECRET)
    sched = conn.connector_scheduler
    try:
        req = _Request("p-1", D_TOKENS + NEW_TURN, {**d_handle(), KV.TENANT: {"not": "a tag"}})
        assert ask(sched, req) == (len(D_TOKENS), True)  # never a reason to fail the pull
        assert claims == [("d-1", "p-1", None)]
    finally:
        sched.shutdown()


@pytest.mark.parametrize(
    ("params", "tag"),
    [({KV.TENANT: TAG}, TAG), ({KV.TENANT: "x" * 65}, None), ({}, None), ([TAG], None), ("x", None)],
)
def test_tenant_tag_of(params: object, tag: str | None) -> None:
    assert tenant_tag_of(params) == tag


@pytest.mark.parametrize("fraction", [0.25, 1.0])
def test_the_tenant_quota_is_configured(connector: Any, fraction: float) -> None:
    status = scheduler(connector, tenant_quota_fraction=fraction).connector_scheduler.desk.status()
    assert status.capacity_blocks == 500  # the stand-in's 1000 blocks, max_retained_fraction 0.5
    assert status.tenant_quota_blocks == int(fraction * 500)
