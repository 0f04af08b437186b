"""The control API has one client: P's claim, the router's renew and its release send the requests
that ``kvlease.protocol``'s builder makes, through the sync or the async twin, byte for byte."""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import aiohttp
import pytest

from kvlease.protocol import (
    CONTROL_AUTH_HEADER,
    CONTROL_RELEASE_PATH,
    AsyncControlClient,
    ControlCall,
    ControlClient,
    ControlReleaseResponse,
    ControlRenewResponse,
    release_call,
    renew_call,
)
from kvlease_router import MemoryStore, NodeSpec, RouterSettings
from kvlease_router._lease_api import _renew_on
from kvlease_router._runtime import RouterRuntime
from kvlease_router._upstreams import Upstreams
from kvlease_router._validate import ClusterPlan
from kvlease_vllm._control import claim

SECRET = "s3cret"


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    auth: str | None
    content_type: str | None
    body: bytes

    @classmethod
    def of(cls, call: ControlCall) -> Seen:
        headers = dict(call.headers)
        path = call.url.split("//", 1)[1].split("/", 1)[1]
        return cls(
            call.method, "/" + path, headers.get(CONTROL_AUTH_HEADER), headers["Content-Type"], call.body
        )


@dataclass
class Recorder:
    """A control endpoint that records what it got; ``status`` is what it answers with."""

    seen: list[Seen] = field(default_factory=list)
    status: int = 200
    url: str = ""


def _handler(rec: Recorder) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            rec.seen.append(
                Seen(
                    "POST",
                    self.path,
                    self.headers.get(CONTROL_AUTH_HEADER),
                    self.headers.get("Content-Type"),
                    body,
                )
            )
            ids = json.loads(body)["request_ids"]
            if self.path == CONTROL_RELEASE_PATH:
                answer = ControlReleaseResponse(len(ids)).to_json()
            else:
                answer = ControlRenewResponse({i: 30.0 for i in ids}).to_json()
            data = json.dumps(answer).encode() if rec.status < 400 else b"{}"
            self.send_response(rec.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    rec = Recorder()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(rec))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    rec.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield rec
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
async def router(recorder: Recorder) -> AsyncIterator[RouterRuntime]:
    settings = RouterSettings(
        prefill=(NodeSpec("http://127.0.0.1:1", recorder.url),),
        decode=(NodeSpec("http://127.0.0.1:2", recorder.url),),
        control_secret=SECRET,
        key_secret="k",
    )
    rt = RouterRuntime(settings, MemoryStore(10), Upstreams(settings.prefill, settings.decode))
    rt.plan = ClusterPlan(20.0, 60.0, True, 16, None, None, ())
    rt.session = aiohttp.ClientSession()
    try:
        yield rt
    finally:
        await rt.session.close()


def test_the_builder_makes_the_contract_shapes() -> None:
    call = renew_call("http://d:9/", ["a", "b"], 30.0, secret=SECRET, timeout=2.0, claim=True)
    assert (call.method, call.url, call.timeout) == ("POST", "http://d:9/renew", 2.0)
    assert json.loads(call.body) == {"request_ids": ["a", "b"], "ttl": 30.0, "claim": True}
    assert dict(call.headers)[CONTROL_AUTH_HEADER] == f"Bearer {SECRET}"
    assert CONTROL_AUTH_HEADER not in dict(release_call("http://d:9", ["a"], secret=None, timeout=1).headers)


async def test_sync_and_async_twins_send_identical_requests(recorder: Recorder) -> None:
    sync = ControlClient(recorder.url, secret=SECRET, timeout=5.0)
    assert sync.renew(["a"], 30.0, claim=True).expires_in == {"a": 30.0}
    assert sync.release(["a", "b"]) == ControlReleaseResponse(2)
    async with aiohttp.ClientSession() as session:
        twin = AsyncControlClient(session, recorder.url, secret=SECRET, timeout=5.0)
        assert (await twin.renew(["a"], 30.0, claim=True)).expires_in == {"a": 30.0}
        assert await twin.release(["a", "b"]) == ControlReleaseResponse(2)
    renew, release, renew2, release2 = recorder.seen
    assert renew == renew2 and release == release2
    assert renew == Seen.of(renew_call(recorder.url, ["a"], 30.0, secret=SECRET, timeout=5.0, claim=True))
    assert release == Seen.of(release_call(recorder.url, ["a", "b"], secret=SECRET, timeout=5.0))


async def test_claim_renew_and_release_use_the_one_client(recorder: Recorder, router: RouterRuntime) -> None:
    url, s = recorder.url, router.settings
    assert claim(url, "lease-a", 30.0, SECRET, timeout=5).left == pytest.approx(30.0)
    assert await _renew_on(router, url, ["lease-a", "lease-b"]) == {"lease-a": 30.0, "lease-b": 30.0}
    assert await router.release_on_decode(url, ["lease-a"]) is True
    assert recorder.seen == [
        Seen.of(renew_call(url, ["lease-a"], 30.0, secret=SECRET, timeout=5, claim=True)),
        Seen.of(
            renew_call(
                url,
                ["lease-a", "lease-b"],
                router.ttl + s.ttl_margin,
                secret=SECRET,
                timeout=s.control_timeout,
            )
        ),
        Seen.of(release_call(url, ["lease-a"], secret=SECRET, timeout=s.control_timeout)),
    ]
    assert router.metrics.releases._value.get() == 1


async def test_an_error_status_keeps_each_callers_semantics(
    recorder: Recorder, router: RouterRuntime
) -> None:
    recorder.status = 401
    with pytest.raises(OSError, match="401"):  # P: the claim fails, the caller recomputes
        claim(recorder.url, "lease-a", 30.0, SECRET, timeout=5)
    assert await _renew_on(router, recorder.url, ["lease-a"]) is None  # router: not extended
    assert await router.release_on_decode(recorder.url, ["lease-a"]) is False
    assert router.metrics.upstream_errors["control"]._value.get() == 2
    assert router.metrics.renewals["failed"]._value.get() == 1
