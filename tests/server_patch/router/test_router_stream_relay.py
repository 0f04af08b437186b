"""The stream relay's ordering and framing: what the client gets, and when, relative to the store."""

from __future__ import annotations

import asyncio
import gzip
import os
import socket
import sys
import time
from typing import Any

import orjson
import pytest
from _router_cluster import Cluster, ClusterFactory, assistant_text, one_route_upstream, parse_body
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlease.protocol import HEADER_STATUS, KV_TRANSFER_PARAMS, ReuseStatus
from kvlease_router import ConversationRecord, MemoryStore
from kvlease_router._relay import rewrite_events as _rewrite_events
from kvlease_router._reuse import NEEDLE, strip_params

CHAT = "/v1/chat/completions"


class GatedStore(MemoryStore):
    """A memory store whose puts wait on a gate once it is closed; ``local`` says whether the
    router may treat it as answering without I/O."""

    def __init__(self, local: bool) -> None:
        super().__init__(1000)
        self.local = local
        self.closed = False
        self.gate = asyncio.Event()
        self.waiting = 0

    async def put(self, key: str, state: ConversationRecord, keep_for: float) -> None:
        if self.closed:
            self.waiting += 1
            await self.gate.wait()
        await super().put(key, state, keep_for)


async def _read_for(resp: Any, seconds: float) -> bytes:
    """What arrives on ``resp`` within ``seconds`` (less if the body ends)."""
    got = b""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            chunk = await asyncio.wait_for(resp.content.readany(), left)
        except asyncio.TimeoutError:
            break
        if not chunk:
            break
        got += chunk
    return got


@pytest.mark.parametrize("local", [True, False], ids=["local-store", "remote-store"])
async def test_done_reaches_the_client_only_after_the_new_handle_is_stored(
    make_cluster: ClusterFactory, local: bool
) -> None:
    store = GatedStore(local)
    cluster = await make_cluster(store=store)
    assert cluster.router.store_is_local is local
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "gated turn " * 30}]
    r1, events1 = await cluster.chat(msgs, cid="gate", stream=True)
    assert r1.status == 200
    msgs += [
        {"role": "assistant", "content": assistant_text(events1, True)},
        {"role": "user", "content": "next"},
    ]
    store.closed = True
    payload = {"model": "fake-model", "messages": msgs, "stream": True}
    early = b""

    async def turn2() -> tuple[Any, bytes]:
        nonlocal early
        async with cluster.client.post(
            cluster.url + CHAT, json=payload, headers={"X-Conversation-Id": "gate"}
        ) as resp:
            while b'"finish_reason":"length"' not in early:
                chunk = await resp.content.readany()
                if not chunk:
                    break
                early += chunk
            return resp, early + await resp.content.read()

    async def until(cond: Any) -> None:
        deadline = time.monotonic() + 10
        while not cond() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    task = asyncio.get_running_loop().create_task(turn2())
    await until(lambda: store.waiting)
    assert store.waiting == 1  # the router is storing D's new handle
    if not local:  # a store put is a round trip: the events went ahead of it
        await until(lambda: b'"finish_reason":"length"' in early)
        assert b'"finish_reason":"length"' in early, early
    await asyncio.sleep(0.1)
    assert b"[DONE]" not in early and not task.done()
    store.gate.set()
    resp, raw = await asyncio.wait_for(task, 10)
    assert resp.status == 200 and resp.headers[HEADER_STATUS] == ReuseStatus.HIT.value
    assert raw.endswith(b"data: [DONE]\n\n")
    assert KV_TRANSFER_PARAMS.encode() not in raw
    events2 = parse_body(raw, True)
    assert assistant_text(events2, True)
    store.closed = False
    msgs += [
        {"role": "assistant", "content": assistant_text(events2, True)},
        {"role": "user", "content": "3"},
    ]
    r3, _ = await cluster.chat(msgs, cid="gate", stream=True)
    assert r3.headers[HEADER_STATUS] == ReuseStatus.HIT.value  # turn 2's handle was stored


