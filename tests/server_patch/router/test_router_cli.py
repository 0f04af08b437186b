"""``kvlease router`` as a process: serves, reads a config file, refuses bad clusters with exit 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvlease.protocol import HEADER_STATUS

SECRET = "cli-secret"


def _spawn(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, process_group=0)


def _first_line(proc: subprocess.Popen[str], timeout: float = 60.0) -> dict[str, Any]:
    out: list[str] = []
    t = threading.Thread(target=lambda: out.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    t.start()
    t.join(timeout)
    assert out and out[0], (
        f"no address line; stderr: {proc.stderr.read()[-2000:] if proc.poll() is not None else ''}"
    )  # type: ignore[union-attr]
    return dict(json.loads(out[0]))


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


@pytest.fixture
def fake_pair() -> Iterator[dict[str, Any]]:
    proc = _spawn(
        [sys.executable, "-m", "kvlease_stack.testing.fake_vllm", "--secret", SECRET, "--ttl", "60"]
    )
    try:
        yield _first_line(proc)
    finally:
        _stop(proc)


def _router_args(pair: dict[str, Any], *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "kvlease_router.cli",
        "--prefill", pair["prefill"], "--prefill-control", pair["prefill_control"],
        "--decode", pair["decode"][0], "--decode-control", pair["decode_control"][0],
        "--control-secret", SECRET, "--port", "0", "--startup-timeout", "10", *extra,
    ]  # fmt: skip


def test_cli_serves_turns_and_stops_on_sigterm(fake_pair: dict[str, Any]) -> None:
    proc = _spawn(_router_args(fake_pair, "--ttl", "30"))
    try:
        url = _first_line(proc)["url"]
        body = {"model": "m", "messages": [{"role": "user", "content": "hello " * 20}]}
        with httpx.Client(timeout=30) as c:
            r = c.post(url + "/v1/chat/completions", json=body, headers={"X-Conversation-Id": "cli"})
            assert (
                r.status_code == 200
                and r.headers[HEADER_STATUS] == "first"
                and r.headers["X-KVLease-TTL"] == "30"
            )
            assert c.get(url + "/v1/kvlease/status").json()["ttl_s"] == 30
    finally:
        _stop(proc)
    assert proc.returncode == 0
    logs = proc.stderr.read()  # type: ignore[union-attr]
    assert "router ready" in logs and '"cli"' not in logs  # JSON logs, no raw conversation id


def test_cli_refuses_a_ttl_above_d_minus_margin(fake_pair: dict[str, Any]) -> None:
    proc = _spawn(_router_args(fake_pair, "--ttl", "58"))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "router TTL 58 s must be at most D's TTL 60 s" in err


def test_cli_config_file_and_unknown_keys(fake_pair: dict[str, Any], tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"prefill": [fake_pair["prefill"]], "bogus": 1}))
    proc = _spawn([sys.executable, "-m", "kvlease_router.cli", "--config", str(bad)])
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "unknown config keys: bogus" in err
    good = tmp_path / "router.json"
    good.write_text(
        json.dumps(
            {
                "prefill": [{"url": fake_pair["prefill"], "control": fake_pair["prefill_control"]}],
                "decode": [{"url": fake_pair["decode"][0], "control": fake_pair["decode_control"][0]}],
                "control_secret": SECRET,
                "port": 0,
                "ttl_margin": 20,
            }
        )
    )
    proc = _spawn([sys.executable, "-m", "kvlease_router.cli", "--config", str(good)])
    try:
        url = _first_line(proc)["url"]
        assert httpx.get(url + "/v1/kvlease/status", timeout=30).json()["ttl_s"] == 40
    finally:
        _stop(proc)


def test_cli_slow_client_flags_reach_the_server(fake_pair: dict[str, Any]) -> None:
    """``--header-timeout`` and ``--max-connections-per-ip`` are enforced by the served process;
    a bad setting is refused with exit 2."""
    import socket
    import time

    proc = _spawn(_router_args(fake_pair, "--header-timeout", "0.5", "--max-connections-per-ip", "2"))
    try:
        url = _first_line(proc)["url"]
        host, port = url.removeprefix("http://").split(":")
        a, b = (socket.create_connection((host, int(port)), timeout=5) for _ in range(2))
        c = socket.create_connection((host, int(port)), timeout=5)
        assert c.recv(1) == b""  # the third connection from this address is closed at once
        a.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
        t0 = time.monotonic()
        assert a.recv(1) == b"" and time.monotonic() - t0 < 3.0
        for s in (a, b, c):
            s.close()
    finally:
        _stop(proc)
    bad = subprocess.run(
        _router_args(fake_pair, "--body-timeout", "0"), capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "body_timeout must be positive" in bad.stderr
