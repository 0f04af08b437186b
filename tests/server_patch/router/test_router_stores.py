"""State stores: one contract, subclassed per backend (in-memory; a real redis-server)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
from _router_cluster import ClusterFactory, assistant_text

from kvlease.protocol import HEADER_STATUS
from kvlease_router import (
    ConversationRecord,
    MemoryStore,
    RedisStore,
    StateStore,
    StoreError,
    redis_client_from_url,
)
from kvlease_stack.testing import RedisServer

KEY_SECRET = "test-key-secret"  # the cluster fixture's key secret


def _state(n: int = 0) -> ConversationRecord:
    return ConversationRecord(
        decode="http://d",
        params={"remote_block_ids": [1, 2, n], "remote_engine_id": "e"},
        lease_id=f"lease-{n}",
        control="http://c",
        tokens=32 + n,
        expires_at=1_900_000_000.0 + n,
        continuity="abc",
        prefix_len=3,
        turns=n + 1,
    )


class StoreContract:
    """Every backend: round trip, replace, delete returns what it removed, entries vanish after
    ``keep_for``, and ``get`` does not extend the TTL."""

    @pytest.fixture
    async def store(self) -> AsyncIterator[StateStore]:
        raise NotImplementedError

    async def test_roundtrip_and_replace(self, store: StateStore) -> None:
        assert await store.get("k") is None
        await store.put("k", _state(1), 30)
        assert await store.get("k") == _state(1)
        await store.put("k", _state(2), 30)
        assert await store.get("k") == _state(2)

    async def test_delete_returns_removed(self, store: StateStore) -> None:
        await store.put("k", _state(3), 30)
        assert await store.delete("k") == _state(3)
        assert await store.get("k") is None
        assert await store.delete("k") is None

    async def test_entries_expire_after_keep_for(self, store: StateStore) -> None:
        await store.put("short", _state(), 0.3)
        await store.put("long", _state(), 30)
        assert await store.get("short") is not None
        await asyncio.sleep(0.45)
        assert await store.get("short") is None
        assert await store.get("long") is not None

    async def test_get_does_not_extend(self, store: StateStore) -> None:
        await store.put("k", _state(), 0.4)
        await asyncio.sleep(0.25)
        assert await store.get("k") is not None
        await asyncio.sleep(0.25)
        assert await store.get("k") is None

    async def test_state_without_handle_roundtrips(self, store: StateStore) -> None:
        s = _state().without_handle()
        await store.put("k", s, 30)
        got = await store.get("k")
        assert got is not None and got.params is None and got.lease_id is None and got.decode == "http://d"

    async def test_get_many_and_put_many(self, store: StateStore) -> None:
        assert await store.get_many([]) == []
        await store.put_many([("a", _state(1), 30), ("b", _state(2), 30), ("gone", _state(3), 0)])
        assert await store.get_many(["b", "missing", "a", "gone"]) == [_state(2), None, _state(1), None]
        await store.put_many([("a", _state(4), 0)])  # keep_for 0: a delete
        assert await store.get("a") is None

    async def test_renew_many_moves_only_the_deadline(self, store: StateStore) -> None:
        await store.put_many([("a", _state(1), 0.3), ("b", _state(2), 0.3)])
        read = await store.get_many(["a", "b"])
        await store.renew_many(["a", "b"], read, 1_950_000_000.0, 30)  # type: ignore[arg-type]
        await asyncio.sleep(0.45)  # past the old keep_for
        got = await store.get_many(["a", "b"])
        assert got == [
            replace(_state(1), expires_at=1_950_000_000.0),
            replace(_state(2), expires_at=1_950_000_000.0),
        ]
        assert await store.renew_many([], [], 1.0, 30) is None

    async def test_renew_many_does_not_bring_back_a_gone_key(self, store: StateStore) -> None:
        await store.put("k", _state(), 30)
        read = await store.get_many(["k"])
        assert await store.delete("k") is not None  # released while D renewed
        await store.renew_many(["k", "never"], [read[0], _state()], 1_950_000_000.0, 30)  # type: ignore[list-item]
        assert await store.get_many(["k", "never"]) == [None, None]


class TestMemoryStore(StoreContract):
    @pytest.fixture
    async def store(self) -> AsyncIterator[StateStore]:
        yield MemoryStore(100)

    async def test_lru_bound_evicts_least_recently_used(self) -> None:
        store = MemoryStore(3)
        for k in "abc":
            await store.put(k, _state(), 30)
        await store.get("a")  # a is now most recent
        await store.put("d", _state(), 30)
        assert await store.get("b") is None and store.evictions == 1
        assert all([await store.get(k) for k in "acd"])
        assert len(store) == 3

    async def test_renew_many_leaves_a_record_a_turn_replaced(self) -> None:
        store = MemoryStore(10)
        mine = _state(1)
        await store.put("k", mine, 30)
        read = await store.get_many(["k"])
        await store.put("k", _state(2), 30)  # a turn finished while D renewed
        await store.renew_many(["k"], read, 1_950_000_000.0, 30)  # type: ignore[arg-type]
        assert await store.get("k") == _state(2)
        assert mine == _state(1)  # a caller's own record never changes

    async def test_injected_clock(self) -> None:
        now = [100.0]
        store = MemoryStore(10, clock=lambda: now[0])
        await store.put("k", _state(), 5)
        now[0] = 104.9
        assert await store.get("k") is not None
        now[0] = 105.0
        assert await store.get("k") is None and len(store) == 0


@pytest.mark.redis
class TestRedisStore(StoreContract):
    @pytest.fixture
    async def store(self, redis_server: RedisServer) -> AsyncIterator[StateStore]:
        s = RedisStore(redis_client_from_url(redis_server.url, 1.0), secret=KEY_SECRET, timeout=1.0)
        yield s
        await s.close()

    async def test_renewed_records_stay_sealed_with_a_new_ttl(self, redis_server: RedisServer) -> None:
        client = redis_client_from_url(redis_server.url, 1.0)
        store = RedisStore(client, secret=KEY_SECRET)
        await store.put("k", _state(), 5)
        await store.renew_many(["k"], [_state()], 1_950_000_000.0, 42)
        assert 40_000 < await client.pttl("kvlease:conv:k") <= 42_000
        got = await RedisStore(client, secret=KEY_SECRET).get("k")  # the MAC checks out
        assert got == replace(_state(), expires_at=1_950_000_000.0) and store.rejected == 0
        await store.close()

    async def test_large_batches_go_through_the_scripts_with_the_same_contract(
        self, redis_server: RedisServer
    ) -> None:
        """Batches of a renew's size (scripts): what is missing, planted (not UTF-8, not sealed)
        or gone meanwhile reads as absent or stays gone, and what is renewed is sealed anew."""
        client = redis_client_from_url(redis_server.url, 1.0)
        store = RedisStore(client, secret=KEY_SECRET)
        keys = [f"b{i}" for i in range(200)]
        await store.put_many([(k, _state(i), 30) for i, k in enumerate(keys)])
        await client.set("kvlease:conv:b1", b"\xff\xfe not utf-8", px=30_000)
        await client.set("kvlease:conv:b2", b"v1." + b"0" * 32 + b".{}", px=30_000)
        got = await store.get_many([*keys, "missing"])
        assert got[1] is None and got[2] is None and got[-1] is None
        assert got[0] == _state(0) and got[199] == _state(199) and store.rejected == 2
        await client.delete("kvlease:conv:b3")  # gone between the read and the renewal
        live = [(k, r) for k, r in zip(keys, got) if r is not None]
        await store.renew_many([k for k, _ in live], [r for _, r in live], 1_950_000_000.0, 42)
        assert await client.exists("kvlease:conv:b3") == 0  # not brought back
        assert 40_000 < await client.pttl("kvlease:conv:b4") <= 42_000
        fresh = RedisStore(client, secret=KEY_SECRET)  # no memo: every MAC checked
        again = await fresh.get_many(keys)
        assert again[3] is None and again[4] == replace(_state(4), expires_at=1_950_000_000.0)
        assert again[1] is None and fresh.rejected == 2
        assert await store.get_many(keys) == again  # the writer's memo answers the same
        await store.close()

    async def test_keys_carry_a_ttl_in_redis(self, redis_server: RedisServer) -> None:
        client = redis_client_from_url(redis_server.url, 1.0)
        store = RedisStore(client, secret=KEY_SECRET)
        await store.put("k", _state(), 42)
        pttl = await client.pttl("kvlease:conv:k")
        assert 40_000 < pttl <= 42_000
        await store.close()

    async def test_dead_redis_raises_store_error_fast_and_backs_off(self, redis_server: RedisServer) -> None:
        store = RedisStore(
            redis_client_from_url(redis_server.url, 0.2), secret=KEY_SECRET, timeout=0.2, backoff=5.0
        )
        await store.put("k", _state(), 30)
        redis_server.kill()
        with pytest.raises(StoreError):
            await store.get("k")
        t0 = time.perf_counter()
        with pytest.raises(StoreError, match="backing off"):
            await store.get("k")
        assert time.perf_counter() - t0 < 0.05
        await store.close()

    async def test_a_busy_pool_waits_then_fails_that_call_only(self, redis_server: RedisServer) -> None:
        """The pool is bounded and blocking: past it a call waits (up to the timeout) for a free
        connection; a busy pool fails that call, without the back-off an outage gets."""
        import redis.asyncio as aioredis

        pool = aioredis.BlockingConnectionPool.from_url(redis_server.url, max_connections=1, timeout=0.1)
        client = aioredis.Redis(connection_pool=pool)
        store = RedisStore(client, secret=KEY_SECRET, timeout=2.0, backoff=30.0)
        await store.put("k", _state(), 30)
        hold = asyncio.create_task(client.blpop(["nothing"], timeout=0.5))  # holds the one connection
        await asyncio.sleep(0.05)
        with pytest.raises(StoreError, match="No connection available"):
            await store.get("k")
        await hold
        assert await store.get("k") == _state()  # at once: no back-off for a busy pool
        await store.close()


@pytest.mark.redis
async def test_router_restart_with_redis_keeps_hits(
    make_cluster: ClusterFactory, redis_server: RedisServer
) -> None:
    first = await make_cluster(
        store=RedisStore(redis_client_from_url(redis_server.url, 1.0), secret=KEY_SECRET, timeout=1.0)
    )
    msgs = [{"role": "user", "content": "restart me " * 20}]
    r1, b1 = await first.chat(msgs, cid="survivor")
    assert r1.headers[HEADER_STATUS] == "first"
    await first.runner.cleanup()  # the router process goes away; the fakes stay
    second = await make_cluster(
        pair=first.pair,
        store=RedisStore(redis_client_from_url(redis_server.url, 1.0), secret=KEY_SECRET, timeout=1.0),
    )
    msgs += [
        {"role": "assistant", "content": assistant_text(b1, False)},
        {"role": "user", "content": "again"},
    ]
    r2, _ = await second.chat(msgs, cid="survivor")
    assert r2.headers[HEADER_STATUS] == "hit"


@pytest.mark.redis
async def test_redis_killed_mid_run_degrades_to_misses_without_failed_turns(
    make_cluster: ClusterFactory, redis_server: RedisServer
) -> None:
    store = RedisStore(
        redis_client_from_url(redis_server.url, 2.0), secret=KEY_SECRET, timeout=2.0, backoff=0.5
    )
    cluster = await make_cluster(store=store)
    convs = {f"k{i}": [{"role": "user", "content": f"conversation {i} " * 10}] for i in range(8)}
    statuses: list[str] = []
    failures = 0
    for turn in range(6):
        if turn == 3:
            redis_server.kill()
        if turn == 5:
            redis_server.restart()
            await asyncio.sleep(0.6)  # past the back-off
        results = await asyncio.gather(
            *(cluster.chat(m, cid=c, stream=turn % 2 == 0) for c, m in convs.items())
        )
        for (_cid, msgs), (resp, body) in zip(convs.items(), results):
            if resp.status != 200:
                failures += 1
                continue
            statuses.append(resp.headers[HEADER_STATUS])
            msgs += [
                {"role": "assistant", "content": assistant_text(body, turn % 2 == 0)},
                {"role": "user", "content": "go"},
            ]
    assert failures == 0
    per_turn = [statuses[i * 8 : (i + 1) * 8] for i in range(6)]
    assert set(per_turn[0]) == {"first"} and set(per_turn[1]) == {"hit"}
    assert set(per_turn[3]) == {"error"} and set(per_turn[4]) == {"error"}  # Redis down: recomputed
    assert set(per_turn[5]) == {"first"}  # a fresh Redis knows nothing: reuse resumes from scratch
    assert cluster.router.metrics.store_errors._value.get() >= 8
