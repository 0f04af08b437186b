"""The router tests' cluster: a fake vLLM P/D pair (real HTTP on 127.0.0.1) with the real router in
front of it, and helpers (a module of its own: ``conftest`` is a name several test folders use)."""

from __future__ import annotations

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
