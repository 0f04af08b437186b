"""SDK overhead: the kvlease-wrapped openai client vs the raw openai client, per call.

Both clients talk to the same fast fake OpenAI-compatible router on 127.0.0.1 (a threaded stdlib
server, ``tests/fakes/openai_server.py``, in its own process so it does not share this process's
GIL or CPU clock) and run the same agent loop: multi-turn conversations whose every turn resends the
whole history (``client.chat.completions.create(...)`` looked up per turn, as agent code does; the
wrapped client is the default ``kvlease.wrap(...)``, lease heartbeats on). The model's full reply is
appended, so every turn is classified exact (a ``ReuseOffWarning`` would fail the run).

Workloads (what is sent is measured and reported with the result):

- ``chat`` (the headline): 8 turns; a system prompt, then per turn a short user question and the
  model's 40-word reply (non-streaming: one JSON body; streaming: 42 SSE events); the request body
  grows from ~0.2 KB on turn 1 to ~2.8 KB on turn 8.
- ``agent`` (non-streaming): the same loop where each user turn also carries a 2 KB tool result (a
  file, a page, a command's output), so turn 8 resends ~19 KB of history, as a coding agent's does.

Method: a slot runs one conversation on each of four clients, back to back (each client takes
each place in the order in turn, slot by slot), so the pair compared ran within about a tenth of a
second: a shared machine's speed, which here changes over seconds (a call's time moved between 2
and 4 ms within minutes), hits both alike. The clients:

- ``raw``: the raw openai client, sending no conversation id;
- ``raw_b``: a second raw client, identical to the first (the A/A arm: how far two identical
  clients differ is the noise floor of the figures, printed with them);
- ``raw_id``: the raw client sending each conversation's id itself (``X-Conversation-Id``, the
  router-only path of ``docs/frameworks.md``), so the server does for it what it does for a wrapped
  call (the conversation's lease bookkeeping) and answers it the same headers;
- ``wrapped``: a conversation of the default ``kvlease.wrap(...)``.

Warm-up conversations come first. Per slot: wall-clock and client CPU time
(``time.process_time``: this process, the keeper thread included) per call for each client, and
their ratios. **The SDK overhead is ``wrapped / raw_id - 1``**: what the SDK adds on the client to
the same conversation on the same server. ``wrapped / raw - 1`` is printed beside it: that figure
also holds the server's work for a tracked call and the headers it answers, which are the router's
cost (``benchmarks/router_overhead.py`` measures the router), not the SDK's. Each is the median over
slots of the paired ratio, with the 25th-75th percentile of the ratios as its spread; CPU time is
the steadier figure of what the SDK adds. The machine's load average is recorded at start and end.
Goal: <= 3 % for non-streaming and streaming calls.

``--breakdown`` runs, instead, one client per public setting (the HTTP layer alone, no strip
detector, no keeper thread) beside the raw and the default wrapped clients, to show where the added
time goes.

Run: ``python benchmarks/sdk_overhead.py [--quick] [--breakdown]``; importable: ``run(quick) -> dict``,
``breakdown(rounds) -> dict``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from openai import OpenAI

import kvlease
from kvlease import protocol
from kvlease._http import FAMILY

TURNS = 8
CONTENT = " ".join(f"word{i}" for i in range(40))  # 40 SSE chunks per streamed reply
SYSTEM = {"role": "system", "content": "You are a terse assistant."}
#: a 2 KB tool result, different on every turn (as a file or a command's output is)
TOOL_RESULT = "\n".join(f"line {i:03d}: result of step {{turn}}, value {i * 37 % 1000}" for i in range(50))


def _question(turn: int) -> str:
    return f"Question {turn}: tell me more about item {turn}."


def _agent_question(turn: int) -> str:
    return f"Tool output of step {turn}:\n{TOOL_RESULT.format(turn=turn)[:2048]}\nWhat next?"


WORKLOADS: dict[str, Callable[[int], str]] = {"chat": _question, "agent": _agent_question}


def _conversation(client: Any, question: Callable[[int], str], stream: bool) -> None:
    """One conversation; ``client`` has ``.chat`` (an openai client or a kvlease conversation)."""
    msgs: list[dict[str, Any]] = [SYSTEM]
    for turn in range(TURNS):
        msgs.append({"role": "user", "content": question(turn)})
        if stream:
            chunks = client.chat.completions.create(model="m", messages=msgs, stream=True)
            text = "".join([c.choices[0].delta.content or "" for c in chunks])
        else:
            text = client.chat.completions.create(model="m", messages=msgs).choices[0].message.content
        msgs.append({"role": "assistant", "content": text})


def _sizes(question: Callable[[int], str]) -> dict[str, Any]:
    """What the workload sends: messages and request-body bytes on the first and last turn."""
    msgs: list[dict[str, Any]] = [SYSTEM]
    body: list[int] = []
    for turn in range(TURNS):
        msgs.append({"role": "user", "content": question(turn)})
        body.append(len(json.dumps({"messages": msgs, "model": "m"}, separators=(",", ":"))))
        msgs.append({"role": "assistant", "content": CONTENT})
    return {
        "messages_sent_first_last": [2, 2 * TURNS],
        "body_bytes_first_last": [body[0], body[-1]],
        "body_bytes_mean": round(statistics.fmean(body)),
        "reply_bytes": len(CONTENT),
    }


def _one(
    kind: str,
    raws: dict[str, OpenAI],
    kc: kvlease.KVLeaseClient,
    question: Callable[[int], str],
    stream: bool,
) -> tuple[float, float]:
    """Wall-clock and client-CPU seconds of one conversation (opening and closing it excluded)."""
    conv = kc.conversation() if kind == "wrapped" else None
    client: Any = conv if conv is not None else _raw_client(kind, raws)
    t0, c0 = time.perf_counter(), time.process_time()
    _conversation(client, question, stream)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if conv is not None:
        conv.close()  # the lease release is not part of a call
    return wall, cpu


def _raw_client(kind: str, raws: dict[str, OpenAI]) -> OpenAI:
    """``raw_id``: the raw client sending one conversation's id on every turn itself (the
    router-only path), so the server does for it what it does for a wrapped call and answers the
    same headers; the other raw kinds send none."""
    if kind != "raw_id":
        return raws[kind]
    return raws["raw"].with_options(
        default_headers={protocol.HEADER_CONVERSATION_ID: f"bench-{secrets.token_hex(8)}"}
    )


def _q(xs: list[float], p: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[round(p * 100) - 1] if len(xs) > 1 else xs[0]


#: The clients of one round: the raw openai client, a second raw client (the A/A arm: what two
#: identical clients differ by here is the noise floor of the figure), the raw client sending a
#: conversation id (``raw_id``: the server's work and answer are the wrapped call's, so the
#: difference is the SDK's own), and the wrapped client.
KINDS = ("raw", "raw_b", "raw_id", "wrapped")


def _orders(i: int) -> tuple[str, ...]:
    """The order of the clients in slot ``i`` of a round: each client takes each place in turn."""
    k = i % len(KINDS)
    order = KINDS[k:] + KINDS[:k]
    return order if (i // len(KINDS)) % 2 == 0 else order[::-1]


def _measure(
    raws: dict[str, OpenAI],
    kc: kvlease.KVLeaseClient,
    question: Callable[[int], str],
    rounds: int,
    conversations: int,
    stream: bool,
) -> dict[str, Any]:
    for i in range(3):  # warm-up: connections, imports, pydantic caches
        for kind in _orders(i):
            _one(kind, raws, kc, question, stream)
    wall: dict[str, list[float]] = {k: [] for k in KINDS}
    cpu: dict[str, list[float]] = {k: [] for k in KINDS}
    #: per slot (one conversation of each client, back to back): wrapped vs raw_id (the SDK's
    #: own), wrapped vs raw (with the server's work for a tracked call and its headers), raw_b vs
    #: raw (A/A); wall-clock and client CPU
    ratios: dict[str, list[float]] = {k: [] for k in ("sdk", "sdk_cpu", "total", "total_cpu", "aa")}
    for slot in range(rounds * conversations):
        got = {kind: _one(kind, raws, kc, question, stream) for kind in _orders(slot)}
        for kind, (w, c) in got.items():
            wall[kind].append(w / TURNS)
            cpu[kind].append(c / TURNS)
        ratios["sdk"].append(got["wrapped"][0] / got["raw_id"][0])
        ratios["sdk_cpu"].append(got["wrapped"][1] / got["raw_id"][1])
        ratios["total"].append(got["wrapped"][0] / got["raw"][0])
        ratios["total_cpu"].append(got["wrapped"][1] / got["raw"][1])
        ratios["aa"].append(got["raw_b"][0] / got["raw"][0])
    n = conversations * TURNS

    def pct(x: float) -> float:
        return round((x - 1) * 100, 2)

    def ms(kind: str, of: dict[str, list[float]] = wall) -> float:
        return round(statistics.median(of[kind]) * 1e3, 4)

    def us(a: str, b: str, of: dict[str, list[float]] = wall) -> float:
        return round((statistics.median(of[a]) - statistics.median(of[b])) * 1e6, 1)

    def spread(key: str) -> list[float]:
        return [pct(_q(ratios[key], 0.25)), pct(_q(ratios[key], 0.75))]

    return {
        "calls_per_client": rounds * n,
        "rounds": rounds,
        "slots": rounds * conversations,
        "raw_ms_per_call": ms("raw"),
        "raw_id_ms_per_call": ms("raw_id"),
        "wrapped_ms_per_call": ms("wrapped"),
        # the goal's figure: what the SDK adds to the same conversation on the same server
        "overhead_pct": pct(statistics.median(ratios["sdk"])),
        "overhead_pct_p25_p75": spread("sdk"),
        "added_us_per_call": us("wrapped", "raw_id"),
        "client_cpu_overhead_pct": pct(statistics.median(ratios["sdk_cpu"])),
        "client_cpu_overhead_pct_p25_p75": spread("sdk_cpu"),
        "added_client_cpu_us_per_call": us("wrapped", "raw_id", cpu),
        # against a raw client sending no id: the above plus the server's work for a tracked call
        "vs_no_id_overhead_pct": pct(statistics.median(ratios["total"])),
        "vs_no_id_overhead_pct_p25_p75": spread("total"),
        "vs_no_id_added_us_per_call": us("wrapped", "raw"),
        "vs_no_id_client_cpu_overhead_pct": pct(statistics.median(ratios["total_cpu"])),
        "raw_client_cpu_ms_per_call": ms("raw", cpu),
        "raw_id_client_cpu_ms_per_call": ms("raw_id", cpu),
        "wrapped_client_cpu_ms_per_call": ms("wrapped", cpu),
        "aa_pct": pct(statistics.median(ratios["aa"])),
        "aa_pct_p25_p75": spread("aa"),
    }


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run(quick: bool = False) -> dict[str, Any]:
    rounds, conversations = (8, 3) if quick else (25, 6)
    out: dict[str, Any] = {
        "http_family": FAMILY,
        "turns_per_conversation": TURNS,
        "cpus": os.cpu_count(),
        "load_average_at_start": _load(),
        "workloads": {name: _sizes(q) for name, q in WORKLOADS.items()},
    }
    with fake_server_process("--content", CONTENT) as base_url:
        raws = {k: OpenAI(base_url=base_url, api_key="k", max_retries=0) for k in ("raw", "raw_b")}
        kc = kvlease.wrap(OpenAI(base_url=base_url, api_key="k", max_retries=0))
        with warnings.catch_warnings():
            warnings.simplefilter("error", kvlease.ReuseOffWarning)  # every turn must be exact
            out["non_streaming"] = _measure(raws, kc, _question, rounds, conversations, stream=False)
            out["load_average_after_non_streaming"] = _load()
            out["streaming"] = _measure(raws, kc, _question, rounds, conversations, stream=True)
            out["load_average_after_streaming"] = _load()
            out["agent_non_streaming"] = _measure(
                raws, kc, _agent_question, rounds, conversations, stream=False
            )
        out["sse_chunks_per_reply"] = len(CONTENT.split()) + 2
        kc.close()
        for raw in raws.values():
            raw.close()
    out["load_average_at_end"] = _load()
    return out


@contextlib.contextmanager
def fake_server_process(*args: str) -> Iterator[str]:
    """The fake router in its own process group; yields its base URL; stopped by its id."""
    script = Path(__file__).resolve().parents[1] / "tests" / "fakes" / "openai_server.py"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(script.parents[1]), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.Popen(
        [sys.executable, str(script), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        ready: list[str] = []
        reader = threading.Thread(target=lambda: ready.append(proc.stdout.readline().strip()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(60)
        if not ready or not ready[0].startswith("http"):
            raise RuntimeError("the fake server did not start within 60 s")
        yield ready[0]
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        proc.wait(10)


def print_table(res: dict[str, Any]) -> None:
    print(
        f"SDK overhead vs raw openai client ({res['http_family']}, {res['turns_per_conversation']}-turn "
        f"conversations; {res['cpus']} CPUs, load average {res['load_average_at_start']} at start, "
        f"{res['load_average_at_end']} at end)"
    )
    for mode in ("non_streaming", "streaming", "agent_non_streaming"):
        r = res[mode]
        lo, hi = r["overhead_pct_p25_p75"]
        clo, chi = r["client_cpu_overhead_pct_p25_p75"]
        print(
            f"  {mode:20s} raw with the id {r['raw_id_ms_per_call']:.3f} ms/call  wrapped "
            f"{r['wrapped_ms_per_call']:.3f} ms/call  SDK overhead {r['overhead_pct']:+.2f} % (p25-p75 "
            f"{lo:+.2f} .. {hi:+.2f} %; {r['added_us_per_call']:+.1f} us; {r['calls_per_client']} calls per client)"
        )
        print(
            f"  {'':20s} client CPU: raw with the id {r['raw_id_client_cpu_ms_per_call']:.3f} ms/call  "
            f"wrapped {r['wrapped_client_cpu_ms_per_call']:.3f} ms/call  "
            f"overhead {r['client_cpu_overhead_pct']:+.2f} % (p25-p75 {clo:+.2f} .. {chi:+.2f} %; "
            f"{r['added_client_cpu_us_per_call']:+.1f} us)"
        )
        nlo, nhi = r["vs_no_id_overhead_pct_p25_p75"]
        print(
            f"  {'':20s} vs a raw client sending no id ({r['raw_ms_per_call']:.3f} ms/call; the server "
            f"does less for it): {r['vs_no_id_overhead_pct']:+.2f} % (p25-p75 {nlo:+.2f} .. {nhi:+.2f} %; "
            f"{r['vs_no_id_added_us_per_call']:+.1f} us; client CPU {r['vs_no_id_client_cpu_overhead_pct']:+.2f} %)"
        )
        alo, ahi = r["aa_pct_p25_p75"]
        print(
            f"  {'':20s} A/A (a second raw client against the first): {r['aa_pct']:+.2f} % "
            f"(p25-p75 {alo:+.2f} .. {ahi:+.2f} %): the noise floor of the figures above"
        )
    for name, w in res["workloads"].items():
        print(f"  workload {name}: {w}")


#: ``--breakdown``: where a wrapped call's added time goes, one public setting at a time.
BREAKDOWN = (
    ("raw", "the raw openai client"),
    ("raw_b", "a second raw client (A/A: the noise floor)"),
    (
        "raw_id",
        "the raw client sending a conversation id itself (the router-only path): the server does "
        "what it does for a wrapped call and answers the same headers",
    ),
    ("untracked", "kc.openai without a conversation id: kvlease's HTTP layer only"),
    ("reasoning_off", "a conversation of kvlease.wrap(..., reasoning='off'): no strip detector"),
    ("no_heartbeat", "a conversation of kvlease.wrap(..., heartbeat=False): no keeper thread"),
    ("wrapped", "a conversation of the default kvlease.wrap(...)"),
)


def breakdown(rounds: int = 30) -> dict[str, Any]:
    """Non-streaming chat calls of each :data:`BREAKDOWN` client, interleaved (the order rotates
    every round); the median per call of each, and its difference to the raw client's."""
    names = [name for name, _ in BREAKDOWN]
    per_call: dict[str, list[float]] = {name: [] for name in names}
    with fake_server_process("--content", CONTENT) as base_url:

        def openai_client() -> OpenAI:
            return OpenAI(base_url=base_url, api_key="k", max_retries=0)

        raws = {"raw": openai_client(), "raw_b": openai_client()}
        kcs = {
            "wrapped": kvlease.wrap(openai_client()),
            "reasoning_off": kvlease.wrap(openai_client(), reasoning="off"),
            "no_heartbeat": kvlease.wrap(openai_client(), heartbeat=False),
        }
        untracked = kcs["wrapped"].openai

        def one(name: str) -> float:
            conv = kcs[name].conversation() if name in kcs else None
            client: Any = (
                conv if conv is not None else untracked if name == "untracked" else _raw_client(name, raws)
            )
            t0 = time.perf_counter()
            _conversation(client, _question, stream=False)
            wall = time.perf_counter() - t0
            if conv is not None:
                conv.close()
            return wall / TURNS

        with warnings.catch_warnings():
            warnings.simplefilter("error", kvlease.ReuseOffWarning)
            for name in names * 3:  # warm-up
                one(name)
            for r in range(rounds):
                k = r % len(names)
                for name in names[k:] + names[:k]:
                    per_call[name].append(one(name))
        for c in kcs.values():
            c.close()
        for raw in raws.values():
            raw.close()
    base = statistics.median(per_call["raw"])
    return {
        "rounds": rounds,
        "load_average_at_end": _load(),
        "clients": {
            name: {
                "what": what,
                "ms_per_call": round(statistics.median(per_call[name]) * 1e3, 4),
                "added_us_per_call": round((statistics.median(per_call[name]) - base) * 1e6, 1),
                "added_pct": round((statistics.median(per_call[name]) / base - 1) * 100, 2),
            }
            for name, what in BREAKDOWN
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument(
        "--breakdown", action="store_true", help="where the added time goes, one public setting at a time"
    )
    args = parser.parse_args()
    if args.breakdown:
        res = breakdown(10 if args.quick else 30)
        print(f"SDK overhead breakdown, non-streaming chat ({res['rounds']} rounds, {os.cpu_count()} CPUs)")
        for name, c in res["clients"].items():
            print(
                f"  {name:14s} {c['ms_per_call']:.3f} ms/call  {c['added_pct']:+6.2f} % "
                f"({c['added_us_per_call']:+.1f} us)  {c['what']}"
            )
        print(f"  load average at end {res['load_average_at_end']}")
        return
    print_table(run(quick=args.quick))


if __name__ == "__main__":
    main()
