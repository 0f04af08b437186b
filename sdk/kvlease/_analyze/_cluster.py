"""The cluster simulator: agent sessions on P and D nodes under five retention policies (sans-IO).

Reading path: :func:`build_sessions` (turns -> :class:`Sessions`, each session's turns in order
with their think times) -> :func:`simulate` (one policy, one load) -> ``_cluster_report`` (all the
policies at equal load, and the sweep of concurrent sessions). Nothing here reads files or clocks;
the costs come in a :class:`~kvlease._analyze._cluster_costs.ClusterConfig`.

**Load.** Sessions are closed loops: a session's next turn arrives its recorded *think time* after
the simulated end of its previous turn (the recorded gap less the previous turn's recorded duration:
its end where the input has it, else ``completion / decode rate``). Sessions start either at their
recorded start times (the trace's own load) or, with ``slots=N``, as N concurrent slots: a slot
starts the next session of the
sample (:data:`SLOT_SESSIONS` x N sessions spread evenly over the trace, or the trace cycled with
new ids for the copies) when its session ends; the first
N start spread over one mean session length, and only turns that arrive before the last session
starts are measured (later the load falls). That is the offered load: N live sessions.

**Placement.** A session lives on D node ``crc32(id) % d_nodes`` and P node ``crc32(id) % p_nodes``
(the router keeps both).

**A turn.** At its arrival ``t`` the turn's reusable prefix is ``min(previous prompt + completion,
prompt)`` tokens where D (or D's host) still holds the previous turn, and ``min(previous prompt,
prompt)`` where P's own prefix cache still holds the previous prompt (P never sees generated
tokens). P's local prefix hits first; the rest comes from D's tier, pulled only when the pull is
faster than recomputing those tokens (kvlease's cost model; applied to every policy). Then:

- P: a FIFO server per P node at the prefill rate: it starts at ``max(t + pull, P free)`` and
  prefills the tokens not reused (linear in tokens: attention's quadratic term is not modelled);
- D: the turn needs ``(prompt + completion) x bytes per token`` of D's KV cache from admission to
  its end. It is admitted when P is done if that fits beside the running batch and the HBM that
  leases retain (as of the node's latest state: turns that end meanwhile still count); otherwise
  it waits for running turns to end (or retentions to expire), in time order.
  ``TTFT = admission + P->D transfer of the prompt's KV - t``; the turn ends ``completion / decode
  rate`` after its first token. P->D transfers and device pulls cost ``fixed + bytes / min(rate,
  NIC)`` (the staged pull's measured line), host pulls ``bytes / min(host rate, NIC)``.

**Policies** (what D keeps when a turn ends; at the session's next arrival its HBM retention is
released, the pulled or recomputed KV running again):

- ``no-reuse``: nothing;
- ``ttl`` (upstream vLLM): the turn's KV stays in HBM until ``end + ttl``; it is not evictable:
  it only leaves at its deadline, or oldest deadline first when retention alone exceeds the node;
- ``lease`` (kvlease, HBM): until ``end + max_idle`` (heartbeats renew it while the session lives;
  with ``release_on_close`` a session's last turn keeps nothing), capped at ``retained_fraction``
  of the node's KV cache, oldest deadline evicted first;
- ``write-through`` (kvlease, host arena): the lease lives in D's host arena (``end + max_idle``,
  capped by host memory, oldest deadline first), ready after the demotion (``bytes / demotion
  rate``); the HBM copy stays as evictable cache (least recently used goes first when the running
  batch needs room; it goes with the lease), so it retains 0 HBM and costs no decode concurrency.
  A hit is ``device`` while the HBM copy lives, else ``host``;
- ``lru-host`` (llm-d's P2P offload, ``offload_prompt_only: false``): D offloads the turn's blocks
  to host DRAM, no lease and no deadline, evicted least recently used when host memory is full; P
  pulls them from there (``host``).

A node's state only moves forward in time (to each arrival, and to a waiting turn's admission): with
a queue, a turn sees D as of the latest admission.
"""

from __future__ import annotations

import enum
import math
import zlib
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from heapq import heapify, heappop, heappush
from typing import Final

