"""The one fake kvlease router, for the SDK and LangChain tests and the SDK benchmarks.

Why a fake and not the real router: ``tests/sdk`` also runs in the SDK-only venv (``make
test-openai2``: no aiohttp, so no router and no fake P/D), and these tests drive the router's side
of the contract directly: renew endpoints that fail N times or refuse, leases dropped behind the
client's back, a server that stops mid-test, a plain vLLM without kvlease headers. Tests that need
the real router use :class:`kvlease_stack.testing.RouterOnFakePair` instead.

It runs the project's real pure logic where there is any: the router's identity rules
(:func:`kvlease_router._identity.conversation_id_from`), the wire shapes of :mod:`kvlease.protocol`
and the fake P/D's reply model (:class:`kvlease_stack.testing.Reply`, scripted replies included).
Real HTTP (a threaded stdlib server, HTTP/1.1 keep-alive, chunked SSE); every request is recorded
(headers and body) so tests assert on what went over the wire.

Statuses: ``first`` on a conversation's first turn (or after its lease was dropped), ``hit`` while
the lease lives (renewed by ``POST /v1/kvlease/renew``), ``expired`` once it ran out, ``disabled``
on the client's reuse opt-out, ``no-id`` without an id.

    with FakeOpenAIServer(reply="reasoning_content", ttl=30) as srv:
        client = OpenAI(base_url=srv.base_url, api_key="k")
        srv.script(Reply(content="scripted", tool_calls=[{"name": "f", "arguments": {}}]))
        ...
        srv.requests_to("/v1/kvlease/renew")
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvlease import protocol
from kvlease_router._identity import IdentityError, conversation_id_from
from kvlease_stack.testing._record import Recorded
from kvlease_stack.testing._replies import Reply, pieces

__all__ = ["REPLY_KINDS", "FakeOpenAIServer", "Recorded", "Reply"]

REPLY_KINDS = ("plain", "think", "reasoning_content", "reasoning", "tool_calls", "echo")
TOOL_ARGUMENTS = '{"city": "Paris"}'
_TOOL_CALL = {"id": "call_1", "name": "get_weather", "arguments": TOOL_ARGUMENTS}


def _last_user_text(messages: object) -> str:
    for m in reversed(messages if isinstance(messages, list) else []):
        if isinstance(m, dict) and m.get("role") == "user":
            c = m.get("content")
            if isinstance(c, str):
                return c
            if isinstance(c, list):
                return " ".join(b.get("text", "") for b in c if isinstance(b, dict))
    return ""


class FakeOpenAIServer:
    """See the module docstring. Attributes may be changed while it runs (tests flip them).

    ``reply="echo"`` answers ``"echo: <last user text>"`` with reasoning ``"thinking about <it>"``
    under ``reasoning_field`` (``None``: no reasoning). ``reused_per_turn`` reports ``turn * N``
    reused tokens on hits (default: the previous turn's prompt tokens).
    """

    def __init__(
        self,
        *,
        reply: str = "plain",
        content: str = "The answer is forty two.",
        reasoning: str = "Let me think about it.",
        reasoning_field: str | None = "reasoning",
        model: str = "fake-model",
        kvlease_headers: bool = True,
        ttl: float = 30.0,
        reused_per_turn: int | None = None,
        renew_failures: int = 0,
        renew_failure_status: int = 503,
        renew_status: int | None = None,
        record_bodies: bool = True,
        record: bool = True,
        verified: bool | None = None,
    ) -> None:
        if reply not in REPLY_KINDS:
            raise ValueError(f"reply must be one of {REPLY_KINDS}")
        self.reply = reply
        self.content = content
        self.reasoning = reasoning
        self.reasoning_field = reasoning_field
        self.model = model
        self.kvlease_headers = kvlease_headers
        self.ttl = ttl
        self.reused_per_turn = reused_per_turn
        self.renew_failures = renew_failures  # the next N renew requests fail with renew_failure_status
        self.renew_failure_status = renew_failure_status
        self.renew_status = renew_status  # a fixed status for every renew request (e.g. 404)
        self.record_bodies = record_bodies
        self.record = record  # False: keep no request log (benchmarks)
        # X-KVLease-Verified on completions: True "tokens" (kvlease connector), False "none", None: absent
        self.verified = verified
        self.requests: list[Recorded] = []
        self.leases: dict[str, float] = {}  # conversation id -> expiry (time.monotonic)
        self.released: list[str] = []
        self._prompt_tokens: dict[str, int] = {}
        self._turns: dict[str, int] = {}
        self._scripted: deque[Reply] = deque()
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self.stopped = False
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------------------- lifecycle
    def start(self) -> FakeOpenAIServer:
        server = _Server(("127.0.0.1", 0), _make_handler(self))
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving: also requests arriving on kept-alive connections get no answer."""
        self.stopped = True
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._server is not None, "not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def script(self, *replies: Reply) -> None:
        """Answer the next completions with ``replies``, in order, before the default reply."""
        with self._lock:
            self._scripted.extend(replies)

    # ----------------------------------------------------------------------------- inspection
    def requests_to(self, path: str, method: str | None = None) -> list[Recorded]:
        with self._lock:
            return [r for r in self.requests if r.path == path and (method is None or r.method == method)]

    def completions(self) -> list[Recorded]:
        return self.requests_to(protocol.CHAT_COMPLETIONS_PATH) + self.requests_to(protocol.COMPLETIONS_PATH)

    def chat_requests(self) -> list[Recorded]:
        return self.requests_to(protocol.CHAT_COMPLETIONS_PATH)

    def renew_requests(self) -> list[Recorded]:
        return self.requests_to(protocol.RENEW_PATH)

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    # ----------------------------------------------------------------------------- behaviour
    def _record(self, r: Recorded) -> None:
        if not self.record:
            return
        with self._lock:
            self.requests.append(r)

    def _lease_headers(self, cid: str | None, headers: Any, prompt_tokens: int) -> dict[str, str]:
        if not self.kvlease_headers:
            return {}
        if not cid:
            return {
                protocol.HEADER_STATUS: protocol.ReuseStatus.NO_ID.value,
                protocol.HEADER_REUSED_TOKENS: "0",
            }
        now = time.monotonic()
        with self._lock:
            held = self.leases.get(cid)
            turn = self._turns.get(cid, 0) if held is not None else 0
            reused = (
                self._prompt_tokens.get(cid, 0)
                if self.reused_per_turn is None
                else self.reused_per_turn * turn
            )
            self.leases[cid] = now + self.ttl
            self._prompt_tokens[cid] = prompt_tokens
            self._turns[cid] = turn + 1
        if (headers.get(protocol.HEADER_REUSE) or "").lower() == protocol.REUSE_OFF:
            status, reused = protocol.ReuseStatus.DISABLED, 0
        elif held is None:
            status, reused = protocol.ReuseStatus.FIRST, 0
        elif held <= now:
            status, reused = protocol.ReuseStatus.EXPIRED, 0
        else:
            status = protocol.ReuseStatus.HIT
        out = {
            protocol.HEADER_STATUS: status.value,
            protocol.HEADER_REUSED_TOKENS: str(reused),
            protocol.HEADER_TTL: f"{self.ttl:g}",
        }
        if self.verified is not None:
            out[protocol.HEADER_VERIFIED] = (
                protocol.VERIFIED_TOKENS if self.verified else protocol.VERIFIED_NONE
            )
        return out

    def _reply_for(self, body: dict[str, Any]) -> Reply:
        with self._lock:
            scripted = self._scripted.popleft() if self._scripted else None
        field = self.reasoning_field
        if scripted is not None:
            return replace(scripted, reasoning_field=field) if field else replace(scripted, reasoning=None)
        kind = self.reply
        if kind == "echo":
            text = _last_user_text(body.get("messages"))
            return Reply(f"echo: {text}", f"thinking about {text}" if field else None, field or "reasoning")
        if kind == "think":
            return Reply(f"<think>{self.reasoning}</think>\n\n{self.content}")
        if kind in ("reasoning_content", "reasoning"):
            return Reply(self.content, self.reasoning, kind)
        if kind == "tool_calls":
            return Reply(tool_calls=[_TOOL_CALL])
        return Reply(self.content)

    def _release(self, cid: str) -> dict[str, Any]:
        with self._lock:
            known = self.leases.pop(cid, None) is not None
            self._turns.pop(cid, None)
            self.released.append(cid)
        return protocol.ReleaseResponse(cid, known, known).to_json()

    def _renew(self, body: Any) -> tuple[int, dict[str, Any]]:
        with self._lock:
            failing = self.renew_failures > 0
            if failing:
                self.renew_failures -= 1
        if failing:
            return self.renew_failure_status, _error(self.renew_failure_status, "renew unavailable")
        if self.renew_status is not None:
            return self.renew_status, _error(self.renew_status, "renew refused")
        try:
            req = protocol.RenewRequest.from_json(body)
        except protocol.ProtocolError as e:
            return 400, _error(400, str(e))
        now = time.monotonic()
        leases: dict[str, float | None] = {}
        with self._lock:
            for cid in req.conversation_ids:
                if cid in self.leases and self.leases[cid] > now:
                    self.leases[cid] = now + self.ttl
                    leases[cid] = self.ttl
                else:
                    leases[cid] = None  # unknown or already expired
        return 200, protocol.RenewResponse(leases, ttl=self.ttl).to_json()


def _error(status: int, message: str) -> dict[str, Any]:
    return protocol.ErrorBody.for_status(status, message).to_json()


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # clients closing kept-alive connections are normal here, not errors worth a traceback
        return


def _count_tokens(body: Any) -> int:
    if not isinstance(body, dict):
        return 0
    if "messages" in body:
        return sum(len(json.dumps(m).split()) for m in body.get("messages") or [])
    return len(str(body.get("prompt", "")).split())


def _events(fake: FakeOpenAIServer, body: dict[str, Any], reply: Reply, chat: bool) -> list[dict[str, Any]]:
    """The SSE events of one streamed completion (without ``[DONE]``)."""
    base = {"id": "cmpl-fake", "created": int(time.time()), "model": body.get("model", fake.model)}
    if chat:
        base["object"] = "chat.completion.chunk"
        deltas = [{"role": "assistant", "content": ""}, *reply.deltas(), {}]
        events = [{**base, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
        events[-1]["choices"][0]["finish_reason"] = reply.finish
    else:
        base["object"] = "text_completion"
        texts = [*pieces(reply.content), ""]
        events = [{**base, "choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in texts]
        events[-1]["choices"][0]["finish_reason"] = "stop"
    return events


def _make_handler(fake: FakeOpenAIServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body go out in separate writes

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            return

        def _read(self) -> Any:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = None
            headers = {k.lower(): v for k, v in self.headers.items()}
            fake._record(Recorded(self.command, self.path, headers, body, raw if fake.record_bodies else b""))
            return body

        def _json(self, status: int, obj: Any, extra: dict[str, str] | None = None) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _gone(self) -> bool:
            if fake.stopped:
                self.close_connection = True
            return fake.stopped

        def do_GET(self) -> None:
            if self._gone():
                return
            self._read()
            if self.path == protocol.HEALTH_PATH:
                self._json(200, protocol.RouterHealth(True, True).to_json())
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": fake.model, "object": "model"}]})
            else:
                self._json(404, _error(404, f"no route {self.path}"))

        def do_POST(self) -> None:
            if self._gone():
                return
            body = self._read()
            if self.path in (protocol.CHAT_COMPLETIONS_PATH, protocol.COMPLETIONS_PATH):
                self._completion(body, chat=self.path == protocol.CHAT_COMPLETIONS_PATH)
            elif self.path == protocol.RENEW_PATH:
                self._json(*fake._renew(body))
            else:
                self._json(404, _error(404, f"no route {self.path}"))

        def do_DELETE(self) -> None:
            if self._gone():
                return
            self._read()
            prefix = protocol.CONVERSATIONS_PATH + "/"
            if not self.path.startswith(prefix):
                self._json(404, _error(404, "no route"))
                return
            self._json(200, fake._release(self.path[len(prefix) :]))

        def _completion(self, body: Any, *, chat: bool) -> None:
            if not isinstance(body, dict):
                self._json(400, _error(400, "body must be a JSON object"))
                return
            if chat and not isinstance(body.get("messages"), list):
                self._json(400, _error(400, "messages must be a list"))
                return
            try:
                identity = conversation_id_from(self.headers, body)  # the router's own rules
            except IdentityError as e:
                self._json(400, _error(400, f"invalid conversation id: {e}"))
                return
            prompt_tokens = _count_tokens(body)
            cid = identity.conversation_id if identity else None
            extra = fake._lease_headers(cid, self.headers, prompt_tokens)
            reply = fake._reply_for(body)
            message = reply.message()
            completion_tokens = len(json.dumps(message).split())
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            }
            if not body.get("stream"):
                base = {
                    "id": "cmpl-fake",
                    "created": int(time.time()),
                    "model": body.get("model", fake.model),
                }
                if chat:
                    choice = {"index": 0, "message": message, "finish_reason": reply.finish, "logprobs": None}
                    obj = {**base, "object": "chat.completion", "choices": [choice], "usage": usage}
                else:
                    choice = {"index": 0, "text": reply.content, "finish_reason": "stop", "logprobs": None}
                    obj = {**base, "object": "text_completion", "choices": [choice], "usage": usage}
                self._json(200, obj, extra)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            for k, v in extra.items():
                self.send_header(k, v)
            self.end_headers()
            events = _events(fake, body, reply, chat)
            if (body.get("stream_options") or {}).get("include_usage"):
                events.append({**events[-1], "choices": [], "usage": usage})
            for event in events:  # one chunk per event, as a real server flushes them
                self._chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
            self._chunk(protocol.SSE_DONE.encode())
            self._chunk(b"")

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    return Handler


def main() -> None:
    """Serve from its own process (benchmarks): prints the base URL, serves until stdin closes."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(description="fake OpenAI-compatible kvlease router")
    parser.add_argument("--reply", default="plain", choices=REPLY_KINDS)
    parser.add_argument("--content", default="The answer is forty two.")
    parser.add_argument("--ttl", type=float, default=30.0)
    parser.add_argument("--no-kvlease-headers", action="store_true")
    parser.add_argument("--record", action="store_true", help="keep a request log (renew counts on stderr)")
    args = parser.parse_args()
    srv = FakeOpenAIServer(
        reply=args.reply,
        content=args.content,
        ttl=args.ttl,
        kvlease_headers=not args.no_kvlease_headers,
        record=args.record,
        record_bodies=False,
    )
    with srv:
        print(srv.base_url, flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
