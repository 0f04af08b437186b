"""Hostile load: the latency of a legit tenant's turns while other clients attack the router.

Separate processes, real HTTP on 127.0.0.1: a ``redis-server`` (the router's state store,
``--state redis://``), the fake vLLM P/D pair (``kvlease_stack.testing.fake_vllm``), the router
(``kvlease router``, its default hardening settings: header timeout 10 s, body timeout 30 s, idle
timeout 75 s, stream write timeout 30 s, stream stall timeout 5 s, 256 connections and 16 turns in
flight per client address, a renew budget of 2,000 ids/s and a burst of 20,000 per tenant), the victim (this process: aiohttp on uvloop) and,
for each attack, an attacker process (this module with ``--attack``), each in its own process
group. The victim connects from 127.0.0.1; each attack from other loopback addresses
(127.0.0.2 and up), so the per-address connection bound applies to attackers, not to the victim,
as it would with attackers elsewhere on the network.

The victim (its own bearer token) runs multi-turn conversations, turns back to back: chat
completions with ``X-Conversation-Id`` and a growing history (a new conversation after 20
messages), streamed and not streamed in turn. Per window: turns completed, failed (non-2xx,
connection errors, timeouts), latency p50/p99 (the whole answer read) and the share of
``X-KVLease-Status: hit`` among follow-up turns (a miss there means reuse was lost).

Phases: ``baseline`` (victim alone), then per attack a window of the victim alone and the same
window with the attack running (the attacker process says when its attack is in place):

* ``renew_flood``: 2 attackers (a bearer token each), each sending ``POST /v1/kvlease/renew`` of
  10,000 random unknown ids, one in flight each, as fast as the router answers (200s and 429s
  counted);
* ``renew_rotating_tokens``: the same, with a made-up bearer token on every request (the tenant is
  a hash of the token, so each request is a new tenant with a full renew budget);
* ``anon_renew``: a 101-id renew a second without ``Authorization`` (the anonymous tenant; this
  once switched reuse off for every tenant through Redis pool exhaustion);
* ``slow_clients``: 300 connections (from 3 addresses, 100 each, under the per-address bound)
  trickling a request head one byte a second (reconnecting when the router closes them), plus
  50 that send a head and one body byte, then stall (reconnecting after the router's 408);
* ``stalled_streams``: 50 clients (a 4 KiB receive buffer) that start a streaming chat turn of
  20,000 tokens and never read its body. In this phase's two windows the fake D paces its tokens
  (200/s a stream; the victim's too), else the fake's one event loop, not the router, is what
  the victim waits for. At that pace the kernel's socket buffers take minutes to fill, so the
  router's writes never block (its 30 s write timeout never starts); what bounds the attack is the
  address's share of the upstream pool (16 turns in flight, the other 34 wait) and the stall
  timeout (a stream whose client's TCP acknowledges nothing for 5 s is cut and D's request
  aborted; the attacker reconnects);
* ``fuzz``: a burst of garbage (random bytes, broken HTTP, bad JSON, hostile fields, mutated
  bodies), 8 in flight: the router's answers by status (5xx must be 0).

Also per window: a probe GETs the router's ``/health`` and the fake's ``/_fake/stats`` every
100 ms (how long each event loop takes to get to a request: who the victim waits for), the
router's CPU (cores, from ``/proc``), redis-server's and the fake pair's and the attacker's, the
router's store errors and turn statuses (``/metrics``), the load average, and the CPU share other
processes took meanwhile (figures taken at a high share are not comparable).

Run: ``python benchmarks/hostile_load.py [--quick] [--only ATTACK ...] [--router-arg=--FLAG=VALUE]``
(windows of 5 s quick, 20 s full; ``--only stalled_streams`` runs that attack alone; each
``--router-arg`` goes to the router's command line); importable: ``run(quick) -> dict``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import aiohttp
import orjson
from _hostile_attacks import ATTACKS, _attack
from _procs import Proc as _Proc
from _procs import busy_seconds as _busy_seconds
from _procs import cpu_seconds as _cpu_seconds
from _procs import readline as _readline
from _procs import stop_group as _stop_group

from kvlease.protocol import (
    CHAT_COMPLETIONS_PATH,
    HEADER_CONVERSATION_ID,
    HEADER_STATUS,
    METRICS_PATH,
)

SECRET = "hostile-secret"
KEY_SECRET = "hostile-key-secret"
MAX_TOKENS = 8
MAX_MESSAGES = 20
VICTIM_TOKEN = "Bearer victim-tenant"
#: Bound of one victim turn (a stuck turn is a failure, not a hang).
TURN_TIMEOUT = 30.0
#: In the stalled-streams phase (both its windows, the victim's turns too) the fake D sleeps this
#: long between tokens: 200 tokens/s a stream, a decode's pace. Without it one stream holds the
#: fake's one event loop until its socket blocks (~10 us a token, the victim's P and D calls
#: waiting behind it) and 50 streams saturate the fake: the figure would be the stand-in's.
STALL_TOKEN_DELAY = 0.005


# ---- processes ------------------------------------------------------------------------------------


class _CpuWindow:
    """CPU cores used by each watched process over a window, and the share of the machine the
    processes outside this benchmark took meanwhile."""

    def __init__(self, pids: dict[str, int], ours: list[int]) -> None:
        self.pids, self.ours = pids, ours
        self.t0 = time.monotonic()
        self.busy0 = _busy_seconds()
        self.cpu0 = {name: _cpu_seconds(pid) for name, pid in pids.items()}
        self.ours0 = sum(_cpu_seconds(p) or 0.0 for p in ours)

    def end(self) -> dict[str, Any]:
        wall = time.monotonic() - self.t0
        out: dict[str, Any] = {}
        for name, pid in self.pids.items():
            a, b = self.cpu0[name], _cpu_seconds(pid)
            out[f"{name}_cpu_cores"] = None if a is None or b is None else round((b - a) / wall, 3)
        busy = _busy_seconds()
        ours = sum(_cpu_seconds(p) or 0.0 for p in self.ours)
        if busy is not None and self.busy0 is not None:
            other = max(0.0, (busy - self.busy0) - (ours - self.ours0)) / (wall * (os.cpu_count() or 1))
            out["other_processes_cpu_share"] = round(other, 3)
        out["load_average"] = [round(x, 2) for x in os.getloadavg()]
        return out


# ---- the victim -----------------------------------------------------------------------------------


def _q(xs: list[float], q: float) -> float:
    return xs[max(0, min(len(xs) - 1, math.ceil(q * len(xs)) - 1))]


class _Victim:
    def __init__(self, url: str) -> None:
        self.url = url + CHAT_COMPLETIONS_PATH
        self.n_conv = 0
        self._new()

    def _new(self) -> None:
        self.n_conv += 1
        self.cid = f"victim-{os.getpid()}-{self.n_conv}-{secrets.token_hex(3)}"
        self.turn = 0
        self.messages = [{"role": "user", "content": f"victim {self.cid}: " + "tell me something " * 20}]

    async def one(self, s: aiohttp.ClientSession) -> tuple[bool, str, bool]:
        """One turn: (ok, status or error kind, follow-up turn)."""
        stream = self.turn % 2 == 0
        body = {"model": "fake-model", "messages": self.messages, "stream": stream, "max_tokens": MAX_TOKENS}
        headers = {
            "Content-Type": "application/json",
            "Authorization": VICTIM_TOKEN,
            HEADER_CONVERSATION_ID: self.cid,
        }
        follow_up = self.turn > 0
        try:
            async with s.post(self.url, data=orjson.dumps(body), headers=headers) as r:
                raw = await r.read()
                if r.status != 200:
                    return False, f"http {r.status}", follow_up
                status = r.headers.get(HEADER_STATUS, "?")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return False, type(e).__name__, follow_up
        if stream:
            text = "".join(
                (orjson.loads(line[6:])["choices"] or [{"delta": {}}])[0]["delta"].get("content") or ""
                for line in raw.split(b"\n")
                if line.startswith(b"data: {")
            )
        else:
            text = orjson.loads(raw)["choices"][0]["message"]["content"]
        self.turn += 1
        self.messages = [
            *self.messages,
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"turn {self.turn}"},
        ]
        if len(self.messages) > MAX_MESSAGES:
            self._new()
        return True, status, follow_up

    async def window(self, s: aiohttp.ClientSession, seconds: float) -> dict[str, Any]:
        lat: list[float] = []
        failed: Counter[str] = Counter()
        statuses: Counter[str] = Counter()
        follow_ups = hits = 0
        start = time.perf_counter()
        stop_at = start + seconds
        worst = (0.0, 0.0)  # (latency, when in the window it started)
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            ok, what, follow_up = await self.one(s)
            dt = time.perf_counter() - t0
            if not ok:
                failed[what] += 1
                self._new()  # the history may be out of step; start afresh
                await asyncio.sleep(0.05)
                continue
            lat.append(dt)
            worst = max(worst, (dt, t0 - start))
            statuses[what] += 1
            if follow_up:
                follow_ups += 1
                hits += what == "hit"
        v = sorted(lat)
        return {
            "turns_completed": len(v),
            "turns_failed": sum(failed.values()),
            "failures": dict(failed),
            "p50_ms": round(1000 * _q(v, 0.5), 2) if v else None,
            "p99_ms": round(1000 * _q(v, 0.99), 2) if v else None,
            "max_ms": round(1000 * v[-1], 2) if v else None,
            "max_started_at_s": round(worst[1], 2),
            "follow_up_turns": follow_ups,
            "follow_up_hit_share": round(hits / follow_ups, 3) if follow_ups else None,
            "statuses": dict(statuses),
        }


async def _metrics(s: aiohttp.ClientSession, router: str) -> dict[str, float]:
    want = (
        "kvlease_router_turns_total",
        "kvlease_router_store_errors_total",
        "kvlease_router_client_errors_total",
        "kvlease_router_renewals_total",
        "kvlease_router_stalled_streams_total",
    )
    out: dict[str, float] = {}
    try:
        async with s.get(router + METRICS_PATH, timeout=aiohttp.ClientTimeout(total=10)) as r:
            text = await r.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return out
    for line in text.splitlines():
        if line.startswith(want):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k.replace("kvlease_router_", ""): v - a.get(k, 0.0) for k, v in b.items() if v != a.get(k, 0.0)}


def _start_attacker(name: str, router: str, seconds: float) -> subprocess.Popen[str]:
    host, port = router.rsplit("//", 1)[1].rsplit(":", 1)
    p = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--attack", name, host, port, str(seconds)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        process_group=0,
    )
    if not _readline(p, 30.0):
        _stop_group(p)
        raise RuntimeError(f"attacker {name} was not ready within 30 s")
    return p


def _stop_attacker(p: subprocess.Popen[str]) -> dict[str, Any]:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGTERM)
    try:
        out, _ = p.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        out = ""
    finally:
        _stop_group(p)
    lines = (out or "").strip().splitlines()
    return json.loads(lines[-1]) if lines else {"error": "no counts from the attacker"}


# ---- the phases -----------------------------------------------------------------------------------


async def _probe(s: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> dict[str, Any]:
    """Latency of a trivial GET every 100 ms until ``stop``: how long the server's event loop
    takes to get to a request (its lag), apart from the turn's other hops."""
    lat: list[float] = []
    failed = 0
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            async with s.get(url, timeout=aiohttp.ClientTimeout(total=30)) as r:
                await r.read()
            lat.append(time.perf_counter() - t0)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            failed += 1
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.1)
    v = sorted(lat)
    return {
        "n": len(v),
        "p50": round(1000 * _q(v, 0.5), 2) if v else None,
        "max": round(1000 * v[-1], 2) if v else None,
        "failed": failed,
    }


