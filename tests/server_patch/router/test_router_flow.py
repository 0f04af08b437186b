"""Per-turn flow against a fake vLLM P/D pair over real HTTP: statuses, headers, what P and D get."""

from __future__ import annotations

from typing import Any

import pytest
from _router_cluster import Cluster, ClusterFactory, assistant_text

from kvlease.protocol import (
    HEADER_REUSE,
    HEADER_REUSED_TOKENS,
    HEADER_STATUS,
    HEADER_TTL,
    KV,
    KV_TRANSFER_PARAMS,
    REUSE_OFF,
    ReuseStatus,
)
from kvlease_stack.testing import FakeConfig


def _status(resp: Any) -> str:
    return str(resp.headers[HEADER_STATUS])


async def _two_turns(cluster: Cluster, stream: bool, cid: str = "conv-1") -> tuple[Any, Any]:
    msgs = [{"role": "user", "content": "hello there, this is a long enough first question " * 4}]
    r1, b1 = await cluster.chat(msgs, cid=cid, stream=stream)
    assert r1.status == 200
    msgs += [
        {"role": "assistant", "content": assistant_text(b1, stream)},
        {"role": "user", "content": "and then?"},
    ]
    r2, b2 = await cluster.chat(msgs, cid=cid, stream=stream)
    assert r2.status == 200
    return (r1, b1), (r2, b2)


@pytest.mark.parametrize("stream", [False, True])
async def test_first_then_hit_with_reused_tokens(cluster: Cluster, stream: bool) -> None:
    (r1, _), (r2, b2) = await _two_turns(cluster, stream)
    assert KV_TRANSFER_PARAMS not in str(b2)
    assert _status(r1) == "first"
    assert _status(r2) == "hit"
    reused = int(r2.headers[HEADER_REUSED_TOKENS])
    assert reused > 0 and reused % cluster.pair.config.block_size == 0
    assert float(r2.headers[HEADER_TTL]) == pytest.approx(cluster.router.ttl)
    # P got max_tokens=1, stream=false and D's handle (with its kvlease hashes) on turn 2
    p_body = cluster.pair.prefill.requests[-1]
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert p_body[KV_TRANSFER_PARAMS][KV.REMOTE_ENGINE_ID] == cluster.pair.decode.engine_id
    assert KV.KVLEASE in p_body[KV_TRANSFER_PARAMS]
    # D got P's params and the client's own settings
    d_body = cluster.pair.decode.requests[-1]
    assert d_body[KV_TRANSFER_PARAMS][KV.REMOTE_ENGINE_ID] == cluster.pair.prefill.engine_id
    assert d_body["stream"] is stream
    assert cluster.router.metrics.turns[ReuseStatus.HIT]._value.get() == 1


async def test_handle_sent_to_p_is_single_use_and_turn3_hits_again(cluster: Cluster) -> None:
    msgs = [{"role": "user", "content": "x" * 200}]
    statuses = []
    for i in range(4):
        r, b = await cluster.chat(msgs, cid="c3", stream=True)
        statuses.append(_status(r))
        msgs += [
            {"role": "assistant", "content": assistant_text(b, True)},
            {"role": "user", "content": f"q{i}"},
        ]
    assert statuses == ["first", "hit", "hit", "hit"]
    assert cluster.pair.decode.stats["reads_ok"] == 3


async def test_no_id_is_plain_pd(cluster: Cluster) -> None:
    r, body = await cluster.chat([{"role": "user", "content": "hi"}])
    assert r.status == 200 and _status(r) == "no-id"
    assert KV_TRANSFER_PARAMS in cluster.pair.prefill.requests[-1]
    assert KV_TRANSFER_PARAMS not in body


