"""The GPU deployment scripts cannot run here, but what they start can be checked: each script is
run with ``vllm`` on ``PATH`` replaced by a shim that records its arguments, the recorded
``--kv-transfer-config`` must pass kvlease's own config validation with the roles the design needs,
and ``router.sh`` must start the real router in front of the fake P/D pair and serve a turn."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvlease_stack.testing import RedisServer
from kvlease_vllm._config import normalize_extra_config

from ._connector_start import check_connector_start

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "examples" / "deploy"
SHIM = """#!/usr/bin/env python3
import json, os, sys
json.dump({"argv": sys.argv[1:], "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}},
          open(os.environ["SHIM_OUT"], "w"))
"""


def _run_node(tmp_path: Path, script: str, **env: str) -> dict[str, Any]:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    shim = bindir / "vllm"
    shim.write_text(f"#!{sys.executable}\n" + SHIM.split("\n", 1)[1])
    shim.chmod(0o755)
    out = tmp_path / f"{script}.json"
    full_env = {
        "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}",
        "SHIM_OUT": str(out),
        "MODEL": "org/model",
        "KVLEASE_CONTROL_SECRET": "s3cret",
        "HOST_IP": "10.0.0.5",
        **env,
    }
    r = subprocess.run(
        ["bash", str(DEPLOY / script)], env=full_env, capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0, r.stderr
    return dict(json.loads(out.read_text()))


def _opts(argv: list[str]) -> dict[str, str]:
    return {a: b for a, b in itertools.pairwise(argv) if a.startswith("--")}


@pytest.mark.parametrize(("script", "role"), [("prefill.sh", "kv_producer"), ("decode.sh", "kv_consumer")])
def test_node_scripts_start_vllm_with_a_valid_kvlease_config(tmp_path: Path, script: str, role: str) -> None:
    rec = _run_node(tmp_path, script, NIXL_BACKEND="LIBFABRIC", TTL="300")
    argv = rec["argv"]
    assert argv[:2] == ["serve", "org/model"]
    kv = json.loads(_opts(argv)["--kv-transfer-config"])
    assert kv["kv_connector"] == "KVLeaseConnector"
    assert kv["kv_connector_module_path"] == "kvlease_vllm.connector"
    assert kv["kv_role"] == role
    extra = kv["kv_connector_extra_config"]
    assert extra["bidirectional_kv_xfer"] is True  # identical on both nodes
    assert extra["backends"] == ["LIBFABRIC"] and extra["decoder_kv_blocks_ttl"] == 300
    cfg, warnings = normalize_extra_config(extra)  # unknown or mistyped keys would raise
    assert warnings == [] and cfg.control_advertise_host == "10.0.0.5"
    if role == "kv_producer":
        assert kv["kv_load_failure_policy"] == "recompute"
    assert rec["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.5"
    # what the connector checks at start on a GPU (vLLM 0.33 schedules asynchronously by default)
    async_scheduling = "--no-async-scheduling" not in argv
    util = float(_opts(argv)["--gpu-memory-utilization"])
    assert util == 0.9
    check_connector_start(role, extra, cfg, async_scheduling=async_scheduling, gpu_memory_utilization=util)


def test_node_scripts_take_the_memory_utilization_from_the_environment(tmp_path: Path) -> None:
    argv = _run_node(tmp_path, "decode.sh", GPU_MEMORY_UTILIZATION="0.8")["argv"]
    assert _opts(argv)["--gpu-memory-utilization"] == "0.8"


def test_node_scripts_refuse_to_start_without_the_secret(tmp_path: Path) -> None:
    env = {"PATH": os.environ["PATH"], "MODEL": "m"}
    r = subprocess.run(
        ["bash", str(DEPLOY / "decode.sh")], env=env, capture_output=True, text=True, timeout=30
    )
    assert r.returncode != 0 and "KVLEASE_CONTROL_SECRET" in r.stderr


@pytest.mark.timeout(120)
def test_router_script_starts_the_router_in_front_of_the_nodes(redis_server: RedisServer) -> None:
    """router.sh with its real flags, against the fake P/D pair (its own process) and real Redis."""
    fake = subprocess.Popen(
        [sys.executable, "-m", "kvlease_stack.testing.fake_vllm", "--secret", "s3cret"],
        stdout=subprocess.PIPE,
        text=True,
        process_group=0,
    )
    router: subprocess.Popen[str] | None = None
    try:
        assert fake.stdout is not None
        info = json.loads(fake.stdout.readline())
        env = {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "PREFILL_URLS": info["prefill"],
            "PREFILL_CONTROL_URLS": info["prefill_control"],
            "DECODE_URLS": info["decode"][0],
            "DECODE_CONTROL_URLS": info["decode_control"][0],
            "KVLEASE_CONTROL_SECRET": "s3cret",
            "KVLEASE_KEY_SECRET": "k" * 32,
            "REDIS_URL": redis_server.url,
            "PORT": "0",
        }
        router = subprocess.Popen(
            ["bash", str(DEPLOY / "router.sh")], env=env, stdout=subprocess.PIPE, text=True, process_group=0
        )
        assert router.stdout is not None
        url = json.loads(router.stdout.readline())["url"]
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
        deadline = time.monotonic() + 30
        while True:
            r = httpx.post(
                url + "/v1/chat/completions", json=body, headers={"X-Conversation-Id": "c1"}, timeout=10
            )
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        status = httpx.get(url + "/v1/kvlease/status", timeout=10).json()
        assert status["mode"] == "kvlease" and "redis" in json.dumps(status["store"]).lower()
    finally:
        for p in (router, fake):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(10)
