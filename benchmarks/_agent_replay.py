"""The agent-session benchmark's replay client (``benchmarks/agent_load.py``): one asyncio task per
live session replays its turns with their recorded delays, polls D's figures meanwhile, and returns
the per-turn records the report is built from."""

from __future__ import annotations

import asyncio
import math
import sys
import time
from typing import TYPE_CHECKING, Any

import _agent_sessions as S

from kvlease.protocol import HEADER_REUSED_TOKENS, HEADER_STATUS, HEADER_TTL

if TYPE_CHECKING:
    from agent_load import Arm, Plan

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


def _request(
    model: str, messages: list[dict[str, str]], turn: S.Turn, extra: dict[str, Any]
) -> dict[str, Any]:
    """The chat request of one replayed turn (a round-tripping answer of the recorded length)."""
    return {
        "model": model,
        "messages": messages,
        "max_tokens": turn.output_tokens + 8,
        "temperature": 0.0,
        "extra_body": {
            **extra,
            "structured_outputs": {"regex": S.answer_regex(turn.output_tokens)},
            "return_token_ids": True,
        },
    }


def _router_figures(headers: Any) -> dict[str, Any]:
    """What the router's response headers say of the turn's reuse."""
    reused = headers.get(HEADER_REUSED_TOKENS)
    return {
        "status": headers.get(HEADER_STATUS),
        "router_ttl_s": headers.get(HEADER_TTL),
        "reused_tokens": int(reused) if reused and reused.strip().isdigit() else 0,
    }


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
        **_request(model, messages, turn, extra),
        stream=True,
        stream_options={"include_usage": True},
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
    return {
        "content": "".join(parts),
        "token_ids": ids,
        "finish": finish,
        "ttft_s": None if first is None else first - t0,
        "e2e_s": time.perf_counter() - t0,
        "itl_s": itl,
        **_router_figures(resp.headers if resp is not None else {}),
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
    t0 = time.perf_counter()
    raw = await client.chat.completions.with_raw_response.create(
        **_request(model, messages, turn, extra), stream=False, extra_headers=headers
    )
    e2e = time.perf_counter() - t0
    resp = raw.parse()
    c = resp.choices[0]
    ids = getattr(c, "token_ids", None) or (c.model_extra or {}).get("token_ids") or []
    return {
        "content": c.message.content or "",
        "token_ids": [int(x) for x in ids],
        "finish": c.finish_reason,
        "ttft_s": None,
        "e2e_s": e2e,
        "itl_s": [],
        **_router_figures(raw.headers),
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
