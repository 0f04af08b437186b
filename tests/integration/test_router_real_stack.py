"""The router on the real vLLM CPU P/D pair (kvlease connector + plugin), driven by the SDK."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from kvlease.protocol import (
    CONVERSATIONS_PATH,
    HEADER_CONVERSATION_ID,
    HEADER_STATUS,
    RENEW_PATH,
    STATUS_PATH,
)
from kvlease_stack import StackSpec
from kvlease_stack.testing import RedisServer

from ._specs import ALWAYS_PULL

pytestmark = pytest.mark.integration

QUESTION = (
    "Write a Python function that parses a configuration file and returns a dict of its sections. " * 12
)


class RouterProcess:
    """``kvlease router`` in its own process group; ``url`` once it listens."""

    def __init__(self, stack: Any, *extra: str, timeout: float = 180.0) -> None:
        args = [
            sys.executable, "-m", "kvlease_router.cli",
            "--prefill", stack.prefill.url, "--prefill-control", stack.prefill.control,
            "--decode", stack.decode.url, "--decode-control", stack.decode.control,
            "--control-secret", stack.control_secret, "--port", "0", "--startup-timeout", "120",
            "--key-secret", "integration-key-secret", *extra,  # Redis state needs one (never in Redis)
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, process_group=0
        )
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout)
        if not line or not line[0]:
            self.stop()
            raise AssertionError(f"router did not start: {self.proc.stderr.read()[-3000:]}")  # type: ignore[union-attr]
        self.url: str = json.loads(line[0])["url"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


@pytest.fixture
def stack(stack_factory: Callable[[StackSpec], Any]) -> Any:
    """P's own prefix cache off: otherwise P already holds every earlier prompt and a pull from D
    gains only the last answer's tokens, which the connector rightly declines below its threshold."""
    return stack_factory(StackSpec(prefix_caching=False, kvlease=ALWAYS_PULL))


@pytest.fixture
def start_router(stack: Any) -> Iterator[Callable[..., RouterProcess]]:
    started: list[RouterProcess] = []

    def start(*extra: str) -> RouterProcess:
        r = RouterProcess(stack, *extra)
        started.append(r)
        return r

    yield start
    for r in started:
        r.stop()


def _sdk_conversation_turns(router: str, model: str, stream: bool, turns: int = 3) -> list[Any]:
    from openai import OpenAI

    import kvlease

    kc = kvlease.wrap(
        OpenAI(base_url=router + "/v1", api_key="test-key", max_retries=0, timeout=600), heartbeat=False
    )
    with kc.conversation() as conv:
        messages: list[dict[str, str]] = [{"role": "user", "content": QUESTION}]
        for i in range(turns):
            kw: dict[str, Any] = dict(model=model, messages=messages, max_tokens=24, temperature=0.0)
            if stream:
                text = "".join(
                    (c.choices[0].delta.content or "")
                    for c in conv.chat.completions.create(stream=True, **kw)
                    if c.choices
                )
            else:
                text = conv.chat.completions.create(**kw).choices[0].message.content or ""
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"Now improve it, step {i}."},
            ]
        return conv.turns


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_sdk_through_router_hits_on_exact_continuations(
    stack: Any, start_router: Callable[..., RouterProcess], stream: bool
) -> None:
    router = start_router()
    turns = _sdk_conversation_turns(router.url, stack.model_name, stream, turns=4)
    statuses = [t.status.value if t.status else None for t in turns]
    # P decides each pull (verified prefix, threshold, cost model, its own prefix cache), so not
    # every follow-up must pull; but the router must offer the handle every time and report P's
    # answer, and exact continuations must pull at least once.
    assert statuses[0] == "first" and set(statuses[1:]) <= {"hit", "miss", "mismatch", "local_hit"}, statuses
    hits = [t for t in turns[1:] if t.status and t.status.value == "hit"]
    assert hits and all(t.reused_tokens and t.reused_tokens > 0 for t in hits), statuses
    assert all(t.ttl_s and t.ttl_s > 0 for t in turns)
    with open(stack.prefill.log_path, errors="replace") as f:
        assert "pulling" in f.read()  # P really read verified blocks from D


def test_renew_and_release_on_the_real_decode_node(
    stack: Any, start_router: Callable[..., RouterProcess]
) -> None:
    router = start_router()
    h = {HEADER_CONVERSATION_ID: "itest-renew", "Authorization": "Bearer t"}
    body = {"model": stack.model_name, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8}
    with httpx.Client(base_url=router.url, timeout=600) as c:
        r = c.post("/v1/chat/completions", json=body, headers=h)
        assert r.status_code == 200 and r.headers[HEADER_STATUS] == "first"
        assert "kv_transfer_params" not in r.text
        renewed = c.post(RENEW_PATH, json={"conversation_ids": ["itest-renew", "nobody"]}, headers=h).json()
        assert renewed["leases"]["itest-renew"]["expires_in"] > 0
        assert renewed["leases"]["nobody"] == {"status": "unknown"}
        released = c.delete(f"{CONVERSATIONS_PATH}/itest-renew", headers=h).json()
        assert released["released"] is True
        after = c.post(RENEW_PATH, json={"conversation_ids": ["itest-renew"]}, headers=h).json()
        assert after["leases"]["itest-renew"] == {"status": "unknown"}
        status = c.get(STATUS_PATH).json()
        assert status["mode"] == "kvlease" and status["renewals"] is True


@pytest.mark.redis
def test_router_restart_with_redis_keeps_hits(
    stack: Any, start_router: Callable[..., RouterProcess], redis_server: RedisServer
) -> None:
    redis = redis_server
    h = {HEADER_CONVERSATION_ID: "itest-restart", "Authorization": "Bearer t"}
    messages = [{"role": "user", "content": QUESTION}]
    body = {"model": stack.model_name, "messages": messages, "max_tokens": 16, "temperature": 0.0}
    first = start_router("--state", redis.url)
    with httpx.Client(timeout=600) as c:
        r1 = c.post(first.url + "/v1/chat/completions", json=body, headers=h)
        assert r1.headers[HEADER_STATUS] == "first"
        first.stop()
        second = start_router("--state", redis.url)
        messages += [
            {"role": "assistant", "content": r1.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Continue."},
        ]
        r2 = c.post(second.url + "/v1/chat/completions", json={**body, "messages": messages}, headers=h)
        # the restarted router still knew the conversation: it offered D's handle, P judged it
        assert r2.status_code == 200 and r2.headers[HEADER_STATUS] in (
            "hit",
            "mismatch",
            "miss",
            "local_hit",
        ), r2.headers
        assert r2.headers[HEADER_STATUS] != "first"
        messages += [
            {"role": "assistant", "content": r2.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Continue again."},
        ]
        r3 = c.post(second.url + "/v1/chat/completions", json={**body, "messages": messages}, headers=h)
        assert r3.status_code == 200 and r3.headers[HEADER_STATUS] != "first"
        assert "hit" in (r2.headers[HEADER_STATUS], r3.headers[HEADER_STATUS])
