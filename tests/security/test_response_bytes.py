"""No block handle ever reaches a client: not in JSON, not in any SSE chunk, not in error bodies, not
in headers, whatever the decode node sends back.

A misbehaving decode server (a stand-in for vLLM answering oddly) echoes the handle it received in
every place it can: nested objects, every stream chunk, comment lines, error messages, headers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import web

from kvlease.protocol import (
    COMPLETIONS_PATH,
    HEADER_CONVERSATION_ID,
    KV_TRANSFER_PARAMS,
    ErrorBody,
)
from security._cluster import Cluster, reply_text, running_cluster

NEEDLE = KV_TRANSFER_PARAMS.encode()


def _forbidden(cluster: Cluster) -> list[bytes]:
    """Strings only a handle contains: engine ids, handle field names, D's block hashes and MACs."""
    out = [NEEDLE, b"remote_block_ids", b"remote_engine_id", b"remote_host", b'"hashes"']
    out += [n.engine_id.encode() for n in (cluster.pair.prefill, *cluster.pair.decodes)]
    for _role, body in cluster.received():
        kv = body.get(KV_TRANSFER_PARAMS)
        ext = kv.get("kvlease") if isinstance(kv, dict) else None
        if isinstance(ext, dict):
            out += [h.encode() for h in ext.get("hashes", [])[:8]]
    return out


def assert_clean(cluster: Cluster, headers: Any, raw: bytes) -> None:
    for needle in _forbidden(cluster):
        assert needle not in raw, (needle, raw[:500])
        for name, value in headers.items():
            assert needle.decode() not in name and needle.decode() not in value, (name, value)


async def test_every_path_of_the_real_fake_pair(cluster: Cluster) -> None:
    """JSON and SSE, chat and completions, with and without usage chunks, over several turns."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "bytes " * 20}]
    for i, stream in enumerate((False, True, True, False, True)):
        extra = {"stream_options": {"include_usage": True}} if stream and i % 2 else {}
        r, raw = await cluster.chat(msgs, cid="bytes", stream=stream, **extra)
        assert r.status == 200
        assert_clean(cluster, r.headers, raw)
        msgs += [{"role": "assistant", "content": reply_text(raw, stream)}, {"role": "user", "content": "go"}]
    for stream in (False, True):
        body = {"model": "m", "prompt": "complete " * 20, "stream": stream}
        for _ in range(2):
            r, raw = await cluster.post(COMPLETIONS_PATH, body, {HEADER_CONVERSATION_ID: f"c{int(stream)}"})
            assert r.status == 200
            assert_clean(cluster, r.headers, raw)
    assert cluster.pair.decode.stats["reads_ok"] >= 5  # handles were captured and used, not lost


# ---- a decode server that leaks the handle everywhere ------------------------------------------


def _echo_app() -> web.Application:
    async def handler(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        kv = body.get(KV_TRANSFER_PARAMS)
        mode = str(body.get("model"))
        leak_header = {"X-Debug-Params": orjson.dumps(kv).decode()[:200]}
        if mode == "error-json":  # vLLM-style validation error echoing the input
            err = {
                "object": "error",
                "message": f"1 validation error: input_value={{'{KV_TRANSFER_PARAMS}': {kv!r}}}",
                "type": "BadRequestError",
                "param": KV_TRANSFER_PARAMS,
                "code": 400,
                "detail": [{"input": {KV_TRANSFER_PARAMS: kv}, "loc": ["body", KV_TRANSFER_PARAMS]}],
            }
            return web.Response(
                status=400, body=orjson.dumps(err), headers=leak_header, content_type="application/json"
            )
        if mode == "error-text":
            return web.Response(status=422, text=f"bad {KV_TRANSFER_PARAMS}={kv!r}", headers=leak_header)
        if mode == "json-nested":
            out = {
                "id": "x",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "hi", KV_TRANSFER_PARAMS: kv},
                        "finish_reason": "stop",
                        "extra": [{KV_TRANSFER_PARAMS: kv}],
                    }
                ],
                KV_TRANSFER_PARAMS: kv,
            }
            return web.Response(body=orjson.dumps(out), headers=leak_header, content_type="application/json")
        if mode == "json-garbage":  # not JSON, but carries the handle
            return web.Response(
                body=b"<html>" + orjson.dumps({KV_TRANSFER_PARAMS: kv}), content_type="application/json"
            )
        # SSE: the handle in every chunk, in a comment line, in an event: line; tiny writes; maybe cut
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **leak_header})
        await resp.prepare(request)
        events = [
            b": comment " + orjson.dumps({KV_TRANSFER_PARAMS: kv}) + b"\n\n",
            b"event: "
            + NEEDLE
            + b"\ndata: "
            + orjson.dumps({"choices": [{"index": 0, "delta": {"content": "a"}}], KV_TRANSFER_PARAMS: kv})
            + b"\n\n",
            b"data: "
            + orjson.dumps({"choices": [{"index": 0, "delta": {"content": "b", KV_TRANSFER_PARAMS: kv}}]})
            + b"\n\n",
            b"data: " + orjson.dumps({"choices": [], "usage": {KV_TRANSFER_PARAMS: kv}}) + b"\n\n",
            b"data: {not json " + NEEDLE + b"}\n\n",
        ]
        payload = b"".join(events)
        if mode == "sse-cut":  # the stream breaks inside an event that carries the handle
            payload += b"data: " + orjson.dumps({KV_TRANSFER_PARAMS: kv})[:40]
        else:
            payload += b"data: [DONE]\n\n"
        for i in range(0, len(payload), 11):
            await resp.write(payload[i : i + 11])
            await asyncio.sleep(0)
        if mode == "sse-cut":
            assert request.transport is not None
            request.transport.close()
            return resp
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    app.router.add_post(COMPLETIONS_PATH, handler)
    return app


@pytest.fixture
async def leaky_cluster() -> AsyncIterator[Cluster]:
    runner = web.AppRunner(_echo_app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with running_cluster(decode_url=f"http://127.0.0.1:{port}") as c:
            yield c
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    "mode", ["error-json", "error-text", "json-nested", "json-garbage", "sse", "sse-cut"]
)
@pytest.mark.parametrize("with_id", [True, False], ids=["id", "no-id"])
async def test_a_leaky_decode_server_never_leaks_through(
    leaky_cluster: Cluster, mode: str, with_id: bool
) -> None:
    stream = mode.startswith("sse")
    for turn in range(2):
        r, raw = await leaky_cluster.chat(
            [{"role": "user", "content": f"leak {turn} " * 10}],
            cid="leaky" if with_id else None,
            stream=stream,
            model=mode,
        )
        if mode == "json-garbage":  # a broken D is a 502 in the OpenAI error shape (issue 15)
            assert r.status == 502 and ErrorBody.from_json(orjson.loads(raw)), (r.status, raw[:300])
        else:
            assert r.status < 500, (r.status, raw[:300])
        if mode.startswith("error"):  # the status passes through, with a message
            assert r.status in (400, 422) and b"message" in raw, raw[:300]
        assert_clean(leaky_cluster, r.headers, raw)
