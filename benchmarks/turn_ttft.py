"""Turn-2 prefill time on P: kvlease verified pull vs recompute vs upstream NixlConnector pull.

On the local real stack (vLLM CPU prefill/decode pair with NIXL, the ``small`` model), for a history
of about 1k, 2k and 3.5k tokens: a conversation's turn 1 runs through P and D, then turn 2 (turn 1 +
D's answer + a new user message) is sent to P and the wall time of P's ``max_tokens=1`` request is
measured. Arms:

- ``pull``: with D's handle (kvlease: verified pull; upstream: pull by length),
- ``recompute``: the same turn 2 without a handle (P recomputes what its prefix cache lacks),
- ``edited`` (kvlease only): an earlier token of the history edited, so only the blocks before the
  edit verify; kvlease pulls those and recomputes the rest;
- ``stripped`` (kvlease only): the first half of D's answer (its reasoning) left out of the resent
  history, as frameworks that drop reasoning do: the whole turn-1 prompt verifies and is pulled, the
  rest is recomputed (the SDK leaves reuse on for this behind the kvlease connector).

kvlease also runs with staged pulls (``kvlease.staging``, see ``kvlease_vllm._worker``) forced on:
the arm ``kvlease`` runs with ``staging: off`` (upstream's per-block READ), the arms
``kvlease+placement=auto`` / ``host`` place every finished turn in D's host arena (the pull then
reads D's intact device copy, or D promotes the lease from the arena: ``placement_vs_device``), the arm
``kvlease+staging=always`` pulls every turn through D's staging buffer (one READ), so its
pull time is compared with kvlease's per-block pull (``staged_vs_per_block``; on this CPU stack a
pull is a handful of contiguous blocks, where staging is not expected to gain, only not to lose).
``--staging MODES`` (or ``$KVLEASE_TTFT_STAGING``, comma-separated ``auto``/``always``; empty: none)
picks the staged arms.

Each configuration runs with P's prefix cache off and on; figures are medians of ``n`` conversations,
every conversation with its own ``cache_salt``. A pull takes a few hundred ms here and varies by tens
of percent from one conversation to the next, so with P's prefix cache off (the case the comparison
with upstream is about) the pull arm gets ``n_pull`` conversations (extra pull-only conversations),
and the result reports kvlease's pull median against upstream's per size, with every sample kept.
Run: ``python benchmarks/turn_ttft.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
import uuid
from typing import Any

import httpx

from kvlease.protocol import KV_TRANSFER_PARAMS, prefill_request_params
from kvlease_stack import Stack, StackSpec, default_dtype

TIMEOUT = httpx.Timeout(600.0, connect=10.0)
GEN = 16
NEW_TURN = 48


def _complete(
    http: httpx.Client, url: str, model: str, prompt: list[int], params: dict[str, Any], salt: str, n: int
) -> tuple[dict[str, Any], float]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "cache_salt": salt,
        KV_TRANSFER_PARAMS: params,
    }
    t0 = time.perf_counter()
    r = http.post(url + "/v1/completions", json=body)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    return dict(r.json()), dt


def _turn1(
    http: httpx.Client, stack: Stack, prompt: list[int], salt: str
) -> tuple[list[int], dict[str, Any] | None]:
    """Turn 1 through P and D; D's generated tokens and its handle."""
    p, _ = _complete(http, stack.prefill.url, stack.model_name, prompt, prefill_request_params(), salt, 1)
    d, _ = _complete(http, stack.decode.url, stack.model_name, prompt, p[KV_TRANSFER_PARAMS], salt, GEN)
    return list(d["choices"][0]["token_ids"]), d.get(KV_TRANSFER_PARAMS)


def _p_time(
    http: httpx.Client, stack: Stack, prompt: list[int], handle: dict[str, Any] | None, salt: str
) -> float:
    """Turn 2 on P only (the measured part); D's decode of turn 2 is not needed for the figure."""
    _, dt = _complete(
        http, stack.prefill.url, stack.model_name, prompt, handle or prefill_request_params(), salt, 1
    )
    return dt