async def _fake_config(s: aiohttp.ClientSession, decode: str, config: dict[str, Any]) -> None:
    async with s.post(decode + "/_fake/config", json=config, timeout=aiohttp.ClientTimeout(total=30)) as r:
        if r.status != 200:
            raise RuntimeError(f"the fake's config answered {r.status}")


async def _fake_stats(s: aiohttp.ClientSession, decode: str) -> dict[str, Any]:
    try:
        async with s.get(decode + "/_fake/stats", timeout=aiohttp.ClientTimeout(total=10)) as r:
            got: dict[str, Any] = await r.json()
            return got
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return {}


async def _measure(
    urls: dict[str, str], pids: dict[str, int], window: float, attacks: tuple[str, ...], quick: bool
) -> dict[str, Any]:
    router, decode = urls["router"], urls["decode"]
    ours = [os.getpid(), *pids.values()]
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, local_addr=("127.0.0.1", 0))
    timeout = aiohttp.ClientTimeout(total=TURN_TIMEOUT)
    phases: dict[str, Any] = {}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s:
        victim = _Victim(router)
        await victim.window(s, 1.0)  # warm-up: connections, the fake's and the router's first turns

        async def measured(attack: str | None, window: float) -> dict[str, Any]:
            m0, d0 = await _metrics(s, router), await _fake_stats(s, decode)
            attacker = _start_attacker(attack, router, window + 60) if attack else None
            ours_now = ours + ([attacker.pid] if attacker else [])
            cpu = _CpuWindow({**pids, "attacker": attacker.pid} if attacker else pids, ours_now)
            try:
                stop_probe = asyncio.Event()
                probes = asyncio.gather(
                    _probe(s, router + "/health", stop_probe), _probe(s, decode + "/_fake/stats", stop_probe)
                )
                try:
                    res = await victim.window(s, window)
                finally:
                    stop_probe.set()
                    lag_router, lag_fake = await probes
                res["probe_router_health_ms"] = lag_router
                res["probe_fake_stats_ms"] = lag_fake
                res.update(cpu.end())
            finally:
                if attacker is not None:
                    res_attack = _stop_attacker(attacker)
            if attacker is not None:
                res["attacker"] = res_attack
            res["router_metrics_delta"] = _delta(m0, await _metrics(s, router))
            d1 = await _fake_stats(s, decode)
            res["decode_streams"] = {
                "started": d1.get("streams", 0) - d0.get("streams", 0),
                "aborted": d1.get("streams_aborted", 0) - d0.get("streams_aborted", 0),
                "open_at_end": d1.get("open_streams"),
            }
            return res

        phases["baseline"] = {"victim_alone": await measured(None, window)}
        for attack in attacks:
            w = window
            if attack == "stalled_streams":
                await _fake_config(s, decode, {"token_delay": STALL_TOKEN_DELAY})
            try:
                alone = await measured(None, w)
                under = await measured(attack, w)
            finally:
                await _fake_config(s, decode, {"token_delay": 0.0})
            phases[attack] = {"victim_alone": alone, "under_attack": under}
            sent = sum(n for k, n in under.get("attacker", {}).items() if k.startswith(("http ", "raw ")))
            a, b = alone.get("router_cpu_cores"), under.get("router_cpu_cores")
            n_alone, n_under = alone["turns_completed"], under["turns_completed"]
            if sent and a is not None and b is not None and n_alone:
                # the router CPU of the attack window less what the victim's turns cost it (at the
                # alone window's CPU per turn: under attack the victim makes fewer turns), per request
                attack_cpu = b * w - a * w * n_under / n_alone
                phases[attack]["router_cpu_ms_per_attack_request"] = round(1000 * attack_cpu / sent, 3)
                phases[attack]["attack_requests_per_s"] = round(sent / w, 1)
            phases[attack]["window_s"] = w
            await asyncio.sleep(1.0)  # let the router close what the attack left behind
    return phases


