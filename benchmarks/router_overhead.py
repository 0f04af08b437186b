"""Router overhead: the kvlease router vs calling the servers directly vs a minimal FastAPI+httpx proxy.

Separate processes: a fake vLLM P/D pair (``kvlease_stack.testing.fake_vllm``, kvlease connector +
plugin, P trusts handles), the router (``kvlease router``), the baseline proxy (FastAPI + httpx on
uvicorn, doing the same two calls with no state), and this process as the load generator (aiohttp on
uvloop, one keep-alive connection pool for every path). Every turn is a streaming chat completion of
a conversation that grows turn by turn (reset after 40 messages, as a new conversation).

Paths:
* ``router``: client -> router -> P and D (the router keeps the handle and offers it to P).
* ``direct_pd``: the client calls P then D itself and, like the router, offers P the handle D
  returned on the previous turn, so P and D do the same work on both paths (P verifies the offered
  handle's block hashes, which costs the fake up to ~0.7 ms on long prompts: a direct path without
  handles would charge that to the router).
* ``direct_d``: one plain D call (no P): a floor, for reference.
* ``baseline_fastapi_httpx``: a stateless FastAPI + httpx proxy doing the P and D calls (no handles).

Figures:
* ``unloaded``: one conversation per path, turns back to back, the paths interleaved: each round
  runs one turn of every path, in an order that rotates from round to round, on the same history.
  The router's added latency is the distribution of the per-round paired difference
  ``router - direct_pd`` (p50/p90/p99), not a difference of percentiles; its p50 over consecutive
  blocks of rounds shows how stable it is. Warm-up rounds are dropped. Also reported: the router
  process's CPU time per turn (from ``/proc``; steadier than wall time on a shared machine), new
  connections opened after warm-up (0: keep-alive everywhere), and handles leaked to the client (0).
* ``loaded``: 64 concurrent conversations per path: turns/s (turns that ended inside each block's
  window) and latency p50/p99, the paths run in alternating blocks (order rotating) so drift in
  the machine's load hits all of them alike.

On a 2-core machine the load generator, the router and the fake servers share the cores; the
loaded figures are bounded by that. ``other_processes_cpu_share`` (per phase, from ``/proc``) says
how much of the machine other jobs took meanwhile: figures taken at a high share are not comparable.

Run: ``python benchmarks/router_overhead.py [--quick]``; importable: ``run(quick) -> dict``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from _procs import Proc as _Proc
from _procs import busy_seconds as _busy_seconds
from _procs import cpu_seconds as _cpu_seconds

SECRET = "bench-secret"
MAX_TOKENS = 16
GOAL_P50_MS = 1.0
GOAL_P99_MS = 5.0


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


# ---- turns ----------------------------------------------------------------------------------------

KV = "kv_transfer_params"
_P_REQUEST = {"do_remote_decode": True, "do_remote_prefill": False}
_JSON = {"Content-Type": "application/json"}
MAX_MESSAGES = 40


class _TurnFailed(Exception):
    pass


class _Conv:
    """One conversation of one path: its id, history and (``direct_pd``) D's last handle."""

    __slots__ = ("base", "cid", "handle", "leaks", "messages", "n", "resets")

    def __init__(self, cid: str) -> None:
        self.base = self.cid = cid
        self.resets = 0
        self.messages: list[dict[str, str]] = [
            {"role": "user", "content": f"conversation {cid}: " + "tell me something " * 20}
        ]
        self.handle: dict[str, Any] | None = None
        self.n = 0
        self.leaks = 0  # handles the router let through to the client (must stay 0)

    def advance(self, text: str) -> None:
        self.n += 1
        self.messages = [
            *self.messages,
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"turn {self.n}"},
        ]
        if len(self.messages) > MAX_MESSAGES:  # keep prompts bounded; a new conversation starts afresh
            self.messages = self.messages[:1]
            self.resets += 1
            self.cid = f"{self.base}.{self.resets}"
            self.handle = None