def _trial(
    http: httpx.Client, stack: Stack, size: int, rng: random.Random, kvlease: bool
) -> dict[str, float]:
    """One conversation per arm. With P's prefix cache off the recompute arm needs no turn 1 of its
    own (P recomputes the whole prompt either way); with it on, every arm plays its own turn 1 so P
    holds its turn-1 prompt as in production."""
    prompt1 = [rng.randrange(200, 4000) for _ in range(size)]
    new = [rng.randrange(200, 4000) for _ in range(NEW_TURN)]
    prefix_on = stack.spec.prefix_caching
    out: dict[str, float] = {}
    gen1, handle = _turn1(http, stack, prompt1, salt := uuid.uuid4().hex)
    out["pull"] = _p_time(http, stack, prompt1 + gen1 + new, handle, salt)
    if prefix_on:
        _turn1(http, stack, prompt1, salt := uuid.uuid4().hex)
    out["recompute"] = _p_time(
        http, stack, prompt1 + gen1 + new, None, salt if prefix_on else uuid.uuid4().hex
    )
    if kvlease:
        gen1, handle = _turn1(http, stack, prompt1, salt := uuid.uuid4().hex)
        history = prompt1 + gen1
        history[len(history) // 2] = 4001 if history[len(history) // 2] != 4001 else 4002
        out["edited"] = _p_time(http, stack, history + new, handle, salt)
        gen1, handle = _turn1(http, stack, prompt1, salt := uuid.uuid4().hex)
        out["stripped"] = _p_time(http, stack, prompt1 + gen1[GEN // 2 :] + new, handle, salt)
    return out


def _pull_only(http: httpx.Client, stack: Stack, size: int, rng: random.Random) -> float:
    """One more conversation for the pull arm alone: turn 1, then turn 2 on P with D's handle."""
    prompt1 = [rng.randrange(200, 4000) for _ in range(size)]
    new = [rng.randrange(200, 4000) for _ in range(NEW_TURN)]
    gen1, handle = _turn1(http, stack, prompt1, salt := uuid.uuid4().hex)
    return _p_time(http, stack, prompt1 + gen1 + new, handle, salt)


def measure(
    spec: StackSpec,
    sizes: tuple[int, ...],
    n: int,
    n_pull: int,
    seed: int = 0,
    samples_out: dict[int, dict[str, list[float]]] | None = None,
) -> dict[int, dict[str, float]]:
    """Median P time (ms) per history size and arm for one stack configuration; every sample (ms)
    goes to ``samples_out`` when given."""
    rng = random.Random(seed)
    results: dict[int, dict[str, float]] = {}
    # the edited and stripped arms measure verification, not the transfer: kvlease's plain arm only
    verify_arms = spec.connector == "kvlease" and spec.kvlease.get("staging", "off") == "off"
    with Stack.start(spec, timeout=900) as stack, httpx.Client(timeout=TIMEOUT) as http:
        _trial(http, stack, sizes[0], rng, verify_arms)  # warm-up, not timed
        for size in sizes:
            _pull_only(http, stack, size, rng)  # first use of this length, not timed
            samples: dict[str, list[float]] = {}
            for _ in range(n):
                for arm, t in _trial(http, stack, size, rng, verify_arms).items():
                    samples.setdefault(arm, []).append(t)
            for _ in range(n_pull - n):
                samples["pull"].append(_pull_only(http, stack, size, rng))
            results[size] = {arm: statistics.median(v) * 1e3 for arm, v in samples.items()}
            if samples_out is not None:
                samples_out[size] = {arm: [round(t * 1e3, 1) for t in v] for arm, v in samples.items()}
            print(
                f"  {spec.connector:8s} prefix_cache={spec.prefix_caching!s:5s} {size:5d} tokens: "
                + ", ".join(f"{a} {m:.0f} ms" for a, m in results[size].items()),
                flush=True,
            )
    return results


#: Staged arms run by default (``--staging`` / ``$KVLEASE_TTFT_STAGING`` override).
DEFAULT_STAGING = "always"


def staging_modes(raw: str | None = None) -> tuple[str, ...]:
    """The staged arms: ``auto`` / ``always``, comma-separated (empty: none)."""
    raw = os.environ.get("KVLEASE_TTFT_STAGING", DEFAULT_STAGING) if raw is None else raw
    modes = tuple(m.strip() for m in raw.split(",") if m.strip())
    bad = [m for m in modes if m not in ("auto", "always")]
    if bad:
        raise ValueError(f"staging arms must be auto or always, not {', '.join(bad)}")
    return modes


def _configurations(staging: tuple[str, ...]) -> list[tuple[str, str, dict[str, Any]]]:
    """``(key prefix, connector, kvlease config)`` of every arm: kvlease's per-block pull (staging
    off, upstream's READ), its staged arms, upstream's connector."""
    arms: list[tuple[str, str, dict[str, Any]]] = [("kvlease", "kvlease", {"staging": "off"})]
    arms += [(f"kvlease+staging={m}", "kvlease", {"staging": m}) for m in staging]
    arms += [
        (
            f"kvlease+placement={p}",
            "kvlease",
            {"staging": "always", "placement": p, "host_arena_bytes": ARENA_BYTES},
        )
        for p in PLACEMENTS
    ]
    return [*arms, ("nixl", "nixl", {})]


#: The host-placement arms (``kvlease.placement``): D writes each finished turn through to its host
#: arena and gives the blocks back; ``auto`` pulls the device copy while it is intact (here always:
#: nothing else runs on D between the turns), ``host`` always promotes the lease from the arena.
PLACEMENTS = ("auto", "host")
ARENA_BYTES = 512 << 20


def placement_vs_device(results: dict[str, Any]) -> dict[str, Any]:
    """Each placement arm's median pull over the staged pull of a lease held in HBM, per prefix
    mode and size (the cost of serving the pull from the arena: D's promotion)."""
    return _pull_ratios(
        results, [(f"placement={p}", f"kvlease+placement={p}", "kvlease+staging=always") for p in PLACEMENTS]
    )


def _pull_ratios(results: dict[str, Any], pairs: list[tuple[str, str, str]]) -> dict[str, Any]:
    """``{"<label>/prefix_cache=<on|off>": {size: arm pull / base pull}}`` for each ``(label, arm,
    base)`` configuration pair that ran, per prefix mode and size both ran."""
    out: dict[str, Any] = {}
    for label, arm, base in pairs:
        for cache in ("off", "on"):
            mine = results.get(f"{arm}/prefix_cache={cache}")
            theirs = results.get(f"{base}/prefix_cache={cache}")
            if mine and theirs:
                out[f"{label}/prefix_cache={cache}"] = {
                    size: round(mine[size]["pull"] / theirs[size]["pull"], 3)
                    for size in mine
                    if size in theirs
                }
    return out


def run(quick: bool = False, staging: str | None = None, arms: str | None = None) -> dict[str, Any]:
    """Run the benchmark; returns ``{"<arm>/prefix_cache=<on|off>": {size: {arm: ms}}}``.
    ``arms``: comma-separated arm names to run (``kvlease``, ``kvlease+staging=auto``, ``nixl``, ...;
    default all)."""
    modes = staging_modes(staging)
    only = {a.strip() for a in arms.split(",") if a.strip()} if arms else None
    sizes = (1024, 2048) if quick else (1024, 2048, 3584)
    n, n_pull_off = 5, (7 if quick else 11)
    prefix_modes = (False,) if quick else (False, True)
    out: dict[str, Any] = {
        "sizes": sizes,
        "n": n,
        "n_pull_prefix_cache_off": n_pull_off,
        "model": "small",
        "staging_arms": list(modes),
        "results": {},
        "samples_ms": {},
    }
    for prefix in prefix_modes:
        for name, connector, kvlease in _configurations(modes):
            if only is not None and name not in only:
                continue
            spec = StackSpec(
                model="small",
                connector=connector,  # type: ignore[arg-type]
                ttl=600.0,
                prefix_caching=prefix,
                dtype=default_dtype(),
                kvlease=kvlease,
            )
            key = f"{name}/prefix_cache={'on' if prefix else 'off'}"
            samples = out["samples_ms"][key] = {}
            out["results"][key] = measure(spec, sizes, n, n if prefix else n_pull_off, samples_out=samples)
    out["pull_vs_upstream"] = pull_vs_upstream(out["results"])
    out["staged_vs_per_block"] = staged_vs_per_block(out["results"], modes)
    out["placement_vs_device"] = placement_vs_device(out["results"])
    return out


def staged_vs_per_block(results: dict[str, Any], modes: tuple[str, ...]) -> dict[str, Any]:
    """Each staged arm's median pull time over kvlease's per-block pull, per prefix mode and size."""
    return _pull_ratios(results, [(f"staging={m}", f"kvlease+staging={m}", "kvlease") for m in modes])


def pull_vs_upstream(results: dict[str, Any]) -> dict[str, Any]:
    """kvlease's median pull time over upstream's, per prefix-cache mode and size (goal: <= 1.10)."""
    out: dict[str, Any] = {}
    for mode in ("off", "on"):
        ours, theirs = results.get(f"kvlease/prefix_cache={mode}"), results.get(f"nixl/prefix_cache={mode}")
        if not ours or not theirs:
            continue
        out[f"prefix_cache={mode}"] = {
            size: round(ours[size]["pull"] / theirs[size]["pull"], 3) for size in ours if size in theirs
        }
    ratios = [r for by_size in out.values() for r in by_size.values()]
    out["goal"] = "kvlease pull within 10 % of upstream's (ratio <= 1.10)"
    out["goal_met"] = bool(ratios) and max(ratios) <= 1.10
    return out


def table(result: dict[str, Any]) -> str:
    lines = [f"turn-2 prefill time on P, model {result['model']}, median of {result['n']} (ms)", ""]
    head = (
        f"{'configuration':28s} {'history':>8s} {'recompute':>10s} {'pull':>8s} {'edited':>8s} "
        f"{'stripped':>9s} {'speedup':>8s}"
    )
    lines += [head, "-" * len(head)]
    for key, by_size in result["results"].items():
        for size, arms in by_size.items():
            rec, pull = arms.get("recompute", float("nan")), arms.get("pull", float("nan"))
            edited, stripped = arms.get("edited"), arms.get("stripped")
            lines.append(
                f"{key:28s} {size:8d} {rec:10.0f} {pull:8.0f} "
                f"{(f'{edited:8.0f}' if edited is not None else '       -')} "
                f"{(f'{stripped:9.0f}' if stripped is not None else '        -')} {rec / pull:7.1f}x"
            )
    for mode, by_size in result.get("pull_vs_upstream", {}).items():
        if isinstance(by_size, dict):
            lines.append(
                f"kvlease pull / upstream pull, {mode}: "
                + ", ".join(f"{size}: {ratio:.2f}" for size, ratio in by_size.items())
            )
    for arm, by_size in result.get("staged_vs_per_block", {}).items():
        lines.append(
            f"staged pull / per-block pull, {arm}: "
            + ", ".join(f"{size}: {ratio:.2f}" for size, ratio in by_size.items())
        )
    for arm, by_size in result.get("placement_vs_device", {}).items():
        lines.append(
            f"pull with host placement / staged pull of a lease in HBM, {arm}: "
            + ", ".join(f"{size}: {ratio:.2f}" for size, ratio in by_size.items())
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1k and 2k tokens, P prefix cache off only")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument(
        "--staging",
        default=None,
        help=f"staged kvlease arms, comma-separated auto/always ('' for none; default {DEFAULT_STAGING})",
    )
    ap.add_argument("--arms", default=None, help="only these arms, comma-separated (e.g. kvlease,nixl)")
    args = ap.parse_args()
    result = run(quick=args.quick, staging=args.staging, arms=args.arms)
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
