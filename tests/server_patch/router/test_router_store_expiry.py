"""The lease end tagged apart from the record (issue 15, item 3: renew at bounded cost).

A stored value is ``v3.<E>.<T>.<M>.<json>``: a renewal rewrites only ``E.T`` (bytes 3..51), the same
49 bytes for every id of one renew (``T`` tags ``E`` alone: no MAC per id). These tests break that
part in every way a Redis writer could (planted without a valid tag, another secret's, another lease
end's tag, garbage, not finite) and check each is ignored (the record reads with the lease end sealed
in its JSON); that a part moved from another record answers only a lease end the router wrote (what
``RecordSeal`` documents as allowed: the router's lease is advisory, D's claim decides); that with
stock vLLM (no renewals) no stored lease end is read at all; and that the scripted renewal, its
plain-command fallback and the in-process memo keep the contract, across replicas.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from _redis_records import KEY_SECRET, RENEWED_TO, SEALED_AT, P, record, redis_client, store_of  # noqa: F401 (redis_client: the "client" fixture)

from kvlease_router import ConversationRecord, RedisStore, StoreError
from kvlease_router import _redis_store as redis_store
from kvlease_router._store import RecordSeal

N = 100  # above the scripts' threshold


def _rec(n: int = 0, expires_at: float = SEALED_AT) -> ConversationRecord:
    return record(n, expires_at, tokens=8 + n)


def _part(raw: bytes | str) -> str:
    """``E.T`` of a sealed value."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    return text[3:52]


def _with_part(raw: bytes, part: str) -> bytes:
    return raw[:3] + part.encode() + raw[52:]


# --- the seal alone -------------------------------------------------------------------------------


def test_a_sealed_value_has_the_lease_end_apart_with_its_own_tag() -> None:
    seal = RecordSeal(KEY_SECRET)
    raw = seal.seal("k", _rec())
    assert raw.startswith(b"v3.") and raw[19:20] == raw[52:53] == raw[85:86] == b"."
    assert raw[86:] == _rec().dumps()  # the JSON as it is: a renewal never re-serializes it
    assert seal.open("k", raw) == _rec() and seal.rejected == 0
    # a renewal: a new E.T (its tag over E alone, the same for every record), the rest untouched
    part = seal.part(RENEWED_TO)
    assert part[:16] == RecordSeal.expiry_code(RENEWED_TO) and part == seal.part(RENEWED_TO)
    renewed = _with_part(raw, part)
    assert seal.open("k", renewed) == _rec(expires_at=RENEWED_TO) and seal.rejected == 0
    assert RecordSeal("another secret").open("k", renewed) is None
    assert seal.open("k2", renewed) is None  # moved whole: the body MAC binds the key
    assert KEY_SECRET.encode() not in renewed


def test_an_expiry_part_without_a_valid_tag_is_ignored() -> None:
    """Planted, garbled, another secret's, another lease end's tag, or a lease end that is not a
    finite time: the record reads with the lease end sealed in its JSON, the part counts as
    rejected."""
    seal = RecordSeal(KEY_SECRET)
    raw = seal.seal("k", _rec())
    code = RecordSeal.expiry_code(RENEWED_TO)
    planted = [
        f"{code}.{'0' * 32}",  # a later lease end without a tag
        f"{code}.{seal.tag(code)[:-1]}{'1' if seal.tag(code)[-1] == '0' else '0'}",  # one digit off
        f"{code}.{RecordSeal('another secret').tag(code)}",
        f"{RecordSeal.expiry_code(RENEWED_TO + 3600)}.{seal.tag(code)}",  # another lease end's tag
        seal.part(math.inf),  # a valid tag, but never a lease end
        seal.part(math.nan),
        "x" * 49,
    ]
    for i, part in enumerate(planted, 1):
        got = seal.open("k", raw[:3] + part.encode() + raw[52:])
        assert got == _rec(), part  # present, with the lease end its JSON was sealed with
        assert seal.rejected == i


