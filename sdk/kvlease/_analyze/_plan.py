"""The capacity planner's core: replay turns through a model of decode-side KV retention (sans-IO).

Reading path: :class:`ModelKV` (bytes per token) -> :func:`prepare` (turns -> a :class:`Trace`,
sorted by arrival) -> :func:`replay` (one policy, one cap) -> :func:`plan_trace` (the sweep of caps
and the recommendation, in ``_plan_report``'s types). Nothing here reads files or clocks.

The model, per decode node (a conversation lives on node ``crc32(id) % nodes``: the router keeps a
conversation on the decode node that served it):

- after each turn the node retains the conversation's KV: ``prompt + completion`` tokens of that
  turn, rounded up to whole blocks of ``block_size`` tokens, ``bytes_per_token`` each. It replaces
  what the conversation held before, and is counted from the turn's arrival (the turn's own
  running KV is not told apart from what it leaves behind);
- the retention ends at ``done + retention_s``: ``done`` is the turn's end when the input records
  it (vLLM stats), ``next.ts - next.gap`` when the next turn carries a measured gap (the SDK turn
  log), else the turn's start. ``retention_s`` is the fixed TTL (``Policy.TTL``, upstream vLLM's
  ``decoder_kv_blocks_ttl``) or the lease's max-idle (``Policy.LEASE``: heartbeats renew the lease
  until the conversation has been idle that long);
- with a cap, when a node's retained bytes exceed it, the retention with the oldest deadline is
  evicted first (kvlease's ``max_retained_fraction``; with the fixed TTL the oldest deadline is
  also the least recently used);
- a follow-up turn is a *hit* when its conversation's KV is still retained at its arrival
  (``deadline >= ts`` and not evicted). A hit reuses ``min(previous prompt + completion, prompt)``
  tokens (the analyzer's estimate), the prefill it saves.

With no cap, hits depend on the gaps only: they equal the analyzer's turns within the TTL (or
within max-idle), and the reused tokens its saved prefill tokens.
"""

from __future__ import annotations

import enum
import math
import zlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from heapq import heappop, heappush
from typing import Final

from kvlease._analyze._model import DEFAULT_MAX_IDLE, DEFAULT_TTL, TurnInput

#: vLLM's default KV block size, tokens.
DEFAULT_BLOCK_SIZE: Final = 16

DTYPE_BYTES: Final = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1}


