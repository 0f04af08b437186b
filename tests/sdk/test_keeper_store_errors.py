"""The keeper and a router whose state store blips (issue 15, item 3): a 503 (or 429) with
``Retry-After`` is transient: retried after the time the router asked for, the leases kept; only an
``unknown`` in a renew answer means a lease is gone."""

from __future__ import annotations

import json
import time

import kvlease
from kvlease import RetryPolicy, protocol
from kvlease._http import hx


def _keeper(
    answers: list[tuple[int, dict[str, str], dict[str, object]]], sleeps: list[float]
) -> kvlease.LeaseKeeper:
    def handler(request: hx.Request) -> hx.Response:
        status, headers, body = answers.pop(0) if answers else (200, {}, {"leases": {}})
        return hx.Response(status, headers=headers, content=json.dumps(body).encode())

    policy = RetryPolicy(attempts=4, max_delay_s=600, initial_wait_s=0.1, max_wait_s=8.0, jitter_s=0.0)
    http = hx.Client(transport=hx.MockTransport(handler))
    return kvlease.LeaseKeeper(http, heartbeat=False, retry=policy, sleep=sleeps.append)


def _unavailable(retry_after: str) -> tuple[int, dict[str, str], dict[str, object]]:
    body = protocol.ErrorBody("state store unavailable", protocol.ERROR_STORE_UNAVAILABLE, 503).to_json()
    return 503, {protocol.HEADER_RETRY_AFTER: retry_after}, body


def test_a_503_with_retry_after_is_retried_after_that_time_and_keeps_the_lease() -> None:
    sleeps: list[float] = []
    ok = (200, {}, {"leases": {"c": {"expires_in": 30.0}}, "ttl": 30.0})
    rate_limited = (429, {protocol.HEADER_RETRY_AFTER: "2"}, {"error": {"message": "slow down"}})
    keeper = _keeper([_unavailable("3"), rate_limited, ok], sleeps)
    keeper.activate("c", "http://router", 30.0, {}, explicit=False)
    keeper.renew_now()
    assert sleeps == [3.0, 2.0]  # what the router asked for, not the 0.1 s / 0.2 s backoff
    assert "c" in keeper and keeper.renew_failures == 0
    keeper.close()


def test_store_errors_past_every_retry_keep_the_lease_and_retry_sooner() -> None:
    sleeps: list[float] = []
    keeper = _keeper([_unavailable("1")] * 4, sleeps)
    keeper.activate("c", "http://router", 30.0, {}, explicit=False)
    keeper.renew_now()
    assert keeper.renew_failures == 1 and "c" in keeper  # not "unknown": still renewed next time
    assert sleeps == [1.0, 1.0, 1.0]
    due = keeper.table.next_wakeup()
    assert due is not None and due - time.monotonic() < 0.6 * 30.0  # sooner than a normal period
    keeper.close()


def test_retry_after_is_bounded_by_the_policy() -> None:
    sleeps: list[float] = []
    keeper = _keeper([_unavailable("3600"), (200, {}, {"leases": {"c": {"expires_in": 30.0}}})], sleeps)
    keeper.activate("c", "http://router", 30.0, {}, explicit=False)
    keeper.renew_now()
    assert sleeps == [8.0]  # max_wait_s
    keeper.close()