def run(
    quick: bool = False,
    attacks: tuple[str, ...] = ATTACKS,
    window: float | None = None,
    router_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Start redis-server, the fake pair and the router, run every phase, stop everything."""
    from kvlease_stack.testing._redis import RedisServer

    py = sys.executable
    window = window or (5.0 if quick else 20.0)
    procs: list[_Proc] = []
    redis = None
    t0 = time.monotonic()
    uptime_start = _uptime()
    try:
        redis = RedisServer.start()
        fake = _Proc(
            [py, "-m", "kvlease_stack.testing.fake_vllm", "--max-tokens", str(MAX_TOKENS), "--secret", SECRET]
        )
        procs.append(fake)
        router = _Proc(
            [
                py, "-m", "kvlease_router.cli",
                "--prefill", fake.info["prefill"], "--prefill-control", fake.info["prefill_control"],
                "--decode", fake.info["decode"][0], "--decode-control", fake.info["decode_control"][0],
                "--control-secret", SECRET, "--key-secret", KEY_SECRET, "--state", redis.url,
                "--port", "0", "--log-level", "error", *router_args,
            ]
        )  # fmt: skip
        procs.append(router)
        assert redis.proc is not None
        pids = {"router": router.pid, "redis": redis.proc.pid, "fake_pd": fake.pid}
        try:
            import uvloop

            loop_run: Any = uvloop.run
        except ImportError:  # pragma: no cover
            loop_run = asyncio.run
        urls = {"router": router.info["url"], "decode": fake.info["decode"][0]}
        phases = loop_run(_measure(urls, pids, window, attacks, quick))
    finally:
        for p in reversed(procs):
            p.stop()
        if redis is not None:
            redis.stop()
    return {
        "window_s": window,
        "phases": phases,
        "cpus": os.cpu_count(),
        "uptime_at_start": uptime_start,
        "uptime_at_end": _uptime(),
        "wall_s": round(time.monotonic() - t0, 1),
    }


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _windows(phase: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(k, v) for k, v in phase.items() if isinstance(v, dict)]


def print_table(res: dict[str, Any]) -> None:
    print(f"windows of {res['window_s']:g} s; victim: one conversation at a time, turns back to back")
    hdr = (
        f"{'phase':22s} {'window':12s} {'ok':>5s} {'fail':>4s} {'p50 ms':>8s} {'p99 ms':>8s} "
        f"{'max ms':>8s} {'hit':>6s} {'router':>6s} {'redis':>6s} {'fake':>6s} {'attkr':>6s} {'other':>6s}  load"
    )
    print(hdr)
    for phase, windows in res["phases"].items():
        for which, w in _windows(windows):
            print(
                f"{phase:22s} {which:12s} {w['turns_completed']:5d} {w['turns_failed']:4d} "
                f"{w['p50_ms']!s:>8s} {w['p99_ms']!s:>8s} {w['max_ms']!s:>8s} "
                f"{w['follow_up_hit_share']!s:>6s} {w.get('router_cpu_cores')!s:>6s} "
                f"{w.get('redis_cpu_cores')!s:>6s} {w.get('fake_pd_cpu_cores')!s:>6s} "
                f"{w.get('attacker_cpu_cores', '-')!s:>6s} "
                f"{w.get('other_processes_cpu_share')!s:>6s}  {w.get('load_average')}"
            )
    print("(cpu columns: cores used over the window; other: share of the machine other processes took)")
    for phase, windows in res["phases"].items():
        if "router_cpu_ms_per_attack_request" in windows:
            print(
                f"  {phase}: {windows['attack_requests_per_s']} attack requests/s, router CPU they added: "
                f"{windows['router_cpu_ms_per_attack_request']} ms each"
            )
        if phase == "fuzz" and "attacker" in windows.get("under_attack", {}):
            got = windows["under_attack"]["attacker"]
            print(f"  fuzz: {got.get('requests', 0)} garbage requests, router 5xx: {got.get('5xx', 0)}")
        for which, w in _windows(windows):
            keys = (
                "failures",
                "statuses",
                "max_started_at_s",
                "probe_router_health_ms",
                "probe_fake_stats_ms",
                "router_metrics_delta",
                "decode_streams",
            )
            extra = {k: w[k] for k in keys if w.get(k) not in (None, {})}
            if "attacker" in w:
                extra["attacker"] = w["attacker"]
            print(f"  {phase}/{which}: {json.dumps(extra)}")
    print(f"uptime at start: {res['uptime_at_start']}")
    print(f"uptime at end:   {res['uptime_at_end']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 s windows instead of 20 s")
    ap.add_argument("--window", type=float, help="seconds per window (default 20; quick 5)")
    ap.add_argument("--only", nargs="*", choices=ATTACKS, help="run only these attacks")
    ap.add_argument("--json", action="store_true", help="print the JSON too")
    ap.add_argument("--router-arg", action="append", default=[], help="an extra flag for the router (repeat)")
    ap.add_argument("--attack", nargs=4, metavar=("NAME", "HOST", "PORT", "SECONDS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.attack:
        name, host, port, seconds = a.attack
        try:
            import uvloop

            counts = uvloop.run(_attack(name, host, int(port), float(seconds)))
        except ImportError:  # pragma: no cover
            counts = asyncio.run(_attack(name, host, int(port), float(seconds)))
        print(json.dumps(counts), flush=True)
        return
    res = run(
        quick=a.quick,
        attacks=tuple(a.only) if a.only else ATTACKS,
        window=a.window,
        router_args=tuple(a.router_arg),
    )
    if a.json:
        print(json.dumps(res, indent=2))
    print_table(res)


if __name__ == "__main__":
    main()
