"""A small OpenAI-compatible kvlease router fake on real HTTP (127.0.0.1, port 0, own thread).

It stands in for the remote server only (router + vLLM): answers ``/v1/chat/completions`` (JSON and
SSE), the lease API (renew, release) and sets the kvlease response headers the way the router does:
``first`` on a conversation's first turn, ``hit`` after, ``disabled`` when the client sent the reuse
opt-out, ``expired`` when the lease (``ttl`` seconds, renewed by ``POST /v1/kvlease/renew``) ran out
before the turn, ``no-id`` without an id. Every request is recorded (path, headers, JSON body) for the tests
to assert on.

Replies: scripted ones (``server.script(Reply(...))``) are used first, in order; otherwise the
answer is ``"echo: <last user text>"`` with reasoning ``"thinking about <last user text>"`` under
``reasoning_field`` (``None``: no reasoning, like a non-reasoning model).
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvlease import protocol as p


@dataclass
class Reply:
    content: str = ""
    reasoning: str | None = None
    # [{"name": ..., "arguments": {...} | "<raw JSON string>"}]
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]  # lower-cased names
    body: Any


def _last_user_text(messages: list[dict[str, Any]]) -> str:
    for m in reversed(messages):
        if m.get("role") == "user":
            c = m.get("content")
            if isinstance(c, str):
                return c
            if isinstance(c, list):
                return " ".join(b.get("text", "") for b in c if isinstance(b, dict))
    return ""


class FakeRouter:
    """``with FakeRouter() as srv: srv.base_url`` → ``http://127.0.0.1:PORT/v1``."""

    def __init__(
        self, *, model: str = "fake-model", reasoning_field: str | None = "reasoning", ttl: float = 30.0
    ):
        self.model = model
        self.reasoning_field = reasoning_field
        self.ttl = ttl
        self.requests: list[Recorded] = []
        self._scripted: deque[Reply] = deque()
        self._turns: dict[str, int] = {}
        self._deadline: dict[str, float] = {}  # lease expiry per conversation (time.monotonic)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-router", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------------------

    def __enter__(self) -> FakeRouter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def script(self, *replies: Reply) -> None:
        with self._lock:
            self._scripted.extend(replies)

    def renew_requests(self) -> list[Recorded]:
        with self._lock:
            return [r for r in self.requests if r.path == p.RENEW_PATH]

    def chat_requests(self) -> list[Recorded]:
        with self._lock:
            return [r for r in self.requests if r.path == p.CHAT_COMPLETIONS_PATH]

    # -- behaviour ---------------------------------------------------------------------------------

    def _reply_for(self, body: dict[str, Any]) -> Reply:
        with self._lock:
            if self._scripted:
                return self._scripted.popleft()
        text = _last_user_text(body.get("messages") or [])
        reasoning = f"thinking about {text}" if self.reasoning_field else None
        return Reply(content=f"echo: {text}", reasoning=reasoning)

    def _kvlease_headers(self, headers: dict[str, str]) -> dict[str, str]:
        cid = headers.get(p.HEADER_CONVERSATION_ID.lower())
        if cid is None:
            return {p.HEADER_STATUS: p.ReuseStatus.NO_ID.value, p.HEADER_REUSED_TOKENS: "0"}
        now = time.monotonic()
        with self._lock:
            turn = self._turns.get(cid, 0)
            self._turns[cid] = turn + 1
            expired = turn > 0 and now > self._deadline.get(cid, 0.0)
            self._deadline[cid] = now + self.ttl
        if headers.get(p.HEADER_REUSE.lower(), "").lower() == p.REUSE_OFF:
            status, reused = p.ReuseStatus.DISABLED, 0
        elif expired:
            status, reused = p.ReuseStatus.EXPIRED, 0
        elif turn == 0:
            status, reused = p.ReuseStatus.FIRST, 0
        else:
            status, reused = p.ReuseStatus.HIT, 16 * turn
        return {
            p.HEADER_STATUS: status.value,
            p.HEADER_REUSED_TOKENS: str(reused),
            p.HEADER_TTL: str(self.ttl),
        }

    def _message(self, reply: Reply, field_name: str | None) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": reply.content or None}
        if reply.reasoning is not None and field_name:
            msg[field_name] = reply.reasoning
        if reply.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": f"call_{i}",
                    "type": "function",
                    "function": {"name": tc["name"], "arguments": _arguments(tc)},
                }
                for i, tc in enumerate(reply.tool_calls)
            ]
        return msg

    def _completion(self, body: dict[str, Any], reply: Reply) -> dict[str, Any]:
        prompt_tokens = len(json.dumps(body.get("messages"))) // 4
        completion_tokens = max(1, len(reply.content) // 4)
        return {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": 1,
            "model": body.get("model", self.model),
            "choices": [
                {
                    "index": 0,
                    "message": self._message(reply, self.reasoning_field),
                    "finish_reason": reply.finish_reason or ("tool_calls" if reply.tool_calls else "stop"),
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    def _chunks(self, body: dict[str, Any], reply: Reply) -> Iterator[dict[str, Any]]:
        full = self._completion(body, reply)
        base = {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": full["model"],
        }

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

        yield chunk({"role": "assistant", "content": ""})
        if reply.reasoning and self.reasoning_field:
            for piece in _pieces(reply.reasoning):
                yield chunk({self.reasoning_field: piece})
        for piece in _pieces(reply.content):
            yield chunk({"content": piece})
        for i, tc in enumerate(reply.tool_calls):
            # like vLLM: id, type and name first, then the arguments in pieces
            head = {"index": i, "id": f"call_{i}", "type": "function", "function": {"name": tc["name"]}}
            yield chunk({"tool_calls": [head]})
            for piece in _pieces(_arguments(tc)):
                yield chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
        yield chunk({}, full["choices"][0]["finish_reason"])
        if (body.get("stream_options") or {}).get("include_usage"):
            yield {**base, "choices": [], "usage": full["usage"]}

    # -- HTTP --------------------------------------------------------------------------------------

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        router = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _read(self) -> tuple[dict[str, str], Any]:
                headers = {k.lower(): v for k, v in self.headers.items()}
                n = int(headers.get("content-length") or 0)
                raw = self.rfile.read(n) if n else b""
                body = json.loads(raw) if raw else None
                with router._lock:
                    router.requests.append(Recorded(self.command, self.path, headers, body))
                return headers, body

            def _json(self, status: int, obj: Any, extra: dict[str, str] | None = None) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                for k, v in (extra or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                headers, body = self._read()
                if self.path == p.CHAT_COMPLETIONS_PATH:
                    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
                        self._json(400, {"error": {"message": "messages must be a list", "type": "invalid"}})
                        return
                    reply = router._reply_for(body)
                    kv = router._kvlease_headers(headers)
                    if body.get("stream"):
                        self.send_response(200)
                        self.send_header("content-type", "text/event-stream")
                        self.send_header("connection", "close")
                        for k, v in kv.items():
                            self.send_header(k, v)
                        self.end_headers()
                        for c in router._chunks(body, reply):
                            self.wfile.write(f"data: {json.dumps(c)}\n\n".encode())
                        self.wfile.write(b"data: [DONE]\n\n")
                        self.wfile.flush()
                        self.close_connection = True
                    else:
                        self._json(200, router._completion(body, reply), kv)
                elif self.path == p.RENEW_PATH:
                    try:
                        req = p.RenewRequest.from_json(body)
                    except p.ProtocolError as e:
                        self._json(400, {"error": {"message": str(e)}})
                        return
                    now = time.monotonic()
                    leases: dict[str, float | None] = {}
                    with router._lock:
                        for c in req.conversation_ids:
                            if now <= router._deadline.get(c, 0.0):
                                router._deadline[c] = now + router.ttl
                                leases[c] = router.ttl
                            else:
                                leases[c] = None  # unknown or already expired
                    self._json(200, p.RenewResponse(leases, ttl=router.ttl).to_json())
                else:
                    self._json(404, {"error": {"message": f"no route {self.path}"}})

            def do_DELETE(self) -> None:
                self._read()
                prefix = p.CONVERSATIONS_PATH + "/"
                if self.path.startswith(prefix):
                    cid = self.path[len(prefix) :]
                    with router._lock:
                        known = router._turns.pop(cid, None) is not None
                        router._deadline.pop(cid, None)
                    self._json(200, {"conversation_id": cid, "released": known})
                else:
                    self._json(404, {"error": {"message": f"no route {self.path}"}})

            def do_GET(self) -> None:
                self._read()
                if self.path == p.HEALTH_PATH:
                    self._json(200, {"status": "ok"})
                elif self.path == "/v1/models":
                    self._json(200, {"object": "list", "data": [{"id": router.model, "object": "model"}]})
                else:
                    self._json(404, {"error": {"message": f"no route {self.path}"}})

        return Handler


def _arguments(tool_call: dict[str, Any]) -> str:
    """A scripted tool call's arguments: a string is sent as it is, anything else as JSON."""
    arguments = tool_call.get("arguments", {})
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def _pieces(text: str, size: int = 4) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]
