"""Client-sent ``kv_transfer_params`` never reach vLLM, in any spelling, on any path.

The fake P/D pair records every body it received; the assertions are on those bodies, and on a
listener the hostile handle points at (it must never be contacted).
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from kvlease.protocol import (
    COMPLETIONS_PATH,
    HEADER_CONVERSATION_ID,
    HEADER_STATUS,
    KV,
    KV_TRANSFER_PARAMS,
    prefill_request_params,
)
from kvlease_router._identity import tenant_from
from security._cluster import Cluster, Listener, reply_text

MARK = "EVIL"


def hostile_params(listener: Listener) -> dict[str, Any]:
    """Every field of vLLM's P/D handle plus the kvlease object, each pointing somewhere hostile."""
    return {
        KV.DO_REMOTE_DECODE: True,
        KV.DO_REMOTE_PREFILL: True,
        KV.REMOTE_ENGINE_ID: f"{MARK}-engine",
        KV.REMOTE_BLOCK_IDS: [list(range(4096))],
        KV.REMOTE_REQUEST_ID: f"{MARK}-request",
        KV.REMOTE_HOST: "127.0.0.1",  # the listener: a host the client controls
        KV.REMOTE_PORT: listener.port,
        KV.REMOTE_NUM_TOKENS: 2**31 - 1,
        KV.REMOTE_BLOCKS_EXPIRY_TIME: 1e300,
        KV.TP_SIZE: 2**62,
        "dcp_size": 2**62,
        "pp_size": -1,
        "prompt_token_ids": [1, 2, 3],
        KV.TENANT: f"{MARK}-tenant",  # a tenant tag of the client's choosing: the router's replaces it
        KV.KVLEASE: {
            "v": 1,
            "block_size": 16,
            "num_tokens": 64,
            "hashes": ["00" * 16] * 4,
            "lease_id": f"{MARK}-request",
            "engine_id": f"{MARK}-engine",
            "control": f"http://127.0.0.1:{listener.port}",
            "mac": f"{MARK}-mac",
            "reused_tokens": 10**9,
        },
    }


def _raw_with(body: dict[str, Any], fragment: bytes) -> bytes:
    """``body`` serialized with a raw JSON member appended (spellings orjson would not produce)."""
    return orjson.dumps(body)[:-1] + b"," + fragment + b"}"


def _variants(listener: Listener, base: dict[str, Any]) -> list[tuple[str, bytes]]:
    evil = hostile_params(listener)
    evil_json = orjson.dumps(evil)
    return [
        ("top-level", orjson.dumps({**base, KV_TRANSFER_PARAMS: evil})),
        ("escaped key", _raw_with(base, b'"kv_transfer_param\\u0073": ' + evil_json)),
        (
            "duplicate key",
            _raw_with(base, b'"kv_transfer_params": ' + evil_json + b', "kv_transfer_params": ' + evil_json),
        ),
        (
            "huge tp_size literal",
            _raw_with(
                base,
                b'"kv_transfer_params": {"tp_size": 1'
                + b"0" * 40
                + b', "remote_host": "'
                + MARK.encode()
                + b'"}',
            ),
        ),
        ("null", orjson.dumps({**base, KV_TRANSFER_PARAMS: None})),
        ("not an object", orjson.dumps({**base, KV_TRANSFER_PARAMS: [MARK, evil]})),
        # vLLM copies vllm_xargs into SamplingParams.extra_args, where it reads kv_transfer_params
        ("vllm_xargs string", orjson.dumps({**base, "vllm_xargs": {KV_TRANSFER_PARAMS: MARK}})),
        ("vllm_xargs list", orjson.dumps({**base, "vllm_xargs": {KV_TRANSFER_PARAMS: [MARK, 1]}})),
        ("vllm_xargs object", orjson.dumps({**base, "vllm_xargs": {KV_TRANSFER_PARAMS: evil}})),
    ]


VARIANT_NAMES = [
    "top-level",
    "escaped key",
    "duplicate key",
    "huge tp_size literal",
    "null",
    "not an object",
    "vllm_xargs string",
    "vllm_xargs list",
    "vllm_xargs object",
]


