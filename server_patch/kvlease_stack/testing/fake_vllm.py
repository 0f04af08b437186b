"""A fast fake of a vLLM prefill/decode pair (OpenAI API + P/D ``kv_transfer_params``).

vLLM is outside this project; router tests and benchmarks need something that answers like it in
microseconds. The fake mimics vLLM 0.32's P/D wire behaviour with ``NixlConnector`` in
bidirectional mode, and optionally the kvlease connector and plugin:

* P (``max_tokens=1``, ``do_remote_decode``) answers JSON with ``kv_transfer_params`` for D. Given
  D's handle, it "pulls": stock mode by length, kvlease mode what the connector's real verification
  (``kvlease_vllm._verify``: MAC, salted block hashes, tail hash) accepts, and reports
  ``kvlease.reused_tokens``. A pull reads D's retained blocks once (single use) through a fake side
  channel, so expired/released/consumed handles really fail.
* D decodes (JSON or SSE like vLLM), leases the blocks of prompt + output in the connector's real
  retention table (``kvlease_vllm._retention``) for the TTL, and returns its handle (real
  ``handle_ext`` + ``handle_mac``) in the JSON body (stock bidirectional) and, with the plugin, in
  the final stream chunk.
* The kvlease control endpoint (``/info``, ``/renew``, ``/release``, ``/metrics``, bearer auth) on
  its own port, over the connector's real ``LeaseDesk``. The kvlease logic lives in
  :mod:`kvlease_stack.testing._fake_kv`; this module is the vLLM-shaped HTTP around it.

"Tokens" are the UTF-8 bytes of the ChatML-rendered prompt; replies may be scripted
(:mod:`kvlease_stack.testing._replies`).
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import orjson
from aiohttp import web

from kvlease.protocol import (
    CACHE_SALT,
    CHAT_COMPLETIONS_PATH,
    COMPLETIONS_PATH,
    CONTROL_AUTH_HEADER,
    CONTROL_INFO_PATH,
    CONTROL_METRICS_PATH,
    CONTROL_RELEASE_PATH,
    CONTROL_RENEW_PATH,
    HEALTH_PATH,
    KV,
    KV_TRANSFER_PARAMS,
    SSE_DONE,
    ControlInfo,
    ErrorBody,
    ProtocolError,
    Role,
)
from kvlease_stack.testing._fake_kv import READ_FAILED, DecodeLeases, PrefillLogic, Reuse
from kvlease_stack.testing._replies import WORDS, Reply, render_chat, tokens
from kvlease_vllm._config import KVLeaseConfig
from kvlease_vllm._metrics import CONTENT_TYPE_LATEST
from kvlease_vllm._verify import Reason

__all__ = ["FakeConfig", "FakeNode", "FakePair", "Reply", "render_chat"]

READ_PATH = "/_fake/nixl/read"
CONFIG_PATH = "/_fake/config"
STATS_PATH = "/_fake/stats"


@dataclass
class FakeConfig:
    model: str = "fake-model"
    vllm_version: str = "0.32.0"
    block_size: int = 16
    ttl: float = 120.0
    bidirectional: bool = True
    kvlease: bool = True  # the kvlease connector: hashes in handles, control endpoint, P reports
    plugin: bool = True  # kv_transfer_params in the final streaming chunk
    prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens on P
    pull_check: bool = True  # P reads D's blocks through the fake side channel (single use)
    prefill_delay: float = 0.0
    token_delay: float = 0.0
    default_max_tokens: int = 8
    fail_next: int = 0  # answer the next N chat/completion requests with fail_status
    fail_status: int = 500
    fail_with_handle: int = 0  # P: fail the next N requests that carry D's handle
    control_secret: str = "fake-secret"  # "": none (renew/release refused, handles unsigned)
    # D names its partial last block too (P may then pull it, verified by the tail hash); off, the
    # handle names whole blocks only and every pull is whole blocks
    partial_block: bool = False
    capacity_blocks: int = 1 << 20  # D's retention cap (the connector's max_retained_fraction)
    renew_guard: float = KVLeaseConfig.renew_guard_s


def _bad(msg: str, status: int = 400) -> web.Response:
    body = {"object": "error", "message": msg, "type": "BadRequestError", "param": None, "code": status}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


@dataclass(eq=False)
class FakeNode:
    role: Role
    config: FakeConfig = field(default_factory=FakeConfig)
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        self.engine_id = f"{self.role.value}-{uuid.uuid4().hex[:8]}"
        kv_cfg = KVLeaseConfig(renew_guard_s=self.config.renew_guard)
        self.verifier = PrefillLogic(kv_cfg, self._secret)
        #: D's leases (lease id -> retained tokens); ``del``/``clear()`` evict behind D's back
        self.retained = DecodeLeases(kv_cfg, self.config.capacity_blocks)
        self.requests: deque[dict[str, Any]] = deque(maxlen=256)  # bodies of the completions
        self._scripted: deque[Reply] = deque()
        self.headers: deque[dict[str, str]] = deque(maxlen=256)
        counters = (
            "requests streams streams_aborted open_streams reads_ok reads_failed renew_calls release_calls"
        )
        self.stats: dict[str, int] = dict.fromkeys(counters.split(), 0)
        self.renew_batches: list[list[str]] = []
        self.port = 0
        self.control_port = 0
        self._runners: list[web.AppRunner] = []

    # ---- addresses -----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def control(self) -> str | None:
        return f"http://{self.host}:{self.control_port}" if self.config.kvlease else None

    def script(self, *replies: Reply) -> None:
        """Answer the next generations (anything but P's prefill of a P/D request) with ``replies``."""
        self._scripted.extend(replies)

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self, port: int = 0, control_port: int = 0) -> FakeNode:
        self.port = await self._serve(self._api_app(), port)
        if self.config.kvlease:
            self.control_port = await self._serve(self._control_app(), control_port)
        return self

    async def _serve(self, app: web.Application, port: int) -> int:
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, self.host, port, backlog=2048)
        await site.start()
        self._runners.append(runner)
        return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    async def stop(self) -> None:
        for r in self._runners:
            await r.cleanup()
        self._runners.clear()

    # ---- the OpenAI side -----------------------------------------------------------------------
    def _api_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.add_routes(
            [
                web.post(CHAT_COMPLETIONS_PATH, self._completion),
                web.post(COMPLETIONS_PATH, self._completion),
                web.get("/v1/models", self._models),
                web.get("/version", self._version),
                web.get(HEALTH_PATH, self._health),
                web.post(READ_PATH, self._read),
                web.post(CONFIG_PATH, self._set_config),
                web.get(STATS_PATH, self._stats),
            ]
        )
        return app

    async def _models(self, request: web.Request) -> web.Response:
        body = {"object": "list", "data": [{"id": self.config.model, "object": "model", "owned_by": "vllm"}]}
        return web.json_response(body)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.config.vllm_version})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response({**self.stats, "retained": len(self.retained)})

    async def _set_config(self, request: web.Request) -> web.Response:
        data = await request.json()
        names = {f.name for f in fields(FakeConfig)}
        for k, v in data.items():
            if k in names:
                setattr(self.config, k, v)
        return web.json_response(asdict(self.config))

    def _secret(self) -> str | None:
        return self.config.control_secret or None

    async def _read(self, request: web.Request) -> web.Response:
        """The fake NIXL READ of retained blocks: single use, like D freeing after the first read."""
        if self.retained.read((await request.json()).get("request_id")):
            self.stats["reads_ok"] += 1
            return web.json_response({"ok": True})
        self.stats["reads_failed"] += 1
        return web.json_response({"ok": False}, status=404)

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        cfg = self.config
        self.stats["requests"] += 1
        self.headers.append(dict(request.headers))
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return _bad("invalid JSON")
        if not isinstance(body, dict):
            return _bad("body must be an object")
        self.requests.append(body)
        if cfg.fail_next > 0:
            cfg.fail_next -= 1
            return _bad("injected failure", cfg.fail_status)
        chat = request.path.endswith("/chat/completions")
        if chat:
            if not isinstance(body.get("messages"), list):
                return _bad("messages: field required")
            prompt_text = render_chat(body["messages"])
        else:
            if not isinstance(body.get("prompt"), str):
                return _bad("prompt must be a string")
            prompt_text = body["prompt"]
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or cfg.default_max_tokens
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return _bad("max_tokens must be a positive integer")
        prompt = tokens(prompt_text)
        kv = body.get(KV_TRANSFER_PARAMS)
        kv = kv if isinstance(kv, dict) else None
        salt = body.get(CACHE_SALT) if isinstance(body.get(CACHE_SALT), str) else None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        reuse: Reuse | None = None
        if kv is not None and kv.get(KV.DO_REMOTE_DECODE) and kv.get(KV.REMOTE_BLOCK_IDS):
            if cfg.fail_with_handle > 0:
                cfg.fail_with_handle -= 1
                return _bad("injected failure with a handle", 500)
            reuse = await self._pull(kv, prompt, salt)
        if cfg.prefill_delay:
            await asyncio.sleep(cfg.prefill_delay)
        prefill = kv is not None and bool(kv.get(KV.DO_REMOTE_DECODE))
        reply = self._scripted.popleft() if self._scripted and not prefill else None
        if reply is None:
            words = [WORDS[(len(prompt) + i * 7) % len(WORDS)] for i in range(max_tokens)]
            pieces: list[Any] = [(" " if i else "") + w for i, w in enumerate(words)]
            text, finish, n_out = "".join(pieces), "length", max_tokens
            message: dict[str, Any] = {"role": "assistant", "content": text, "reasoning_content": None}
            message["tool_calls"] = []
            if chat:
                pieces = [{"content": piece} for piece in pieces]
        else:
            text, finish, message = reply.text(), reply.finish, reply.message()
            n_out = max(len(tokens(text)), 1)
            pieces = (reply.deltas() or [{}]) if chat else [text]
        params = self._params_out(kv, rid, prompt, text, chat, reuse, salt)
        usage: dict[str, Any] = {"prompt_tokens": len(prompt), "completion_tokens": n_out}
        usage["total_tokens"] = len(prompt) + n_out
        if cfg.prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": reuse.tokens if reuse else 0}
        if body.get("stream") is True:
            return await self._stream(request, body, rid, chat, (pieces, finish), params, usage)
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
        }
        if chat:
            choice["message"] = message
        else:
            choice["text"] = text
        out = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model", cfg.model),
            "choices": [choice],
            "usage": usage,
            "prompt_logprobs": None,
            KV_TRANSFER_PARAMS: params,
        }
        return web.Response(body=orjson.dumps(out), content_type="application/json")

    async def _pull(self, kv: dict[str, Any], prompt: list[int], salt: str | None) -> Reuse:
        """P with D's handle: decide what to reuse, then read it from D (single use)."""
        cfg = self.config
        bs = cfg.block_size
        if cfg.kvlease:
            reuse = self.verifier.plan(dict(kv), prompt, salt, bs)  # a copy: requests logs what came
            if reuse.reason is not Reason.PULL:
                return reuse
        else:  # stock vLLM: by length, unverified; at least one token is always computed
            num = kv.get(KV.REMOTE_NUM_TOKENS)
            n = min((num if isinstance(num, int) else 0) // bs, max(len(prompt) - 1, 0) // bs)
            reuse = Reuse(n * bs, Reason.PULL)
        if cfg.pull_check:
            import aiohttp

            url = f"http://{kv.get(KV.REMOTE_HOST)}:{kv.get(KV.REMOTE_PORT)}{READ_PATH}"
            try:
                async with (
                    aiohttp.ClientSession() as s,
                    s.post(url, json={"request_id": kv.get(KV.REMOTE_REQUEST_ID)}) as r,
                ):
                    ok = r.status == 200
            except aiohttp.ClientError:
                ok = False
            if not ok:
                return READ_FAILED
        return reuse

    def _params_out(
        self,
        kv: dict[str, Any] | None,
        rid: str,
        prompt: list[int],
        text: str,
        chat: bool,
        reuse: Reuse | None,
        salt: str | None,
    ) -> dict[str, Any] | None:
        cfg = self.config
        bs = cfg.block_size
        if kv is None:
            return None
        common = {
            KV.REMOTE_ENGINE_ID: self.engine_id,
            KV.REMOTE_REQUEST_ID: rid,
            KV.REMOTE_HOST: self.host,
            KV.REMOTE_PORT: self.port,
            KV.TP_SIZE: 1,
        }
        if self.role is Role.PREFILL and kv.get(KV.DO_REMOTE_DECODE):
            out: dict[str, Any] = {
                KV.DO_REMOTE_PREFILL: True,
                KV.DO_REMOTE_DECODE: False,
                KV.REMOTE_BLOCK_IDS: [list(range(-(-len(prompt) // bs)))],
                KV.REMOTE_NUM_TOKENS: len(prompt),
                KV.REMOTE_BLOCKS_EXPIRY_TIME: None,
                **common,
            }
            if cfg.kvlease and reuse is not None:
                out[KV.KVLEASE] = reuse.report()
            return out
        if self.role is Role.DECODE and kv.get(KV.DO_REMOTE_PREFILL) and cfg.bidirectional:
            held = prompt + tokens(text) + (tokens("<|im_end|>") if chat else [])
            n_blocks = -(-len(held) // bs) if cfg.partial_block else len(held) // bs
            out = {
                KV.DO_REMOTE_DECODE: True,
                KV.DO_REMOTE_PREFILL: False,
                KV.REMOTE_BLOCK_IDS: [list(range(n_blocks))],
                KV.REMOTE_NUM_TOKENS: len(held),
                KV.REMOTE_BLOCKS_EXPIRY_TIME: None,
                **common,
            }
            retained = self.retained.retain(
                out,
                held,
                block_size=bs,
                salt=salt,
                ttl=cfg.ttl,
                control=self.control,
                secret=self._secret(),
                kvlease=cfg.kvlease,
                request_params=kv,
            )
            return out if retained else None
        return None

    async def _stream(
        self,
        request: web.Request,
        body: dict[str, Any],
        rid: str,
        chat: bool,
        output: tuple[list[Any], str],
        params: dict[str, Any] | None,
        usage: dict[str, Any],
    ) -> web.StreamResponse:
        """``output``: chat deltas (or completion texts) and the finish reason of the last one."""
        cfg = self.config
        pieces, finish = output
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.stats["streams"] += 1
        self.stats["open_streams"] += 1
        base = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model", cfg.model),
        }
        try:
            if chat:
                first = {
                    **base,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
                await resp.write(b"data: " + orjson.dumps(first) + b"\n\n")
            for i, piece in enumerate(pieces):
                if cfg.token_delay:
                    await asyncio.sleep(cfg.token_delay)
                last = i == len(pieces) - 1
                c: dict[str, Any] = {
                    "index": 0,
                    "logprobs": None,
                    "finish_reason": finish if last else None,
                }
                if chat:
                    c["delta"] = piece
                else:
                    c["text"] = piece
                if last:
                    c["stop_reason"] = None
                chunk: dict[str, Any] = {**base, "choices": [c]}
                if last and params is not None and cfg.plugin:
                    chunk[KV_TRANSFER_PARAMS] = params
                await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            so = body.get("stream_options")
            if isinstance(so, dict) and so.get("include_usage"):
                await resp.write(b"data: " + orjson.dumps({**base, "choices": [], "usage": usage}) + b"\n\n")
            await resp.write(SSE_DONE.encode())
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            self.stats["streams_aborted"] += 1
            raise
        finally:
            self.stats["open_streams"] -= 1
        return resp

    # ---- the kvlease control endpoint ----------------------------------------------------------
    def _control_app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 20)  # the connector's MAX_BODY_BYTES
        app.add_routes(
            [
                web.get(CONTROL_INFO_PATH, self._info),
                web.get(CONTROL_METRICS_PATH, self._metrics),
                web.post(CONTROL_RENEW_PATH, self._renew),
                web.post(CONTROL_RELEASE_PATH, self._release),
            ]
        )
        return app

    def _refused(self, request: web.Request, mutating: bool) -> web.Response | None:
        """The connector's auth: bearer token in constant time; no secret, no renew/release."""
        secret = self._secret()
        if secret is None:
            return _control_error(403, "no control secret configured on this node") if mutating else None
        scheme, _, token = request.headers.get(CONTROL_AUTH_HEADER, "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), secret.encode()):
            return _control_error(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
        return None

    async def _info(self, request: web.Request) -> web.Response:
        if (refused := self._refused(request, False)) is not None:
            return refused
        cfg = self.config
        info = ControlInfo(
            role=self.role,
            engine_id=self.engine_id,
            vllm_version=cfg.vllm_version,
            kvlease_version="0.1.0",
            bidirectional_kv_xfer=cfg.bidirectional,
            ttl_s=cfg.ttl,
            recompute_threshold=64,
            block_size=cfg.block_size,
            model=cfg.model,
            leases=self.retained.desk.status(),
            placement="device" if self.role is not Role.PREFILL else None,
            tier=self.retained.desk.metrics.tier(),
        )
        return web.json_response(info.to_json())

    async def _metrics(self, request: web.Request) -> web.Response:
        if (refused := self._refused(request, False)) is not None:
            return refused
        body = self.retained.desk.metrics.render()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _control_body(self, request: web.Request) -> object:
        try:
            return orjson.loads(await request.read() or b"null")
        except orjson.JSONDecodeError:
            raise ProtocolError("body is not valid JSON") from None

    async def _renew(self, request: web.Request) -> web.Response:
        if (refused := self._refused(request, True)) is not None:
            return refused
        try:
            req, answer = self.retained.renew(await self._control_body(request))
        except ProtocolError as e:
            return _control_error(400, str(e))
        self.stats["renew_calls"] += 1
        self.renew_batches.append(list(req.request_ids))
        return web.json_response(answer)

    async def _release(self, request: web.Request) -> web.Response:
        if (refused := self._refused(request, True)) is not None:
            return refused
        try:
            answer = self.retained.release(await self._control_body(request))
        except ProtocolError as e:
            return _control_error(400, str(e))
        self.stats["release_calls"] += 1
        return web.json_response(answer)


def _control_error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    """The connector control endpoint's error body (``_control._Handler._error``)."""
    body = ErrorBody.for_status(status, message).to_json()
    return web.json_response(body, status=status, headers=headers)


@dataclass
class FakePair:
    """A prefill and a decode fake sharing one config object (or one each)."""

    config: FakeConfig = field(default_factory=FakeConfig)
    n_decode: int = 1

    def __post_init__(self) -> None:
        self.prefill = FakeNode(Role.PREFILL, self.config)
        self.decodes = [FakeNode(Role.DECODE, self.config) for _ in range(self.n_decode)]

    @property
    def decode(self) -> FakeNode:
        return self.decodes[0]

    async def __aenter__(self) -> FakePair:
        await self.prefill.start()
        for d in self.decodes:
            await d.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for node in (self.prefill, *self.decodes):
            await node.stop()


def main(argv: list[str] | None = None) -> None:
    """``python -m kvlease_stack.testing.fake_vllm [--stock] [--no-plugin] [--decodes N]``: serve a
    fake pair (uvloop) and print its addresses as one JSON line; stop with SIGTERM/SIGINT."""
    import argparse
    import json
    import signal

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--stock", action="store_true", help="stock vLLM: no kvlease connector/control")
    ap.add_argument("--no-plugin", action="store_true", help="no handle in the final stream chunk")
    ap.add_argument("--no-pull-check", action="store_true", help="P trusts handles without reading D")
    ap.add_argument("--decodes", type=int, default=1)
    ap.add_argument("--ttl", type=float, default=120.0)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--secret", default="fake-secret")
    args = ap.parse_args(argv)
    cfg = FakeConfig(
        kvlease=not args.stock,
        plugin=not args.no_plugin,
        pull_check=not args.no_pull_check,
        ttl=args.ttl,
        default_max_tokens=args.max_tokens,
        control_secret=args.secret,
    )

    async def run() -> None:
        async with FakePair(cfg, args.decodes) as pair:
            addresses = {
                "prefill": pair.prefill.url,
                "prefill_control": pair.prefill.control,
                "decode": [d.url for d in pair.decodes],
                "decode_control": [d.control for d in pair.decodes],
                "nodes": 1 + len(pair.decodes),
            }
            print(json.dumps(addresses), flush=True)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()

    try:
        import uvloop
    except ImportError:  # pragma: no cover
        asyncio.run(run())
    else:
        uvloop.run(run())


if __name__ == "__main__":
    main()
