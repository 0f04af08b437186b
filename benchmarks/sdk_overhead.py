"""SDK overhead: the kvlease-wrapped openai client vs the raw openai client, per call.

Both clients talk to the same fast fake OpenAI-compatible router on 127.0.0.1 (a threaded stdlib
server, ``tests/fakes/openai_server.py``, in its own process so it does not share this process's
GIL or CPU clock) and send the same multi-turn conversations (8 turns each,
the history growing as an agent's does; the wrapped client appends the model's full reply so every
turn is classified exact). Rounds alternate raw and wrapped to cancel drift on a shared machine;
the figure is the median over rounds of the mean time per call, and the overhead is
``wrapped / raw - 1``. Goal: <= 3 % for non-streaming and streaming calls. Besides wall-clock time
per call, the client's own CPU time per call (``time.process_time``) is reported: on a busy machine
it is the steadier figure of what the SDK adds.

Run: ``python benchmarks/sdk_overhead.py [--quick]``; importable: ``run(quick) -> dict``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from openai import OpenAI

import kvlease
from kvlease._http import FAMILY

TURNS = 8
CONTENT = " ".join(f"word{i}" for i in range(40))  # 40 SSE chunks per streamed reply


def _conversation(create: Any, stream: bool) -> None:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a terse assistant."}]
    for turn in range(TURNS):
        msgs.append({"role": "user", "content": f"Question {turn}: tell me more about item {turn}."})
        if stream:
            parts = [c.choices[0].delta.content or "" for c in create(model="m", messages=msgs, stream=True)]
            text = "".join(parts)
        else:
            text = create(model="m", messages=msgs).choices[0].message.content
        msgs.append({"role": "assistant", "content": text})


def _round(
    kind: str, raw: OpenAI, kc: kvlease.KVLeaseClient, conversations: int, stream: bool
) -> tuple[float, float]:
    """Mean wall-clock and client-CPU seconds per call of ``conversations`` conversations."""
    t = cpu = 0.0
    for _ in range(conversations):
        conv = kc.conversation() if kind == "wrapped" else None
        create = raw.chat.completions.create if conv is None else conv.chat.completions.create
        t0, c0 = time.perf_counter(), time.process_time()
        _conversation(create, stream)
        t += time.perf_counter() - t0
        cpu += time.process_time() - c0
        if conv is not None:
            conv.close()  # the release is not part of a call
    n = conversations * TURNS
    return t / n, cpu / n


def _measure(
    raw: OpenAI, kc: kvlease.KVLeaseClient, rounds: int, conversations: int, stream: bool
) -> dict[str, Any]:
    per: dict[str, list[float]] = {"raw": [], "wrapped": []}
    per_cpu: dict[str, list[float]] = {"raw": [], "wrapped": []}
    for _ in range(2):  # warm-up: connections, imports, pydantic caches
        _round("raw", raw, kc, 2, stream)
        _round("wrapped", raw, kc, 2, stream)
    for i in range(rounds):
        order = ("raw", "wrapped") if i % 2 == 0 else ("wrapped", "raw")
        for kind in order:
            wall, cpu = _round(kind, raw, kc, conversations, stream)
            per[kind].append(wall)
            per_cpu[kind].append(cpu)
    raw_s = statistics.median(per["raw"])
    wrapped_s = statistics.median(per["wrapped"])
    raw_cpu = statistics.median(per_cpu["raw"])
    wrapped_cpu = statistics.median(per_cpu["wrapped"])
    return {
        "calls_per_client": rounds * conversations * TURNS,
        "raw_ms_per_call": round(raw_s * 1e3, 4),
        "wrapped_ms_per_call": round(wrapped_s * 1e3, 4),
        "added_us_per_call": round((wrapped_s - raw_s) * 1e6, 1),
        "overhead_pct": round((wrapped_s / raw_s - 1) * 100, 2),
        "best_raw_ms": round(min(per["raw"]) * 1e3, 4),
        "best_wrapped_ms": round(min(per["wrapped"]) * 1e3, 4),
        "overhead_pct_of_best": round((min(per["wrapped"]) / min(per["raw"]) - 1) * 100, 2),
        "raw_client_cpu_ms_per_call": round(raw_cpu * 1e3, 4),
        "wrapped_client_cpu_ms_per_call": round(wrapped_cpu * 1e3, 4),
        "client_cpu_overhead_pct": round((wrapped_cpu / raw_cpu - 1) * 100, 2),
    }


def run(quick: bool = False) -> dict[str, Any]:
    rounds, conversations = (6, 4) if quick else (20, 10)
    out: dict[str, Any] = {"http_family": FAMILY, "turns_per_conversation": TURNS}
    with fake_server_process("--content", CONTENT) as base_url:
        raw = OpenAI(base_url=base_url, api_key="k", max_retries=0)
        kc = kvlease.wrap(OpenAI(base_url=base_url, api_key="k", max_retries=0), heartbeat=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error", kvlease.ReuseOffWarning)  # every turn must be exact
            out["non_streaming"] = _measure(raw, kc, rounds, conversations, stream=False)
            out["streaming"] = _measure(raw, kc, rounds, conversations, stream=True)
        out["sse_chunks_per_reply"] = len(CONTENT.split()) + 2
        kc.close()
        raw.close()
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    args = parser.parse_args()
    res = run(quick=args.quick)
    print(
        f"SDK overhead vs raw openai client ({res['http_family']}, {res['turns_per_conversation']}-turn conversations)"
    )
    for mode in ("non_streaming", "streaming"):
        r = res[mode]
        print(
            f"  {mode:14s} raw {r['raw_ms_per_call']:.3f} ms/call  wrapped {r['wrapped_ms_per_call']:.3f} ms/call  "
            f"added {r['added_us_per_call']:+.1f} us  overhead {r['overhead_pct']:+.2f} % "
            f"(best-of-rounds {r['overhead_pct_of_best']:+.2f} %, {r['calls_per_client']} calls per client)"
        )
        print(
            f"  {'':14s} client CPU: raw {r['raw_client_cpu_ms_per_call']:.3f} ms/call  "
            f"wrapped {r['wrapped_client_cpu_ms_per_call']:.3f} ms/call  overhead {r['client_cpu_overhead_pct']:+.2f} %"
        )


if __name__ == "__main__":
    main()
