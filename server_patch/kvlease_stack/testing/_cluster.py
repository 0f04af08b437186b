"""What the router tests share: the router's settings for a fake pair (or for placeholder nodes), a
node's ``/info``, serving an app on a free 127.0.0.1 port, a chat request and reading its answer."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from kvlease.protocol import HEADER_CONVERSATION_ID, SSE_DONE_DATA, ControlInfo, Role
from kvlease_router import NodeSpec, RouterSettings

if TYPE_CHECKING:
    from kvlease_stack.testing.fake_vllm import FakePair

__all__ = [
    "chat_request",
    "control_info",
    "pair_settings",
    "parse_sse",
    "placeholder_settings",
    "reply_text",
    "serve",
]


def pair_settings(
    pair: FakePair,
    *,
    control_secret: str | None,
    decode_url: Callable[[str], str] | None = None,
    **settings: Any,
) -> RouterSettings:
    """The router in front of ``pair``: its nodes, with control URLs and the secret only in kvlease
    mode. ``decode_url`` maps each fake D's URL to the one the router is given (e.g. a proxy's)."""
    kvlease = pair.config.kvlease
    return RouterSettings(
        prefill=(NodeSpec(pair.prefill.url, pair.prefill.control if kvlease else None),),
        decode=tuple(
            NodeSpec(decode_url(d.url) if decode_url else d.url, d.control if kvlease else None)
            for d in pair.decodes
        ),
        control_secret=control_secret if kvlease else None,
        **settings,
    )


def placeholder_settings(**settings: Any) -> RouterSettings:
    """One P and one D at placeholder URLs (nothing is contacted), control secret ``"s"``."""
    return RouterSettings(
        prefill=(NodeSpec("http://p", "http://pc"),),
        decode=(NodeSpec("http://d", "http://dc"),),
        control_secret="s",
        **settings,
    )


def control_info(role: Role, **fields: Any) -> ControlInfo:
    """A connector's ``/info`` (vLLM 0.32, kvlease 0.1, model ``m``); ``fields`` override."""
    base: dict[str, Any] = {
        "engine_id": "e",
        "vllm_version": "0.32.0",
        "kvlease_version": "0.1.0",
        "bidirectional_kv_xfer": True,
        "ttl_s": 120.0,
        "recompute_threshold": 64,
        "block_size": 16,
        "model": "m",
        **fields,
    }
    return ControlInfo(role=role, **base)


async def serve(app: web.Application, **runner_kw: Any) -> tuple[web.AppRunner, str]:
    """``app`` on a free port of 127.0.0.1: its runner (``cleanup()`` it) and ``http://127.0.0.1:PORT``."""
    runner = web.AppRunner(app, **runner_kw)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def chat_request(
    messages: list[dict[str, Any]],
    *,
    cid: str | None = None,
    stream: bool = False,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> tuple[dict[str, str], dict[str, Any]]:
    """The headers (``cid`` as the conversation id) and body of one chat turn to the fake model."""
    h = dict(headers or {})
    if cid is not None:
        h[HEADER_CONVERSATION_ID] = cid
    return h, {"model": "fake-model", "messages": messages, "stream": stream, **extra}


def parse_sse(raw: bytes) -> list[Any]:
    """The payloads of an SSE body (:data:`~kvlease.protocol.SSE_DONE_DATA` for the terminator)."""
    out: list[Any] = []
    for block in raw.split(b"\n\n"):
        if not block.strip():
            continue
        assert block.startswith(b"data: "), block[:200]
        data = block[6:]
        out.append(SSE_DONE_DATA if data == SSE_DONE_DATA.encode() else orjson.loads(data))
    return out


def reply_text(result: Any, stream: bool) -> str:
    """The assistant's text of a parsed answer: the JSON body, or the SSE payloads if ``stream``."""
    if not stream:
        return str(result["choices"][0]["message"]["content"])
    return "".join(
        e["choices"][0]["delta"].get("content") or ""
        for e in result
        if e != SSE_DONE_DATA and e.get("choices")
    )
