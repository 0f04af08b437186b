"""The real router over real HTTP on 127.0.0.1 in front of the fake vLLM P/D pair, for hostile tests.

Shared by ``tests/security`` and ``tests/fuzz`` (the router's own fixtures live in its test folder;
this is the same construction, kept small).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from kvlease.protocol import CHAT_COMPLETIONS_PATH
from kvlease_router import ROUTER_KEY, MemoryStore, create_app
from kvlease_router._runtime import RouterRuntime
from kvlease_stack.testing import FakeConfig, FakePair, chat_request, pair_settings, parse_sse, serve
from kvlease_stack.testing import reply_text as parsed_reply_text

__all__ = ["Cluster", "ErrorLog", "Listener", "parse_sse", "reply_text", "router_errors", "running_cluster"]

SECRET = "fake-secret"


@dataclass
class Cluster:
    pair: FakePair
    url: str
    app: web.Application
    client: aiohttp.ClientSession

    @property
    def router(self) -> RouterRuntime:
        return self.app[ROUTER_KEY]

    def received(self) -> list[tuple[str, dict[str, Any]]]:
        """Every request body the fake vLLM nodes got: (role, body)."""
        out = [("prefill", b) for b in self.pair.prefill.requests]
        for d in self.pair.decodes:
            out += [("decode", b) for b in d.requests]
        return out

    async def post(
        self, path: str, body: Any, headers: dict[str, str] | None = None
    ) -> tuple[aiohttp.ClientResponse, bytes]:
        data = body if isinstance(body, bytes) else orjson.dumps(body)
        h = {"Content-Type": "application/json", **(headers or {})}
        async with self.client.post(self.url + path, data=data, headers=h) as r:
            raw = await r.read()
        return r, raw

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        cid: str | None = None,
        stream: bool = False,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> tuple[aiohttp.ClientResponse, bytes]:
        h, body = chat_request(messages, cid=cid, stream=stream, headers=headers, **extra)
        return await self.post(CHAT_COMPLETIONS_PATH, body, h)


def reply_text(raw: bytes, stream: bool) -> str:
    """The assistant's text of a raw answer body (SSE if ``stream``)."""
    return parsed_reply_text(parse_sse(raw) if stream else orjson.loads(raw), stream)


@asynccontextmanager
async def running_cluster(
    config: FakeConfig | None = None, *, decode_url: str | None = None, **overrides: Any
) -> AsyncIterator[Cluster]:
    """A fake P/D pair and the router (in-memory store) serving on free ports; all stopped after.

    ``decode_url`` sends decodes to another server (e.g. a misbehaving one) while the router still
    validates and controls leases through the fake decode node's control endpoint.
    """
    pair = FakePair(config or FakeConfig(control_secret=SECRET))
    await pair.__aenter__()
    runner: web.AppRunner | None = None
    client: aiohttp.ClientSession | None = None
    try:
        settings = pair_settings(
            pair,
            control_secret=pair.config.control_secret,
            decode_url=(lambda _: decode_url) if decode_url else None,
            **{
                "key_secret": "security-test-key-secret",
                "health_interval": 0.5,
                "unhealthy_for": 0.5,
                "startup_timeout": 10.0,
                **overrides,
            },
        )
        app = create_app(settings, MemoryStore(10_000))
        runner, url = await serve(app, access_log=None, handle_signals=False, shutdown_timeout=0.5)
        client = aiohttp.ClientSession()
        yield Cluster(pair, url, app, client)
    finally:
        if client is not None:
            await client.close()
        if runner is not None:
            await runner.cleanup()
        await pair.__aexit__(None, None, None)


class Listener:
    """A TCP listener on 127.0.0.1 that counts connections (the host a hostile handle points at)."""

    def __init__(self) -> None:
        self.connections = 0
        self._server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> Listener:
        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            writer.close()

        self._server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()


class ErrorLog(logging.Handler):
    """Every ERROR, and every record with a traceback, the router or aiohttp's server logs."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR or record.exc_info:
            self.records.append(record)


@contextmanager
def router_errors() -> Iterator[ErrorLog]:
    """An :class:`ErrorLog` on the router's, aiohttp's and asyncio's loggers while the block runs."""
    errors = ErrorLog()
    loggers = [logging.getLogger(n) for n in ("kvlease.router", "aiohttp.server", "aiohttp.web", "asyncio")]
    for lg in loggers:
        lg.addHandler(errors)
    try:
        yield errors
    finally:
        for lg in loggers:
            lg.removeHandler(errors)
