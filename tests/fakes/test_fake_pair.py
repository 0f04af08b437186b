"""The fake P/D pair runs the connector's real verification and retention (over real HTTP)."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from kvlease.protocol import (
    CACHE_SALT,
    CONTROL_RELEASE_PATH,
    CONTROL_RENEW_PATH,
    KV,
    KV_TRANSFER_PARAMS,
    LEASE_HANDLE_MAC,
    PREFILL_REUSE_STATUS,
    PREFILL_REUSED_TOKENS,
)
from kvlease_stack.testing import FakeConfig, FakePair
from kvlease_vllm._verify import handle_mac

pytestmark = pytest.mark.asyncio
AUTH = {"Authorization": "Bearer fake-secret"}
FIRST = [{"role": "user", "content": "tell me about leases " * 6}]


async def _post(s: aiohttp.ClientSession, url: str, body: dict[str, Any], **kw: Any) -> Any:
    async with s.post(url, json=body, **kw) as r:
        return r.status, await r.json()


async def _decode(s: aiohttp.ClientSession, pair: FakePair, salt: str | None = None) -> tuple[dict, list]:
    """One D turn: D's handle, and the next turn's messages (which extend what D holds)."""
    body: dict[str, Any] = {"messages": FIRST, KV_TRANSFER_PARAMS: {KV.DO_REMOTE_PREFILL: True}}
    if salt is not None:
        body[CACHE_SALT] = salt
    _, out = await _post(s, pair.decode.url + "/v1/chat/completions", body)
    text = out["choices"][0]["message"]["content"]
    return out[KV_TRANSFER_PARAMS], [
        *FIRST,
        {"role": "assistant", "content": text},
        {"role": "user", "content": "and?"},
    ]


async def _prefill(
    s: aiohttp.ClientSession, pair: FakePair, handle: dict, msgs: list, salt: str | None = None
) -> dict:
    kv = {**handle, KV.DO_REMOTE_DECODE: True, KV.DO_REMOTE_PREFILL: False}
    body: dict[str, Any] = {"messages": msgs, "max_tokens": 1, KV_TRANSFER_PARAMS: kv}
    if salt is not None:
        body[CACHE_SALT] = salt
    _, out = await _post(s, pair.prefill.url + "/v1/chat/completions", body)
    return out[KV_TRANSFER_PARAMS][KV.KVLEASE]


@pytest.mark.parametrize("partial", [False, True])
async def test_d_signs_its_handle_and_p_pulls_what_verifies(partial: bool) -> None:
    cfg = FakeConfig(partial_block=partial)
    async with FakePair(cfg) as pair, aiohttp.ClientSession() as s:
        handle, msgs = await _decode(s, pair, salt="tenant-a")
        assert handle[KV.KVLEASE][LEASE_HANDLE_MAC] == handle_mac(cfg.control_secret, handle)
        held = handle[KV.REMOTE_NUM_TOKENS]
        report = await _prefill(s, pair, handle, msgs, salt="tenant-a")
        assert report[PREFILL_REUSE_STATUS] == "hit"
        # whole blocks, or with D's partial last block (tail hash) everything D computed
        assert report[PREFILL_REUSED_TOKENS] == (held if partial else held // cfg.block_size * cfg.block_size)
        assert held % cfg.block_size != 0  # the tail case is really exercised
        assert len(pair.decode.retained) == 0  # the read is single use


async def test_another_salt_or_an_edited_handle_is_not_pulled() -> None:
    async with FakePair(FakeConfig()) as pair, aiohttp.ClientSession() as s:
        handle, msgs = await _decode(s, pair, salt="tenant-a")
        assert (await _prefill(s, pair, handle, msgs, salt="tenant-b"))[PREFILL_REUSE_STATUS] == "mismatch"
        edited = {**handle, KV.REMOTE_NUM_TOKENS: handle[KV.REMOTE_NUM_TOKENS] + 16}
        report = await _prefill(s, pair, edited, msgs, salt="tenant-a")
        assert report == {PREFILL_REUSED_TOKENS: 0, PREFILL_REUSE_STATUS: "miss"}  # MAC rejected
        assert len(pair.decode.retained) == 1  # neither touched D's blocks


async def test_control_endpoint_renews_and_releases_through_the_retention_table() -> None:
    async with FakePair(FakeConfig()) as pair, aiohttp.ClientSession() as s:
        handle, msgs = await _decode(s, pair)
        rid, ctl = handle[KV.REMOTE_REQUEST_ID], pair.decode.control
        status, body = await _post(s, ctl + CONTROL_RENEW_PATH, {"request_ids": [rid, "x"], "ttl": 300})
        assert status == 401 and "bearer token" in body["error"]["message"]
        status, body = await _post(
            s, ctl + CONTROL_RENEW_PATH, {"request_ids": [rid, "x"], "ttl": 300}, headers=AUTH
        )
        assert status == 200 and body["expires_in"]["x"] is None and body["expires_in"][rid] > 250
        status, body = await _post(s, ctl + CONTROL_RELEASE_PATH, {"request_ids": [rid]}, headers=AUTH)
        assert (status, body) == (200, {"released": 1}) and rid not in pair.decode.retained
        assert (await _prefill(s, pair, handle, msgs))[PREFILL_REUSE_STATUS] == "miss"  # blocks gone
        _, body = await _post(s, ctl + CONTROL_RENEW_PATH, {"request_ids": [rid], "ttl": 5}, headers=AUTH)
        assert body["expires_in"][rid] is None  # a released lease is never resurrected
