"""The real router in front of the fake P/D pair, on 127.0.0.1 in a background thread (sync tests).

    with RouterOnFakePair(FakeConfig(ttl=8.0), ttl_margin=5.0) as stack:   # router TTL 3 s
        client = OpenAI(base_url=stack.base_url, api_key="k")
        stack.script(Reply(content="hi", reasoning="think"))                 # what D answers next
        ...
        stack.requests_to(RENEW_PATH)                                        # what the router got

Everything is real but vLLM: ``kvlease_router.create_app`` (memory store) over
:class:`~kvlease_stack.testing.FakePair`. Every request the router receives is recorded (method,
path, lower-cased headers, parsed JSON body) by a middleware at its edge, before the router runs.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any

import orjson
from aiohttp import web

from kvlease.protocol import CHAT_COMPLETIONS_PATH, CONVERSATIONS_PATH, RENEW_PATH
from kvlease_router import MemoryStore, create_app
from kvlease_stack.testing._cluster import pair_settings, serve
from kvlease_stack.testing._record import Recorded
from kvlease_stack.testing._replies import Reply
from kvlease_stack.testing.fake_vllm import FakeConfig, FakePair

__all__ = ["Recorded", "RouterOnFakePair"]


class RouterOnFakePair:
    """See the module docstring. ``router_settings`` are passed to :class:`RouterSettings`."""

    def __init__(
        self, config: FakeConfig | None = None, *, n_decode: int = 1, **router_settings: Any
    ) -> None:
        self.config = config or FakeConfig()
        self.pair = FakePair(self.config, n_decode)
        self._settings = router_settings
        self.requests: list[Recorded] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="router-on-fake-pair", daemon=True
        )
        self._runner: web.AppRunner | None = None
        self.url = ""

    # ---- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> RouterOnFakePair:
        self._thread.start()
        try:
            self._call(self._start())
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread.is_alive():
            self._call(self._stop())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        self._loop.close()

    def _call(self, coro: Awaitable[Any]) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        return fut.result(timeout=60)

    async def _start(self) -> None:
        pair = await self.pair.__aenter__()
        settings = pair_settings(
            pair,
            control_secret=self.config.control_secret or None,
            **{"health_interval": 0.2, "unhealthy_for": 0.5, "startup_timeout": 10.0, **self._settings},
        )
        app = create_app(settings, MemoryStore(10_000))
        app.middlewares.insert(0, self._record)
        self._runner, self.url = await serve(app, access_log=None, handle_signals=False, shutdown_timeout=0.5)

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.pair.__aexit__(None, None, None)

    @web.middleware
    async def _record(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        raw = await request.read()  # aiohttp keeps it: the router reads the same bytes
        try:
            body = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            body = None
        headers = {k.lower(): v for k, v in request.headers.items()}
        with self._lock:
            self.requests.append(Recorded(request.method, request.path_qs, headers, body, raw))
        return await handler(request)

    # ---- use and inspection --------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def script(self, *replies: Reply) -> None:
        """What the decode node answers next, in order (each decode node, if there are several)."""
        for d in self.pair.decodes:
            d.script(*replies)

    def requests_to(self, path: str, method: str | None = None) -> list[Recorded]:
        with self._lock:
            return [r for r in self.requests if r.path == path and (method is None or r.method == method)]

    def chat_requests(self) -> list[Recorded]:
        return self.requests_to(CHAT_COMPLETIONS_PATH)

    def renew_requests(self) -> list[Recorded]:
        return self.requests_to(RENEW_PATH)

    @property
    def released(self) -> list[str]:
        """Conversation ids the router was asked to release, in order."""
        prefix = CONVERSATIONS_PATH + "/"
        with self._lock:
            return [
                r.path[len(prefix) :]
                for r in self.requests
                if r.method == "DELETE" and r.path.startswith(prefix)
            ]