def test_a_lease_end_moved_from_another_record_is_one_the_router_wrote() -> None:
    """The tag does not bind the key (what lets a renew tag thousands of ids at once): a part
    moved or replayed from any record of this secret answers the lease end the router wrote there,
    never one it never wrote, and the record's body, handle and control URL stay its own."""
    seal = RecordSeal(KEY_SECRET)
    raw = seal.seal("k", _rec())
    donor = seal.seal("k2", _rec(5, expires_at=RENEWED_TO))
    got = seal.open("k", _with_part(raw, _part(donor)))
    assert got == _rec(expires_at=RENEWED_TO) and seal.rejected == 0
    for when in (SEALED_AT + 60, SEALED_AT + 120):  # older renewals replayed
        assert seal.open("k", _with_part(raw, seal.part(when))) == _rec(expires_at=when)


def test_with_stock_vllm_no_stored_lease_end_is_read() -> None:
    """Nothing renews with stock vLLM, and P pulls on the router's word there: the lease end is
    the one sealed in the JSON, whatever part a writer put beside it (valid ones included)."""
    seal = RecordSeal(KEY_SECRET, renewals=False)
    raw = seal.seal("k", _rec())
    for part in (seal.part(RENEWED_TO), RecordSeal(KEY_SECRET).part(RENEWED_TO), "x" * 49):
        assert seal.open("k", _with_part(raw, part)) == _rec()
    assert seal.rejected == 0


# --- on a real Redis ------------------------------------------------------------------------------


async def _renewed(client: Any) -> tuple[RedisStore, list[str]]:
    """A store that wrote and renewed (through the script) ``N`` records."""
    store = store_of(client)
    keys = [f"r{i}" for i in range(N)]
    await store.put_many([(k, _rec(i), 30) for i, k in enumerate(keys)])
    read = await store.get_many(keys)
    await store.renew_many(keys, read, RENEWED_TO, 42)  # type: ignore[arg-type]
    return store, keys


@pytest.mark.redis
async def test_a_scripted_renewal_rewrites_only_the_expiry_part(client: Any) -> None:
    store = store_of(client)
    keys = [f"r{i}" for i in range(N)]
    await store.put_many([(k, _rec(i), 30) for i, k in enumerate(keys)])
    before = [await client.get(P + k) for k in keys]
    read = await store.get_many(keys)
    await store.renew_many(keys, read, RENEWED_TO, 42)  # type: ignore[arg-type]
    after = [await client.get(P + k) for k in keys]
    for old, new in zip(before, after):
        assert new[:3] == old[:3] and new[52:] == old[52:]  # the JSON and its MAC as they were
        assert new[3:52] != old[3:52]
    assert {new[3:52] for new in after} == {RecordSeal(KEY_SECRET).part(RENEWED_TO).encode()}
    assert 40_000 < await client.pttl(P + keys[7]) <= 42_000
    want = [_rec(i, RENEWED_TO) for i in range(N)]
    assert read == want  # the records read were the store's own, renewed in place
    fresh = store_of(client)  # no memo: every MAC checked
    assert await fresh.get_many(keys) == want and await fresh.get(keys[3]) == want[3]
    assert fresh.rejected == 0 and store.rejected == 0
    assert await store.get_many(keys) == want  # the memo answers the same


@pytest.mark.redis
@pytest.mark.parametrize("reader", ["fresh", "memo"])
async def test_planted_expiry_parts_in_redis_are_ignored(client: Any, reader: str) -> None:
    """Whether the reader verifies everything (a fresh replica) or remembers the record (the
    writer's memo): a forged or garbled lease end is ignored, the record still reads; one moved from
    another record (a lease end the router wrote) is taken, as ``RecordSeal`` documents."""
    writer, keys = await _renewed(client)
    r3 = await client.get(P + keys[3])
    code = RecordSeal.expiry_code(RENEWED_TO + 3600)
    seal = RecordSeal(KEY_SECRET)
    await client.setrange(P + keys[0], 3, f"{code}.{'0' * 32}")  # a later lease end, no tag
    await client.setrange(P + keys[1], 3, f"{code}.{seal.tag(RecordSeal.expiry_code(RENEWED_TO))}")
    await client.setrange(P + keys[2], 3, "garbage" * 7)
    await client.set(P + keys[3], _with_part(r3, f"{code}.{RecordSeal('another').tag(code)}"))
    donor = seal.seal("elsewhere", _rec(7, expires_at=RENEWED_TO + 60))
    await client.setrange(P + keys[4], 3, _part(donor))  # moved from another record
    store = store_of(client) if reader == "fresh" else writer
    rejected = store.rejected
    got = await store.get_many(keys)
    assert got[:4] == [_rec(i) for i in range(4)]  # each with the lease end sealed in its JSON
    assert got[4] == _rec(4, RENEWED_TO + 60)
    assert got[5:] == [_rec(i, RENEWED_TO) for i in range(5, N)]
    assert store.rejected - rejected == 4
    assert [await store.get(k) for k in keys[:4]] == [_rec(i) for i in range(4)]
    assert store.rejected - rejected == 4
    # read again: the reader now remembers several lease ends (sent one per key), and answers alike
    assert await store.get_many(keys) == got and store.rejected - rejected == 4


