"""Fault injection on the real stack: a kvlease failure can cost speed, never a turn and never a
correct answer.

Each test runs one agent conversation through ``kvlease router`` on ``kvlease.wrap(OpenAI(...))``
(``max_retries=0``: nothing hides a failed turn), injects one fault between turns, and checks:

- every turn returned 200 with content (0 failed client turns; some turns stream, through the
  router's SSE relay and the kvlease plugin's final-chunk handle);
- every turn's greedy output equals its no-reuse reference (the same messages recomputed on P and D
  directly, with a fresh ``cache_salt``), also the turns before the fault;
- the ``X-KVLease-Status`` header tells the truth where the fault makes it knowable, and reused
  tokens are reported exactly on hits.

One stack spec for the whole file (the one of ``test_connector_pd``: D TTL 20 s, so a router lease is
15 s; P's prefix cache off, so a hit is P pulling D's blocks). The test that restarts D runs last.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvlease import RetryPolicy
from kvlease.protocol import ReuseStatus
from kvlease_stack import Stack, StackSpec
from kvlease_stack.testing import RedisServer

from ._faults import (
    TURN_TIMEOUT_S,
    Agent,
    Record,
    RouterProc,
    Tally,
    check_references,
    kill_group,
    log_size,
    stopped,
    wait_for_log,
    wait_until,
)
from ._specs import ALWAYS_PULL

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

D_TTL = 20.0
SPEC = StackSpec(
    model="tiny",
    connector="kvlease",
    ttl=D_TTL,
    recompute_threshold=32,
    prefix_caching=False,
    kvlease=ALWAYS_PULL,
)
STACK_TIMEOUT_S = float(os.environ.get("KVLEASE_STACK_TIMEOUT", "900"))
HIT, ERROR, EXPIRED, MISS, FIRST = (
    ReuseStatus.HIT,
    ReuseStatus.ERROR,
    ReuseStatus.EXPIRED,
    ReuseStatus.MISS,
    ReuseStatus.FIRST,
)


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def tally(request: pytest.FixtureRequest) -> Iterator[Tally]:
    t = Tally()
    yield t
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    for line in t.lines():
        if reporter is not None:
            reporter.write_line(line)
        else:  # pragma: no cover
            print(line)


@pytest.fixture
def fstack(stack_factory: Callable[[StackSpec], Stack]) -> Stack:
    return stack_factory(SPEC)


@pytest.fixture
def routers(fstack: Stack, tmp_path: Path) -> Iterator[Callable[..., RouterProc]]:
    started: list[RouterProc] = []

    def start(*extra: str) -> RouterProc:
        r = RouterProc(fstack, tmp_path / f"router-{len(started)}.log", *extra)
        started.append(r)
        return r

    yield start
    for r in started:
        r.stop()


@pytest.fixture
def agents(
    fstack: Stack, routers: Callable[..., RouterProc], tally: Tally, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Agent]]:
    made: list[Agent] = []

    def make(router: RouterProc, **kw: Any) -> Agent:
        a = Agent(router.url, fstack.model_name, tally, request.node.name, **kw)
        made.append(a)
        return a

    yield make
    for a in made:  # before the routers stop: the SDK releases its leases
        a.close()


@pytest.fixture
def redis(redis_server: RedisServer) -> RedisServer:
    """Tests list it before ``routers`` and ``agents``: torn down after them, so the agents' closing
    releases still reach a router whose store is up."""
    return redis_server


def in_thread(fn: Callable[[], Record]) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, box


def any_hit(records: list[Record]) -> bool:
    return any(r.status is HIT for r in records)


# ------------------------------------------------------------------------------ faults


def test_failed_pull_recomputes(fstack: Stack, routers: Callable[..., RouterProc], agents: Any) -> None:
    """D hangs when P goes to pull its blocks (SIGSTOP: connections are accepted, nothing answers):
    P's claim on D's lease fails, P recomputes, the turn is answered once D is back."""
    router = routers()
    a = agents(router)
    a.turn()
    a.turn()
    p_log = fstack.prefill.log_path
    offset = log_size(p_log)
    assert fstack.decode.pgid is not None
    with stopped(fstack.decode.pgid) as resume:
        th, box = in_thread(a.turn)
        seen = wait_for_log(p_log, offset, ("recompute (claim_failed)", "pull failed"), timeout=180)
        resume()  # D answers the decode part of the turn
        th.join(TURN_TIMEOUT_S)
    assert not th.is_alive(), "the turn did not finish after D resumed"
    if "error" in box:
        raise box["error"]
    stalled: Record = box["value"]
    assert seen is not None, "P never tried (and failed) to pull from the hung D"
    assert stalled.status is ERROR and not stalled.reused, stalled.status
    after = [a.turn(), a.turn()]
    assert any_hit(after), f"pulls did not resume after D came back: {a.statuses()}"
    check_references(fstack, a)


def test_expired_lease_recomputes(fstack: Stack, routers: Callable[..., RouterProc], agents: Any) -> None:
    """No heartbeats and a pause past D's TTL: the next turn is an honest ``expired`` recompute."""
    router = routers()
    a = agents(router, heartbeat=False)
    a.turn()
    a.turn()
    time.sleep(D_TTL + 2.0)
    late = a.turn(stream=True)
    assert late.status is EXPIRED and not late.reused, a.statuses()
    after = [a.turn(), a.turn(stream=True)]  # the late turn's own lease is good again
    assert any_hit(after), a.statuses()
    check_references(fstack, a)


