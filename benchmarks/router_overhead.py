"""Router overhead: the kvlease router vs calling the servers directly vs a minimal FastAPI+httpx proxy.

Separate processes: a fake vLLM P/D pair (``kvlease_vllm.testing.fake_vllm``, kvlease connector +
plugin, P trusts handles so every path costs the fake the same), the router (``kvlease router``),
the baseline proxy (FastAPI + httpx on uvicorn, doing the same two calls with no state), and this
process as the load generator (aiohttp on uvloop). Every turn is a streaming chat completion.

Figures:
* ``unloaded``: one conversation, turns back to back: latency p50/p99 of each path, and the
  router's added latency over the client making the P and D calls itself (``direct_pd``), and over
  a plain D call (``direct_d``).
* ``loaded``: 64 concurrent conversations for a fixed time: turns/s and latency p50/p99.

Run: ``python benchmarks/router_overhead.py [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

SECRET = "bench-secret"
MAX_TOKENS = 16


# ---- the baseline: a minimal FastAPI + httpx proxy doing the same two calls -----------------------


def _serve_baseline(prefill: str, decode: str, port: int) -> None:
    import httpx
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    client = httpx.AsyncClient(
        timeout=60, limits=httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    )
    app = FastAPI()

    async def chat(request: Request) -> Any:
        body = await request.json()
        p_body = {
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        }
        p_body.pop("stream_options", None)
        p = await client.post(prefill + "/v1/chat/completions", json=p_body)
        d_body = {**body, "kv_transfer_params": p.json().get("kv_transfer_params")}
        req = client.build_request("POST", decode + "/v1/chat/completions", json=d_body)
        resp = await client.send(req, stream=True)

        async def relay() -> Any:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

    chat.__annotations__ = {"request": Request}  # this module uses postponed annotations
    app.post("/v1/chat/completions")(chat)

    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
    )


# ---- processes ------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Proc:
    def __init__(self, args: list[str], wait_line: bool = True) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.p = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, process_group=0, env=env
        )
        self.info: dict[str, Any] = {}
        if wait_line:
            assert self.p.stdout is not None
            line = self.p.stdout.readline()
            if not line:
                self.stop()
                raise RuntimeError(f"{args[:3]} exited before reporting its address")
            self.info = json.loads(line)

    def stop(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(10)


async def _wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status < 500:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not come up within {timeout} s")
            await asyncio.sleep(0.1)


# ---- load -----------------------------------------------------------------------------------------

Turn = Callable[[aiohttp.ClientSession, str, list[dict[str, str]]], Awaitable[str]]


async def _stream_text(resp: aiohttp.ClientResponse) -> str:
    out = []
    async for line in resp.content:
        if line.startswith(b"data: {"):
            ch = json.loads(line[6:])["choices"]
            if ch:
                out.append(ch[0]["delta"].get("content") or "")
    return "".join(out)


def _body(messages: list[dict[str, str]]) -> dict[str, Any]:
    return {"model": "fake-model", "messages": messages, "stream": True, "max_tokens": MAX_TOKENS}


class _TurnFailed(Exception):
    pass


def make_proxy_turn(base: str) -> Turn:
    async def turn(s: aiohttp.ClientSession, cid: str, messages: list[dict[str, str]]) -> str:
        async with s.post(
            base + "/v1/chat/completions", json=_body(messages), headers={"X-Conversation-Id": cid}
        ) as r:
            if r.status != 200:
                raise _TurnFailed(f"HTTP {r.status}: {(await r.read())[:200]!r}")
            return await _stream_text(r)

    return turn


def make_direct_d_turn(decode: str) -> Turn:
    async def turn(s: aiohttp.ClientSession, cid: str, messages: list[dict[str, str]]) -> str:
        async with s.post(decode + "/v1/chat/completions", json=_body(messages)) as r:
            return await _stream_text(r)

    return turn


def make_direct_pd_turn(prefill: str, decode: str) -> Turn:
    async def turn(s: aiohttp.ClientSession, cid: str, messages: list[dict[str, str]]) -> str:
        p_body = {**_body(messages), "max_tokens": 1, "stream": False}
        p_body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
        async with s.post(prefill + "/v1/chat/completions", json=p_body) as r:
            params = (await r.json())["kv_transfer_params"]
        async with s.post(
            decode + "/v1/chat/completions", json={**_body(messages), "kv_transfer_params": params}
        ) as r:
            return await _stream_text(r)

    return turn


async def _conversation(
    s: aiohttp.ClientSession,
    turn: Turn,
    cid: str,
    stop_at: float,
    lat: list[float],
    max_turns: int,
    errors: list[str],
) -> None:
    messages = [{"role": "user", "content": f"conversation {cid}: " + "tell me something " * 20}]
    n = 0
    while time.perf_counter() < stop_at and n < max_turns:
        t0 = time.perf_counter()
        try:
            text = await turn(s, cid, messages)
        except (_TurnFailed, aiohttp.ClientError) as e:  # counted, reported, never hidden
            errors.append(str(e))
            n += 1
            await asyncio.sleep(0.01)
            continue
        lat.append(time.perf_counter() - t0)
        n += 1
        messages = [
            *messages,
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"turn {n}"},
        ]
        if len(messages) > 40:  # keep prompts bounded; a new conversation id starts afresh
            messages = messages[:1]
            cid = cid + "x"


async def _load(turn: Turn, concurrency: int, seconds: float, warmup_turns: int = 2) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as s:
        warm: list[float] = []
        errors: list[str] = []
        await asyncio.gather(
            *(
                _conversation(s, turn, f"w{i}", time.perf_counter() + 30, warm, warmup_turns, errors)
                for i in range(concurrency)
            )
        )
        lat: list[float] = []
        t0 = time.perf_counter()
        stop_at = t0 + seconds
        tag = f"c{time.monotonic_ns()}"
        await asyncio.gather(
            *(_conversation(s, turn, f"{tag}-{i}", stop_at, lat, 1 << 30, errors) for i in range(concurrency))
        )
        elapsed = time.perf_counter() - t0
    lat.sort()
    return {
        "turns": len(lat),
        "turns_per_s": round(len(lat) / elapsed, 1),
        "p50_ms": round(1000 * statistics.median(lat), 3),
        "p99_ms": round(1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3),
        "failed_turns": len(errors),
        "first_error": errors[0] if errors else None,
    }


async def _router_statuses(router: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(router + "/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        if line.startswith("kvlease_router_turns_total{"):
            status = line.split('"')[1]
            out[status] = float(line.rsplit(" ", 1)[1])
    return out


async def _measure(quick: bool, urls: dict[str, str]) -> dict[str, Any]:
    paths: dict[str, Turn] = {
        "direct_d": make_direct_d_turn(urls["decode"]),
        "direct_pd": make_direct_pd_turn(urls["prefill"], urls["decode"]),
        "router": make_proxy_turn(urls["router"]),
        "baseline_fastapi_httpx": make_proxy_turn(urls["baseline"]),
    }
    seconds_unloaded = 3.0 if quick else 8.0
    seconds_loaded = 4.0 if quick else 12.0
    unloaded = {name: await _load(t, 1, seconds_unloaded) for name, t in paths.items()}
    loaded = {name: await _load(t, 64, seconds_loaded) for name, t in paths.items()}
    r, b = unloaded["router"], unloaded["direct_pd"]
    added = {
        "vs_direct_pd_p50_ms": round(r["p50_ms"] - b["p50_ms"], 3),
        "vs_direct_pd_p99_ms": round(r["p99_ms"] - b["p99_ms"], 3),
        "vs_direct_d_p50_ms": round(r["p50_ms"] - unloaded["direct_d"]["p50_ms"], 3),
        "vs_direct_d_p99_ms": round(r["p99_ms"] - unloaded["direct_d"]["p99_ms"], 3),
    }
    base = loaded["baseline_fastapi_httpx"]
    return {
        "unloaded_1_conversation": unloaded,
        "loaded_64_conversations": loaded,
        "router_added_latency_unloaded": added,
        "router_vs_baseline_throughput_x": round(loaded["router"]["turns_per_s"] / base["turns_per_s"], 2),
        "router_p99_vs_baseline_p99_ms": [loaded["router"]["p99_ms"], base["p99_ms"]],
        "router_statuses": await _router_statuses(urls["router"]),
        "cpus": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
    }


def run(quick: bool = False) -> dict[str, Any]:
    """Start the processes, measure every path, stop everything; return the figures."""
    py = sys.executable
    procs: list[_Proc] = []
    try:
        fake = _Proc(
            [
                py,
                "-m",
                "kvlease_vllm.testing.fake_vllm",
                "--no-pull-check",
                "--max-tokens",
                str(MAX_TOKENS),
                "--secret",
                SECRET,
            ]
        )
        procs.append(fake)
        prefill, decode = fake.info["prefill"], fake.info["decode"][0]
        router = _Proc(
            [
                py, "-m", "kvlease_vllm.router.cli",
                "--prefill", prefill, "--prefill-control", fake.info["prefill_control"],
                "--decode", decode, "--decode-control", fake.info["decode_control"][0],
                "--control-secret", SECRET, "--port", "0", "--log-level", "warning",
            ]
        )  # fmt: skip
        procs.append(router)
        port = _free_port()
        baseline = _Proc(
            [py, os.path.abspath(__file__), "--serve-baseline", prefill, decode, str(port)], wait_line=False
        )
        procs.append(baseline)
        urls = {
            "prefill": prefill,
            "decode": decode,
            "router": router.info["url"],
            "baseline": f"http://127.0.0.1:{port}",
        }
        try:
            import uvloop

            runner: Callable[[Any], Any] = uvloop.run
        except ImportError:  # pragma: no cover
            runner = asyncio.run

        async def go() -> dict[str, Any]:
            await _wait_http(urls["baseline"] + "/docs", timeout=180.0)
            return await _measure(quick, urls)

        result: dict[str, Any] = runner(go())
        return result
    finally:
        for p in reversed(procs):
            p.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="shorter runs")
    ap.add_argument(
        "--serve-baseline", nargs=3, metavar=("PREFILL", "DECODE", "PORT"), help=argparse.SUPPRESS
    )
    args = ap.parse_args()
    if args.serve_baseline:
        _serve_baseline(args.serve_baseline[0], args.serve_baseline[1], int(args.serve_baseline[2]))
        return
    print(json.dumps(run(quick=args.quick), indent=2))


if __name__ == "__main__":
    main()