@pytest.mark.redis
async def test_a_stock_vllm_router_reads_no_stored_lease_end(client: Any) -> None:
    """``renewals=False`` (stock vLLM): a valid lease end put beside a record is not read, by a
    fresh reader nor by the writer's memo."""
    store = RedisStore(client, secret=KEY_SECRET, renewals=False, timeout=2.0)
    keys = [f"s{i}" for i in range(N)]
    await store.put_many([(k, _rec(i), 30) for i, k in enumerate(keys)])
    await client.setrange(P + keys[0], 3, RecordSeal(KEY_SECRET).part(RENEWED_TO + 3600))
    for reader in (store, RedisStore(client, secret=KEY_SECRET, renewals=False, timeout=2.0)):
        assert await reader.get_many(keys) == [_rec(i) for i in range(N)]
        assert await reader.get(keys[0]) == _rec(0)
    assert (await store_of(client).get_many(keys))[0] == _rec(0, RENEWED_TO + 3600)  # kvlease mode reads it


@pytest.mark.redis
async def test_a_replica_reads_another_replicas_renewal_with_one_tag_check(client: Any) -> None:
    a, keys = await _renewed(client)
    b = store_of(client)
    assert await b.get_many(keys) == [_rec(i, RENEWED_TO) for i in range(N)]  # b now remembers them
    read = await a.get_many(keys)
    await a.renew_many(keys, read, RENEWED_TO + 60, 42)  # type: ignore[arg-type]
    want = [_rec(i, RENEWED_TO + 60) for i in range(N)]
    assert await b.get_many(keys) == want and await b.get(keys[5]) == want[5]
    read = await b.get_many(keys)
    await b.renew_many(keys, read, RENEWED_TO + 120, 42)  # type: ignore[arg-type]
    assert await a.get_many(keys) == [_rec(i, RENEWED_TO + 120) for i in range(N)]
    assert a.rejected == b.rejected == 0


@pytest.mark.redis
async def test_a_scripted_renewal_leaves_a_record_replaced_or_released_meanwhile(client: Any) -> None:
    store, keys = await _renewed(client)
    other = store_of(client)  # another replica
    read = await store.get_many(keys)
    await other.put(keys[0], _rec(500), 30)  # a turn on the other replica
    await other.delete(keys[1])  # a release there
    await store.renew_many(keys, read, RENEWED_TO + 60, 42)  # type: ignore[arg-type]
    assert await client.exists(P + keys[1]) == 0
    for reader in (store, store_of(client)):
        got = await reader.get_many(keys)
        assert got[0] == _rec(500) and got[1] is None
        assert got[2:] == [_rec(i, RENEWED_TO + 60) for i in range(2, N)]
    assert store.rejected == 0


@pytest.mark.redis
async def test_records_the_memo_does_not_hold_are_resealed_whole(client: Any) -> None:
    store, keys = await _renewed(client)
    mine = await store.get_many(keys)
    stranger = [_rec(i, RENEWED_TO) for i in range(N)]  # equal records, not the store's objects
    await store.renew_many(keys, [*stranger[:50], *mine[50:]], RENEWED_TO + 60, 42)  # type: ignore[list-item]
    assert stranger[0] == _rec(0, RENEWED_TO)  # a caller's own record never changes
    want = [_rec(i, RENEWED_TO + 60) for i in range(N)]
    assert await store_of(client).get_many(keys) == want and await store.get_many(keys) == want


