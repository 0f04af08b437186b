"""Agent sessions at equal offered load: plain P/D, upstream's NixlConnector and kvlease, side by side.

Offered load is the number N of live agent sessions. Each live slot replays recorded sessions back to
back (``benchmarks/data/agent_sessions.jsonl``: AIPerf's agentic-code synthesizer, parameters in
``benchmarks/data/agent_sessions.md``), with each turn's recorded think/tool delay before it, the
history resent every turn, for a fixed run length. Every arm replays the same sessions with the same
delays, one arm after another on the same local real stack (vLLM CPU P/D with NIXL, the ``tiny``
model), through kvlease's router:

- ``plain``: NixlConnector P->D only (``bidirectional_kv_xfer`` off): every turn is recomputed on P
  (beyond P's own prefix cache); router in stock-vLLM mode; a plain openai client.
- ``upstream``: NixlConnector with ``bidirectional_kv_xfer`` and its fixed TTL on D; router in
  stock-vLLM mode (told D's TTL, ``--node-ttl``); a plain openai client (``X-Session-Id``: nothing
  renews D's blocks). Its turns are *not streamed*: in stock-vLLM mode the router captures D's
  handle from non-streamed answers only (``kvlease_router._turn.record``), even where D streams it
  (kvlease's vLLM plugin on 0.32, vLLM 0.33 natively), so streamed turns would never be offered
  D's blocks. Its TTFT is estimated: the turn's end-to-end time less ``completion_tokens - 1``
  times D's mean inter-token latency over the run (``vllm:inter_token_latency_seconds``); its ITL
  percentiles are that histogram's. The streamed arms report the same estimate's error against
  their measured TTFT (``ttft_estimate_error_s``).
- ``kvlease-device`` / ``kvlease-auto`` / ``kvlease-host``: KVLeaseConnector with ``placement``
  ``device`` / ``auto`` / ``host`` (the last two with a host arena); the SDK (``kvlease.wrap``,
  heartbeats on) keeps leases across tool pauses.

AIPerf does not drive the stack here: on 2 cores its worker processes starve P and D (the replay is
a light asyncio client in this process). To replay the real SemiAnalysis Claude Code traces with
AIPerf against a real deployment (GPUs; the traces download from a hub)::

    pip install agentx-harness==1.0.12   # AIPerf 0.13.0 underneath
    aiperf profile --model MODEL --url http://ROUTER:8000 --endpoint-type chat --streaming \\
        --input-file semianalysis_claude_code.jsonl --custom-dataset-type mooncake_trace \\
        --session-header X-Session-ID --benchmark-duration 900

Answers are shaped by structured outputs (a closed word list) so that the resent history
re-tokenizes to the tokens D generated; the round-trip rate per arm says how often it did.

    python benchmarks/agent_load.py [--quick] [--arms plain,kvlease-device] [--n 2,4,8] [--duration 120]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(HERE), str(ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _agent_sessions as S  # noqa: E402
import _report_agents as RA  # noqa: E402
from _report_agents import print_table  # noqa: E402  (run.py calls ``agent_load.print_table``)

MODEL = "tiny"
#: vLLM CPU's KV block (tokens); D's block count below is in these.
BLOCK_TOKENS = 128
#: The host arena of the ``auto`` / ``host`` arms (bytes).
HOST_ARENA_BYTES = 64 << 20
#: TTFT p90 target of "supported sessions" (seconds, this CPU stack).
TTFT_TARGET_S = 1.5
#: D's TTL, every arm (upstream: the fixed ``decoder_kv_blocks_ttl``; kvlease: the lease TTL the
#: SDK's heartbeats renew). The router's lease is D's TTL less its 5 s margin, and the SDK's keeper
#: renews at 60 % of the router's: 60 s gives a 33 s renewal period, far above any stall of a
#: loaded 2-core machine (at 6 s the router's lease was 1 s and renewals came every 0.6 s, so a
#: 0.4 s stall expired it). Scaled gaps (x 0.25 / x 0.1) keep most turns inside it for upstream.
TTL_S = 60.0
#: The SDK keeper's renewal period as a share of the router's lease (``kvlease._renewal``).
RENEW_FRACTION = 0.6
#: The router's margin below D's TTL (``RouterSettings.ttl_margin``).
ROUTER_TTL_MARGIN_S = 5.0


@dataclass(frozen=True)
class Arm:
    name: str
    connector: str  # "kvlease" | "nixl"
    bidir: bool
    kvlease: dict[str, Any] = field(default_factory=dict)
    sdk: bool = False
    what: str = ""
    #: Streamed turns (TTFT measured at the first token); else TTFT is estimated (module doc).
    stream: bool = True


ARMS: tuple[Arm, ...] = (
    Arm("plain", "nixl", False, what="P: NixlConnector, D: NixlConnector (P->D only, no retention)"),
    Arm(
        "upstream",
        "nixl",
        True,
        what="P/D: NixlConnector, bidirectional_kv_xfer, D fixed TTL; non-streamed turns, TTFT estimated",
        stream=False,
    ),
    Arm(
        "kvlease-device",
        "kvlease",
        True,
        {"placement": "device"},
        sdk=True,
        what="P/D: KVLeaseConnector, leases in D's KV cache, SDK heartbeats",
    ),
    Arm(
        "kvlease-auto",
        "kvlease",
        True,
        {"placement": "auto", "host_arena_bytes": HOST_ARENA_BYTES},
        sdk=True,
        what="P/D: KVLeaseConnector, leases written through to a host arena at finish, D's blocks given back (HBM a cache: pulls read the intact device copy, else the arena)",
    ),
    Arm(
        "kvlease-host",
        "kvlease",
        True,
        {"placement": "host", "host_arena_bytes": HOST_ARENA_BYTES},
        sdk=True,
        what="P/D: KVLeaseConnector, leases written through to a host arena at finish, pulls always from the arena",
    ),
)
QUICK_ARMS = ("upstream", "kvlease-device")


@dataclass(frozen=True)
class Plan:
    arms: tuple[Arm, ...]
    ns: tuple[int, ...]
    duration_s: float
    gap_scale: float  # recorded delays x this
    ttl_s: float  # D's TTL (upstream's fixed TTL; kvlease's lease TTL, renewed by heartbeats)
    d_blocks: int
    sizing: str


def size_d(sessions: list[S.Session], ns: tuple[int, ...]) -> tuple[int, str]:
    """D's KV blocks: room for three of the longest prompts at once (no turn is ever too long for
    D), plus what the mean session holds between turns at the sweep's middle N, halved: from that N
    up, retention and the running batch compete for the same blocks."""
    lengths = []
    for s in sessions:
        total = 0
        for t in s.turns:
            total += t.input_tokens + t.output_tokens
            lengths.append(total)
    longest = max(lengths)
    mean_hist = sum(lengths) / len(lengths)
    per_long = math.ceil((longest + 64) / BLOCK_TOKENS)
    per_session = math.ceil(mean_hist / BLOCK_TOKENS)
    mid = ns[len(ns) // 2]
    blocks = 3 * per_long + (mid * per_session) // 2
    why = (
        f"D: {blocks} KV blocks of {BLOCK_TOKENS} tokens (--num-gpu-blocks-override): 3 x the longest "
        f"prompt ({longest} tokens, {per_long} blocks) + half of what {mid} sessions hold between turns "
        f"({per_session} blocks each, mean history {mean_hist:.0f} tokens): from N~{mid} up, retained "
        "blocks compete with the running batch"
    )
    return blocks, why


def make_plan(quick: bool, arms: str | None, ns: str | None, duration: float | None) -> Plan:
    sessions = S.load_sessions()
    names = (
        [a.strip() for a in arms.split(",")]
        if arms
        else list(QUICK_ARMS if quick else [a.name for a in ARMS])
    )
    by = {a.name: a for a in ARMS}
    bad = [n for n in names if n not in by]
    if bad:
        raise ValueError(f"unknown arm(s) {bad}; known: {list(by)}")
    sweep = tuple(int(x) for x in ns.split(",")) if ns else ((4,) if quick else (2, 4))
    blocks, why = size_d(sessions, sweep)
    return Plan(
        arms=tuple(by[n] for n in names),
        ns=sweep,
        duration_s=duration or 60.0,
        gap_scale=0.1 if quick else 0.25,
        ttl_s=TTL_S,
        d_blocks=blocks,
        sizing=why,
    )


# --------------------------------------------------------------------------------------------------
# The replay client
# --------------------------------------------------------------------------------------------------


class Progress:
    """One line per arm phase on stderr: what, elapsed, remaining (planned)."""

    def __init__(self, total_s: float) -> None:
        self.t0 = time.monotonic()
        self.total = total_s
        self.done = 0.0

    def say(self, what: str, planned_s: float = 0.0) -> None:
        el = time.monotonic() - self.t0
        left = max(0.0, self.total - self.done)
        print(
            f"[agents] {what} | elapsed {el / 60:.1f} min, remaining ~{left / 60:.1f} min",
            file=sys.stderr,
            flush=True,
        )
        self.done += planned_s


async def _turn(
    client: Any,
    model: str,
    messages: list[dict[str, str]],
    turn: S.Turn,
    extra: dict[str, Any],
    headers: dict[str, str],
    streamed: bool = True,
) -> dict[str, Any]:
    if not streamed:
        return await _turn_unstreamed(client, model, messages, turn, extra, headers)
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=turn.output_tokens + 8,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={
            **extra,
            "structured_outputs": {"regex": S.answer_regex(turn.output_tokens)},
            "return_token_ids": True,
        },
        extra_headers=headers,
    )
    first = None
    last = None
    itl: list[float] = []
    parts: list[str] = []
    ids: list[int] = []
    usage = None
    finish = None
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        finish = c.finish_reason or finish
        extra_ids = (c.model_extra or {}).get("token_ids")
        if extra_ids:
            ids.extend(int(x) for x in extra_ids)
        if c.delta.content:
            if first is None:
                first = now
            elif last is not None:
                itl.append(now - last)
            last = now
            parts.append(c.delta.content)
    resp = getattr(stream, "response", None)
    hdr = resp.headers if resp is not None else {}
    from kvlease.protocol import HEADER_REUSED_TOKENS, HEADER_STATUS, HEADER_TTL

    reused = hdr.get(HEADER_REUSED_TOKENS)
    return {
        "content": "".join(parts),
        "token_ids": ids,
        "finish": finish,
        "ttft_s": None if first is None else first - t0,
        "e2e_s": time.perf_counter() - t0,
        "itl_s": itl,
        "status": hdr.get(HEADER_STATUS),
        "router_ttl_s": hdr.get(HEADER_TTL),
        "reused_tokens": int(reused) if reused and reused.strip().isdigit() else 0,
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "completion_tokens": usage.completion_tokens if usage else None,
    }


async def _turn_unstreamed(
    client: Any,
    model: str,
    messages: list[dict[str, str]],
    turn: S.Turn,
    extra: dict[str, Any],
    headers: dict[str, str],
) -> dict[str, Any]:
    """One non-streamed turn: ``ttft_s`` is filled in after the run (:func:`S.estimate_ttft`)."""
    from kvlease.protocol import HEADER_REUSED_TOKENS, HEADER_STATUS, HEADER_TTL

    t0 = time.perf_counter()
    raw = await client.chat.completions.with_raw_response.create(
        model=model,
        messages=messages,
        max_tokens=turn.output_tokens + 8,
        temperature=0.0,
        stream=False,
        extra_body={
            **extra,
            "structured_outputs": {"regex": S.answer_regex(turn.output_tokens)},
            "return_token_ids": True,
        },
        extra_headers=headers,
    )
    e2e = time.perf_counter() - t0
    resp = raw.parse()
    c = resp.choices[0]
    ids = getattr(c, "token_ids", None) or (c.model_extra or {}).get("token_ids") or []
    reused = raw.headers.get(HEADER_REUSED_TOKENS)
    return {
        "content": c.message.content or "",
        "token_ids": [int(x) for x in ids],
        "finish": c.finish_reason,
        "ttft_s": None,
        "e2e_s": e2e,
        "itl_s": [],
        "status": raw.headers.get(HEADER_STATUS),
        "router_ttl_s": raw.headers.get(HEADER_TTL),
        "reused_tokens": int(reused) if reused and reused.strip().isdigit() else 0,
        "prompt_tokens": resp.usage.prompt_tokens if resp.usage else None,
        "completion_tokens": resp.usage.completion_tokens if resp.usage else None,
    }


async def _session(
    client: Any,
    arm: Arm,
    model: str,
    sess: S.Session,
    tag: str,
    shared: int,
    scale: float,
    deadline: float,
    out: list[dict[str, Any]],
) -> None:
    from kvlease.protocol import CACHE_SALT

    conv_id = f"{tag}-{sess.id}"
    extra = {CACHE_SALT: tag}
    messages: list[dict[str, str]] = S.first_messages(sess, shared)
    conv = client.conversation(id=conv_id) if arm.sdk else None
    target = conv if conv is not None else client
    headers = {} if arm.sdk else {"X-Session-Id": conv_id}
    try:
        for i, turn in enumerate(sess.turns):
            if i > 0:
                if time.monotonic() + turn.delay_s * scale > deadline:
                    return
                await asyncio.sleep(turn.delay_s * scale)
                messages.append({"role": "user", "content": "Tool output:\n" + S.turn_text(turn)})
            rec: dict[str, Any] = {
                "session": sess.id,
                "turn": i,
                "gap_s": turn.delay_s,
                "bucket": S.gap_bucket(turn.delay_s) if i else None,
            }
            try:
                rec.update(await _turn(target, model, messages, turn, extra, headers, arm.stream))
            except Exception as e:  # a failed turn: the client saw an error
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                out.append(rec)
                return
            out.append(rec)
            messages.append({"role": "assistant", "content": rec["content"]})
    finally:
        if conv is not None:
            await conv.aclose()


async def _slot(
    client: Any,
    arm: Arm,
    model: str,
    queue: list[S.Session],
    tag: str,
    shared: int,
    scale: float,
    deadline: float,
    out: list[dict[str, Any]],
) -> None:
    k = 0
    while time.monotonic() < deadline:
        sess = queue[k % len(queue)]
        await _session(client, arm, model, sess, f"{tag}-r{k // len(queue)}", shared, scale, deadline, out)
        k += 1


async def _poll_d(
    stack: Any,
    t0: float,
    stop: asyncio.Event,
    held: list[tuple[float, float]],
    used: list[tuple[float, float]],
    host: list[tuple[float, float]],
    cached: list[tuple[float, float]],
    every: float = 1.0,
) -> None:
    """Every ``every`` s: the blocks leases hold on D (its control endpoint's
    ``kvlease_device_blocks_held``, else ``kvlease_retained_blocks``; NixlConnector exposes no such
    figure) and the share of D's KV cache in use (vLLM's ``vllm:kv_cache_usage_perc``, every arm)."""
    import httpx

    from kvlease.protocol import CONTROL_AUTH_HEADER, CONTROL_METRICS_PATH
    from kvlease_stack import parse_prometheus

    base = stack.decode.control
    auth = {CONTROL_AUTH_HEADER: f"Bearer {stack.control_secret}"}
    async with httpx.AsyncClient(timeout=5.0) as http:
        while not stop.is_set():
            now = time.monotonic() - t0
            try:
                m = parse_prometheus((await http.get(stack.decode.url + "/metrics")).text)
                used.append((now, m.total("vllm:kv_cache_usage_perc")))
                if base is not None:
                    m = parse_prometheus((await http.get(base + CONTROL_METRICS_PATH, headers=auth)).text)
                    key = "kvlease_device_blocks_held"
                    held.append((now, m.total(key if key in m.names() else "kvlease_retained_blocks")))
                    host.append((now, m.total("kvlease_host_bytes_used")))
                    cached.append((now, m.total("kvlease_device_blocks_cached")))
            except Exception:  # a missed poll is a gap in the series, not a failure of the arm
                pass
            try:
                await asyncio.wait_for(stop.wait(), every)
            except asyncio.TimeoutError:
                pass


#: Where a hit's reused tokens come from (``X-KVLease-Reused-Tokens``, ``kvlease_router._reuse``).
REUSED_SOURCE = {
    "kvlease": "P's report: tokens pulled from D beyond P's own prefix cache",
    "nixl": "the router's upper bound: tokens D held (stock vLLM reports no pull; P's prefix-cache hits included)",
}
#: Counters diffed over each run: P's pull decisions (by reason) and pulls (by source); D's lease
#: renewals, releases (by cause), placements, demotions and host-arena evictions (by reason).
CONTROL_COUNTERS = (
    "kvlease_pull_decisions",
    "kvlease_pulls",
    "kvlease_lease_",
    "kvlease_placements",
    "kvlease_demotions",
    "kvlease_evictions",
)


def _scrape(stack: Any) -> dict[str, Any]:
    """D's vLLM metrics and both control endpoints' (kvlease), for before/after deltas."""
    import httpx

    from kvlease.protocol import CONTROL_AUTH_HEADER, CONTROL_METRICS_PATH
    from kvlease_stack import parse_prometheus

    out: dict[str, Any] = {}
    for role, server in (("p", stack.prefill), ("d", stack.decode)):
        try:
            out[role] = server.metrics(timeout=10.0)
        except Exception:
            out[role] = {}
    auth = {CONTROL_AUTH_HEADER: f"Bearer {stack.control_secret}"}
    for role, server in (("p_control", stack.prefill), ("d_control", stack.decode)):
        if server.control is None:
            continue
        try:
            text = httpx.get(server.control + CONTROL_METRICS_PATH, headers=auth, timeout=10.0).text
            out[role] = parse_prometheus(text)
        except Exception:
            out[role] = {}
    return out


async def _tokenize(url: str, model: str, texts: list[str]) -> list[list[int] | None]:
    import httpx

    out: list[list[int] | None] = []
    async with httpx.AsyncClient(timeout=30.0) as http:
        for text in texts:
            try:
                r = await http.post(
                    url + "/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False}
                )
                out.append([int(x) for x in r.json()["tokens"]])
            except Exception:
                out.append(None)
    return out


async def _replay(
    arm: Arm, stack: Any, router: str, sessions: list[S.Session], n: int, plan: Plan
) -> dict[str, Any]:
    from openai import AsyncOpenAI

    import kvlease

    shared = S.shared_prefix_blocks(sessions)
    raw = AsyncOpenAI(base_url=router + "/v1", api_key="bench", max_retries=0, timeout=300)
    client: Any = kvlease.wrap(raw, heartbeat=True) if arm.sdk else raw
    turns: list[dict[str, Any]] = []
    held: list[tuple[float, float]] = []
    used: list[tuple[float, float]] = []
    host: list[tuple[float, float]] = []
    stop = asyncio.Event()
    before = _scrape(stack)
    t0 = time.monotonic()
    deadline = t0 + plan.duration_s
    cached: list[tuple[float, float]] = []
    poller = asyncio.create_task(_poll_d(stack, t0, stop, held, used, host, cached))
    tag = f"{arm.name}-n{n}"
    try:
        await asyncio.gather(
            *(
                _slot(client, arm, stack.model_name, q, tag, shared, plan.gap_scale, deadline, turns)
                for q in S.schedule(sessions, n)
            )
        )
    finally:
        wall = time.monotonic() - t0
        stop.set()
        await poller
        if arm.sdk:
            await client.close()
        else:
            await raw.close()
    after = _scrape(stack)
    preempt = (
        sum(S.counter_deltas(before["d"], after["d"], ("vllm:num_preemptions",)).values())
        if before["d"] and after["d"]
        else math.nan
    )
    itl_buckets, itl_sum, itl_count = S.histogram_delta(
        before["d"], after["d"], "vllm:inter_token_latency_seconds"
    )
    itl_mean = itl_sum / itl_count if itl_count else None
    # TTFT of non-streamed turns, and the same estimate's error where TTFT was measured
    est_err = S.fill_ttft_estimates(turns, itl_mean)
    # round trip: does the answer's text re-tokenize to what D generated (D holds those tokens)?
    done = [t for t in turns if not t.get("error") and t.get("token_ids")]
    toks = await _tokenize(stack.prefill.url, stack.model_name, [t["content"] for t in done])
    for t, ids in zip(done, toks):
        gen = list(t["token_ids"])
        if t.get("finish") == "stop" and ids is not None and len(gen) == len(ids) + 1:
            gen = gen[:-1]  # the stop token: the template writes it back as <|im_end|>
        t["round_trip_answer"] = None if ids is None else ids == gen
    by_key = {(t["session"], t["turn"]): t for t in turns}
    for t in turns:
        prev = by_key.get((t["session"], t["turn"] - 1)) if t["turn"] > 0 else None
        t["round_trip"] = None if prev is None else prev.get("round_trip_answer")
        t.pop("token_ids", None)
        t.pop("content", None)
    ttl_seen = sorted({str(t["router_ttl_s"]) for t in turns if t.get("router_ttl_s")})
    for t in turns:
        t.pop("router_ttl_s", None)
    out = S.summarize(turns, wall)
    if not arm.stream:  # no client-side token timing: D's own histogram
        out["itl_s"] = {
            "p50": S.histogram_quantile(itl_buckets, 0.5),
            "p99": S.histogram_quantile(itl_buckets, 0.99),
        }
    out["ttft_source"] = (
        "first streamed token (client)"
        if arm.stream
        else "estimated: end-to-end less (completion tokens - 1) x D's mean ITL (non-streamed turns)"
    )
    out["itl_source"] = "client, streamed chunks" if arm.stream else "D's vllm:inter_token_latency_seconds"
    out["reused_source"] = REUSED_SOURCE[arm.connector]
    out["d_itl_mean_s"] = itl_mean
    out["ttft_estimate_error_s"] = S.error_summary(est_err)
    out["router_ttl_s"] = ttl_seen
    # measured on P by vLLM itself, every arm: tokens P loaded through its connector (pulled from D;
    # the router's figure for stock vLLM is only what D held), P's own prefix-cache hits, NIXL reads
    pulled = sum(S.counter_deltas(before["p"], after["p"], ("vllm:external_prefix_cache_hits",)).values())
    follow_prompt = sum(t.get("prompt_tokens") or 0 for t in turns if t["turn"] > 0 and not t.get("error"))
    out["p_pulled"] = {
        "tokens": pulled,
        "share_of_follow_up_prompts": pulled / follow_prompt if follow_prompt else None,
        "nixl_reads": S.histogram_delta(before["p"], after["p"], "vllm:nixl_xfer_time_seconds")[2],
        "vllm_counters_p": S.counter_deltas(
            before["p"], after["p"], ("vllm:external_prefix_cache", "vllm:prefix_cache", "vllm:nixl_num")
        ),
        "vllm_counters_d": S.counter_deltas(before["d"], after["d"], ("vllm:nixl_num",)),
    }
    out["connector_counters"] = {
        role: S.counter_deltas(before[role], after[role], CONTROL_COUNTERS)
        for role in ("p_control", "d_control")
        if role in after
    }
    block_s, mx = S.block_seconds(held)
    cached_s, cached_mx = S.block_seconds(cached)
    used_s, used_max = S.block_seconds(used)
    exposed = stack.decode.control is not None
    out |= {
        "n": n,
        "wall_s": round(wall, 1),
        "d_preemptions": preempt,
        "lease_blocks": {
            "block_s": round(block_s, 1) if exposed else None,
            "max": mx if exposed else None,
            "series": [(round(t, 1), b) for t, b in held],
            # auto/host: the device copies of written-through leases (evictable, not held)
            "cached_block_s": round(cached_s, 1) if exposed else None,
            "cached_max": cached_mx if exposed else None,
            "source": "D control /metrics" if exposed else "not exposed by NixlConnector",
        },
        # vLLM's own gauge, every arm: the running batch plus whatever D retains
        "d_kv_used": {
            "mean_share": round(used_s / wall, 3) if wall > 0 else None,
            "max_share": round(used_max, 3),
            "block_s": round(used_s * plan.d_blocks, 1),
            "series": [(round(t, 1), round(u, 4)) for t, u in used],
        },
        "host_bytes_max": max((b for _, b in host), default=None),
        "errors": sorted({t["error"] for t in turns if t.get("error")})[:5],
    }
    return out


# --------------------------------------------------------------------------------------------------
# Arms
# --------------------------------------------------------------------------------------------------


def _spec(arm: Arm, plan: Plan) -> Any:
    from kvlease_stack import StackSpec, default_dtype

    return StackSpec(
        model=MODEL,
        connector=arm.connector,
        bidir=arm.bidir,
        ttl=plan.ttl_s,
        kvlease=arm.kvlease,
        prefix_caching=True,
        dtype=default_dtype(),
        decode_args=("--num-gpu-blocks-override", str(plan.d_blocks)),
    )


def _budgets(arm: Arm, plan: Plan) -> str:
    d = f"D KV {plan.d_blocks} blocks x {BLOCK_TOKENS} tokens"
    if arm.kvlease.get("host_arena_bytes"):
        d += f", host arena {arm.kvlease['host_arena_bytes'] >> 20} MiB"
    if not arm.bidir:
        return d
    return d + f", TTL {plan.ttl_s:g} s" + (" (fixed)" if not arm.sdk else " (renewed by heartbeats)")


def run_arm(arm: Arm, plan: Plan, sessions: list[S.Session], progress: Progress) -> dict[str, Any]:
    from kvlease_stack import Stack
    from kvlease_stack.demo import router_process

    res: dict[str, Any] = {
        "connectors": arm.what,
        "budgets": _budgets(arm, plan),
        "kvlease": arm.kvlease,
        "by_n": {},
    }
    progress.say(f"{arm.name}: starting the stack ({arm.what})", 90)
    try:
        stack = Stack.start(_spec(arm, plan), timeout=420)
    except Exception as e:  # the arm's stack refused (e.g. a key this connector does not know)
        res["not_run"] = f"{type(e).__name__}: {str(e)[-600:]}"
        progress.say(f"{arm.name}: not run: {res['not_run'][:160]}")
        return res
    try:
        # stock-vLLM mode: the router cannot ask D its TTL (/v1/models does not say), so tell it
        args = [] if arm.connector == "kvlease" else ["--node-ttl", f"{plan.ttl_s:g}"]
        with stack, router_process(stack, extra_args=args) as router:
            for n in plan.ns:
                progress.say(f"{arm.name}: N={n} replay ({plan.duration_s:g} s)", plan.duration_s)
                r = asyncio.run(_replay(arm, stack, router, sessions, n, plan))
                res["by_n"][str(n)] = r
                print(f"  {arm.name} N={n}: {RA.run_line(r)}", flush=True)
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {str(e)[-600:]}"
    p90 = {int(n): r["ttft_s"]["p90"] for n, r in res["by_n"].items()}
    res["supported_sessions"] = S.supported_sessions(p90, TTFT_TARGET_S)
    return res


def settings_line(plan: Plan) -> str:
    router = plan.ttl_s - ROUTER_TTL_MARGIN_S
    return (
        f"Settings, every arm: N {','.join(map(str, plan.ns))}, {plan.duration_s:g} s per N, recorded gaps "
        f"x {plan.gap_scale:g}; D's TTL {plan.ttl_s:g} s (upstream: fixed decoder_kv_blocks_ttl; kvlease: "
        f"lease TTL); router lease {router:g} s (D's less {ROUTER_TTL_MARGIN_S:g} s; stock mode told "
        f"--node-ttl); SDK keeper renews every {RENEW_FRACTION * router:g} s (kvlease arms, heartbeats on); "
        f"host arena {HOST_ARENA_BYTES >> 20} MiB per worker (auto/host)"
    )


def run(
    quick: bool = False, arms: str | None = None, ns: str | None = None, duration: float | None = None
) -> dict[str, Any]:
    plan = make_plan(quick, arms, ns, duration)
    sessions = S.load_sessions()
    print(plan.sizing, flush=True)
    print(settings_line(plan), flush=True)
    total = len(plan.arms) * (90 + len(plan.ns) * plan.duration_s)
    progress = Progress(total)
    out: dict[str, Any] = {
        "model": MODEL,
        "sessions_file": "benchmarks/data/agent_sessions.jsonl (AIPerf 0.13.0 agentic-code synthesizer)",
        "sessions": len(sessions),
        "ns": list(plan.ns),
        "duration_s": plan.duration_s,
        "gap_scale": plan.gap_scale,
        "gap_note": (
            f"recorded think/tool delays x {plan.gap_scale:g} (buckets by recorded gap)"
            if plan.gap_scale != 1
            else "recorded delays"
        ),
        "ttl_s": plan.ttl_s,
        "settings": settings_line(plan),
        "d_blocks": plan.d_blocks,
        "d_sizing": plan.sizing,
        "ttft_target_s": TTFT_TARGET_S,
        "replay": "light asyncio client in the benchmark process (AIPerf generated the sessions, does not drive the stack)",
        "arms": {},
    }
    for arm in plan.arms:
        out["arms"][arm.name] = run_arm(arm, plan, sessions, progress)
    progress.say("done")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help=f"arms {','.join(QUICK_ARMS)}, N=4, 60 s, gaps x 0.1"
    )
    ap.add_argument("--arms", help=f"comma-separated, of {','.join(a.name for a in ARMS)}")
    ap.add_argument("--n", help="comma-separated live-session counts (the sweep)")
    ap.add_argument("--duration", type=float, help="run length per N (s)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    a = ap.parse_args()
    res = run(quick=a.quick, arms=a.arms, ns=a.n, duration=a.duration)
    print_table(res)
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