async def test_stream_relay_keeps_every_event_in_order(make_cluster: ClusterFactory) -> None:
    """Whether D's events arrive in one read or one by one, the client gets them all, once, in
    order, then [DONE]."""
    from kvlease_stack.testing import FakeConfig

    for delay in (0.0, 0.002):
        cluster = await make_cluster(FakeConfig(token_delay=delay, default_max_tokens=12))
        msgs = [{"role": "user", "content": "ordered " * 20}]
        payload = {
            "model": "fake-model",
            "messages": msgs,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with cluster.client.post(cluster.url + CHAT, json=payload) as resp:
            raw = await resp.read()
        events = parse_body(raw, True)
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        chunks = [e for e in events[:-1] if e["choices"]]
        assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
        assert len(chunks) == 13 and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "usage" in events[-2]  # the usage event comes after the last token, before [DONE]
        assert KV_TRANSFER_PARAMS.encode() not in raw


# ---- _rewrite_events: only the lines that carry the handle are parsed, with the old semantics ----


def _rewrite_reference(block: bytes) -> tuple[bytes, Any]:
    """The straightforward form: split into lines, rewrite or drop the ones with the needle, join."""
    found: Any = None
    out = []
    for line in block.split(b"\n"):
        if NEEDLE in line:
            if not line.startswith(b"data:"):
                continue
            try:
                obj = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                continue
            got = strip_params(obj)
            if got is not None:
                found = got
            line = b"data: " + orjson.dumps(obj)
        out.append(line)
    return b"\n".join(out), found


_KV = {"remote_block_ids": [1, 2], "remote_engine_id": "e"}
_LINES = [
    b"data: " + orjson.dumps({"choices": [{"delta": {"content": "a"}}]}),
    b"data: " + orjson.dumps({"choices": [], KV_TRANSFER_PARAMS: _KV}),
    b"data: " + orjson.dumps({"choices": [{"delta": {KV_TRANSFER_PARAMS: {"x": 1}}}]}),
    b"data: " + orjson.dumps({KV_TRANSFER_PARAMS: None}),
    b"data: {not json " + NEEDLE + b"}",
    b"event: " + NEEDLE,
    b": comment " + NEEDLE,
    b"data:" + orjson.dumps([{KV_TRANSFER_PARAMS: 3}]),
    b"data: [DONE]",
    b"",
    b"id: 7",
]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(_LINES), max_size=12), st.booleans())
def test_rewrite_events_matches_the_line_by_line_form(lines: list[bytes], trailing_newline: bool) -> None:
    block = b"\n".join(lines) + (b"\n" if trailing_newline else b"")
    got, found = _rewrite_events(block)
    want, want_found = _rewrite_reference(block)
    assert got == want and found == want_found
    assert NEEDLE not in got


# ---- content coding: the router scans upstream bytes for handles, so it asks for them plain ----


async def test_upstream_requests_ask_for_uncompressed_answers(cluster: Cluster) -> None:
    r, _ = await cluster.chat([{"role": "user", "content": "plain please " * 10}], cid="enc", stream=True)
    assert r.status == 200
    for node in (cluster.pair.prefill, cluster.pair.decode):
        assert node.headers[-1]["Accept-Encoding"] == "identity"


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("stream", [True, False])
async def test_a_compressed_upstream_answer_is_a_502_not_a_leak(
    make_cluster: ClusterFactory, role: str, stream: bool
) -> None:
    """An upstream that compresses anyway: the handle inside could be neither found nor stripped."""
    cluster = await make_cluster()
    kv = {"remote_block_ids": [1], "remote_engine_id": "secret-engine", "remote_request_id": "r"}

    async def gzipping(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        if body.get("stream"):
            event = {"choices": [{"index": 0, "delta": {"content": "hi"}}], KV_TRANSFER_PARAMS: kv}
            payload = b"data: " + orjson.dumps(event) + b"\n\ndata: [DONE]\n\n"
            content_type = "text/event-stream"
        else:
            payload = orjson.dumps({"choices": [{"message": {"content": "hi"}}], KV_TRANSFER_PARAMS: kv})
            content_type = "application/json"
        return web.Response(
            body=gzip.compress(payload), headers={"Content-Encoding": "gzip", "Content-Type": content_type}
        )

    async with one_route_upstream(CHAT, gzipping) as url:
        pool = cluster.router.upstreams.prefill if role == "prefill" else cluster.router.upstreams.decode
        pool.nodes[0].url = url
        payload = {"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "stream": stream}
        async with cluster.client.post(
            cluster.url + CHAT, json=payload, headers={"X-Conversation-Id": "gz"}, auto_decompress=False
        ) as resp:
            raw = await resp.read()
        assert resp.status == 502, raw[:300]
        assert "Content-Encoding" not in resp.headers
        for body in (raw, gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw):
            assert NEEDLE not in body and b"secret-engine" not in body


# ---- Nagle: every socket the router writes small events or requests on has TCP_NODELAY ----------


def _tcp_sockets() -> list[tuple[tuple[str, int], tuple[str, int], int]]:
    """(local, peer, TCP_NODELAY) of this process's connected TCP sockets (Linux)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        with s:
            if s.family != socket.AF_INET or s.type != socket.SOCK_STREAM:
                continue
            try:
                peer = s.getpeername()
            except OSError:
                continue  # a listening socket
            out.append((s.getsockname(), peer, s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)))
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")
async def test_router_sockets_have_nodelay_both_ways(cluster: Cluster) -> None:
    msgs = [{"role": "user", "content": "nagle " * 20}]
    async with cluster.client.post(
        cluster.url + CHAT, json={"model": "m", "messages": msgs, "stream": True}
    ) as resp:  # held open while the sockets are inspected
        await resp.content.readany()
        router_port = int(cluster.url.rsplit(":", 1)[1])
        upstream_ports = {int(n.url.rsplit(":", 1)[1]) for n in (cluster.pair.prefill, cluster.pair.decode)}
        socks = _tcp_sockets()
        await resp.read()
    downstream = [s for s in socks if s[0][1] == router_port]
    upstream = [s for s in socks if s[1][1] in upstream_ports]
    assert downstream and upstream, socks
    assert all(nodelay for *_, nodelay in downstream + upstream), socks