Turn = Callable[[aiohttp.ClientSession, _Conv], Awaitable[str]]


async def _read_stream(resp: aiohttp.ClientResponse) -> tuple[str, Any]:
    """(the streamed text, the ``kv_transfer_params`` of the final chunk if any)."""
    out = []
    params = None
    async for line in resp.content:
        if line.startswith(b"data: {"):
            event = orjson.loads(line[6:])
            ch = event.get("choices")
            if ch:
                out.append(ch[0]["delta"].get("content") or "")
            if event.get(KV) is not None:
                params = event[KV]
    return "".join(out), params


def _body(messages: list[dict[str, str]]) -> dict[str, Any]:
    return {"model": "fake-model", "messages": messages, "stream": True, "max_tokens": MAX_TOKENS}


async def _post_stream(
    s: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[str, Any]:
    async with s.post(url, data=orjson.dumps(body), headers=headers) as r:
        if r.status != 200:
            raise _TurnFailed(f"HTTP {r.status}: {(await r.read())[:200]!r}")
        return await _read_stream(r)


def make_proxy_turn(base: str) -> Turn:
    url = base + "/v1/chat/completions"

    async def turn(s: aiohttp.ClientSession, conv: _Conv) -> str:
        text, leaked = await _post_stream(
            s, url, _body(conv.messages), {**_JSON, "X-Conversation-Id": conv.cid}
        )
        if leaked is not None:
            conv.leaks += 1
        return text

    return turn


def make_direct_d_turn(decode: str) -> Turn:
    url = decode + "/v1/chat/completions"

    async def turn(s: aiohttp.ClientSession, conv: _Conv) -> str:
        return (await _post_stream(s, url, _body(conv.messages), _JSON))[0]

    return turn


def make_direct_pd_turn(prefill: str, decode: str) -> Turn:
    """The client does the router's job itself: P (offering D's last handle), then D."""
    p_url, d_url = prefill + "/v1/chat/completions", decode + "/v1/chat/completions"

    async def turn(s: aiohttp.ClientSession, conv: _Conv) -> str:
        offer = {**conv.handle, **_P_REQUEST} if conv.handle else _P_REQUEST
        p_body = {**_body(conv.messages), "max_tokens": 1, "stream": False, KV: offer}
        async with s.post(p_url, data=orjson.dumps(p_body), headers=_JSON) as r:
            raw = await r.read()
            if r.status != 200:
                raise _TurnFailed(f"P: HTTP {r.status}: {raw[:200]!r}")
        params = orjson.loads(raw).get(KV)
        text, conv.handle = await _post_stream(s, d_url, {**_body(conv.messages), KV: params}, _JSON)
        return text

    return turn


# ---- statistics -----------------------------------------------------------------------------------


def _q(xs: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted ``xs``."""
    return xs[max(0, min(len(xs) - 1, math.ceil(q * len(xs)) - 1))]


def _ms(x: float) -> float:
    return round(1000 * x, 3)


def _dist(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {
        "p50_ms": _ms(_q(s, 0.5)),
        "p90_ms": _ms(_q(s, 0.9)),
        "p99_ms": _ms(_q(s, 0.99)),
        "mean_ms": _ms(statistics.fmean(s)),
    }


def _added(router: list[float], other: list[float], blocks: int = 5) -> dict[str, Any]:
    """Distribution of the per-round difference ``router - other`` (paired samples)."""
    diff = [r - o for r, o in zip(router, other)]
    out: dict[str, Any] = _dist(diff)
    size = max(1, len(diff) // blocks)
    out["p50_ms_by_block"] = [
        _ms(statistics.median(diff[i : i + size]))
        for i in range(0, size * blocks, size)
        if diff[i : i + size]
    ]
    ro, oo = sorted(router), sorted(other)
    # for comparison only: what subtracting each path's own percentiles gives on the same samples
    out["diff_of_p50s_ms"] = _ms(_q(ro, 0.5) - _q(oo, 0.5))
    out["diff_of_p99s_ms"] = _ms(_q(ro, 0.99) - _q(oo, 0.99))
    return out


class _OtherLoad:
    """The share of the machine's CPU that processes other than this benchmark's used while it
    measured (0: the cores were ours; near 1: another job had them and the figures are not
    comparable)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.t0, self.busy0, self.ours0 = time.monotonic(), _busy_seconds(), self._ours()

    def _ours(self) -> float | None:
        got = [_cpu_seconds(p) for p in self.pids]
        return None if None in got else sum(g for g in got if g is not None)

    def share(self) -> float | None:
        busy, ours = _busy_seconds(), self._ours()
        if busy is None or ours is None or self.busy0 is None or self.ours0 is None:
            return None
        wall = (time.monotonic() - self.t0) * (os.cpu_count() or 1)
        return round(max(0.0, (busy - self.busy0) - (ours - self.ours0)) / wall, 3)


def _cpu_ms_per_turn(before: float | None, after: float | None, turns: int) -> float | None:
    if before is None or after is None or not turns:
        return None
    return round(1000 * (after - before) / turns, 3)


# ---- load -----------------------------------------------------------------------------------------


async def _unloaded(
    s: aiohttp.ClientSession,
    paths: dict[str, Turn],
    rounds: int,
    warmup: int,
    router_pid: int,
    new_conns: list[int],
) -> dict[str, Any]:
    names = list(paths)
    tag = f"u{time.monotonic_ns()}"
    convs = {name: _Conv(f"{tag}-{name}") for name in names}
    lat: dict[str, list[float]] = {name: [] for name in names}
    failed: list[str] = []
    cpu0, conns0 = None, 0
    for i in range(warmup + rounds):
        if i == warmup:
            cpu0 = _cpu_seconds(router_pid)
            conns0 = new_conns[0]
        k = i % len(names)
        got: dict[str, float] = {}
        texts: dict[str, str] = {}
        for name in names[k:] + names[:k]:  # each path takes each position equally often
            t0 = time.perf_counter()
            try:
                texts[name] = await paths[name](s, convs[name])
            except (_TurnFailed, aiohttp.ClientError) as e:  # reported, and the round dropped
                failed.append(f"{name}: {e}")
                continue
            got[name] = time.perf_counter() - t0
        for name, text in texts.items():
            convs[name].advance(text)
        if i >= warmup and len(got) == len(names):
            for name in names:
                lat[name].append(got[name])
    cpu = _cpu_ms_per_turn(cpu0, _cpu_seconds(router_pid), len(lat["router"]))
    return {
        "rounds": len(lat["router"]),
        "warmup_rounds": warmup,
        "failed_turns": len(failed),
        "first_error": failed[0] if failed else None,
        "paths": {name: _dist(v) for name, v in lat.items()},
        "added_vs_direct_pd": _added(lat["router"], lat["direct_pd"]),
        "added_vs_direct_d": _added(lat["router"], lat["direct_d"]),
        "router_cpu_ms_per_turn": cpu,
        "new_connections_after_warmup": new_conns[0] - conns0,
        "handles_leaked_to_client": convs["router"].leaks,
    }


async def _loaded_block(
    s: aiohttp.ClientSession, turn: Turn, concurrency: int, seconds: float, tag: str
) -> tuple[list[float], list[str], int]:
    convs = [_Conv(f"{tag}-{i}") for i in range(concurrency)]
    errors: list[str] = []

    async def one(conv: _Conv) -> float | None:
        t0 = time.perf_counter()
        try:
            text = await turn(s, conv)
        except (_TurnFailed, aiohttp.ClientError) as e:  # counted, reported, never hidden
            errors.append(str(e))
            await asyncio.sleep(0.01)
            return None
        conv.advance(text)
        return time.perf_counter() - t0

    await asyncio.gather(*(one(c) for c in convs))  # warm-up: every conversation's first turn
    errors.clear()
    lat: list[float] = []
    in_window = 0
    stop_at = time.perf_counter() + seconds

    async def worker(conv: _Conv) -> None:
        nonlocal in_window
        while time.perf_counter() < stop_at:
            dt = await one(conv)
            if dt is not None:
                lat.append(dt)
                in_window += time.perf_counter() <= stop_at

    await asyncio.gather(*(worker(c) for c in convs))
    # throughput counts the turns that ended within the window (the ones still running at its end
    # would otherwise stretch it by up to a turn's latency: a slow path's blocks would look slower)
    return lat, errors, in_window


async def _loaded(
    s: aiohttp.ClientSession,
    paths: dict[str, Turn],
    concurrency: int,
    seconds: float,
    blocks: int,
    router_pid: int,
) -> dict[str, Any]:
    names = list(paths)
    lat: dict[str, list[float]] = {n: [] for n in names}
    errors: dict[str, list[str]] = {n: [] for n in names}
    in_window = dict.fromkeys(names, 0)
    router_cpu = 0.0
    cpu_known = True
    for b in range(blocks):
        k = b % len(names)
        for name in names[k:] + names[:k]:
            cpu0 = _cpu_seconds(router_pid) if name == "router" else None
            got, errs, done = await _loaded_block(
                s, paths[name], concurrency, seconds / blocks, f"l{b}-{name}"
            )
            if name == "router":
                cpu1 = _cpu_seconds(router_pid)
                if cpu0 is None or cpu1 is None:
                    cpu_known = False
                else:
                    router_cpu += cpu1 - cpu0  # includes the block's warm-up turns
            lat[name] += got
            errors[name] += errs
            in_window[name] += done
    out: dict[str, Any] = {}
    for name in names:
        v = sorted(lat[name])
        out[name] = {
            "turns": len(v),
            "turns_per_s": round(in_window[name] / seconds, 1),
            "p50_ms": _ms(_q(v, 0.5)) if v else None,
            "p99_ms": _ms(_q(v, 0.99)) if v else None,
            "failed_turns": len(errors[name]),
            "first_error": errors[name][0] if errors[name] else None,
        }
    n_router = len(lat["router"]) + blocks * concurrency
    out["router_cpu_ms_per_turn"] = round(1000 * router_cpu / n_router, 3) if cpu_known else None
    return out


async def _router_statuses(router: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(router + "/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        if line.startswith("kvlease_router_turns_total{"):
            status = line.split('"')[1]
            out[status] = float(line.rsplit(" ", 1)[1])
    return out


async def _measure(quick: bool, urls: dict[str, str], pids: dict[str, int]) -> dict[str, Any]:
    router_pid = pids["router"]
    ours = [os.getpid(), *pids.values()]
    paths: dict[str, Turn] = {
        "router": make_proxy_turn(urls["router"]),
        "direct_pd": make_direct_pd_turn(urls["prefill"], urls["decode"]),
        "direct_d": make_direct_d_turn(urls["decode"]),
        "baseline_fastapi_httpx": make_proxy_turn(urls["baseline"]),
    }
    load_start = os.getloadavg()
    new_conns = [0]

    async def on_new_conn(*_: Any) -> None:
        new_conns[0] += 1

    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(on_new_conn)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=120)
    async with aiohttp.ClientSession(connector=connector, trace_configs=[trace]) as s:
        other = _OtherLoad(ours)
        unloaded = await _unloaded(s, paths, 300 if quick else 1500, 30, router_pid, new_conns)
        unloaded["other_processes_cpu_share"] = other.share()
        other = _OtherLoad(ours)
        loaded = await _loaded(s, paths, 64, 4.0 if quick else 12.0, 2 if quick else 4, router_pid)
        loaded["other_processes_cpu_share"] = other.share()
    base, direct = loaded["baseline_fastapi_httpx"], loaded["direct_pd"]
    added = unloaded["added_vs_direct_pd"]
    return {
        "router_added_latency_unloaded": {
            "p50_ms": added["p50_ms"],
            "p99_ms": added["p99_ms"],
            "goal_met": added["p50_ms"] <= GOAL_P50_MS and added["p99_ms"] <= GOAL_P99_MS,
            "goal": f"p50 <= {GOAL_P50_MS:g} ms, p99 <= {GOAL_P99_MS:g} ms (paired, vs direct_pd)",
        },
        "unloaded_interleaved": unloaded,
        "loaded_64_conversations": loaded,
        "router_vs_baseline_throughput_x": round(loaded["router"]["turns_per_s"] / base["turns_per_s"], 2),
        "router_vs_direct_pd_throughput_x": round(loaded["router"]["turns_per_s"] / direct["turns_per_s"], 2),
        "router_p99_vs_baseline_p99_ms": [loaded["router"]["p99_ms"], base["p99_ms"]],
        "router_statuses": await _router_statuses(urls["router"]),
        "cpus": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in load_start],
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
    }


def print_table(res: dict[str, Any]) -> None:
    u = res["unloaded_interleaved"]
    print(f"unloaded, {u['rounds']} interleaved rounds (after {u['warmup_rounds']} warm-up):")
    for name, d in u["paths"].items():
        print(f"  {name:24s} p50 {d['p50_ms']:8.3f} ms  p99 {d['p99_ms']:8.3f} ms")
    for other in ("direct_pd", "direct_d"):
        a = u[f"added_vs_{other}"]
        print(
            f"  router - {other:15s} per round: p50 {a['p50_ms']:.3f}  p90 {a['p90_ms']:.3f}  "
            f"p99 {a['p99_ms']:.3f} ms  (p50 by block {a['p50_ms_by_block']})"
        )
    print(
        f"  router CPU {u['router_cpu_ms_per_turn']} ms/turn, new connections after warm-up "
        f"{u['new_connections_after_warmup']}, handles leaked {u['handles_leaked_to_client']}"
    )
    print("loaded, 64 conversations:")
    for name, d in res["loaded_64_conversations"].items():
        if isinstance(d, dict):
            print(
                f"  {name:24s} {d['turns_per_s']:8.1f} turns/s  p50 {d['p50_ms']} ms  p99 {d['p99_ms']} ms"
                f"  failed {d['failed_turns']}"
            )
    print(f"  router CPU {res['loaded_64_conversations']['router_cpu_ms_per_turn']} ms/turn")
    print(f"goal: {res['router_added_latency_unloaded']}")
    print(
        f"load average at start {res['load_average_at_start']}, at end {res['load_average_at_end']}; "
        f"CPU share of other processes: unloaded {u['other_processes_cpu_share']}, "
        f"loaded {res['loaded_64_conversations']['other_processes_cpu_share']}"
    )


def run(quick: bool = False) -> dict[str, Any]:
    """Start the processes, measure every path, stop everything; return the figures."""
    py = sys.executable
    procs: list[_Proc] = []
    try:
        fake = _Proc(
            [
                py,
                "-m",
                "kvlease_stack.testing.fake_vllm",
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
                py, "-m", "kvlease_router.cli",
                "--prefill", prefill, "--prefill-control", fake.info["prefill_control"],
                "--decode", decode, "--decode-control", fake.info["decode_control"][0],
                "--control-secret", SECRET, "--port", "0", "--log-level", "warning",
                # every conversation comes from this one address: measure the relay, not the
                # per-address fair share (max_turns_per_ip, 16 by default)
                "--max-turns-per-ip", "0",
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
            pids = {"router": router.p.pid, "fake": fake.p.pid, "baseline": baseline.p.pid}
            return await _measure(quick, urls, pids)

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
    res = run(quick=args.quick)
    print(json.dumps(res, indent=2))
    print_table(res)


if __name__ == "__main__":
    main()