@pytest.mark.redis
def test_router_restart_with_redis_resumes_hits(
    redis: RedisServer, fstack: Stack, routers: Callable[..., RouterProc], agents: Any
) -> None:
    router = routers("--state", redis.url)
    a = agents(router)
    a.turn()
    a.turn()
    router.kill()  # a crash, then a start on the same port: the agent's client does not know
    router.start()
    after = [a.turn(), a.turn()]
    assert all(r.status is not FIRST for r in after), f"the restarted router forgot: {a.statuses()}"
    assert any_hit(after), a.statuses()
    check_references(fstack, a)


@pytest.mark.redis
def test_redis_hung_or_down_costs_reuse_not_turns(
    redis: RedisServer, fstack: Stack, routers: Callable[..., RouterProc], agents: Any
) -> None:
    router = routers("--state", redis.url)
    a = agents(router)
    a.turn()
    a.turn()
    assert redis.proc is not None
    with stopped(redis.proc.pid):  # hung (a partition): connections open, no answer
        hung = a.turn()
    time.sleep(1.5)  # the router skips the store for ``store_backoff`` (1 s) after an error
    resumed = a.turn()  # answers queued while it hung must not be read as this turn's
    redis.kill()
    down = [a.turn(stream=True), a.turn()]
    # the store is unreachable: the router says so, and reuses nothing
    assert all(r.status is ERROR and not r.reused for r in [hung, *down]), a.statuses()
    assert resumed.status is not FIRST, f"state lost while Redis only hung: {a.statuses()}"
    redis.restart()  # empty: no persistence
    time.sleep(1.5)  # the router skips the store for ``store_backoff`` (1 s) after an error
    after = [a.turn()]
    while not any_hit(after) and len(after) < 4:
        after.append(a.turn())
    assert any_hit(after), f"hits did not come back after Redis restarted: {a.statuses()}"
    assert all(r.status in (ERROR, FIRST, HIT) for r in after), a.statuses()
    check_references(fstack, a)


@pytest.mark.redis
def test_heartbeat_endpoint_down_while_agent_waits(
    redis: RedisServer, fstack: Stack, routers: Callable[..., RouterProc], agents: Any
) -> None:
    """The router is down during the tool pause: renewals fail in the keeper (never in agent code),
    the next turn recomputes or hits, never fails."""
    router = routers("--state", redis.url)
    quick = RetryPolicy(
        attempts=2, max_delay_s=5.0, initial_wait_s=0.2, max_wait_s=1.0, jitter_s=0.1, timeout_s=5.0
    )
    a = agents(router, retry=quick)
    a.turn()
    a.turn()
    keeper = a.client.keeper
    failures = keeper.renew_failures
    router.stop()
    # the keeper renews at 60 % of the 15 s router TTL: wait for it to fail in the background
    assert wait_until(lambda: keeper.renew_failures > failures, timeout=90), (
        keeper.renew_requests,
        keeper.renew_failures,
    )
    keeper.renew_now()  # in the agent's own thread: logs, never raises
    router.start()
    back = [a.turn(), a.turn()]
    assert all(r.status in (HIT, EXPIRED, MISS, ERROR) for r in back), a.statuses()
    check_references(fstack, a)


def test_decode_killed_and_restarted_mid_conversation(
    fstack: Stack, routers: Callable[..., RouterProc], agents: Any
) -> None:
    """SIGKILL D (a crash) after its handle was stored, start it again on the same ports: the next
    turn recomputes and says it did not reuse; the turns after pull from the new D."""
    router = routers()
    a = agents(router)
    a.turn()
    a.turn()
    assert fstack.decode.pgid is not None
    kill_group(fstack.decode.pgid, fstack.decode.proc)
    fstack.restart_decode(timeout=STACK_TIMEOUT_S)
    recovered = a.turn(stream=True)
    assert recovered.status in (EXPIRED, MISS, ERROR) and not recovered.reused, a.statuses()
    after = [a.turn(), a.turn()]
    assert any_hit(after), f"pulls did not resume from the restarted D: {a.statuses()}"
    check_references(fstack, a)