from kvlease._analyze._cluster_costs import ClusterConfig, ClusterInputError
from kvlease._analyze._model import TurnInput
from kvlease._analyze._plan import percentile


class SimPolicy(str, enum.Enum):
    NONE = "no-reuse"
    TTL = "ttl"
    LEASE = "lease"
    WRITE_THROUGH = "write-through"
    LRU_HOST = "lru-host"


#: Where a turn's reused prefix came from (``FIRST``: a session's first turn, not a follow-up).
FIRST, DEVICE, HOST, P_LOCAL, MISS = range(5)
SOURCES: Final = ("first", "device", "host", "p_local", "miss")
INF: Final = math.inf
#: With ``slots=N``: sessions simulated, ``SLOT_SESSIONS x N`` but at least ``MIN_SLOT_SESSIONS``
#: (or all the trace's, if fewer): an even sample of the trace, or the trace cycled.
SLOT_SESSIONS: Final = 3
MIN_SLOT_SESSIONS: Final = 300


@dataclass(frozen=True)
class Sessions:
    """Turns grouped by session (sessions by start time); session ``s`` has turns
    ``offsets[s] .. offsets[s + 1] - 1``."""

    ids: tuple[str, ...]
    offsets: array[int]
    start: array[float]  # seconds from the trace's first arrival
    prompt: array[int]
    completion: array[int]
    think: array[float]  # per turn: seconds from the previous turn's end to its arrival (0: first)
    duration: float  # mean recorded session length (first to last arrival), seconds

    @property
    def sessions(self) -> int:
        return len(self.ids)

    @property
    def turns(self) -> int:
        return len(self.prompt)


def build_sessions(turns: Iterable[TurnInput], decode_tps: float) -> Sessions:
    """:class:`Sessions` of ``turns`` (any order); unknown token counts count 0."""
    if not decode_tps > 0:
        raise ClusterInputError(f"the decode rate must be > 0, got {decode_tps}")
    by: dict[str, list[TurnInput]] = {}
    for row in turns:
        by.setdefault(row[0], []).append(row)
    groups = sorted(by.values(), key=lambda rows: min(r[1] for r in rows))
    t0 = min((g[0][1] for g in groups), default=0.0)
    offsets, start = array("q", [0]), array("d")
    prompt, completion, think = array("q"), array("q"), array("d")
    spans = 0.0
    for rows in groups:
        rows.sort(key=lambda r: r[1])
        start.append(rows[0][1] - t0)
        spans += rows[-1][1] - rows[0][1]
        end = 0.0
        for i, (_, ts, p, c, e, gap) in enumerate(rows):
            if i:
                think.append(max(0.0, gap if gap is not None else ts - end))
            else:
                think.append(0.0)
            prompt.append(p or 0)
            completion.append(c or 0)
            end = e if e is not None and e > ts else ts + (c or 0) / decode_tps
        offsets.append(len(prompt))
    ids = tuple(g[0][0] for g in groups)
    return Sessions(ids, offsets, start, prompt, completion, think, spans / len(groups) if groups else 0.0)


@dataclass(frozen=True)
class SimResult:
    """One simulation: one policy at one load."""

    policy: SimPolicy
    sessions: int  # session instances simulated
    turns: int  # measured turns
    ttft: array[float]  # measured turns' TTFT, sorted
    sources: tuple[int, ...]  # measured turns per source (index: FIRST .. MISS)
    reused_tokens: int
    hbm_retained_byte_s: float  # summed over D nodes
    host_peak_bytes: int  # the most one D node's host tier held
    evictions: int
    span_s: float  # first arrival to last end
    per_turn: tuple[tuple[str, int, float, float, int, int], ...] | None = None
    # (session id, turn index from 0, arrival s, TTFT s, source, reused tokens)

    def ttft_at(self, q: float) -> float | None:
        return percentile(self.ttft, q)

    @property
    def follow_ups(self) -> int:
        return sum(self.sources) - self.sources[FIRST]

    def share(self, source: int) -> float | None:
        n = self.follow_ups
        return self.sources[source] / n if n else None


