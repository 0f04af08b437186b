"""The renew's fast paths answer exactly as the plain ones: the keyer's key cache, the memory store's
batched reads and renewals, the renew answer's shared objects."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from _router_cluster import Cluster

from kvlease.protocol import RENEW_PATH, RenewResponse
from kvlease_router import ConversationRecord, MemoryStore
from kvlease_router._identity import Keyer

TENANTS = ["anonymous", "t:" + "ab" * 32, "h:acme", "h:\u00e9l\u00e8ve"]
IDS = ["c0", "conv-000001", "a" * 128, "x.y:z_w-1", "sha256:" + "0" * 64]


# --- Keyer: the key cache -------------------------------------------------------------------------


def test_keys_equal_key_for_every_id_and_tenant_cached_or_not() -> None:
    keyer = Keyer("secret")
    for tenant in TENANTS:
        want = [keyer.key(tenant, cid) for cid in IDS]
        assert keyer.keys(tenant, IDS) == want  # nothing cached
        keyer.remember(tenant, list(zip(IDS[::2], want[::2])))
        keys, missed = keyer.lookup(tenant, IDS)  # some cached
        assert keys == want and list(missed) == [1, 3]
        keyer.remember(tenant, [(IDS[i], keys[i]) for i in missed])
        assert keyer.lookup(tenant, IDS) == (want, ())  # all cached
    assert keyer.cached == len(TENANTS) * len(IDS)


def test_lookup_adds_nothing_to_the_cache() -> None:
    keyer = Keyer("secret")
    keys, missed = keyer.lookup("anonymous", IDS)
    assert list(missed) == list(range(len(IDS))) and keyer.cached == 0
    assert keyer.lookup("anonymous", IDS) == (keys, missed)


def test_the_same_id_under_two_tenants_is_two_keys_in_the_cache() -> None:
    keyer = Keyer("secret")
    a, b = keyer.keys("h:a", ["same"]), keyer.keys("h:b", ["same"])
    assert a != b
    keyer.remember("h:a", [("same", a[0])])
    assert keyer.lookup("h:a", ["same"]) == (a, ())
    assert keyer.lookup("h:b", ["same"]) == (b, range(1))  # not a's cached key
    keyer.remember("h:b", [("same", b[0])])
    assert keyer.lookup("h:a", ["same"])[0] == a and keyer.lookup("h:b", ["same"])[0] == b
    assert keyer.cached == 2


def test_the_cache_is_bounded_and_starts_again_when_full() -> None:
    keyer = Keyer("secret", cache_max=10)
    for batch in range(7):
        ids = [f"b{batch}-{i}" for i in range(4)]
        keyer.remember(f"h:{batch % 2}", list(zip(ids, keyer.keys(f"h:{batch % 2}", ids))))
        assert keyer.cached <= 10
    big = [f"big-{i}" for i in range(25)]
    keyer.remember("h:big", list(zip(big, keyer.keys("h:big", big))))
    assert keyer.cached == 10  # one batch over the bound keeps its first ``cache_max``
    keys, missed = keyer.lookup("h:big", big)
    assert keys == [keyer.key("h:big", cid) for cid in big] and list(missed) == list(range(10, 25))
    keyer.remember("h:x", [("again", "k")] * 3)  # the same id twice counts once
    assert keyer.cached == 1


def test_a_cache_of_size_zero_caches_nothing() -> None:
    keyer = Keyer("secret", cache_max=0)
    keyer.remember("anonymous", [("c0", keyer.key("anonymous", "c0"))])
    assert keyer.cached == 0 and list(keyer.lookup("anonymous", ["c0"])[1]) == [0]


async def test_a_renew_caches_the_keys_of_known_ids_only(cluster: Cluster) -> None:
    r, _ = await cluster.chat([{"role": "user", "content": "known " * 40}], cid="known")
    assert r.status == 200
    keyer = cluster.router.keyer
    ids = ["known", *(f"random-{i}" for i in range(50))]
    for _ in range(2):
        async with cluster.client.post(cluster.url + RENEW_PATH, json={"conversation_ids": ids}) as resp:
            assert resp.status == 200
            leases = RenewResponse.from_json(orjson.loads(await resp.read())).leases
        assert leases["known"] is not None and all(leases[c] is None for c in ids[1:])
        assert keyer.cached == 1  # the attacker-like random ids are never cached
    keys, missed = keyer.lookup("anonymous", ids)
    assert list(missed) == list(range(1, len(ids)))
    assert keys == [keyer.key("anonymous", cid) for cid in ids]


# --- MemoryStore: batched reads and renewals ------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _rec(i: int) -> ConversationRecord:
    return ConversationRecord("http://d", {"b": [i]}, f"l{i}", "http://c", i, 5000.0 + i)


async def _store(lives: dict[str, float]) -> tuple[MemoryStore, _Clock]:
    """A store holding ``k<i>`` for each key, living ``lives[key]`` seconds from 1000."""
    clock = _Clock()
    store = MemoryStore(100, clock)
    for key, keep in lives.items():
        await store.put(key, _rec(int(key[1:])), keep)
    return store, clock


async def _plain_get_many(store: MemoryStore, keys: list[str]) -> list[ConversationRecord | None]:
    return [await store.get(k) for k in keys]


@pytest.mark.parametrize(
    ("lives", "keys"),
    [
        ({"k0": 10, "k1": 10, "k2": 10}, ["k0", "k1", "k2"]),  # all live
        ({"k0": 10, "k1": 10}, ["k9", "k8"]),  # none known
        ({"k0": 10, "k1": 10}, ["k1", "k9", "k0", "k1"]),  # some unknown, a duplicate
        ({"k0": 10, "k1": 1, "k2": 10}, ["k0", "k1", "k2", "k7"]),  # one expired
        ({"k0": 1, "k1": 1}, ["k0", "k1"]),  # all expired
        ({}, []),
    ],
)
async def test_get_many_is_get_of_each(lives: dict[str, float], keys: list[str]) -> None:
    fast, clock = await _store(lives)
    plain, plain_clock = await _store(lives)
    clock.now = plain_clock.now = 1005.0
    assert await fast.get_many(keys) == await _plain_get_many(plain, keys)
    assert list(fast._data) == list(plain._data)  # same entries left, in the same LRU order


@pytest.mark.parametrize(
    ("lives", "replaced", "keep_for"),
    [
        ({"k0": 10, "k1": 10, "k2": 10}, set(), 60.0),  # all renew
        ({"k0": 10, "k1": 10, "k2": 10}, {"k1"}, 60.0),  # a turn replaced one meanwhile
        ({"k0": 10, "k1": 1, "k2": 10}, set(), 60.0),  # one expired meanwhile
        ({"k0": 10, "k2": 10}, set(), 60.0),  # one gone meanwhile
        ({"k0": 10, "k1": 10, "k2": 10}, set(), 0.0),  # kept no longer: removed
    ],
)
@pytest.mark.parametrize("as_read", [True, False], ids=["the-read-keys", "other-keys"])
async def test_renew_many_renews_what_is_still_there(
    lives: dict[str, float], replaced: set[str], keep_for: float, as_read: bool
) -> None:
    """``as_read``: the renewal gets the very key list the read got (the renew handler's call:
    the read's entries are reused, no lookup per key), or an equal copy (each key looked up)."""
    keys = ["k0", "k1", "k2"]
    store, clock = await _store({k: 10 for k in keys})
    read = await store.get_many(keys)
    for key in keys:  # what happened between the read and the renewal
        if key not in lives:
            await store.delete(key)
        elif lives[key] < 10:
            store._data[key][0] = 1000.0 + lives[key]  # the same record, expired by the renewal
        elif key in replaced:
            await store.put(key, _rec(99), 10)
    clock.now = 1005.0
    await store.renew_many(keys if as_read else list(keys), read, 7777.0, keep_for)  # type: ignore[arg-type]
    for key, rec in zip(keys, read):
        got = await store.get(key)
        if keep_for <= 0 or key not in lives or lives[key] < 10:
            assert got is None
        elif key in replaced:
            assert got == _rec(99)  # left as the turn wrote it
        else:
            assert got is rec and got.expires_at == 7777.0 and got == _rec(int(key[1:])).with_expiry(7777.0)
            assert store._data[key][0] == 1005.0 + keep_for


async def test_the_store_copies_a_record_on_put() -> None:
    store = MemoryStore(10)
    rec = _rec(1)
    await store.put("k1", rec, 10)
    held = await store.get("k1")
    assert held == rec and held is not rec
    await store.renew_many(["k1"], [held], 9.0, 10)  # type: ignore[list-item]
    assert rec.expires_at == 5001.0 and (await store.get("k1")).expires_at == 9.0  # type: ignore[union-attr]


# --- RenewResponse: one object per distinct value -------------------------------------------------


@pytest.mark.parametrize(
    "leases",
    [
        {},
        {"a": None, "b": None},
        {"a": 291.5, "b": 291.5, "c": None, "d": 12.34567},
        {"a": 0.0, "b": -0.0, "c": 1, "d": 1.0},  # equal values: the first one's object
        {"b": -0.0, "a": 0.0},
    ],
)
def test_renew_answer_is_the_plain_per_id_answer(leases: dict[str, Any]) -> None:
    seen: dict[Any, dict[str, Any]] = {}
    for exp in leases.values():
        if exp is not None and exp not in seen:
            seen[exp] = {"expires_in": round(exp, 3)}
    want = {cid: {"status": "unknown"} if exp is None else seen[exp] for cid, exp in leases.items()}
    body = RenewResponse(leases, 300.0).to_json()
    assert body == {"leases": want, "ttl": 300.0}
    assert list(body["leases"]) == list(leases)
    assert orjson.dumps(body["leases"]) == orjson.dumps(want)  # -0.0 vs 0.0, 1 vs 1.0 alike
    values = [id(v) for v in body["leases"].values()]
    assert len(set(values)) == len({v for v in leases.values()})  # shared, one per distinct value


def test_found_picks_the_ids_with_a_record() -> None:
    from kvlease_router._lease_api import _found

    assert bool(_rec(0))  # ``_found`` picks records by truth: a record is always true
    ids, keys = ["a", "b", "c"], ["ka", "kb", "kc"]
    records = [None, _rec(1), None]
    assert _found(ids, keys, records, range(3)) == [("b", "kb")]
    assert _found(ids, keys, records, [0, 1]) == [("b", "kb")]
    assert _found(ids, keys, [_rec(0), _rec(1), None], [0, 2]) == [("a", "ka")]


def test_tenant_tags_are_remembered_within_a_bound() -> None:
    """Every kvlease-mode turn sends its tenant's tag: it is computed once per tenant, equals a
    fresh keyer's, and made-up tokens cannot grow the memory past the bound (cleared whole)."""
    from kvlease_router import _identity

    keyer, fresh = Keyer("s3cret"), Keyer("s3cret")
    tags = {t: keyer.tenant_tag(t) for t in ("t:a", "t:b", "anonymous")}
    assert tags == {t: fresh.tenant_tag(t) for t in tags} and len(set(tags.values())) == 3
    assert keyer.tenant_tag("t:a") == tags["t:a"] != Keyer("other").tenant_tag("t:a")
    for i in range(_identity._TAGS_MAX + 10):
        keyer.tenant_tag(f"t:made-up-{i}")
    assert len(keyer._tags) <= _identity._TAGS_MAX
    assert keyer.tenant_tag("t:b") == tags["t:b"]
