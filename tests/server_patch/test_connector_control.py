"""The connector's control endpoint over real HTTP on 127.0.0.1, with a real lease table behind it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

from kvlease.protocol import (
    CONTROL_AUTH_HEADER,
    CONTROL_INFO_PATH,
    CONTROL_METRICS_PATH,
    CONTROL_RELEASE_PATH,
    CONTROL_RENEW_PATH,
    LEASE_STATUS_MAX_TENANTS,
    ControlInfo,
    ControlRenewRequest,
    ControlRenewResponse,
    LeaseStatus,
    Role,
    TenantLeases,
)
from kvlease_stack.testing import control_info
from kvlease_vllm._control import ControlServer, LeaseDesk, claim
from kvlease_vllm._metrics import ConnectorMetrics
from kvlease_vllm._retention import RetentionTable

SECRET = "s3cret"
AUTH = {CONTROL_AUTH_HEADER: f"Bearer {SECRET}"}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


INFO = control_info(Role.DECODE, engine_id="engine-d", ttl_s=20.0, model="tiny")


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def desk(clock: Clock) -> LeaseDesk:
    d = LeaseDesk(RetentionTable(100, max_ttl=600.0, renew_guard=2.0), ConnectorMetrics(), clock=clock)
    d.add("lease-a", 10, clock.now + 20)
    d.add("lease-b", 10, clock.now + 30)
    return d


def serve(desk: LeaseDesk, secret: str | None) -> Iterator[httpx.Client]:
    server = ControlServer(desk, lambda: INFO, host="127.0.0.1", port=0, secret=secret, max_ttl=600.0).start()
    try:
        with httpx.Client(base_url=server.url("127.0.0.1"), timeout=10) as client:
            yield client
    finally:
        server.stop()


@pytest.fixture
def client(desk: LeaseDesk) -> Iterator[httpx.Client]:
    yield from serve(desk, SECRET)


@pytest.fixture
def open_client(desk: LeaseDesk) -> Iterator[httpx.Client]:
    yield from serve(desk, None)


def test_info(client: httpx.Client) -> None:
    r = client.get(CONTROL_INFO_PATH, headers=AUTH)
    assert r.status_code == 200
    info = ControlInfo.from_json(r.json())
    assert replace(info, leases=None) == INFO
    # the lease table now: the fixture's two leases are untagged
    assert info.leases == LeaseStatus(2, 20, 100, 50, 0, TenantLeases(None, 2, 20), ())


def test_info_counts_leases_per_tenant_tag_bounded(
    client: httpx.Client, desk: LeaseDesk, clock: Clock
) -> None:
    desk.add("a-1", 3, clock.now + 40, "tag-a")
    desk.add("a-2", 4, clock.now + 40, "tag-a")
    desk.add("b-1", 2, clock.now + 40, "tag-b")
    for i in range(LEASE_STATUS_MAX_TENANTS + 4):  # more tags than the status names
        desk.add(f"small-{i}", 1, clock.now + 40, f"small-{i:02d}")
    got = ControlInfo.from_json(client.get(CONTROL_INFO_PATH, headers=AUTH).json()).leases
    assert got is not None
    assert (got.leases, got.retained_blocks) == desk.snapshot()
    assert got.tenant_count == 2 + LEASE_STATUS_MAX_TENANTS + 4
    assert len(got.tenants) == LEASE_STATUS_MAX_TENANTS  # bounded: the top tags by blocks
    assert got.tenants[:2] == (TenantLeases("tag-a", 2, 7), TenantLeases("tag-b", 1, 2))
    assert got.tenant("tag-a").blocks == 7 and got.tenant("nobody") == TenantLeases("nobody", 0, 0)
    assert got.untagged == TenantLeases(None, 2, 20)


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", CONTROL_INFO_PATH, None),
        ("GET", CONTROL_METRICS_PATH, None),
        ("POST", CONTROL_RENEW_PATH, {"request_ids": ["lease-a"], "ttl": 60}),
        ("POST", CONTROL_RELEASE_PATH, {"request_ids": ["lease-a"]}),
    ],
)
@pytest.mark.parametrize("auth", [None, "Bearer wrong", "Basic czNjcmV0", f"bearer{SECRET}", SECRET])
def test_auth_required(
    client: httpx.Client, desk: LeaseDesk, method: str, path: str, body: Any, auth: str | None
) -> None:
    headers = {} if auth is None else {CONTROL_AUTH_HEADER: auth}
    r = client.request(method, path, json=body, headers=headers)
    assert r.status_code == 401
    assert r.headers["WWW-Authenticate"] == "Bearer"
    assert "message" in r.json()["error"]
    assert desk.snapshot() == (2, 20)  # nothing changed


def test_renew_extends_and_reports_unknown(client: httpx.Client, desk: LeaseDesk, clock: Clock) -> None:
    clock.now += 10  # lease-a has 10 s left
    body = ControlRenewRequest(("lease-a", "nope"), 60.0).to_json()
    r = client.post(CONTROL_RENEW_PATH, json=body, headers=AUTH)
    assert r.status_code == 200
    got = ControlRenewResponse.from_json(r.json()).expires_in
    assert got == {"lease-a": pytest.approx(60.0), "nope": None}
    assert desk.take_updates() == {"lease-a": pytest.approx(clock.now + 60)}


def test_renew_ttl_is_capped(client: httpx.Client, clock: Clock) -> None:
    r = client.post(CONTROL_RENEW_PATH, json={"request_ids": ["lease-a"], "ttl": 86_400}, headers=AUTH)
    assert r.json()["expires_in"]["lease-a"] == pytest.approx(600.0)


def test_release_then_renew_is_unknown(client: httpx.Client, desk: LeaseDesk, clock: Clock) -> None:
    r = client.post(CONTROL_RELEASE_PATH, json={"request_ids": ["lease-b", "nope"]}, headers=AUTH)
    assert r.status_code == 200 and r.json() == {"released": 1}
    assert desk.take_updates() == {"lease-b": clock.now}  # workers free it at the next sweep
    r = client.post(CONTROL_RENEW_PATH, json={"request_ids": ["lease-b"], "ttl": 60}, headers=AUTH)
    assert r.json()["expires_in"] == {"lease-b": None}
    assert desk.snapshot() == (1, 10)


@pytest.mark.parametrize(
    ("path", "content", "status"),
    [
        (CONTROL_RENEW_PATH, b"{not json", 400),
        (CONTROL_RENEW_PATH, b'{"request_ids": "lease-a", "ttl": 5}', 400),
        (CONTROL_RENEW_PATH, b'{"request_ids": ["lease-a"], "ttl": -5}', 400),
        (CONTROL_RENEW_PATH, b'{"request_ids": ["lease-a"], "ttl": 5, "claim": "yes"}', 400),
        (CONTROL_RENEW_PATH, b'{"request_ids": ["lease-a"]}', 400),
        (CONTROL_RENEW_PATH, b"[1, 2]", 400),
        (CONTROL_RELEASE_PATH, b'{"request_ids": [1]}', 400),
        (CONTROL_RELEASE_PATH, b"", 400),
        ("/nope", b"{}", 404),
    ],
)
def test_bad_requests_are_4xx_with_a_message(
    client: httpx.Client, desk: LeaseDesk, path: str, content: bytes, status: int
) -> None:
    r = client.post(path, content=content, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == status
    assert r.json()["error"]["message"]
    assert desk.snapshot() == (2, 20)


def test_wrong_method(client: httpx.Client) -> None:
    assert client.get(CONTROL_RENEW_PATH, headers=AUTH).status_code == 405
    assert client.post(CONTROL_INFO_PATH, json={}, headers=AUTH).status_code == 405


def test_body_too_large(client: httpx.Client) -> None:
    r = client.post(CONTROL_RELEASE_PATH, content=b"x" * (2 << 20), headers=AUTH)
    assert r.status_code == 413


def test_without_secret_reads_open_mutations_refused(open_client: httpx.Client, desk: LeaseDesk) -> None:
    assert open_client.get(CONTROL_INFO_PATH).status_code == 200
    r = open_client.post(CONTROL_RELEASE_PATH, json={"request_ids": ["lease-a"]})
    assert r.status_code == 403 and "secret" in r.json()["error"]["message"]
    assert desk.snapshot() == (2, 20)


def test_metrics_count_renewals_and_releases(client: httpx.Client) -> None:
    client.post(CONTROL_RENEW_PATH, json={"request_ids": ["lease-a", "x"], "ttl": 60}, headers=AUTH)
    client.post(CONTROL_RELEASE_PATH, json={"request_ids": ["lease-b"]}, headers=AUTH)
    text = client.get(CONTROL_METRICS_PATH, headers=AUTH).text
    assert 'kvlease_lease_renewals_total{result="ok"} 1.0' in text
    assert 'kvlease_lease_renewals_total{result="unknown"} 1.0' in text
    assert 'kvlease_lease_releases_total{cause="request"} 1.0' in text
    assert "kvlease_retained_blocks 10.0" in text
    assert "kvlease_leases 1.0" in text


def test_claim_pins_the_lease(client: httpx.Client, desk: LeaseDesk, clock: Clock) -> None:
    url = str(client.base_url)
    got = claim(url, "lease-a", 30.0, SECRET, timeout=5, claimant="p-1")
    assert got.left == pytest.approx(30.0)
    # D's absolute deadline on its own clock, for upstream's expired-read guard
    assert got.deadline == pytest.approx(clock.now + 30.0)
    assert desk.relieve(1000) == ["lease-b"]  # the claimed lease is not released early
    assert claim(url, "lease-b", 30.0, SECRET, timeout=5).left is None
    with pytest.raises(OSError, match="401"):
        claim(url, "lease-a", 30.0, "wrong", timeout=5)
    # exclusive: a second reader of the same handle is refused, the first may claim again
    refused = claim(url, "lease-a", 30.0, SECRET, timeout=5, claimant="p-2")
    assert refused.left is None and refused.deadline is None
    assert claim(url, "lease-a", 30.0, SECRET, timeout=5, claimant="p-1").left is not None
    # a release while pinned is deferred: the read is not freed under it
    assert desk.release(("lease-a",)) == 1
    assert desk.snapshot()[0] == 1


def test_claim_unreachable_raises() -> None:
    with pytest.raises(OSError):
        claim("http://127.0.0.1:9", "x", 1.0, SECRET, timeout=1)


def test_lease_status_round_trips_and_a_malformed_one_is_dropped() -> None:
    status = LeaseStatus(3, 9, 10, 5, 1, TenantLeases(None, 1, 1), (TenantLeases("tag-a", 2, 8),))
    assert LeaseStatus.from_json(status.to_json()) == status
    info = replace(INFO, leases=status)
    assert ControlInfo.from_json(info.to_json()) == info
    good = status.to_json()
    too_many = [TenantLeases(f"t{i}", 1, 1).to_json() for i in range(LEASE_STATUS_MAX_TENANTS + 1)]
    for bad in (
        [],
        {**good, "leases": -1},
        {**good, "tenants": "all"},
        {**good, "tenants": too_many},
        {**good, "tenants": [{"tenant": 7, "leases": 1, "blocks": 1}]},
        {**good, "untagged": None},
    ):
        # informational: a node's malformed status never makes its /info unreadable
        assert ControlInfo.from_json({**INFO.to_json(), "leases": bad}).leases is None
