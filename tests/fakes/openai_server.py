"""A fast fake OpenAI-compatible kvlease router on 127.0.0.1, for SDK tests and benchmarks.

Real HTTP (a threaded stdlib server, HTTP/1.1 keep-alive, chunked SSE), no model: it serves
``/v1/chat/completions`` and ``/v1/completions`` (JSON and SSE, usage, optional ``reasoning`` /
``reasoning_content`` / ``<think>`` in content / tool calls), the kvlease response headers (or none,
like plain vLLM), ``POST /v1/kvlease/renew`` and ``DELETE /v1/kvlease/conversations/{id}``, and
records every request it got (headers and body) so tests assert on what went over the wire.

    with FakeOpenAIServer(reply="reasoning_content", ttl=30) as srv:
        client = OpenAI(base_url=srv.base_url, api_key="k")
        ...
        srv.requests_to("/v1/kvlease/renew")
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvlease import protocol

__all__ = ["REPLY_KINDS", "FakeOpenAIServer", "Recorded"]

REPLY_KINDS = ("plain", "think", "reasoning_content", "reasoning", "tool_calls")
TOOL_ARGUMENTS = '{"city": "Paris"}'


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]  # keys lower-cased
    body: Any  # parsed JSON, or None
    raw: bytes = b""
    ts: float = field(default_factory=time.time)

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())


class FakeOpenAIServer:
    """See the module docstring. Attributes may be changed while it runs (tests flip them)."""

    def __init__(
        self,
        *,
        reply: str = "plain",
        content: str = "The answer is forty two.",
        reasoning: str = "Let me think about it.",
        kvlease_headers: bool = True,
        ttl: float = 30.0,
        renew_failures: int = 0,
        renew_failure_status: int = 503,
        renew_status: int | None = None,
        record_bodies: bool = True,
        record: bool = True,
    ) -> None:
        if reply not in REPLY_KINDS:
            raise ValueError(f"reply must be one of {REPLY_KINDS}")
        self.reply = reply
        self.content = content
        self.reasoning = reasoning
        self.kvlease_headers = kvlease_headers
        self.ttl = ttl
        self.renew_failures = renew_failures  # the next N renew requests fail with renew_failure_status
        self.renew_failure_status = renew_failure_status
        self.renew_status = renew_status  # a fixed status for every renew request (e.g. 404)
        self.record_bodies = record_bodies
        self.record = record  # False: keep no request log (benchmarks)
        self.requests: list[Recorded] = []
        self.leases: dict[str, float] = {}  # conversation id -> expiry (time.monotonic)
        self.released: list[str] = []
        self._prompt_tokens: dict[str, int] = {}
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

    # ----------------------------------------------------------------------------- inspection
    def requests_to(self, path: str, method: str | None = None) -> list[Recorded]:
        with self._lock:
            return [r for r in self.requests if r.path == path and (method is None or r.method == method)]

    def completions(self) -> list[Recorded]:
        return [r for r in self.requests_to(protocol.CHAT_COMPLETIONS_PATH)] + self.requests_to(
            protocol.COMPLETIONS_PATH
        )

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    # ----------------------------------------------------------------------------- behaviour
    def _record(self, r: Recorded) -> None:
        if not self.record:
            return
        with self._lock:
            self.requests.append(r)

    def _lease_headers(self, headers: dict[str, str], body: Any, prompt_tokens: int) -> dict[str, str]:
        if not self.kvlease_headers:
            return {}
        cid = headers.get(protocol.HEADER_CONVERSATION_ID.lower())
        if cid is None and isinstance(body, dict):
            cid = body.get(protocol.BODY_CONVERSATION_ID)
        if not cid:
            return {protocol.HEADER_STATUS: protocol.ReuseStatus.NO_ID.value}
        now = time.monotonic()
        with self._lock:
            known = cid in self.leases and self.leases[cid] > now
            reused = self._prompt_tokens.get(cid, 0) if known else 0
            self.leases[cid] = now + self.ttl
            self._prompt_tokens[cid] = prompt_tokens
        if (headers.get(protocol.HEADER_REUSE.lower()) or "").lower() == protocol.REUSE_OFF:
            status, reused = protocol.ReuseStatus.DISABLED, 0
        else:
            status = protocol.ReuseStatus.HIT if known else protocol.ReuseStatus.FIRST
        return {
            protocol.HEADER_STATUS: status.value,
            protocol.HEADER_REUSED_TOKENS: str(reused),
            protocol.HEADER_TTL: f"{self.ttl:g}",
        }

    def _message(self) -> dict[str, Any]:
        kind = self.reply
        if kind == "think":
            return {"role": "assistant", "content": f"<think>{self.reasoning}</think>\n\n{self.content}"}
        if kind in ("reasoning_content", "reasoning"):
            return {"role": "assistant", "content": self.content, kind: self.reasoning}
        if kind == "tool_calls":
            return {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": TOOL_ARGUMENTS},
                    }
                ],
            }
        return {"role": "assistant", "content": self.content}

    def _deltas(self) -> list[dict[str, Any]]:
        kind = self.reply
        out: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
        if kind == "tool_calls":
            fn = {"name": "get_weather", "arguments": ""}
            out.append({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": fn}]})
            for piece in (TOOL_ARGUMENTS[:8], TOOL_ARGUMENTS[8:]):
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
            return out
        text = self._message()["content"]
        if kind in ("reasoning_content", "reasoning"):
            out.extend({kind: w} for w in _pieces(self.reasoning))
        out.extend({"content": w} for w in _pieces(text))
        return out


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # clients closing kept-alive connections are normal here, not errors worth a traceback
        return


def _pieces(text: str) -> list[str]:
    words = text.split(" ")
    return [w if i == 0 else " " + w for i, w in enumerate(words)]


def _count_tokens(body: Any) -> int:
    if not isinstance(body, dict):
        return 0
    if "messages" in body:
        return sum(len(json.dumps(m).split()) for m in body.get("messages") or [])
    return len(str(body.get("prompt", "")).split())


def _make_handler(fake: FakeOpenAIServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body go out in separate writes

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            return

        def _read(self) -> tuple[bytes, Any]:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = None
            headers = {k.lower(): v for k, v in self.headers.items()}
            fake._record(Recorded(self.command, self.path, headers, body, raw if fake.record_bodies else b""))
            return raw, body

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

        def do_POST(self) -> None:
            if self._gone():
                return
            _, body = self._read()
            headers = {k.lower(): v for k, v in self.headers.items()}
            if self.path in (protocol.CHAT_COMPLETIONS_PATH, protocol.COMPLETIONS_PATH):
                self._completion(body, headers, chat=self.path == protocol.CHAT_COMPLETIONS_PATH)
            elif self.path == protocol.RENEW_PATH:
                self._renew(body)
            else:
                self._json(404, {"error": {"message": f"no route {self.path}"}})

        def do_DELETE(self) -> None:
            if self._gone():
                return
            self._read()
            prefix = protocol.CONVERSATIONS_PATH + "/"
            if not self.path.startswith(prefix):
                self._json(404, {"error": {"message": "no route"}})
                return
            cid = self.path[len(prefix) :]
            with fake._lock:
                held = fake.leases.pop(cid, None) is not None
                fake.released.append(cid)
            self._json(200 if held else 404, {"released": held})

        def _renew(self, body: Any) -> None:
            with fake._lock:
                failing = fake.renew_failures > 0
                if failing:
                    fake.renew_failures -= 1
            if failing:
                self._json(fake.renew_failure_status, {"error": {"message": "renew unavailable"}})
                return
            if fake.renew_status is not None:
                self._json(fake.renew_status, {"error": {"message": "renew refused"}})
                return
            try:
                req = protocol.RenewRequest.from_json(body)
            except protocol.ProtocolError as e:
                self._json(400, {"error": {"message": str(e)}})
                return
            now = time.monotonic()
            leases: dict[str, float | None] = {}
            with fake._lock:
                for cid in req.conversation_ids:
                    if cid in fake.leases and fake.leases[cid] > now:
                        fake.leases[cid] = now + fake.ttl
                        leases[cid] = fake.ttl
                    else:
                        leases[cid] = None
            self._json(200, protocol.RenewResponse(leases, ttl=fake.ttl).to_json())

        def _completion(self, body: Any, headers: dict[str, str], *, chat: bool) -> None:
            if not isinstance(body, dict):
                self._json(400, {"error": {"message": "body must be a JSON object"}})
                return
            cid_header = headers.get(protocol.HEADER_CONVERSATION_ID.lower())
            if cid_header is not None and protocol.CONVERSATION_ID_PATTERN.fullmatch(cid_header) is None:
                self._json(400, {"error": {"message": "invalid conversation id"}})
                return
            prompt_tokens = _count_tokens(body)
            extra = fake._lease_headers(headers, body, prompt_tokens)
            message = fake._message()
            completion_tokens = len(json.dumps(message).split())
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            }
            base = {"id": "cmpl-fake", "created": int(time.time()), "model": body.get("model", "fake")}
            finish = "tool_calls" if fake.reply == "tool_calls" else "stop"
            if not body.get("stream"):
                if chat:
                    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
                    obj = {**base, "object": "chat.completion", "choices": [choice], "usage": usage}
                else:
                    choice = {
                        "index": 0,
                        "text": message.get("content") or "",
                        "finish_reason": "stop",
                        "logprobs": None,
                    }
                    obj = {**base, "object": "text_completion", "choices": [choice], "usage": usage}
                self._json(200, obj, extra)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            for k, v in extra.items():
                self.send_header(k, v)
            self.end_headers()
            if chat:
                events = [
                    {
                        **base,
                        "object": "chat.completion.chunk",
                        "choices": [{"index": 0, "delta": d, "finish_reason": None}],
                    }
                    for d in fake._deltas()
                ]
                events.append(
                    {
                        **base,
                        "object": "chat.completion.chunk",
                        "choices": [{"index": 0, "delta": {}, "finish_reason": finish}],
                    }
                )
            else:
                events = [
                    {
                        **base,
                        "object": "text_completion",
                        "choices": [{"index": 0, "text": w, "finish_reason": None}],
                    }
                    for w in _pieces(message.get("content") or "")
                ]
                events.append(
                    {
                        **base,
                        "object": "text_completion",
                        "choices": [{"index": 0, "text": "", "finish_reason": "stop"}],
                    }
                )
            opts = body.get("stream_options") or {}
            if opts.get("include_usage"):
                obj_name = "chat.completion.chunk" if chat else "text_completion"
                events.append({**base, "object": obj_name, "choices": [], "usage": usage})
            payload = (
                b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
            )
            # one chunk per event, as a real server flushes them
            for part in payload.split(b"\n\n")[:-1]:
                self._chunk(part + b"\n\n")
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