@pytest.mark.parametrize(
    "where",
    [
        {"headers": {"X-Conversation-Id": "A"}},
        {"body": {"conversation_id": "A"}},
        {"headers": {"X-Session-Id": "A"}},
        {"body": {"prompt_cache_key": "A"}},
    ],
)
async def test_identity_sources_all_work(cluster: Cluster, where: dict[str, Any]) -> None:
    msgs = [{"role": "user", "content": "y" * 100}]
    r1, b1 = await cluster.chat(msgs, headers=where.get("headers"), **where.get("body", {}))
    msgs += [{"role": "assistant", "content": assistant_text(b1, False)}, {"role": "user", "content": "z"}]
    r2, _ = await cluster.chat(msgs, headers=where.get("headers"), **where.get("body", {}))
    assert (_status(r1), _status(r2)) == ("first", "hit")
    assert "conversation_id" not in cluster.pair.prefill.requests[-1]
    assert "conversation_id" not in cluster.pair.decode.requests[-1]


async def test_header_beats_body_identity(cluster: Cluster) -> None:
    msgs = [{"role": "user", "content": "w" * 100}]
    _, b1 = await cluster.chat(msgs, cid="H", conversation_id="B")
    msgs += [{"role": "assistant", "content": assistant_text(b1, False)}, {"role": "user", "content": "z"}]
    r2, _ = await cluster.chat(msgs, cid="H", conversation_id="other")
    assert _status(r2) == "hit"
    r3, _ = await cluster.chat(msgs, conversation_id="B")
    assert _status(r3) == "first"


async def test_reuse_off_header_disables_and_sends_no_handle(cluster: Cluster) -> None:
    msgs = [{"role": "user", "content": "v" * 100}]
    _, b1 = await cluster.chat(msgs, cid="off")
    msgs += [{"role": "assistant", "content": assistant_text(b1, False)}, {"role": "user", "content": "z"}]
    r2, _ = await cluster.chat(msgs, cid="off", headers={HEADER_REUSE: REUSE_OFF})
    assert _status(r2) == "disabled" and r2.headers[HEADER_REUSED_TOKENS] == "0"
    assert cluster.pair.prefill.requests[-1][KV_TRANSFER_PARAMS][KV.REMOTE_BLOCK_IDS] is None
    await cluster.router.drain_background()
    assert cluster.pair.decode.stats["release_calls"] == 1  # the unused turn-1 lease was given back
    # the handle of turn 2 was still captured: turn 3 hits
    msgs += [{"role": "assistant", "content": "whatever"}, {"role": "user", "content": "z"}]
    r3, _ = await cluster.chat(msgs, cid="off")
    assert _status(r3) == "hit"


async def test_edited_history_is_mismatch_in_kvlease_mode(cluster: Cluster) -> None:
    msgs = [{"role": "user", "content": "u" * 100}]
    _, b1 = await cluster.chat(msgs, cid="edit")
    answer = {"role": "assistant", "content": assistant_text(b1, False)}
    # an edit late in the history: only the verified prefix of whole blocks is reused
    late = [{"role": "user", "content": "u" * 60 + "U" + "u" * 39}, answer, {"role": "user", "content": "z"}]
    r2, _ = await cluster.chat(late, cid="edit")
    assert _status(r2) == "hit" and 0 < int(r2.headers[HEADER_REUSED_TOKENS]) <= 80
    # a history that differs from the first block on: P reuses nothing
    _, b3 = await cluster.chat(late, cid="edit2")
    rewritten = [
        {"role": "system", "content": "new"},
        *late,
        {"role": "assistant", "content": assistant_text(b3, False)},
    ]
    r4, _ = await cluster.chat([*rewritten, {"role": "user", "content": "z"}], cid="edit2")
    assert _status(r4) == "mismatch" and r4.headers[HEADER_REUSED_TOKENS] == "0"