def simulate(
    sessions: Sessions,
    cfg: ClusterConfig,
    policy: SimPolicy | str,
    *,
    slots: int | None = None,
    per_turn: bool = False,
) -> SimResult:
    """Simulate ``sessions`` on ``cfg``'s nodes under ``policy`` (the module docstring's model)."""
    pol = SimPolicy(policy)
    S = sessions.sessions
    if slots is not None and slots < 1:
        raise ClusterInputError(f"concurrent sessions must be >= 1, got {slots}")
    M = S if slots is None or not S else max(SLOT_SESSIONS * slots, min(S, MIN_SLOT_SESSIONS))
    D, P = cfg.d_nodes, cfg.p_nodes
    bpt = cfg.bytes_per_token
    off, prompt, comp, think = sessions.offsets, sessions.prompt, sessions.completion, sessions.think
    if M <= S:  # every session once, or an even sample of them
        base = [m * S // M for m in range(M)]
        names = [sessions.ids[b] for b in base]
    else:  # cycled: copies get new ids (and so their own nodes)
        base = [m % S for m in range(M)]
        names = [sessions.ids[m % S] + (f"#{m // S}" if m >= S else "") for m in range(M)]
    hashes = [zlib.crc32(n.encode()) for n in names]
    dnode = [h % D for h in hashes]
    pnode = [h % P for h in hashes]
    last_turn = [off[b + 1] - 1 for b in base]
    first_turn = [off[b] for b in base]

    hbm = cfg.hbm_kv.value
    tps = cfg.prefill_tps.value
    dtps = cfg.decode_tps.value
    host_cap = cfg.host_bytes.value
    pcap = cfg.p_cache.value
    demote = cfg.demote_rate.value
    ttl_like = pol in (SimPolicy.TTL, SimPolicy.LEASE)
    max_idle = cfg.max_idle
    retention = cfg.ttl if pol is SimPolicy.TTL else max_idle
    ret_cap = hbm if pol is SimPolicy.TTL else hbm * cfg.retained_fraction
    release_last = cfg.release_on_close and pol in (SimPolicy.LEASE, SimPolicy.WRITE_THROUGH)
    wt, lru = pol is SimPolicy.WRITE_THROUGH, pol is SimPolicy.LRU_HOST
    keeps = pol is not SimPolicy.NONE
    inv_tps = 1.0 / tps
    staged = cfg.per_block_s is None
    dev_fixed = cfg.device_pull_s(0) if staged else 0.0
    dev_spt = cfg.device_pull_s(1) - dev_fixed if staged else 0.0  # seconds a token
    host_spt = cfg.host_pull_s(1)
    dev_pull = cfg.device_pull_s

    running = [0.0] * D
    runh: list[list[tuple[float, int]]] = [[] for _ in range(D)]  # (end, instance): one turn each
    ret = [0.0] * D  # HBM retained (ttl, lease)
    exph: list[list[tuple[float, int, int]]] = [[] for _ in range(D)]
    area = [0.0] * D
    last_t = [0.0] * D
    cache: list[dict[int, int]] = [{} for _ in range(D)]  # write-through's evictable HBM copies
    cache_used = [0.0] * D
    host: list[dict[int, int]] = [{} for _ in range(D)]  # lru-host's LRU
    host_used = [0.0] * D
    host_peak = [0.0] * D
    pfree = [0.0] * P
    pcache: list[dict[int, int]] = [{} for _ in range(P)]
    pused = [0.0] * P
    live = [0] * M  # the seq of the instance's retention (HBM or host lease); 0: none
    held = [0] * M
    ready = [0.0] * M
    run_seq, run_need, run_last = [0] * M, [0] * M, [False] * M  # the instance's running turn
    evictions = 0

    def set_ret(k: int, t: float, delta: float) -> None:
        lt = last_t[k]
        if t > lt:
            area[k] += ret[k] * (t - lt)
            last_t[k] = t
        ret[k] += delta

    def evict_oldest(k: int, t: float) -> bool:
        """Drop the retention with the oldest deadline (HBM for ttl/lease, host for write-through)."""
        eh = exph[k]
        while eh:
            _, s, m = heappop(eh)
            if live[m] == s:
                live[m] = 0
                if ttl_like:
                    set_ret(k, t, -held[m])
                else:  # write-through: the lease is gone, so is its HBM copy
                    host_used[k] -= held[m]
                    cache_used[k] -= cache[k].pop(m, 0)
                return True
        return False

    def fit_cache(k: int) -> None:
        room = hbm - running[k]
        c = cache[k]
        while cache_used[k] > room and c:
            cache_used[k] -= c.pop(next(iter(c)))

    def finished(k: int, f: float, s: int, m: int, b: int, last: bool) -> None:
        nonlocal evictions
        if ttl_like:
            if last and release_last:
                return
            set_ret(k, f, b)
            live[m], held[m] = s, b
            heappush(exph[k], (f + retention, s, m))
            while ret[k] > ret_cap and evict_oldest(k, f):
                evictions += 1
        elif wt:
            if live[m]:
                host_used[k] -= held[m]
                live[m] = 0
            if last and release_last:
                return
            cache[k][m] = b  # the running KV becomes cache: HBM in use is unchanged
            cache_used[k] += b
            live[m], held[m], ready[m] = s, b, f + b / demote
            host_used[k] += b
            heappush(exph[k], (f + max_idle, s, m))
            while host_used[k] > host_cap and evict_oldest(k, f):
                evictions += 1
            if host_used[k] > host_peak[k]:
                host_peak[k] = host_used[k]
        elif lru:
            h = host[k]
            host_used[k] += b - h.pop(m, 0)
            h[m] = b
            ready[m] = f + b / demote
            while host_used[k] > host_cap and h:
                host_used[k] -= h.pop(next(iter(h)))
                evictions += 1
            if host_used[k] > host_peak[k]:
                host_peak[k] = host_used[k]

    def advance(k: int, now: float) -> None:
        """Apply node ``k``'s turn ends and retention deadlines up to ``now``, in time order."""
        rh, eh = runh[k], exph[k]
        while True:
            tr = rh[0][0] if rh else INF
            te = eh[0][0] if eh else INF
            if tr <= te:
                if tr > now or not rh:
                    return
                f, m = heappop(rh)
                b = run_need[m]
                running[k] -= b
                if keeps:
                    finished(k, f, run_seq[m], m, b, run_last[m])
            else:
                if te > now:
                    return
                d, s, m = heappop(eh)
                if live[m] == s:
                    live[m] = 0
                    if ttl_like:
                        set_ret(k, d, -held[m])
                    else:
                        host_used[k] -= held[m]
                        cache_used[k] -= cache[k].pop(m, 0)

    if slots is None:
        ev = [(sessions.start[m], off[m] * M + m) for m in range(M)]
        heapify(ev)
        next_start = M
    else:
        next_start = min(slots, M)
        step = sessions.duration / next_start if next_start else 0.0
        ev = [(i * step, off[base[i]] * M + i) for i in range(next_start)]
    seq = next_start
    last_start = INF  # slots: when the last session starts (turns after it are not measured)
    end = 0.0
    keep = slots is not None or per_turn  # per-turn columns (else running counts)
    arrivals, ttfts = array("d"), array("d")
    srcs = array("b")
    reused_at = array("q")
    turn_of = array("q")
    inst_of = array("q")
    counts = [0] * len(SOURCES)
    reused = 0
    while ev:
        t, key = heappop(ev)
        j, m = divmod(key, M)
        seq += 1
        k, pk = dnode[m], pnode[m]
        p, c = prompt[j], comp[j]
        rh, eh = runh[k], exph[k]
        if (rh and rh[0][0] <= t) or (eh and eh[0][0] <= t):
            advance(k, t)
        src = FIRST
        local = ext = 0
        pull = 0.0
        pc = pcache[pk]
        if j != first_turn[m]:
            pp, ppc = prompt[j - 1], comp[j - 1]
            tier = 0
            if ttl_like:
                if live[m]:
                    tier = DEVICE
                    set_ret(k, t, -held[m])
                    live[m] = 0
            elif wt:
                if not live[m]:
                    pass
                elif m in cache[k]:
                    tier = DEVICE
                    cache_used[k] -= cache[k].pop(m)
                elif ready[m] <= t:
                    tier = HOST
            elif lru:
                h = host[k]
                if m in h and ready[m] <= t:
                    tier = HOST
                    h[m] = h.pop(m)
            if m in pc:  # (moved to the LRU end when the prompt is cached again below)
                local = pp if pp < p else p
            e = (pp + ppc if pp + ppc < p else p) - local
            if tier and e > 0:
                tp = e * host_spt if tier == HOST else (dev_fixed + e * dev_spt if staged else dev_pull(e))
                if tp < e * inv_tps:
                    ext, pull, src = e, tp, tier
            if not ext:
                src = P_LOCAL if local else MISS
        # P: FIFO prefill of what is not reused
        st = t + pull
        if pfree[pk] > st:
            st = pfree[pk]
        done_p = st + (p - local - ext) * inv_tps
        pfree[pk] = done_p
        if pcap > 0:
            b = p * bpt
            pused[pk] += b - pc.pop(m, 0)
            pc[m] = b
            while pused[pk] > pcap and pc:
                pused[pk] -= pc.pop(next(iter(pc)))
        # D: admitted when the turn's KV fits beside the running batch and the retained HBM
        need = (p + c) * bpt
        a = done_p
        if hbm - running[k] - ret[k] < need and ((rh and rh[0][0] <= a) or (eh and eh[0][0] <= a)):
            advance(k, a)
        while hbm - running[k] - ret[k] < need:
            nxt = min(rh[0][0] if rh else INF, eh[0][0] if ttl_like and eh else INF)
            if nxt == INF:
                if ret[k] > 0 and evict_oldest(k, a):
                    evictions += 1
                    continue
                break  # nothing left to wait for: larger than the node, runs alone
            a = max(a, nxt)
            advance(k, a)
        first_token = a + (dev_fixed + p * dev_spt if staged else dev_pull(p))
        finish = first_token + c / dtps
        if finish > end:
            end = finish
        running[k] += need
        if wt:
            fit_cache(k)
        last = j == last_turn[m]
        run_seq[m], run_need[m], run_last[m] = seq, need, last
        heappush(rh, (finish, m))
        ttfts.append(first_token - t)
        if keep:
            arrivals.append(t)
            srcs.append(src)
            reused_at.append(local + ext)
            if per_turn:
                turn_of.append(j - first_turn[m])
                inst_of.append(m)
        else:
            counts[src] += 1
            reused += local + ext
        if not last:
            heappush(ev, (finish + think[j + 1], key + M))
        elif slots is not None and next_start < M:
            n = next_start
            next_start += 1
            heappush(ev, (finish, off[base[n]] * M + n))
            if next_start == M:
                last_start = finish
    for k in range(D):
        advance(k, INF)
        set_ret(k, max(last_t[k], end), 0.0)
    measured = [i for i, at in enumerate(arrivals) if at < last_start] if last_start < INF else None
    if measured is None:
        ttft = array("d", sorted(ttfts))
        if keep:
            for s_ in srcs:
                counts[s_] += 1
            reused = sum(reused_at)
    else:
        ttft = array("d", sorted(ttfts[i] for i in measured))
        counts = [0] * len(SOURCES)
        for i in measured:
            counts[srcs[i]] += 1
        reused = sum(reused_at[i] for i in measured)
    rows = None
    if per_turn:
        rows = tuple(
            (names[inst_of[i]], turn_of[i], arrivals[i], ttfts[i], srcs[i], reused_at[i])
            for i in range(len(arrivals))
        )
    return SimResult(
        policy=pol,
        sessions=M,
        turns=len(ttft),
        ttft=ttft,
        sources=tuple(counts),
        reused_tokens=reused,
        hbm_retained_byte_s=sum(area),
        host_peak_bytes=round(max(host_peak, default=0.0)),
        evictions=evictions,
        span_s=end,
        per_turn=rows,
    )


__all__ = ["FIRST", "SOURCES", "Sessions", "SimPolicy", "SimResult", "build_sessions", "simulate"]