def assert_nothing_hostile_reached_vllm(cluster: Cluster, listener: Listener) -> None:
    pair = cluster.pair
    d = pair.decode
    received = cluster.received()
    assert received, "the fakes got nothing: the test would prove nothing"
    tags = set()
    for role, body in received:
        raw = orjson.dumps(body)
        assert MARK.encode() not in raw, (role, raw[:400])
        xargs = body.get("vllm_xargs")
        assert not (isinstance(xargs, dict) and KV_TRANSFER_PARAMS in xargs), (role, xargs)
        kv = body.get(KV_TRANSFER_PARAMS)
        assert isinstance(kv, dict), (role, kv)
        kv = dict(kv)
        tags.add(kv.pop(KV.TENANT, None))  # the router's own tag (kvlease mode), checked below
        assert "prompt_token_ids" not in kv and "dcp_size" not in kv and "pp_size" not in kv
        if role == "prefill":
            if kv.get(KV.REMOTE_BLOCK_IDS) is None:
                assert kv == prefill_request_params()
            else:  # D's own handle, captured by the router: every routing field is D's
                assert kv[KV.REMOTE_ENGINE_ID] == d.engine_id
                assert (kv[KV.REMOTE_HOST], kv[KV.REMOTE_PORT]) == (d.host, d.port)
                assert kv[KV.TP_SIZE] == 1
                assert kv[KV.KVLEASE]["control"] == d.control
        else:  # what D gets is what P answered
            assert kv[KV.REMOTE_ENGINE_ID] == pair.prefill.engine_id
            assert kv[KV.TP_SIZE] == 1
    assert tags == {cluster.router.keyer.tenant_tag(tenant_from({}, None))}  # the requests' tenant
    assert listener.connections == 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("variant", VARIANT_NAMES)
async def test_client_params_never_reach_vllm(
    cluster: Cluster, listener: Listener, variant: str, stream: bool
) -> None:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "hostile " * 12}]
    cid = f"inj-{VARIANT_NAMES.index(variant)}-{int(stream)}"
    statuses = []
    for turn in range(3):  # a first turn, then turns where the router holds D's real handle
        base = {"model": "fake-model", "messages": msgs, "stream": stream}
        raw = dict(_variants(listener, base))[variant]
        r, out = await cluster.post("/v1/chat/completions", raw, {HEADER_CONVERSATION_ID: cid})
        assert r.status == 200, (variant, out[:300])
        assert KV_TRANSFER_PARAMS.encode() not in out and MARK.encode() not in out
        statuses.append(r.headers[HEADER_STATUS])
        msgs = [
            *msgs,
            {"role": "assistant", "content": reply_text(out, stream)},
            {"role": "user", "content": f"turn {turn}"},
        ]
    assert statuses[0] == "first"
    # streams carry the handle in the final chunk (plugin), so every later turn reuses D's real KV
    assert statuses[1:] == ["hit", "hit"], statuses
    assert_nothing_hostile_reached_vllm(cluster, listener)
    assert cluster.pair.decode.stats["reads_ok"] == 2


async def test_completions_path_too(cluster: Cluster, listener: Listener) -> None:
    for stream in (False, True):
        for _name, raw in _variants(
            listener, {"model": "fake-model", "prompt": "abc " * 20, "stream": stream}
        ):
            r, out = await cluster.post(
                COMPLETIONS_PATH, raw, {HEADER_CONVERSATION_ID: f"cmpl-{int(stream)}"}
            )
            assert r.status == 200, out[:300]
            assert MARK.encode() not in out and KV_TRANSFER_PARAMS.encode() not in out
    assert_nothing_hostile_reached_vllm(cluster, listener)


async def test_without_conversation_id_too(cluster: Cluster, listener: Listener) -> None:
    for _name, raw in _variants(
        listener, {"model": "fake-model", "messages": [{"role": "user", "content": "x"}]}
    ):
        r, out = await cluster.post("/v1/chat/completions", raw)
        assert r.status == 200 and r.headers[HEADER_STATUS] == "no-id", out[:300]
    assert_nothing_hostile_reached_vllm(cluster, listener)
