"""Seeded synthetic agent traffic: conversations of tool-calling turns with pauses (tests, benchmarks,
docs). Deterministic for a seed; pure (returns turns, writes nothing) except :func:`write_requests`."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path

from kvlease._analyze._model import TurnInput
from kvlease.protocol import TurnLogKey

T0 = 1_760_000_000.0


def agent_trace(
    conversations: int = 10_000,
    *,
    seed: int = 0,
    turns: tuple[int, int] = (2, 20),
    arrival_window_s: float = 12 * 3600.0,
    tool_pause_s: tuple[float, float] = (1.0, 120.0),
    long_pause_share: float = 0.25,
    long_pause_s: tuple[float, float] = (600.0, 1500.0),
    first_prompt: tuple[int, int] = (800, 4000),
    growth: tuple[int, int] = (50, 800),
    completion: tuple[int, int] = (20, 600),
    decode_tokens_per_s: float = 60.0,
) -> list[TurnInput]:
    """Turns of ``conversations`` agent conversations, sorted by start time.

    A conversation starts uniformly within ``arrival_window_s``; it has ``turns`` turns (uniform);
    between two turns the agent waits for a tool call (``tool_pause_s``, log-uniform) or, with
    ``long_pause_share``, for a long pause (a human, a build, a slow tool: ``long_pause_s``, uniform;
    the default lies beyond vLLM's 480 s TTL and within kvlease's 1800 s max-idle). Each prompt is
    the previous prompt plus its completion plus ``growth`` new tokens (the tool's result), so the
    previous turn's KV is a prefix of the next prompt. A turn ends ``completion /
    decode_tokens_per_s`` after it starts; the rows carry no end time (like a request log): gaps are
    measured from the previous start.
    """
    rng = random.Random(seed)
    lo_log, hi_log = tool_pause_s
    rows: list[TurnInput] = []
    for k in range(conversations):
        cid = f"agent-{k:06d}"
        ts = T0 + rng.uniform(0.0, arrival_window_s)
        prompt = rng.randint(*first_prompt)
        for _ in range(rng.randint(*turns)):
            comp = rng.randint(*completion)
            rows.append((cid, round(ts, 3), prompt, comp, None, None))
            if rng.random() < long_pause_share:
                pause = rng.uniform(*long_pause_s)
            else:
                pause = lo_log * (hi_log / lo_log) ** rng.random()
            ts += comp / decode_tokens_per_s + pause
            prompt += comp + rng.randint(*growth)
    rows.sort(key=lambda r: r[1])
    return rows


def write_requests(rows: Iterable[TurnInput], path: str | Path, *, shuffle_seed: int | None = None) -> Path:
    """Write ``rows`` as a request log (JSONL); ``shuffle_seed`` shuffles the lines (a merged log)."""
    lines = [
        json.dumps(
            {
                TurnLogKey.CONVERSATION_ID: cid,
                TurnLogKey.TS: ts,
                TurnLogKey.PROMPT_TOKENS: p,
                TurnLogKey.COMPLETION_TOKENS: c,
            }
        )
        for cid, ts, p, c, _end, _gap in rows
    ]
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(lines)
    out = Path(path)
    out.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return out
