"""Write the analyzer's sample inputs under ``tests/data/`` (deterministic: same bytes every run).

    python scripts/make_samples.py            # (re)write the samples
    python scripts/make_samples.py --check    # exit 1 if a committed sample differs

The small files are hand-written cases whose figures the tests compute by hand; ``agents.jsonl`` is
a seeded synthetic agent workload (tool calls of seconds to minutes, some humans taking longer).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from kvlease.protocol import TurnLogRecord

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"


def _jsonl(rows: list[object]) -> bytes:
    out = []
    for row in rows:
        out.append(row if isinstance(row, str) else json.dumps(row, separators=(", ", ": ")))
    return ("\n".join(out) + "\n").encode()


def requests_small() -> bytes:
    """Unsorted turns, duplicate timestamps, zero-token prompts, a one-turn conversation, 2 bad lines."""
    return _jsonl(
        [
            {"conversation_id": "a", "ts": 1010, "prompt_tokens": 150, "completion_tokens": 30},
            {"conversation_id": "a", "ts": 1000, "prompt_tokens": 100, "completion_tokens": 20},
            {"conversation_id": "c", "ts": 1500, "prompt_tokens": 300},
            "this line is not JSON",
            {"conversation_id": "a", "ts": 1600, "prompt_tokens": 200},
            {"conversation_id": "b", "ts": 2000, "prompt_tokens": 0},
            {"conversation_id": "b", "ts": 2000, "prompt_tokens": 50},
            {"conversation_id": "", "ts": 2500, "prompt_tokens": 10},
            {"conversation_id": "d", "ts": 3000, "prompt_tokens": 0},
            {"conversation_id": "d", "ts": 3100, "prompt_tokens": 0},
            {"conversation_id": "b", "ts": 4000, "prompt_tokens": 60},
        ]
    )


def turnlog_small() -> bytes:
    """Two conversations as the SDK writes them (``gap_s`` measured from the previous turn's end)."""
    rows = [
        ("t1", 100.0, 1000, 200, 0.8, "first", 0, None),
        ("t1", 130.0, 1300, 100, 0.2, "hit", 1184, 25.0),
        ("t1", 800.0, 1500, 50, 0.9, "expired", 0, 660.0),
        ("t2", 200.0, 500, None, 0.3, "first", 0, None),
        ("t2", 210.0, None, None, None, "error", None, 5.0),
    ]
    return _jsonl([TurnLogRecord(*r).to_json() for r in rows])


def vllm_stats() -> bytes:
    """vLLM multi-turn benchmark ``--stats-json-output`` shape (a JSON array, indent 2)."""

    def stat(conv: str, start: float, latency: float, turns: int, inp: object, out: int) -> dict[str, object]:
        return {
            "ttft_ms": 50.0,
            "tpot_ms": 20.0,
            "latency_ms": latency,
            "start_time_ms": start,
            "input_num_turns": turns,
            "input_num_tokens": inp,
            "output_num_tokens": out,
            "output_num_chunks": out - 1,
            "output_num_first_chunk_tokens": 1,
            "approx_cached_percent": 0.0,
            "conversation_id": conv,
            "client_id": 0,
        }

    rows = [
        stat("CONV_ID_0", 1000.0, 500.0, 1, 100, 20),
        stat("CONV_ID_1", 1200.0, 300.0, 1, 400, 40),
        stat("CONV_ID_0", 3000.0, 400.0, 3, 150, 10),
        stat("CONV_ID_1", 9000.0, 300.0, 3, "many", 40),
        stat("CONV_ID_0", 603400.0, 400.0, 5, 170, 10),
    ]
    return (json.dumps(rows, indent=2) + "\n").encode()


def mooncake_small() -> bytes:
    """Two sessions inferred from chained hash ids (512-token blocks)."""
    return _jsonl(
        [
            {"timestamp": 0, "input_length": 1100, "output_length": 50, "hash_ids": [0, 1, 2]},
            {"timestamp": 1000, "input_length": 700, "output_length": 20, "hash_ids": [7, 8]},
            {"timestamp": 5000, "input_length": 1700, "output_length": 30, "hash_ids": [0, 1, 4, 5]},
            {"timestamp": 600000, "input_length": 2300, "output_length": 40, "hash_ids": [0, 1, 4, 9, 10]},
        ]
    )


def agents(conversations: int = 100, seed: int = 7) -> bytes:
    """A synthetic agent workload: prompts grow by the last response plus a tool result."""
    rng = random.Random(seed)
    rows: list[tuple[float, str]] = []
    for c in range(conversations):
        t = 1_760_000_000.0 + rng.uniform(0, 7200)
        prompt = rng.randint(1500, 6000)
        for _ in range(rng.randint(1, 25)):
            completion = rng.randint(20, 600)
            row = {"conversation_id": f"agent-{c:04d}", "ts": round(t, 3), "prompt_tokens": prompt,
                   "completion_tokens": completion}  # fmt: skip
            rows.append((t, json.dumps(row)))
            kind = rng.random()
            gap = (
                rng.lognormvariate(2.0, 1.0)
                if kind < 0.8
                else rng.uniform(300, 3000)
                if kind < 0.97
                else 7200
            )
            t += rng.uniform(2, 20) + gap
            prompt += completion + rng.randint(50, 2000)
    rows.sort(key=lambda r: r[0])
    return ("\n".join(line for _, line in rows) + "\n").encode()


def samples() -> dict[str, bytes]:
    return {
        "requests_small.jsonl": requests_small(),
        "turnlog_small.jsonl": turnlog_small(),
        "vllm_multiturn_stats.json": vllm_stats(),
        "mooncake_small.jsonl": mooncake_small(),
        "agents.jsonl": agents(),
        "empty.jsonl": b"",
    }


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    DATA.mkdir(parents=True, exist_ok=True)
    for name, data in samples().items():
        path = DATA / name
        if check:
            if not path.exists() or path.read_bytes() != data:
                stale.append(name)
        else:
            path.write_bytes(data)
    if stale:
        print("stale samples (run scripts/make_samples.py):", ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
