"""The lease end MACed apart from the record (issue 15, item 3: renew at bounded cost).

A stored value is ``v2.<E>.<T>.<M>.<json>``: a renewal rewrites only ``E.T`` (bytes 3..51). These
tests break that part in every way a Redis writer could (planted without a valid tag, moved from
another record or key, another secret's, garbage, an older one replayed) and check each is ignored
(the record reads with the lease end sealed in its JSON) or, for a replay, answers only a lease end
the router itself wrote for that very record; and that the scripted renewal, its plain-command
fallback and the in-process memo keep the contract, across replicas.
"""

from __future__ import annotations

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


def test_a_sealed_value_has_the_lease_end_apart_with_its_own_mac() -> None:
    seal = RecordSeal(KEY_SECRET)
    raw = seal.seal("k", _rec())
    assert raw.startswith(b"v2.") and raw[19:20] == raw[52:53] == raw[85:86] == b"."
    assert raw[86:] == _rec().dumps()  # the JSON as it is: a renewal never re-serializes it
    assert seal.open("k", raw) == _rec() and seal.rejected == 0
    # a renewal: a new E.T, its tag over (E, key, M), the rest untouched
    code = RecordSeal.expiry_code(RENEWED_TO)
    renewed = _with_part(raw, f"{code}.{seal.tag(code, 'k', raw[53:85].decode())}")
    assert seal.open("k", renewed) == _rec(expires_at=RENEWED_TO) and seal.rejected == 0
    assert RecordSeal("another secret").open("k", renewed) is None
    assert seal.open("k2", renewed) is None  # moved whole: the body MAC binds the key
    assert KEY_SECRET.encode() not in renewed


def test_an_expiry_part_without_a_valid_mac_is_ignored() -> None:
    """Planted, garbled, another secret's, another key's or another record's: the record reads
    with the lease end sealed in its JSON, and the part counts as rejected."""
    seal = RecordSeal(KEY_SECRET)
    raw = seal.seal("k", _rec())
    mac = raw[53:85].decode()
    code = RecordSeal.expiry_code(RENEWED_TO)
    other = seal.seal("k", _rec(1, expires_at=RENEWED_TO))  # another record of the same key
    planted = [
        f"{code}.{'0' * 32}",  # a later lease end without a MAC
        f"{code}.{seal.tag(code, 'k', mac)[:-1]}0",  # a tag one digit off
        f"{code}.{RecordSeal('another secret').tag(code, 'k', mac)}",
        f"{code}.{seal.tag(code, 'k2', mac)}",  # the right body MAC, another key
        _part(other),  # moved from another record (a valid part, for that record's MAC)
        _part(seal.seal("k2", _rec(expires_at=RENEWED_TO))),  # moved from the same record of another key
        f"{RecordSeal.expiry_code(RENEWED_TO + 1)}{_part(seal.seal('k', _rec(expires_at=RENEWED_TO)))[16:]}",
        "x" * 49,
    ]
    for i, part in enumerate(planted, 1):
        got = seal.open("k", raw[:3] + part.encode() + raw[52:])
        assert got == _rec(), part  # present, with the lease end its JSON was sealed with
        assert seal.rejected == i
    assert seal.open("k", other) == _rec(1, expires_at=RENEWED_TO)  # the donor is fine itself


def test_a_replayed_expiry_part_gives_only_a_lease_end_written_for_that_record() -> None:
    """Every part the router wrote for one body verifies for that body only: an older one
    replayed answers that older lease end (what was granted then), never one it never wrote."""
    seal = RecordSeal(KEY_SECRET)
    raw = seal.seal("k", _rec())
    mac = raw[53:85].decode()
    written = [SEALED_AT + 60 * i for i in range(1, 4)]
    parts = [f"{c}.{seal.tag(c, 'k', mac)}" for c in map(RecordSeal.expiry_code, written)]
    for when, part in zip(written, parts):
        assert seal.open("k", _with_part(raw, part)) == _rec(expires_at=when)
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
    assert 40_000 < await client.pttl(P + keys[7]) <= 42_000
    want = [_rec(i, RENEWED_TO) for i in range(N)]
    assert read == want  # the records read were the store's own, renewed in place
    fresh = store_of(client)  # no memo: every MAC checked
    assert await fresh.get_many(keys) == want and await fresh.get(keys[3]) == want[3]
    assert fresh.rejected == 0 and store.rejected == 0
    assert await store.get_many(keys) == want  # the memo answers the same


@pytest.mark.redis
@pytest.mark.parametrize("reader", ["fresh", "memo"])
async def test_planted_or_moved_expiry_parts_in_redis_are_ignored(client: Any, reader: str) -> None:
    """Whether the reader verifies everything (a fresh replica) or remembers the record (the
    writer's memo): a forged, garbled or moved lease end is ignored, the record still reads."""
    writer, keys = await _renewed(client)
    r0, r1, r2, r3 = [await client.get(P + k) for k in keys[:4]]
    code = RecordSeal.expiry_code(RENEWED_TO + 3600)
    await client.setrange(P + keys[0], 3, f"{code}.{'0' * 32}")  # a later lease end, no MAC
    await client.setrange(P + keys[1], 3, _part(r2))  # moved from another record
    await client.setrange(P + keys[2], 3, "garbage" * 7)
    await client.set(P + keys[3], _with_part(r3, _part(r1)))  # the whole value, E.T of another
    store = store_of(client) if reader == "fresh" else writer
    rejected = store.rejected
    got = await store.get_many(keys)
    assert got[:4] == [_rec(i) for i in range(4)]  # each with the lease end sealed in its JSON
    assert got[4:] == [_rec(i, RENEWED_TO) for i in range(4, N)]
    assert store.rejected - rejected == 4
    assert [await store.get(k) for k in keys[:4]] == [_rec(i) for i in range(4)]
    assert r0 is not None and store.rejected - rejected == 4


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
    """The memo takes the new tag before the write: where the write fails, the next read sees
    Redis's tag differ from it and checks Redis's again (the old lease end, as written)."""

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
