"""Soak: many concurrent multi-turn conversations through the router, with clients hanging up
mid-stream, against the fast fake vLLM P/D pair.

Separate processes: the fake P/D pair (``kvlease_stack.testing.fake_vllm``), the router
(``kvlease router``) and this process as the clients (aiohttp on uvloop). Each conversation sends
``turns`` streaming chat turns; with probability ``disconnect_p`` a turn's client reads the first
chunk and hangs up, then re-sends the same turn (an agent retrying).

Checks and figures:
* turns: every conversation completes all its turns exactly once, each answer is the one the fake
  computes for that conversation's own prompt (no lost, duplicated or crossed turns, client side);
  P and D each received exactly one request per client attempt (fake side, its counters).
* router RSS (``/proc/<pid>/status``) after a warm-up and after the run.
* the router's TCP sockets to the fake nodes (from ``/proc/<pid>/fd`` and ``/proc/net/tcp``) after
  the warm-up and after the run, by state: pooled keep-alive connections are fine, growth beyond
  the concurrency or sockets stuck in CLOSE_WAIT are leaks; the fake's open streams and the
  router's in-flight gauge must be 0.

The load runs ``rounds`` times (default 2) on one router: memory that is flat grows in the first
round (pools, caches, the state store filling) and much less in the next; a leak grows every round.

Run: ``python benchmarks/soak.py [--quick]`` (2 x 1,000 x 5; quick: 2 x 200 x 5).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from _procs import Proc as _Proc

from kvlease.protocol import CHAT_COMPLETIONS_PATH, HEADER_CONVERSATION_ID, HEADER_STATUS, METRICS_PATH
from kvlease_stack.testing import render_chat

SECRET = "soak-secret"
MAX_TOKENS = 8
_WORDS = ("alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu")
_TCP_STATES = {
    "01": "ESTABLISHED",
    "06": "TIME_WAIT",
    "08": "CLOSE_WAIT",
    "04": "FIN_WAIT1",
    "05": "FIN_WAIT2",
}


def expected_reply(messages: list[dict[str, str]]) -> str:
    """What the fake answers to these messages (its words depend on the rendered prompt's length)."""
    n = len(render_chat(messages).encode())
    return " ".join(_WORDS[(n + i * 7) % len(_WORDS)] for i in range(MAX_TOKENS))


# ---- processes ------------------------------------------------------------------------------------


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def upstream_sockets(pid: int, ports: set[int]) -> dict[str, int]:
    """The process's TCP sockets whose remote port is one of ``ports``, counted by state."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out: Counter[str] = Counter()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[9] in inodes and int(f[2].rsplit(":", 1)[1], 16) in ports:
                out[_TCP_STATES.get(f[3], f[3])] += 1
    return dict(out)


# ---- clients --------------------------------------------------------------------------------------


@dataclass
class Tally:
    attempts: int = 0
    completed: int = 0
    disconnects: int = 0
    wrong_answers: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    turns_per_conversation: Counter[int] = field(default_factory=Counter)


async def _conversation(
    s: aiohttp.ClientSession, url: str, cid: str, turns: int, p_drop: float, rng: random.Random, t: Tally
) -> None:
    messages = [{"role": "user", "content": f"soak {cid}: " + "tell me more " * rng.randint(1, 30)}]
    done = 0
    tries = 0
    while done < turns and tries < turns * 10:
        tries += 1
        t.attempts += 1
        body = {"model": "fake-model", "messages": messages, "stream": True, "max_tokens": MAX_TOKENS}
        drop = rng.random() < p_drop
        try:
            async with s.post(
                url + CHAT_COMPLETIONS_PATH, json=body, headers={HEADER_CONVERSATION_ID: cid}
            ) as r:
                if r.status != 200:
                    t.errors[f"http {r.status}"] += 1
                    continue
                if drop:
                    await r.content.readline()  # the first bytes, then hang up mid-stream
                    r.close()
                    t.disconnects += 1
                    continue
                pieces = []
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        ch = json.loads(line[6:])["choices"]
                        if ch:
                            pieces.append(ch[0]["delta"].get("content") or "")
                t.statuses[r.headers.get(HEADER_STATUS, "?")] += 1
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            t.errors[type(e).__name__] += 1
            continue
        text = "".join(pieces)
        if text != expected_reply(messages):
            t.wrong_answers += 1
        done += 1
        t.completed += 1
        messages = [
            *messages,
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"turn {done}"},
        ]
    t.turns_per_conversation[done] += 1


async def _get_json(s: aiohttp.ClientSession, url: str) -> Any:
    async with s.get(url) as r:
        return await r.json()


async def _gauge(s: aiohttp.ClientSession, router: str, name: str) -> float:
    async with s.get(router + METRICS_PATH) as r:
        for line in (await r.text()).splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.split()[-1])
    return float("nan")


async def _soak(
    urls: dict[str, Any],
    router_pid: int,
    conversations: int,
    turns: int,
    p_drop: float,
    seed: int,
    rounds: int,
) -> dict[str, Any]:
    router, prefill, decode = urls["router"], urls["prefill"], urls["decode"]
    ports = {int(u.rsplit(":", 1)[1]) for u in (prefill, decode)}
    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s:
        # slow D's tokens a little, so a hang-up lands mid-stream
        async with s.post(decode + "/_fake/config", json={"token_delay": 0.002}) as r:
            assert r.status == 200
        warm = Tally()
        await asyncio.gather(
            *(_conversation(s, router, f"warm-{i}", 2, 0.0, rng, warm) for i in range(min(50, conversations)))
        )
        p0, d0 = await _get_json(s, prefill + "/_fake/stats"), await _get_json(s, decode + "/_fake/stats")
        rss_before, socks_before = rss_mib(router_pid), upstream_sockets(router_pid, ports)
        t = Tally()
        t0 = time.perf_counter()
        rss_rounds = []
        for rnd in range(rounds):  # the same load again: a leak grows the RSS in every round
            await asyncio.gather(
                *(
                    _conversation(
                        s, router, f"soak-{seed}-{rnd}-{i}", turns, p_drop, random.Random(rng.random()), t
                    )
                    for i in range(conversations)
                )
            )
            await asyncio.sleep(1.0)  # let the router finish closing what the hang-ups left behind
            rss_rounds.append(rss_mib(router_pid))
        elapsed = time.perf_counter() - t0 - rounds * 1.0
        p1, d1 = await _get_json(s, prefill + "/_fake/stats"), await _get_json(s, decode + "/_fake/stats")
        in_flight = await _gauge(s, router, "kvlease_router_in_flight")
        rss_after, socks_after = rss_mib(router_pid), upstream_sockets(router_pid, ports)
    p_reqs, d_reqs = p1["requests"] - p0["requests"], d1["requests"] - d0["requests"]
    lost = sum(n for done, n in t.turns_per_conversation.items() if done < turns)
    per_round = [round(b - a, 1) for a, b in zip([rss_before, *rss_rounds], rss_rounds)]
    return {
        "rounds": rounds,
        "conversations": conversations,
        "turns_per_conversation": turns,
        "disconnect_probability": p_drop,
        "client_attempts": t.attempts,
        "turns_completed": t.completed,
        "turns_expected": rounds * conversations * turns,
        "conversations_incomplete": lost,
        "wrong_or_crossed_answers": t.wrong_answers,
        "mid_stream_disconnects": t.disconnects,
        "client_errors": dict(t.errors),
        "statuses": dict(t.statuses),
        "prefill_requests": p_reqs,
        "decode_requests": d_reqs,
        "decode_streams_aborted": d1["streams_aborted"] - d0["streams_aborted"],
        "fake_open_streams_after": d1["open_streams"],
        "router_in_flight_after": in_flight,
        "router_rss_mib_before": rss_before,
        "router_rss_mib_after": rss_after,
        "router_rss_mib_after_each_round": rss_rounds,
        "router_rss_growth_mib_per_round": per_round,
        "router_upstream_sockets_before": socks_before,
        "router_upstream_sockets_after": socks_after,
        "elapsed_s": round(elapsed, 1),
        "turns_per_s": round(t.completed / elapsed, 1),
    }


def verdict(res: dict[str, Any]) -> list[str]:
    """The invariants the soak must hold (empty when all hold)."""
    bad = []
    if res["turns_completed"] != res["turns_expected"] or res["conversations_incomplete"]:
        bad.append("lost turns")
    if res["wrong_or_crossed_answers"]:
        bad.append("wrong or crossed answers")
    if not (res["prefill_requests"] == res["decode_requests"] == res["client_attempts"]):
        bad.append("fake saw a different number of requests than the clients sent (lost or duplicated)")
    if res["client_errors"]:
        bad.append(f"client errors {res['client_errors']}")
    if res["fake_open_streams_after"] or res["router_in_flight_after"]:
        bad.append("streams or in-flight turns left open")
    after = res["router_upstream_sockets_after"]
    if after.get("CLOSE_WAIT", 0) or sum(after.values()) > 2 * res["conversations"] + 100:
        bad.append(f"leaked upstream sockets {after}")
    return bad


def run_soak(
    conversations: int, turns: int = 5, p_drop: float = 0.1, seed: int = 1, rounds: int = 2
) -> dict[str, Any]:
    """Start the fake pair and the router as processes, soak, stop them; return the figures."""
    py = sys.executable
    procs: list[_Proc] = []
    try:
        fake = _Proc(
            [py, "-m", "kvlease_stack.testing.fake_vllm", "--max-tokens", str(MAX_TOKENS), "--secret", SECRET]
        )
        procs.append(fake)
        router = _Proc(
            [
                py, "-m", "kvlease_router.cli",
                "--prefill", fake.info["prefill"], "--prefill-control", fake.info["prefill_control"],
                "--decode", fake.info["decode"][0], "--decode-control", fake.info["decode_control"][0],
                "--control-secret", SECRET, "--port", "0", "--log-level", "error",
                # all clients share one address here: no per-address fair share
                "--max-turns-per-ip", "0",
            ]
        )  # fmt: skip
        procs.append(router)
        urls = {
            "router": router.info["url"],
            "prefill": fake.info["prefill"],
            "decode": fake.info["decode"][0],
        }
        try:
            import uvloop

            loop_run: Any = uvloop.run
        except ImportError:  # pragma: no cover
            loop_run = asyncio.run
        res: dict[str, Any] = loop_run(_soak(urls, router.pid, conversations, turns, p_drop, seed, rounds))
        res["failures"] = verdict(res)
        return res
    finally:
        for p in reversed(procs):
            p.stop()


def run(quick: bool = False) -> dict[str, Any]:
    return run_soak(200 if quick else 1000, 5)


def print_table(res: dict[str, Any]) -> None:
    rows = [
        (
            "rounds x conversations x turns",
            f"{res['rounds']} x {res['conversations']} x {res['turns_per_conversation']}",
        ),
        (
            "client attempts / completed / expected",
            f"{res['client_attempts']} / {res['turns_completed']} / {res['turns_expected']}",
        ),
        ("mid-stream disconnects", res["mid_stream_disconnects"]),
        ("incomplete conversations", res["conversations_incomplete"]),
        ("wrong or crossed answers", res["wrong_or_crossed_answers"]),
        ("P / D requests (fake side)", f"{res['prefill_requests']} / {res['decode_requests']}"),
        ("D streams aborted", res["decode_streams_aborted"]),
        ("client errors", res["client_errors"] or 0),
        ("statuses", res["statuses"]),
        (
            "router RSS MiB before / after each round",
            f"{res['router_rss_mib_before']} / {res['router_rss_mib_after_each_round']}",
        ),
        ("router RSS growth MiB per round", res["router_rss_growth_mib_per_round"]),
        ("upstream sockets before", res["router_upstream_sockets_before"]),
        ("upstream sockets after", res["router_upstream_sockets_after"]),
        (
            "open streams / in flight after",
            f"{res['fake_open_streams_after']} / {res['router_in_flight_after']:g}",
        ),
        ("elapsed s / turns per s", f"{res['elapsed_s']} / {res['turns_per_s']}"),
        ("failures", res["failures"] or "none"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="200 conversations instead of 1,000")
    ap.add_argument("--conversations", type=int, help="override the number of conversations")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="repeat the load (RSS after each round)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    a = ap.parse_args()
    n = a.conversations or (200 if a.quick else 1000)
    res = run_soak(n, a.turns, rounds=a.rounds)
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        print_table(res)
    raise SystemExit(1 if res["failures"] else 0)


if __name__ == "__main__":
    main()