@pytest.mark.redis
async def test_without_scripts_the_plain_commands_keep_the_contract(client: Any) -> None:
    """A Redis that refuses scripts: ``MGET`` and a pipeline of ``SET XX``, same answers."""

    class NoScripts(RedisStore):
        async def _run_script(self, i: int, args: list[Any]) -> Any:
            self._scripts_ok = False
            return redis_store._NO_SCRIPT

    store = NoScripts(client, secret=KEY_SECRET, timeout=2.0)
    keys = [f"r{i}" for i in range(N)]
    await store.put_many([(k, _rec(i), 30) for i, k in enumerate(keys)])
    await client.delete(P + keys[9])
    read = await store.get_many(keys)
    assert read[9] is None and read[8] == _rec(8) and not store._scripts_ok
    live = [i for i, r in enumerate(read) if r is not None]
    await store.renew_many([keys[i] for i in live], [read[i] for i in live], RENEWED_TO, 42)  # type: ignore[misc]
    assert await client.exists(P + keys[9]) == 0
    want = [None if i == 9 else _rec(i, RENEWED_TO) for i in range(N)]
    assert await store.get_many(keys) == want and await store_of(client).get_many(keys) == want
    await client.setrange(P + keys[4], 3, f"{RecordSeal.expiry_code(RENEWED_TO + 9)}.{'0' * 32}")
    assert (await store.get_many(keys))[4] == _rec(4, RENEWED_TO)  # the JSON's: re-sealed whole
    assert store.rejected == 1


@pytest.mark.redis
async def test_a_key_of_another_type_reads_as_absent_and_keeps_the_scripts(client: Any) -> None:
    store, keys = await _renewed(client)
    await client.delete(P + keys[0])
    await client.hset(P + keys[0], "x", "y")  # planted: a hash where a record was
    got = await store.get_many(keys)
    assert got[0] is None and store._scripts_ok
    await store.renew_many(keys[1:], got[1:], RENEWED_TO + 60, 42)  # type: ignore[arg-type]
    assert store._scripts_ok and await client.type(P + keys[0]) == b"hash"
    assert (await store_of(client).get_many(keys))[1:] == [_rec(i, RENEWED_TO + 60) for i in range(1, N)]


@pytest.mark.redis
async def test_records_of_the_older_format_read_as_absent(client: Any) -> None:
    store = store_of(client)
    await store.put("k", _rec(), 30)
    raw = await client.get(P + "k")
    await client.set(P + "k", b"v1." + raw[53:85] + b"." + raw[86:], px=30_000)  # v1's layout
    assert await store_of(client).get("k") is None
    await client.set(P + "k", b"v2." + raw[3:], px=30_000)  # v2's layout (its tag bound the key)
    assert (
        await store_of(client).get("k") is None and await store_of(client).get_many(["k"] * N) == [None] * N
    )


@pytest.mark.redis
async def test_the_memo_stays_bounded_and_right(client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_store, "MEMO_ENTRIES", 30)
    store, keys = await _renewed(client)
    assert len(store._memo) <= 30
    read = await store.get_many(keys)
    assert read == [_rec(i, RENEWED_TO) for i in range(N)] and len(store._memo) <= 30
    await store.renew_many(keys, read, RENEWED_TO + 60, 42)  # type: ignore[arg-type]
    assert await store_of(client).get_many(keys) == [_rec(i, RENEWED_TO + 60) for i in range(N)]


@pytest.mark.redis
async def test_a_renewal_that_failed_to_write_leaves_the_memo_answering_what_redis_has(client: Any) -> None:
    """The memo takes the new lease end before the write: where the write fails, the next read sees
    Redis's differ from it and checks Redis's again (the old lease end, as written)."""

    class FailsOnce(RedisStore):
        fail = True

        async def _run_script(self, i: int, args: list[Any]) -> Any:
            if i == 1 and self.fail:
                self.fail = False
                raise ConnectionError("the write is lost")
            return await super()._run_script(i, args)

    store = FailsOnce(client, secret=KEY_SECRET, timeout=2.0, backoff=0.0)
    keys = [f"r{i}" for i in range(N)]
    await store.put_many([(k, _rec(i), 30) for i, k in enumerate(keys)])
    read = await store.get_many(keys)
    with pytest.raises(StoreError):
        await store.renew_many(keys, read, RENEWED_TO, 42)  # type: ignore[arg-type]
    want = [_rec(i) for i in range(N)]  # Redis has the old lease ends
    assert await store.get_many(keys) == want and await store.get(keys[0]) == want[0]
    assert store.rejected == 0
    read = await store.get_many(keys)
    await store.renew_many(keys, read, RENEWED_TO, 42)  # type: ignore[arg-type]
    assert await store_of(client).get_many(keys) == [_rec(i, RENEWED_TO) for i in range(N)]
