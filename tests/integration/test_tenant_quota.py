"""Per-tenant retention quota on the real stack, through the real router, with no renews at all.

Two tenants (two bearer tokens) send turns through ``kvlease router``; nobody renews (no SDK
heartbeats, no lease API call, no pull to claim). D tags each lease when it creates it, with the
router's opaque tenant tag from D's request, and reports leases and blocks per tag on its control
endpoint's ``/info``. Tenant A then fills the retention cap (a few blocks, as in
``test_connector_retention``): the lease D releases early is A's oldest, not B's older one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvlease.protocol import (
    COMPLETIONS_PATH,
    CONTROL_INFO_PATH,
    HEADER_AUTHORIZATION,
    HEADER_CONVERSATION_ID,
    ControlInfo,
    LeaseStatus,
)
from kvlease_router._identity import Keyer, tenant_from
from kvlease_stack import Stack, StackSpec

from .test_connector_pd import PD, USER_1
from .test_connector_retention import CAP_SPEC, d_metric
from .test_router_real_stack import RouterProcess

pytestmark = pytest.mark.integration

KEY_SECRET = "integration-key-secret"  # RouterProcess starts the router with this --key-secret
TOKENS = {"a": "Bearer tenant-a-token", "b": "Bearer tenant-b-token"}


@pytest.fixture(scope="module")
def pd(stack_factory: Callable[[StackSpec], Stack]) -> PD:
    return PD(stack_factory(CAP_SPEC))  # the retention test's stack: shared when both run


@pytest.fixture
def router(pd: PD) -> Iterator[RouterProcess]:
    r = RouterProcess(pd.stack)
    try:
        yield r
    finally:
        r.stop()


def leases(pd: PD) -> LeaseStatus:
    info = ControlInfo.from_json(pd.control("decode", CONTROL_INFO_PATH).json())
    assert info.leases is not None, "D's /info reports no lease status"
    return info.leases


def renewals(pd: PD) -> float:
    return sum(d_metric(pd, f'kvlease_lease_renewals_total{{result="{r}"}}') for r in ("ok", "unknown"))


def turn(pd: PD, router: RouterProcess, who: str, prompt: list[int], cid: str) -> None:
    body: dict[str, Any] = {
        "model": pd.stack.model_name,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    headers = {HEADER_AUTHORIZATION: TOKENS[who], HEADER_CONVERSATION_ID: cid}
    r = pd.http.post(router.url + COMPLETIONS_PATH, json=body, headers=headers)
    assert r.status_code == 200, r.text


def test_leases_tagged_at_creation_and_the_over_quota_tenant_goes_first(
    pd: PD, router: RouterProcess
) -> None:
    keyer = Keyer(KEY_SECRET)
    tag = {who: keyer.tenant_tag(tenant_from({HEADER_AUTHORIZATION: t}, None)) for who, t in TOKENS.items()}
    text = pd.tok(USER_1 * 3)
    start = leases(pd)
    cap, quota = start.capacity_blocks, start.tenant_quota_blocks
    assert 6 <= cap <= 40 and quota == cap // 2, start  # a few blocks (128-token blocks on CPU)
    renewed = renewals(pd)

    # B: one small lease (one block), the older one
    turn(pd, router, "b", pd.tok("Tenant B asks. ") + text[:40], "quota-b-0")
    s = leases(pd)
    b = s.tenant(tag["b"])
    assert b.leases == 1 and b.blocks >= 1, s  # tagged at creation: B never renewed
    assert s.tenant(tag["a"]).leases == 0

    # A: three-block leases until the cap makes D release one early (bounded: the cap's worth)
    for i in range(cap):
        turn(pd, router, "a", pd.tok(f"Tenant A, conversation {i}. ") + text[:280], f"quota-a-{i}")
        s = leases(pd)
        assert s.tenant(tag["b"]) == b, (i, s)  # B's older lease is never the one to go
        if s.tenant(tag["a"]).leases <= i:
            break
    else:
        pytest.fail(f"tenant A's leases never pressed the cap of {cap} blocks: {s}")
    assert 1 <= s.tenant(tag["a"]).leases <= i, s  # A's own (oldest) lease went early
    assert s.tenant_count >= 2 and s.retained_blocks <= cap
    assert renewals(pd) == renewed  # no renews, no claims: the tags came with D's requests
