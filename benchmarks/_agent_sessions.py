"""Pure parts of the agent-load benchmark: the sessions, their text, and the arithmetic of the figures.

No IO but reading the session file; no vLLM, no network. ``benchmarks/agent_load.py`` drives them.

The session file is AIPerf's agentic-code synthesizer output (Mooncake-style JSON lines: one row per
turn, ``session_id``, ``input_length`` (the first turn's whole prompt, then the tokens the turn adds),
``output_length``, ``hash_ids`` (one id per block of ``block_size`` tokens; equal ids are equal
text), ``delay`` (ms before the turn: the recorded think or tool time). How it was made:
``benchmarks/data/agent_sessions.md``.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data"
SESSIONS_FILE = DATA / "agent_sessions.jsonl"
#: AIPerf's ``block_size`` in the synthesizer config (tokens per hash id).
HASH_BLOCK_TOKENS = 16

#: Gap buckets (seconds, recorded time): under 10 s, 10-60 s, 60-480 s, over 480 s.
GAP_BUCKETS: tuple[tuple[str, float, float], ...] = (
    ("<10s", 0.0, 10.0),
    ("10-60s", 10.0, 60.0),
    ("60-480s", 60.0, 480.0),
    (">480s", 480.0, math.inf),
)


@dataclass(frozen=True)
class Turn:
    hash_ids: tuple[int, ...]  # the blocks this turn adds to the prompt
    input_tokens: int  # tokens it adds (the whole prompt on the first turn)
    output_tokens: int  # the recorded answer length
    delay_s: float  # recorded think/tool time before this turn (0 on the first)


@dataclass(frozen=True)
class Session:
    id: str
    turns: tuple[Turn, ...]


def load_sessions(path: Path = SESSIONS_FILE) -> list[Session]:
    """The sessions of an AIPerf/Mooncake JSON-lines file, in file order."""
    order: list[str] = []
    turns: dict[str, list[Turn]] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        sid = str(row["session_id"])
        if sid not in turns:
            order.append(sid)
            turns[sid] = []
        delay = 0.0 if not turns[sid] else float(row.get("delay", 0.0)) / 1000.0
        turns[sid].append(
            Turn(
                tuple(int(h) for h in row["hash_ids"]),
                int(row["input_length"]),
                int(row["output_length"]),
                delay,
            )
        )
    return [Session(sid, tuple(turns[sid])) for sid in order]


_WORDS = ("load", "store", "parse", "check", "emit", "merge", "split", "index", "cache", "flush")


def block_text(h: int) -> str:
    """Deterministic code-like text for one hash id (about one 16-token block)."""
    rng = random.Random(h)
    a, b = rng.choice(_WORDS), rng.choice(_WORDS)
    return f"r{h % 997} = {a}_{b}(item{rng.randrange(100)}, {rng.randrange(1000)})\n"


def turn_text(turn: Turn) -> str:
    return "".join(block_text(h) for h in turn.hash_ids)


def first_messages(session: Session, shared_blocks: int) -> list[dict[str, str]]:
    """The first turn: the hash ids every session shares (AIPerf's layer 1) as the system prompt,
    the rest as the task."""
    ids = session.turns[0].hash_ids
    system = "You are a coding agent. Repository context:\n" + "".join(
        block_text(h) for h in ids[:shared_blocks]
    )
    task = "Task: fix the failing handler.\n" + "".join(block_text(h) for h in ids[shared_blocks:])
    return [{"role": "system", "content": system}, {"role": "user", "content": task}]


def shared_prefix_blocks(sessions: Sequence[Session]) -> int:
    """How many leading hash ids every session's first turn shares."""
    firsts = [s.turns[0].hash_ids for s in sessions]
    n = 0
    while all(len(f) > n and f[n] == firsts[0][n] for f in firsts):
        n += 1
    return n


def answer_regex(tokens: int) -> str:
    """The answer's shape (structured outputs): single digits joined by commas, about ``tokens``
    tokens. The stack's models do not re-tokenize their own free text to what they generated (a
    guided answer of words comes out a character a token); digits and commas never merge in their
    tokenizer, so this answer's text re-tokenizes to exactly the tokens D holds."""
    n = max(2, (tokens + 1) // 2)
    return f"[0-9](,[0-9]){{{n - 1}}}"


def schedule(sessions: Sequence[Session], n: int) -> list[list[Session]]:
    """Session ``i`` of the file goes to live slot ``i % n``: each slot replays its sessions back to
    back (a new one starts when the previous ends), so ``n`` sessions are live at every moment."""
    if n < 1:
        raise ValueError("n must be >= 1")
    return [list(sessions[i::n]) for i in range(n)]


# --------------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile ``q`` in [0, 100] (numpy's default), None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def pcts(values: Sequence[float], qs: Iterable[float] = (50, 90, 99)) -> dict[str, float | None]:
    return {f"p{q:g}": percentile(values, q) for q in qs}


def gap_bucket(gap_s: float) -> str:
    for name, lo, hi in GAP_BUCKETS:
        if lo <= gap_s < hi:
            return name
    raise ValueError(f"gap must be >= 0, not {gap_s}")


def block_seconds(samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(block·s, max) of a step function sampled as ``(t, blocks)``: each value holds until the next
    sample (trapezoids would invent blocks between polls)."""
    total = 0.0
    for (t0, b0), (t1, _) in itertools.pairwise(samples):
        total += b0 * max(0.0, t1 - t0)
    return total, max((b for _, b in samples), default=0.0)


def supported_sessions(p90_by_n: dict[int, float | None], target_s: float) -> int:
    """Largest N whose TTFT p90 is under ``target_s`` (0: none); an N with no figure does not count."""
    ok = [n for n, p in p90_by_n.items() if p is not None and p <= target_s]
    return max(ok, default=0)


def summarize(turns: Sequence[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """Per-arm figures from the replay's turn records (see ``_agent_replay._turn``)."""
    done = [t for t in turns if not t.get("error")]
    ttfts = [t["ttft_s"] for t in done if t.get("ttft_s") is not None]
    follow = [t for t in done if t["turn"] > 0]
    hits = [t for t in follow if t.get("status") == "hit"]
    prompt = sum(t.get("prompt_tokens") or 0 for t in follow)
    reused = sum(t.get("reused_tokens") or 0 for t in hits)
    by_bucket: dict[str, dict[str, Any]] = {}
    for name, _, _ in GAP_BUCKETS:
        xs = [t["ttft_s"] for t in follow if t.get("bucket") == name and t.get("ttft_s") is not None]
        by_bucket[name] = {"n": len(xs), **pcts(xs)}
    itl = [x for t in done for x in t.get("itl_s", ())]
    out_tokens = sum(t.get("completion_tokens") or 0 for t in done)
    checked = [t for t in follow if t.get("round_trip") is not None]
    statuses: dict[str, int] = {}
    for t in follow:
        statuses[str(t.get("status"))] = statuses.get(str(t.get("status")), 0) + 1
    return {
        "turns": len(turns),
        "follow_up_turns": len(follow),
        "failed_turns": len(turns) - len(done),
        "ttft_s": pcts(ttfts),
        "ttft_by_gap_s": by_bucket,
        "hit_rate": len(hits) / len(follow) if follow else None,
        "reused_token_share": reused / prompt if prompt else None,
        "statuses": statuses,
        "round_trip_rate": (sum(1 for t in checked if t["round_trip"]) / len(checked) if checked else None),
        "decode_tokens_per_s": out_tokens / wall_s if wall_s > 0 else None,
        "itl_s": pcts(itl, (50, 99)),
    }


# --------------------------------------------------------------------------------------------------
# Scrapes: counter deltas, histogram quantiles, and TTFT of a non-streamed turn
# --------------------------------------------------------------------------------------------------

_LE = re.compile(r'le="([^"]+)"')


def counter_deltas(
    before: Mapping[str, float], after: Mapping[str, float], prefixes: Sequence[str]
) -> dict[str, float]:
    """What each counter sample (``name_total{labels}``, keyed as the scrape keys it) whose name
    starts with one of ``prefixes`` grew by between two scrapes; zero deltas left out."""
    out: dict[str, float] = {}
    for key, value in after.items():
        name = key.split("{", 1)[0]
        if not name.endswith("_total") or not name.startswith(tuple(prefixes)):
            continue
        delta = value - before.get(key, 0.0)
        if delta:
            out[key] = round(delta, 3)
    return dict(sorted(out.items()))


def histogram_delta(
    before: Mapping[str, float], after: Mapping[str, float], name: str
) -> tuple[list[tuple[float, float]], float, float]:
    """(cumulative buckets ``[(le, count)]``, sum, count) of histogram ``name`` observed between two
    scrapes, summed over its label sets."""
    buckets: dict[float, float] = {}
    for key, value in after.items():
        if key.split("{", 1)[0] != name + "_bucket":
            continue
        m = _LE.search(key)
        if m is None:
            continue
        le = math.inf if m.group(1) in ("+Inf", "inf") else float(m.group(1))
        buckets[le] = buckets.get(le, 0.0) + value - before.get(key, 0.0)

    def total(suffix: str) -> float:
        return sum(v - before.get(k, 0.0) for k, v in after.items() if k.split("{", 1)[0] == name + suffix)

    return sorted(buckets.items()), total("_sum"), total("_count")


def histogram_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float | None:
    """Prometheus' ``histogram_quantile`` (linear within a bucket) of cumulative ``buckets``, ``q``
    in [0, 1]; None when nothing was observed."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lo_le, lo_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lo_le
            if count == lo_count:
                return le
            return lo_le + (le - lo_le) * (rank - lo_count) / (count - lo_count)
        lo_le, lo_count = le, count
    return lo_le


def estimate_ttft(e2e_s: float, completion_tokens: int, itl_s: float) -> float:
    """TTFT of a non-streamed turn: its end-to-end time less the decode steps after the first token
    (``completion_tokens - 1`` of them, each D's mean inter-token latency over the run)."""
    return max(0.0, e2e_s - max(0, completion_tokens - 1) * itl_s)


def error_summary(errors: Sequence[float]) -> dict[str, Any]:
    """The TTFT estimate's error on streamed turns: n, median signed error, p90 of |error|."""
    return {
        "n": len(errors),
        "median": percentile(errors, 50),
        "p90_abs": percentile([abs(e) for e in errors], 90),
    }


def fill_ttft_estimates(turns: Sequence[dict[str, Any]], itl_s: float | None) -> list[float]:
    """Give each answered turn without a measured TTFT (non-streamed) its estimate; return the
    estimate's error (estimate - measured) on the turns whose TTFT was measured."""
    errors: list[float] = []
    for t in turns:
        if t.get("error") or itl_s is None or t.get("completion_tokens") is None:
            continue
        est = estimate_ttft(t["e2e_s"], t["completion_tokens"], itl_s)
        if t.get("ttft_s") is None:
            t["ttft_s"] = est
        else:
            errors.append(est - t["ttft_s"])
    return errors