async def test_expired_lease(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster(FakeConfig(ttl=5.5), ttl_margin=5.0)  # router TTL 0.5 s
    msgs = [{"role": "user", "content": "t" * 100}]
    _, b1 = await cluster.chat(msgs, cid="exp")
    import asyncio

    await asyncio.sleep(0.7)
    msgs += [{"role": "assistant", "content": assistant_text(b1, False)}, {"role": "user", "content": "z"}]
    r2, _ = await cluster.chat(msgs, cid="exp")
    assert _status(r2) == "expired"
    assert cluster.pair.prefill.requests[-1][KV_TRANSFER_PARAMS][KV.REMOTE_BLOCK_IDS] is None


async def test_stream_without_plugin_misses_next_turn(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster(FakeConfig(plugin=False))
    (r1, _), (r2, _) = await _two_turns(cluster, stream=True)
    assert (_status(r1), _status(r2)) == ("first", "miss")


async def test_d_handle_gone_reports_miss(cluster: Cluster) -> None:
    msgs = [{"role": "user", "content": "s" * 100}]
    _, b1 = await cluster.chat(msgs, cid="gone")
    cluster.pair.decode.retained.clear()  # D evicted the blocks behind the router's back
    msgs += [{"role": "assistant", "content": assistant_text(b1, False)}, {"role": "user", "content": "z"}]
    r2, _ = await cluster.chat(msgs, cid="gone")
    assert r2.status == 200 and _status(r2) == "miss"


async def test_prefill_error_with_handle_retries_without_it(cluster: Cluster) -> None:
    msgs = [{"role": "user", "content": "r" * 100}]
    _, b1 = await cluster.chat(msgs, cid="retry")
    cluster.pair.config.fail_with_handle = 1
    msgs += [{"role": "assistant", "content": assistant_text(b1, False)}, {"role": "user", "content": "z"}]
    r2, b2 = await cluster.chat(msgs, cid="retry")
    assert r2.status == 200 and _status(r2) == "error"
    assert b2["choices"][0]["message"]["content"]
    assert cluster.pair.prefill.requests[-1][KV_TRANSFER_PARAMS][KV.REMOTE_BLOCK_IDS] is None


async def test_upstream_4xx_passed_through_with_body(cluster: Cluster) -> None:
    cluster.pair.config.fail_next = 1
    cluster.pair.config.fail_status = 422
    r, body = await cluster.chat([{"role": "user", "content": "q"}], cid="e4")
    assert r.status == 422 and body["message"] == "injected failure"


async def test_completions_endpoint_streaming_and_not(cluster: Cluster) -> None:
    for stream in (False, True):
        prompt = "Once upon a time " * 10
        url = cluster.url + "/v1/completions"
        async with cluster.client.post(
            url,
            json={"model": "m", "prompt": prompt, "stream": stream},
            headers={"X-Conversation-Id": f"cmp{stream}"},
        ) as r1:
            raw1 = await r1.read()
        assert r1.status == 200 and r1.headers[HEADER_STATUS] == "first"
        assert b"kv_transfer_params" not in raw1
        text = (
            __import__("orjson").loads(raw1)["choices"][0]["text"]
            if not stream
            else "".join(
                __import__("orjson").loads(line[6:])["choices"][0]["text"]
                for line in raw1.split(b"\n\n")
                if line.startswith(b"data: {")
            )
        )
        async with cluster.client.post(
            url,
            json={"model": "m", "prompt": prompt + text + " more", "stream": stream},
            headers={"X-Conversation-Id": f"cmp{stream}"},
        ) as r2:
            await r2.read()
        assert r2.headers[HEADER_STATUS] == "hit"


async def test_all_misses_over_the_window_log_a_warning(
    make_cluster: ClusterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = await make_cluster(FakeConfig(plugin=False), miss_window_min_turns=4, miss_window_s=60.0)
    msgs = [{"role": "user", "content": "m " * 40}]
    with caplog.at_level("WARNING", logger="kvlease.router"):
        for _ in range(5):
            _r, b = await cluster.chat(msgs, cid="always-miss", stream=True)
            msgs += [
                {"role": "assistant", "content": assistant_text(b, True)},
                {"role": "user", "content": "z"},
            ]
    warnings = [rec.getMessage() for rec in caplog.records if "missed KV reuse" in rec.getMessage()]
    assert len(warnings) == 1 and "kvlease plugin" in warnings[0]
    assert "always-miss" not in caplog.text  # logs never carry raw conversation ids
