"""The Redis store's scripts take a batch's keys and per-key strings packed into a few arguments.

``_packed`` concatenates the keys and gives their widths in bytes (one number, or a JSON list); the
fingerprint and tag of each key go as 48 characters each. These tests check the format round trips
(uniform, mixed and non-ASCII keys through both scripts), that garbage planted in Redis (short
values, another type, a tag that is not UTF-8) costs reuse but never an error, and that the
write-back still only rewrites a record that is the one read (compare-and-set), also when the
renewal reuses the entries of the read that answered it.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from _redis_records import KEY_SECRET, RENEWED_TO, SEALED_AT, P, record, redis_client, store_of  # noqa: F401 (redis_client: the "client" fixture)

from kvlease_router import ConversationRecord
from kvlease_router import _redis_store as redis_store
from kvlease_router._lease_core import LeaseSettings, plan_renew, settle_renew

N = 80  # above the scripts' threshold


def _rec(n: int = 0, expires_at: float = SEALED_AT) -> ConversationRecord:
    return record(n, expires_at)


def _unpacked(blob: str, widths: str, n: int) -> list[str]:
    """What the scripts make of ``_packed``'s answer (byte widths, as Lua's ``string.sub``)."""
    raw = blob.encode("utf-8")
    got = orjson.loads(widths)
    sizes = [got] * n if isinstance(got, int) else got
    out, at = [], 0
    for size in sizes:
        out.append(raw[at : at + size].decode("utf-8"))
        at += size
    assert at == len(raw)
    return out


@pytest.mark.parametrize(
    "keys",
    [
        [f"{i:064x}" for i in range(5)],  # the router's keys: one width
        ["a", "bb", "ccc", "dd"],
        ["ключ", "k", "🔑x"],  # widths in bytes, not characters
        ["same", "size", "ключ"],  # as many characters, not as many bytes
    ],
)
def test_packed_keys_round_trip(keys: list[str]) -> None:
    blob, widths = redis_store._packed(keys)
    assert _unpacked(blob, widths, len(keys)) == keys
    assert (widths == str(len(keys[0]))) == (len({len(k.encode()) for k in keys}) == 1 and blob.isascii())


def test_a_lease_end_read_from_redis_is_kept_at_a_fixed_ascii_width() -> None:
    good = "0123456789abcdef"
    assert redis_store._ascii_code(good) == good
    for planted in ["short", "x" * 17, "\udcff" * 16, "é" * 16, ""]:
        kept = redis_store._ascii_code(planted)
        assert len(kept) == 16 and kept.isascii() and kept != planted


@pytest.mark.redis
@pytest.mark.parametrize(
    "make_key",
    [lambda i: f"{i:064x}", lambda i: f"k{i}", lambda i: f"ключ-{i}" if i % 3 else f"k{i}"],
    ids=["uniform", "mixed", "non-ascii"],
)
async def test_keys_of_any_width_round_trip_through_both_scripts(client: Any, make_key: Any) -> None:
    store = store_of(client)
    keys = [make_key(i) for i in range(N)]
    await store.put_many([(k, _rec(i), 30) for i, k in enumerate(keys)])
    read = await store.get_many(keys)
    assert read == [_rec(i) for i in range(N)]
    await store.renew_many(keys, read, RENEWED_TO, 42)
    want = [_rec(i, RENEWED_TO) for i in range(N)]
    fresh = store_of(client)  # no memo: every MAC checked
    assert await fresh.get_many(keys) == want and fresh.rejected == 0
    assert await store.get_many(keys) == want  # the memo (answered "=" by the read script)
    assert 40_000 < await client.pttl(P + keys[N - 1]) <= 42_000
    # and the other way round: the fresh reader's renewal, read by the writer
    got = await fresh.get_many(keys)
    await fresh.renew_many(keys, got, RENEWED_TO + 60, 42)
    assert await store.get_many(keys) == [_rec(i, RENEWED_TO + 60) for i in range(N)]
    assert store.rejected == fresh.rejected == 0


@pytest.mark.redis
@pytest.mark.parametrize("reader", ["fresh", "memo"])
async def test_garbage_in_redis_reads_as_absent_and_the_rest_renews(client: Any, reader: str) -> None:
    writer = store_of(client)
    keys = [f"{i:064x}" for i in range(N)]
    await writer.put_many([(k, _rec(i), 30) for i, k in enumerate(keys)])
    await writer.get_many(keys)  # the writer remembers them all
    sealed = await client.get(P + keys[5])
    await client.set(P + keys[0], b"x")  # short
    await client.set(P + keys[1], sealed[:60])  # cut inside the MAC
    await client.set(P + keys[2], b"v3." + b"\xff" * 100)  # not UTF-8
    await client.delete(P + keys[3])
    await client.hset(P + keys[3], "x", "y")  # another type
    await client.set(P + keys[4], sealed)  # another key's record, whole
    await client.set(P + keys[6], b"")
    # a good record with a tag that is not UTF-8: the record reads (with its JSON's lease end)
    seventh = await client.get(P + keys[7])
    await client.set(P + keys[7], seventh[:20] + b"\xfe" * 32 + seventh[52:])
    store = store_of(client) if reader == "fresh" else writer
    gone = {0, 1, 2, 3, 4, 6}
    for _ in range(2):  # and again, from what the first read left in the memo
        got = await store.get_many(keys)
        assert got == [None if i in gone else _rec(i) for i in range(N)]  # 7: its JSON's lease end
    live = [i for i, r in enumerate(got) if r is not None]
    await store.renew_many([keys[i] for i in live], [got[i] for i in live], RENEWED_TO, 42)
    want = [None if i in gone else _rec(i, RENEWED_TO) for i in range(N)]
    assert await store_of(client).get_many(keys) == want and await store.get_many(keys) == want
    assert await client.type(P + keys[3]) == b"hash" and await client.get(P + keys[4]) == sealed


@pytest.mark.redis
async def test_a_record_a_turn_of_this_process_replaced_after_the_read_is_not_overwritten(
    client: Any,
) -> None:
    """The renewal reuses the read's memo entries: the record a turn wrote since (same store, new
    entry) keeps its value in Redis and its entry in the memo."""
    store = store_of(client)
    keys = [f"{i:064x}" for i in range(N)]
    await store.put_many([(k, _rec(i), 30) for i, k in enumerate(keys)])
    read = await store.get_many(keys)
    assert store._last_read is not None  # the renewal below takes the read's entries
    await store.put(keys[0], _rec(500), 30)
    newer = await client.get(P + keys[0])
    await store.renew_many(keys, read, RENEWED_TO, 42)
    assert await client.get(P + keys[0]) == newer  # byte for byte
    assert keys[0] in store._memo
    want = [_rec(500), *(_rec(i, RENEWED_TO) for i in range(1, N))]
    assert await store.get_many(keys) == want and await store_of(client).get_many(keys) == want


@pytest.mark.redis
async def test_a_renewal_of_a_read_the_memo_forgot_since_still_renews(
    client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_store, "MEMO_ENTRIES", N)
    store = store_of(client)
    keys = [f"{i:064x}" for i in range(N)]
    await store.put_many([(k, _rec(i), 30) for i, k in enumerate(keys)])
    read = await store.get_many(keys)
    await store.put_many([(f"other-{i}", _rec(i), 30) for i in range(N)])  # evicts the read's entries
    assert not set(keys) & set(store._memo)
    await store.renew_many(keys, read, RENEWED_TO, 42)
    want = [_rec(i, RENEWED_TO) for i in range(N)]
    assert read == want
    assert await store_of(client).get_many(keys) == want and await store.get_many(keys) == want


@pytest.mark.redis
async def test_a_renewal_of_other_lists_than_the_read_looks_the_memo_up(client: Any) -> None:
    store = store_of(client)
    keys = [f"{i:064x}" for i in range(N)]
    await store.put_many([(k, _rec(i), 30) for i, k in enumerate(keys)])
    read = await store.get_many(keys)
    # the same pairs in another order, then a caller's own (equal) records for half of them
    await store.renew_many(keys[::-1], read[::-1], RENEWED_TO, 42)
    assert await store_of(client).get_many(keys) == [_rec(i, RENEWED_TO) for i in range(N)]
    read = await store.get_many(keys)
    mixed = [*(_rec(i, RENEWED_TO) for i in range(N // 2)), *read[N // 2 :]]
    await store.renew_many(keys, mixed, RENEWED_TO + 60, 42)
    assert await store_of(client).get_many(keys) == [_rec(i, RENEWED_TO + 60) for i in range(N)]


# --- the lease core's bulk paths ------------------------------------------------------------------


def _resolve(url: str | None, decode: str | None) -> str | None:
    return "http://c" if url == "http://c" else None


KV = LeaseSettings(True, ttl=300.0, ttl_margin=5.0, expired_grace=60.0, configured_control=_resolve)


def test_plan_renew_takes_the_callers_dedup_as_its_leases() -> None:
    ids = ["a", "b"]
    unique: dict[str, None] = dict.fromkeys(ids)
    p = plan_renew(ids, [_rec(1, 1000.0), None], 900.0, KV, unique)
    assert p.leases is unique and p.leases == {"a": None, "b": None} and p.calls == {"http://c": [0]}


@pytest.mark.parametrize(
    ("answer", "leases", "renewals", "drops"),
    [
        ({"lease-0": 305.0, "lease-1": 305.0}, [300.0, 300.0], {300.0: [0, 1]}, []),  # alike
        ({"lease-0": 305.0, "lease-1": 105.0}, [300.0, 100.0], {300.0: [0], 100.0: [1]}, []),
        ({"lease-0": 305.0}, [300.0, None], {300.0: [0]}, [1]),  # one D no longer holds
        ({"lease-0": 5.0, "lease-1": 5.0}, [None, None], {}, [0, 1]),  # alike, within the margin
        (None, [100.0, 100.0], {}, []),  # D unreachable
    ],
)
def test_settle_renew_of_every_id_on_one_node(
    answer: dict[str, float] | None,
    leases: list[float | None],
    renewals: dict[float, list[int]],
    drops: list[int],
) -> None:
    p = plan_renew(["a", "b"], [_rec(0, 1000.0), _rec(1, 1000.0)], 900.0, KV)
    r = settle_renew(p, {"http://c": answer}, KV)
    assert r.leases == dict(zip(["a", "b"], leases)) and r.renewals == renewals and r.drops == drops
    assert p.leases == {"a": None, "b": None} and p.calls == {"http://c": [0, 1]}  # the plan is unchanged