@dataclass(frozen=True)
class ModelKV:
    """The KV cache layout of a model: ``2 * layers * kv_heads * head_dim * dtype`` bytes a token."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bf16"
    name: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        if min(self.layers, self.kv_heads, self.head_dim) <= 0:
            raise ValueError("layers, kv_heads and head_dim must be positive")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]


#: Published configs (``config.json`` of each model on the Hugging Face Hub), KV in bf16.
PRESETS: Final[dict[str, ModelKV]] = {
    m.name: m
    for m in (
        ModelKV(16, 8, 64, name="llama-3.2-1b"),
        ModelKV(32, 8, 128, name="llama-3.1-8b"),
        ModelKV(80, 8, 128, name="llama-3.1-70b"),
        ModelKV(28, 8, 128, name="qwen3-0.6b"),
        ModelKV(36, 8, 128, name="qwen3-8b"),
        ModelKV(64, 8, 128, name="qwen3-32b"),
        ModelKV(28, 4, 128, name="qwen2.5-7b"),
        ModelKV(64, 8, 128, name="qwen2.5-32b"),
        ModelKV(80, 8, 128, name="qwen2.5-72b"),
        ModelKV(40, 8, 128, name="mistral-small-24b"),
        ModelKV(24, 8, 64, name="gpt-oss-20b", note="half the layers use a 128-token sliding window"),
        ModelKV(36, 8, 64, name="gpt-oss-120b", note="half the layers use a 128-token sliding window"),
    )
}


class Policy(str, enum.Enum):
    TTL = "ttl"  # upstream vLLM: retained until a fixed TTL after the turn
    LEASE = "lease"  # kvlease: renewed by heartbeats until max-idle after the turn


def node_of(conversation_id: str, nodes: int) -> int:
    """The decode node of a conversation: ``crc32(id) % nodes`` (stable across runs and machines)."""
    return zlib.crc32(conversation_id.encode()) % nodes if nodes > 1 else 0


@dataclass(frozen=True)
class Trace:
    """Turns sorted by arrival (a stable sort: equal times keep input order), as columns."""

    conversation_ids: tuple[str, ...]
    conversation: array[int]  # index into conversation_ids, per turn
    arrival: array[float]
    done: array[float]  # when the turn's retention starts counting
    retained_tokens: array[int]  # prompt + completion (unknown counts 0)
    reusable: array[int]  # tokens a hit reuses: min(previous prompt + completion, prompt); 0 unknown
    prompt_tokens: int  # over follow-up turns with both prompts known
    gaps: array[float]  # per follow-up turn: arrival - the previous turn's done (>= 0)
    final: bytes  # 1 for each conversation's last turn

    @property
    def turns(self) -> int:
        return len(self.arrival)

    @property
    def follow_up_turns(self) -> int:
        return len(self.gaps)

    def nodes(self, n: int) -> list[int]:
        return [node_of(cid, n) for cid in self.conversation_ids]


def prepare(turns: Iterable[TurnInput]) -> Trace:
    """A :class:`Trace` of ``turns`` (:data:`~kvlease._analyze._model.TurnInput` rows, any order)."""
    rows = sorted(turns, key=lambda r: r[1])
    index: dict[str, int] = {}
    conv = array("q")
    arrival = array("d")
    done = array("d")
    retained = array("q")
    reusable = array("q")
    gaps_at: list[int] = []
    last: dict[int, int] = {}  # conversation -> its latest turn's row
    prompt_sum = 0
    for i, (cid, ts, p, c, end, gap) in enumerate(rows):
        k = index.setdefault(cid, len(index))
        conv.append(k)
        arrival.append(ts)
        done.append(end if end is not None and end > ts else ts)
        retained.append((p or 0) + (c or 0))
        use = 0
        j = last.get(k)
        if j is not None:
            if gap is not None:
                done[j] = ts - gap
            gaps_at.append(i)
            pp, pc = rows[j][2], rows[j][3]
            if p is not None and pp is not None:
                use = min(pp + (pc or 0), p)
                prompt_sum += p
        reusable.append(use)
        last[k] = i
    final = bytearray(len(rows))
    for i in last.values():
        final[i] = 1
    prev: dict[int, int] = {}
    gaps = array("d")
    for i in range(len(rows)):
        k = conv[i]
        j = prev.get(k)
        if j is not None:
            gaps.append(max(arrival[i] - done[j], 0.0))
        prev[k] = i
    return Trace(tuple(index), conv, arrival, done, retained, reusable, prompt_sum, gaps, bytes(final))


@dataclass(frozen=True)
class ReplayResult:
    """The outcome of one replay: one policy, one retention time, one cap per node."""

    policy: Policy
    retention_s: float
    cap_bytes: int | None  # per node; None: unlimited
    nodes: int
    turns: int
    follow_up_turns: int
    hits: int
    reused_tokens: int
    prompt_tokens: int
    evictions: int
    peak_bytes: int  # the most any node retained at once

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.follow_up_turns if self.follow_up_turns else None

    @property
    def reused_share(self) -> float | None:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else None


def replay(
    trace: Trace,
    policy: Policy | str,
    retention_s: float,
    *,
    bytes_per_token: int,
    nodes: int = 1,
    cap_bytes: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    release_on_close: bool = False,
) -> ReplayResult:
    """Replay ``trace`` through the retention model (the module docstring); one loop, locals only.

    ``release_on_close`` (leases only): the client releases the lease when the conversation closes
    (the SDK's ``with kc.conversation()`` does), so a conversation's last turn retains nothing; off,
    the last turn is retained until max-idle like every other (a client that just goes away).
    """
    if nodes < 1 or block_size < 1 or bytes_per_token < 0 or retention_s < 0:
        raise ValueError("nodes and block_size must be >= 1; bytes_per_token and retention_s >= 0")
    node = trace.nodes(nodes)
    heaps: list[list[tuple[float, int, int]]] = [[] for _ in range(nodes)]
    used = [0] * nodes
    peak = [0] * nodes
    live = [0] * len(trace.conversation_ids)  # the sequence number of the conversation's retention
    held = [0] * len(trace.conversation_ids)
    block_bytes = block_size * bytes_per_token
    cap = math.inf if cap_bytes is None else cap_bytes
    hits = reused = evictions = 0
    tokens_of: Sequence[int] = trace.retained_tokens
    if release_on_close and Policy(policy) is Policy.LEASE:
        tokens_of = [-1 if f else t for t, f in zip(trace.retained_tokens, trace.final)]
    turns = zip(trace.conversation, trace.arrival, trace.done, tokens_of, trace.reusable)
    for seq, (c, t, d, tokens, use) in enumerate(turns, 1):  # seq: numbers each retention, from 1
        k = node[c]
        h = heaps[k]
        u = used[k]
        while h and h[0][0] < t:  # expired before this arrival
            _, s, cc = heappop(h)
            if live[cc] == s:
                u -= held[cc]
                live[cc] = 0
        if live[c]:
            hits += 1
            reused += use
            u -= held[c]
        if tokens < 0:  # the conversation closes: its lease is released
            live[c] = 0
            used[k] = u
            continue
        b = -(-tokens // block_size) * block_bytes
        live[c] = seq
        held[c] = b
        u += b
        heappush(h, (d + retention_s, seq, c))
        while u > cap and h:  # over the cap: the oldest deadline goes first
            _, s, cc = heappop(h)
            if live[cc] == s:
                u -= held[cc]
                live[cc] = 0
                evictions += 1
        used[k] = u
        if u > peak[k]:
            peak[k] = u
    return ReplayResult(
        policy=Policy(policy),
        retention_s=retention_s,
        cap_bytes=cap_bytes,
        nodes=nodes,
        turns=trace.turns,
        follow_up_turns=trace.follow_up_turns,
        hits=hits,
        reused_tokens=reused,
        prompt_tokens=trace.prompt_tokens,
        evictions=evictions,
        peak_bytes=max(peak, default=0),
    )


def auto_caps(peak_bytes: int, points: int) -> list[int]:
    """``points`` caps halving down from ``peak_bytes`` (the uncapped need), smallest first."""
    if peak_bytes <= 0 or points <= 0:
        return []
    return sorted({max(1, round(peak_bytes / 2**k)) for k in range(points)})


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (as the analyzer's exact percentiles)."""
    if not sorted_values:
        return None
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_MAX_IDLE",
    "DEFAULT_TTL",
    "DTYPE_BYTES",
    "PRESETS",
    "ModelKV",
    "Policy",
    "ReplayResult",
    "Trace",
    "auto_caps",
    "node_of",
    "percentile",
    "prepare",
    "replay",
]
