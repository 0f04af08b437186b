"""The lease keeper against a real local HTTP server: batching, retries, unknown ids, idle, release."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Iterator

import pytest
from _sdk_support import FAST_RETRY
from fakes.openai_server import FakeOpenAIServer
from openai import AsyncOpenAI, OpenAI

import kvlease
from kvlease import RetryPolicy, protocol
from kvlease._http import hx
from kvlease._keeper import LeaseKeeper

USER = {"role": "user", "content": "hi"}
RENEW = protocol.RENEW_PATH


def _deletes(srv: FakeOpenAIServer) -> list[str]:
    prefix = protocol.CONVERSATIONS_PATH + "/"
    return [r.path[len(prefix) :] for r in srv.requests if r.method == "DELETE" and r.path.startswith(prefix)]


def _wait_for(cond: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


@pytest.fixture
def heartbeat_kc(openai_client: OpenAI) -> Iterator[kvlease.KVLeaseClient]:
    with kvlease.wrap(openai_client, heartbeat=True, retry=FAST_RETRY) as kc:
        yield kc


def test_one_renew_request_for_many_conversations(
    kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer
) -> None:
    convs = [kc.conversation(id=f"c{i}") for i in range(40)]
    for c in convs:
        c.chat.completions.create(model="m", messages=[USER])
    assert len(kc.keeper) == 40
    kc.keeper.renew_now()
    (req,) = fake_server.requests_to(RENEW, "POST")
    assert sorted(req.body["conversation_ids"]) == sorted(c.id for c in convs)
    assert req.header("authorization") == "Bearer sk-test"  # same auth as the chat requests
    assert kc.keeper.renew_requests == 1 and kc.keeper.renew_failures == 0


def test_background_thread_renews_before_expiry(
    heartbeat_kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer
) -> None:
    fake_server.ttl = 0.5  # renew every ~0.3 s
    with heartbeat_kc.conversation(id="hb") as conv:
        conv.chat.completions.create(model="m", messages=[USER])
        assert _wait_for(lambda: len(fake_server.requests_to(RENEW)) >= 3)
        reqs = fake_server.requests_to(RENEW)
        gaps = [b.ts - a.ts for a, b in itertools.pairwise(reqs)]
        assert all(0.1 < g < 0.5 for g in gaps), gaps  # about 60 % of the TTL, never after expiry
        assert all(r.body == {"conversation_ids": ["hb"]} for r in reqs)
        assert "hb" in fake_server.leases  # still alive on the router thanks to the heartbeats
    assert _deletes(fake_server) == ["hb"]


def test_retries_until_the_renew_endpoint_recovers(
    kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer
) -> None:
    kc.conversation(id="r").chat.completions.create(model="m", messages=[USER])
    fake_server.renew_failures = 2
    kc.keeper.renew_now()
    assert len(fake_server.requests_to(RENEW)) == 3
    assert kc.keeper.renew_failures == 0 and "r" in kc.keeper


def test_exhausted_retries_are_logged_not_raised(
    kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer, caplog: pytest.LogCaptureFixture
) -> None:
    kc.conversation(id="r").chat.completions.create(model="m", messages=[USER])
    fake_server.renew_failures = 100
    with caplog.at_level(logging.WARNING, logger="kvlease"):
        kc.keeper.renew_now()
    assert len(fake_server.requests_to(RENEW)) == FAST_RETRY.attempts
    assert kc.keeper.renew_failures == 1
    assert "r" in kc.keeper  # a transient failure keeps the lease in the table for the next period
    assert any("renewing 1 conversation" in r.message for r in caplog.records)


def test_backoff_waits_grow_and_use_the_injected_sleep(fake_server: FakeOpenAIServer) -> None:
    sleeps: list[float] = []
    policy = RetryPolicy(attempts=5, max_delay_s=60, initial_wait_s=1.0, max_wait_s=100.0, jitter_s=0.0)
    with hx.Client() as http:
        keeper = kvlease.LeaseKeeper(http, heartbeat=False, retry=policy, sleep=sleeps.append)
        keeper.activate("x", fake_server.url, 30.0, {}, explicit=True)
        fake_server.leases["x"] = time.monotonic() + 30
        fake_server.renew_failures = 3
        keeper.renew_now()
        assert sleeps == [1.0, 2.0, 4.0]
        assert keeper.renew_failures == 0
        keeper.close()
    assert _deletes(fake_server) == ["x"]


def test_permanent_refusal_stops_renewing(kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer) -> None:
    kc.conversation(id="p").chat.completions.create(model="m", messages=[USER])
    fake_server.renew_status = 404  # a router without the lease API
    kc.keeper.renew_now()
    assert len(fake_server.requests_to(RENEW)) == 1  # not retried
    assert "p" not in kc.keeper


def test_unknown_id_stops_renewing_that_one(kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer) -> None:
    a, b = kc.conversation(id="a"), kc.conversation(id="b")
    for c in (a, b):
        c.chat.completions.create(model="m", messages=[USER])
    del fake_server.leases["a"]  # e.g. the router restarted or D evicted it
    kc.keeper.renew_now()
    assert "a" not in kc.keeper and "b" in kc.keeper
    assert kc.get_conversation("a") is a  # the conversation itself stays open
    follow_up = [USER, {"role": "assistant", "content": fake_server.content}, USER]
    a.chat.completions.create(model="m", messages=follow_up)  # its next turn starts a new lease
    assert "a" in kc.keeper and a.turns[-1].status is protocol.ReuseStatus.FIRST


def test_idle_conversations_are_released(openai_client: OpenAI, fake_server: FakeOpenAIServer) -> None:
    with kvlease.wrap(openai_client, heartbeat=False, max_idle=0.05, retry=FAST_RETRY) as kc:
        kc.conversation(id="idle").chat.completions.create(model="m", messages=[USER])
        kc.openai.chat.completions.create(
            model="m", messages=[USER], extra_headers={protocol.HEADER_CONVERSATION_ID: "implicit"}
        )
        time.sleep(0.1)
        kc.conversation(id="busy").chat.completions.create(model="m", messages=[USER])
        kc.keeper.renew_now()
        assert sorted(_deletes(fake_server)) == ["idle", "implicit"]
        assert fake_server.requests_to(RENEW)[0].body == {"conversation_ids": ["busy"]}
        # auto-registered conversations are forgotten too; explicit ones stay until closed
        assert kc.get_conversation("implicit") is None
        assert kc.get_conversation("idle") is not None


def test_release_on_conversation_and_client_close(
    openai_client: OpenAI, fake_server: FakeOpenAIServer
) -> None:
    kc = kvlease.wrap(openai_client, retry=FAST_RETRY)
    with kc.conversation(id="one") as one:
        one.chat.completions.create(model="m", messages=[USER])
    assert _deletes(fake_server) == ["one"] and "one" not in fake_server.leases
    assert one.closed and kc.get_conversation("one") is None
    for cid in ("two", "three"):
        kc.conversation(id=cid).chat.completions.create(model="m", messages=[USER])
    kc.close()
    assert sorted(_deletes(fake_server)) == ["one", "three", "two"]
    assert fake_server.leases == {}
    kc.close()  # idempotent
    assert len(_deletes(fake_server)) == 3
    # the caller's own client still works
    assert openai_client.chat.completions.create(model="m", messages=[USER]).choices


def test_keeper_never_raises_when_the_router_is_gone(
    openai_client: OpenAI, fake_server: FakeOpenAIServer
) -> None:
    kc = kvlease.wrap(openai_client, retry=FAST_RETRY)
    kc.conversation(id="gone").chat.completions.create(model="m", messages=[USER])
    fake_server.stop()
    kc.keeper.renew_now()
    assert kc.keeper.renew_failures == 1
    kc.close()  # the release fails quietly too


async def test_async_keeper(fake_server: FakeOpenAIServer) -> None:
    raw = AsyncOpenAI(base_url=fake_server.base_url, api_key="sk-test", max_retries=0)
    fake_server.ttl = 0.5
    async with kvlease.wrap(raw, retry=FAST_RETRY) as akc:
        for cid in ("x", "y"):
            await akc.conversation(id=cid).chat.completions.create(model="m", messages=[USER])
        for _ in range(500):
            if len(fake_server.requests_to(RENEW)) >= 2:
                break
            await asyncio.sleep(0.01)
        reqs = fake_server.requests_to(RENEW)
        assert len(reqs) >= 2 and sorted(reqs[0].body["conversation_ids"]) == ["x", "y"]
        fake_server.renew_failures = 2
        await akc.keeper.renew_now()
        assert akc.keeper.renew_failures == 0
        del fake_server.leases["x"]
        await akc.keeper.renew_now()
        assert "x" not in akc.keeper and "y" in akc.keeper
    assert _deletes(fake_server) == ["y"]
    await raw.close()


def test_keeper_wakes_only_for_an_earlier_deadline() -> None:
    now = [0.0]
    keeper = LeaseKeeper(hx.Client(), heartbeat=False, clock=lambda: now[0])
    keeper._thread = object()  # type: ignore[assignment]  # as if its loop were waiting
    woken: list[bool] = []
    keeper._wakeup.set = lambda: woken.append(True)  # type: ignore[method-assign]
    keeper._sleeping_until = None  # waiting without a deadline: any lease wakes it
    keeper.activate("a", "http://r1", 100.0, {}, explicit=True)
    assert woken == [True]
    keeper._sleeping_until = 60.0  # the loop waits until r1 is due
    now[0] = 10.0
    keeper.activate("a", "http://r1", 100.0, {}, explicit=True)  # due at 60 still: no wakeup
    assert woken == [True]
    keeper.activate("b", "http://r2", 50.0, {}, explicit=True)  # due at 40: wakes it
    assert woken == [True, True]
    keeper.activate("c", "http://r1", 20.0, {}, explicit=True)  # r1 now due at 22: wakes it
    assert woken == [True, True, True]
    keeper._sleeping_until = -float("inf")  # awake: it reads the table before waiting again
    keeper.activate("d", "http://r3", 1.0, {}, explicit=True)
    assert woken == [True, True, True]
    keeper._thread = None
    keeper.close()
