"""The router tests' cluster: a fake vLLM P/D pair (real HTTP on 127.0.0.1) with the real router in
front of it, and helpers (a module of its own: ``conftest`` is a name several test folders use)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvlease_router import (
    ROUTER_KEY,
    RouterSettings,
)
from kvlease_router._runtime import RouterRuntime
from kvlease_stack.testing import FakePair

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
        h = dict(headers or {})
        if cid is not None:
            h["X-Conversation-Id"] = cid
        payload = {"model": "fake-model", "messages": messages, "stream": stream, **body}
        async with self.client.post(self.url + "/v1/chat/completions", json=payload, headers=h) as resp:
            raw = await resp.read()
        return resp, parse_body(raw, stream and resp.status == 200)

    async def stop(self) -> None:
        await self.client.close()
        await self.runner.cleanup()
        await self.pair.__aexit__(None, None, None)


def parse_body(raw: bytes, sse: bool) -> Any:
    import orjson

    if not sse:
        return orjson.loads(raw) if raw else None
    events = []
    for block in raw.split(b"\n\n"):
        if not block.strip():
            continue
        assert block.startswith(b"data: "), block
        data = block[6:]
        events.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return events


def assistant_text(result: Any, stream: bool) -> str:
    if not stream:
        return str(result["choices"][0]["message"]["content"])
    return "".join(
        e["choices"][0]["delta"].get("content") or "" for e in result if e != "[DONE]" and e.get("choices")
    )


ClusterFactory = Callable[..., Awaitable[Cluster]]


@contextlib.asynccontextmanager
async def one_route_upstream(
    path: str, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> AsyncIterator[str]:
    """A stand-in upstream on 127.0.0.1 answering POST ``path`` with ``handler``; yields its URL."""
    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
