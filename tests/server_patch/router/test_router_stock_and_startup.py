"""Stock-vLLM mode (message continuity, JSON-only capture, no renewals) and start-up validation."""

from __future__ import annotations

import pytest
from _router_cluster import ClusterFactory, assistant_text
from aiohttp import web

from kvlease.protocol import HEADER_REUSED_TOKENS, HEADER_STATUS, RENEW_PATH, STATUS_PATH, Role
from kvlease_router import ConfigError, MemoryStore, NodeSpec, RouterSettings, create_app
from kvlease_router._validate import NodeFacts, plan_cluster
from kvlease_stack.testing import FakeConfig, FakePair, control_info, pair_settings, placeholder_settings


def stock(**kw: object) -> FakeConfig:
    base: dict[str, object] = {"kvlease": False, "plugin": False, "ttl": 120.0, **kw}
    return FakeConfig(**base)  # type: ignore[arg-type]


async def test_stock_exact_continuation_hits_nonstreaming(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster(stock(), node_ttl=120.0)
    msgs = [{"role": "user", "content": "stock " * 30}]
    r1, b1 = await cluster.chat(msgs, cid="s")
    msgs += [{"role": "assistant", "content": assistant_text(b1, False)}, {"role": "user", "content": "next"}]
    r2, _ = await cluster.chat(msgs, cid="s")
    assert (r1.headers[HEADER_STATUS], r2.headers[HEADER_STATUS]) == ("first", "hit")
    # P reported nothing: the count is what D held (upper bound), below the prompt length
    assert (
        0
        < int(r2.headers[HEADER_REUSED_TOKENS])
        < int(cluster.pair.prefill.requests[-1]["max_tokens"]) + 10_000
    )


async def test_stock_uses_cached_tokens_when_p_reports_them(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster(stock(prompt_tokens_details=True), node_ttl=120.0)
    msgs = [{"role": "user", "content": "details " * 30}]
    _, b1 = await cluster.chat(msgs, cid="d")
    msgs += [{"role": "assistant", "content": assistant_text(b1, False)}, {"role": "user", "content": "next"}]
    r2, _ = await cluster.chat(msgs, cid="d")
    assert r2.headers[HEADER_STATUS] == "hit"
    assert int(r2.headers[HEADER_REUSED_TOKENS]) % 16 == 0


@pytest.mark.parametrize(
    "edit",
    [
        lambda m, a: [*m, {"role": "assistant", "content": a + " (edited)"}],
        lambda m, a: [{"role": "user", "content": "changed"}, {"role": "assistant", "content": a}],
        lambda m, a: [*m],  # the answer was dropped
        lambda m, a: [*m, {"role": "assistant", "content": a}][:-2] + [{"role": "assistant", "content": a}],
    ],
    ids=["answer edited", "earlier message edited", "answer dropped", "message removed"],
)
async def test_stock_broken_continuity_is_mismatch_and_sends_no_handle(
    make_cluster: ClusterFactory, edit: object
) -> None:
    cluster = await make_cluster(stock(), node_ttl=120.0)
    msgs = [{"role": "user", "content": "orig " * 30}]
    _, b1 = await cluster.chat(msgs, cid="m")
    history = edit(msgs, assistant_text(b1, False))  # type: ignore[operator]
    r2, _ = await cluster.chat([*history, {"role": "user", "content": "next"}], cid="m")
    assert r2.headers[HEADER_STATUS] == "mismatch"
    assert cluster.pair.prefill.requests[-1]["kv_transfer_params"]["remote_block_ids"] is None
    assert cluster.pair.decode.stats["reads_ok"] == 0


async def test_stock_streaming_never_captures(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster(stock(plugin=True), node_ttl=120.0)  # even if a stream carried one
    msgs = [{"role": "user", "content": "stream " * 30}]
    _, b1 = await cluster.chat(msgs, cid="st", stream=True)
    msgs += [{"role": "assistant", "content": assistant_text(b1, True)}, {"role": "user", "content": "next"}]
    r2, _ = await cluster.chat(msgs, cid="st", stream=True)
    assert r2.headers[HEADER_STATUS] == "miss"


async def test_stock_status_says_no_renewals_and_renew_does_not_extend(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster(stock(), node_ttl=120.0)
    async with cluster.client.get(cluster.url + STATUS_PATH) as r:
        status = await r.json()
    assert (
        status["mode"] == "stock-vllm" and status["renewals"] is False and status["stream_capture"] is False
    )
    assert any("stock-vLLM mode" in n for n in status["notes"])
    _, _b1 = await cluster.chat([{"role": "user", "content": "r " * 30}], cid="nr")
    async with cluster.client.post(cluster.url + RENEW_PATH, json={"conversation_ids": ["nr"]}) as r:
        body = await r.json()
    assert body["leases"]["nr"]["expires_in"] <= 115.0
    assert cluster.pair.decode.stats["renew_calls"] == 0


@pytest.mark.parametrize(
    ("p_kw", "d_kw", "settings_kw", "message"),
    [
        ({}, {"bidirectional_kv_xfer": False}, {}, "bidirectional_kv_xfer"),
        ({"model": "other"}, {}, {}, "served model"),
        ({"block_size": 32}, {}, {}, "block size"),
        ({"vllm_version": "0.31.0"}, {}, {}, "vLLM version"),
        ({}, {"role": Role.PREFILL}, {}, "role"),
        ({}, {}, {"ttl": 118.0}, "router TTL"),
        ({}, {"ttl_s": 4.0}, {}, "safety margin"),
        ({}, {"protocol_version": 99}, {}, "protocol"),
    ],
)
def test_plan_refuses_inconsistent_clusters(p_kw: dict, d_kw: dict, settings_kw: dict, message: str) -> None:
    p = NodeFacts("http://p", "m", "0.32.0", control_info(**{"role": Role.PREFILL, **p_kw}))
    d = NodeFacts("http://d", "m", "0.32.0", control_info(**{"role": Role.DECODE, **d_kw}))
    with pytest.raises(ConfigError, match=message):
        plan_cluster(placeholder_settings(**settings_kw), [p], [d])


def test_plan_ok_uses_decode_ttl_minus_margin() -> None:
    p = NodeFacts("http://p", "m", "0.32.0", control_info(Role.PREFILL, ttl_s=30.0))
    d = NodeFacts("http://d", "m", "0.32.0", control_info(Role.DECODE, ttl_s=200.0))
    plan = plan_cluster(placeholder_settings(ttl_margin=10.0), [p], [d])
    assert plan.ttl == 190.0 and plan.decode_ttl == 200.0 and plan.block_size == 16 and plan.reuse


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(prefill=(), decode=(NodeSpec("http://d"),)), "at least one"),
        (
            dict(prefill=(NodeSpec("http://p", "http://c"),), decode=(NodeSpec("http://d"),)),
            "either every node",
        ),
        (
            dict(prefill=(NodeSpec("http://p", "http://c"),), decode=(NodeSpec("http://d", "http://e"),)),
            "control-secret",
        ),
        (dict(prefill=(NodeSpec("http://p"),), decode=(NodeSpec("http://d"),), state="mysql://x"), "redis"),
    ],
)
def test_settings_reject_bad_config(kw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RouterSettings(**kw)


def test_node_urls_must_be_http() -> None:
    with pytest.raises(ConfigError):
        NodeSpec("ftp://x")


async def test_router_refuses_to_start_when_p_and_d_disagree() -> None:
    async with FakePair(FakeConfig()) as pair:
        pair.decode.config = FakeConfig(block_size=32)
        settings = pair_settings(pair, control_secret="fake-secret", startup_timeout=1.0)
        runner = web.AppRunner(create_app(settings, MemoryStore()))
        with pytest.raises(ConfigError, match="block size"):
            await runner.setup()
        await runner.cleanup()


async def test_router_refuses_wrong_control_secret() -> None:
    async with FakePair(FakeConfig()) as pair:
        settings = pair_settings(pair, control_secret="wrong", startup_timeout=0.5)
        runner = web.AppRunner(create_app(settings, MemoryStore()))
        with pytest.raises(ConfigError, match="401"):
            await runner.setup()
        await runner.cleanup()
