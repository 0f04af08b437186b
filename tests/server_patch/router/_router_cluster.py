"""The router tests' cluster: a fake vLLM P/D pair (real HTTP on 127.0.0.1) with the real router in
front of it, and helpers (a module of its own: ``conftest`` is a name several test folders use)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from kvlease_router import (
    ROUTER_KEY,
    RouterSettings,
)
from kvlease_router._runtime import RouterRuntime
from kvlease_stack.testing import FakePair, chat_request, parse_sse, reply_text, serve

SECRET = "fake-secret"


@dataclass
class Cluster:
    pair: FakePair
    url: str
    app: web.Application
    runner: web.AppRunner
    client: aiohttp.ClientSession
    settings: RouterSettings
    extra: list[Any] = field(default_factory=list)

    @property
    def router(self) -> RouterRuntime:
        return self.app[ROUTER_KEY]

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        cid: str | None = None,
        stream: bool = False,
        headers: dict[str, str] | None = None,
        **body: Any,
    ) -> tuple[aiohttp.ClientResponse, Any]:
        """One chat turn; returns (response, parsed JSON | list of SSE payload dicts)."""
        h, payload = chat_request(messages, cid=cid, stream=stream, headers=headers, **body)
        async with self.client.post(self.url + "/v1/chat/completions", json=payload, headers=h) as resp:
            raw = await resp.read()
        return resp, parse_body(raw, stream and resp.status == 200)

    async def stop(self) -> None:
        await self.client.close()
        await self.runner.cleanup()
        await self.pair.__aexit__(None, None, None)


def parse_body(raw: bytes, sse: bool) -> Any:
    if sse:
        return parse_sse(raw)
    return orjson.loads(raw) if raw else None


assistant_text = reply_text  # (parsed JSON | SSE payloads, stream) -> the assistant's text


ClusterFactory = Callable[..., Awaitable[Cluster]]


@contextlib.asynccontextmanager
async def one_route_upstream(
    path: str, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> AsyncIterator[str]:
    """A stand-in upstream on 127.0.0.1 answering POST ``path`` with ``handler``; yields its URL."""
    app = web.Application()
    app.router.add_post(path, handler)
    runner, url = await serve(app)
    try:
        yield url
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def guarded_site(
    config: Any = None, **settings: Any
) -> AsyncIterator[tuple[int, FakePair, web.Application]]:
    """The router behind its guarded server (``start_site``: real sockets, header, body and idle
    timeouts) in front of a fake pair (``config``: a ``FakeConfig``, default: no token delay, 4
    tokens), with ``settings`` over short test defaults; yields (port, pair, app)."""
    from kvlease_router import MemoryStore, NodeSpec, create_app
    from kvlease_router._guard import start_site, stop_site
    from kvlease_stack.testing import FakeConfig

    pair = await FakePair(config or FakeConfig(token_delay=0.0, default_max_tokens=4)).__aenter__()
    try:
        s = RouterSettings(
            prefill=(NodeSpec(pair.prefill.url, pair.prefill.control),),
            decode=(NodeSpec(pair.decode.url, pair.decode.control),),
            **{
                "control_secret": SECRET,
                "key_secret": "k",
                "startup_timeout": 5.0,
                "health_interval": 3600.0,
                **settings,
            },
        )
        app = create_app(s, MemoryStore(100))
        runner, server = await start_site(app, s, "127.0.0.1", 0)
        try:
            yield server.sockets[0].getsockname()[1], pair, app
        finally:
            await stop_site(runner, server)
    finally:
        await pair.__aexit__(None, None, None)


async def closed_within(reader: Any, seconds: float) -> bool:
    """Whether the server closes the connection of ``reader`` (an ``asyncio.StreamReader``) within
    ``seconds`` (what it sends meanwhile is read and dropped)."""
    try:
        async with asyncio.timeout(seconds):
            while await reader.read(65536):
                pass
        return True
    except (TimeoutError, ConnectionError):
        return False


async def trickle_head(reader: Any, writer: Any, lines: int) -> None:
    """Send a request head one header line every 0.1 s (``lines`` of them, never its end), until
    the server closes the connection."""
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    for i in range(lines):
        if writer.is_closing() or reader.at_eof():
            return
        try:
            writer.write(b"X-A%d: b\r\n" % i)
            await writer.drain()
        except ConnectionError:
            return
        await asyncio.sleep(0.1)
