"""``kvlease plan FILE``: the capacity planner's command (registered in the ``kvlease.commands``
entry-point group). A thin shell: options -> :class:`PlanConfig` -> ``plan()`` -> table or JSON;
with ``--cluster``, options -> ``ClusterConfig`` -> ``plan_cluster_file()`` -> table, JSON and the
per-turn JSONL."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Final

import typer
from rich.console import Console
from rich.markup import escape

from kvlease._analyze._cluster_costs import CLASS_ALIASES, CLASS_PRESETS, ClusterInputError, cluster_config
from kvlease._analyze._cluster_report import per_turn_records, render_cluster
from kvlease._analyze._cluster_report import to_json_text as cluster_json_text
from kvlease._analyze._formats import (
    MOONCAKE_BLOCK_SIZE,
    InputFormat,
)
from kvlease._analyze._model import DEFAULT_MAX_IDLE, DEFAULT_TTL
from kvlease._analyze._plan import DEFAULT_BLOCK_SIZE, DTYPE_BYTES, PRESETS, ModelKV
from kvlease._analyze._plan_api import plan, plan_cluster_file
from kvlease._analyze._plan_report import DEFAULT_POINTS, DEFAULT_TARGET, PlanConfig, render, to_json_text
from kvlease._analyze.cli import input_errors, input_path, require_plotting

_UNITS: Final = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
                 "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip
_SIZE: Final = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``80GiB``, ``40 GB``, ``512MiB``, ``1e9``: a size in bytes (decimal units: kB, MB, GB, TB)."""
    m = _SIZE.fullmatch(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise typer.BadParameter(f"not a size: {text!r} (e.g. 80GiB, 40GB, 512MiB)")
    return round(float(m.group(1)) * _UNITS[unit])


def kv_bytes_per_token(
    model: str | None,
    per_token: int | None,
    layers: int | None,
    kv_heads: int | None,
    head_dim: int | None,
    dtype: str,
) -> tuple[int, str]:
    """One of: a preset, ``--kv-bytes-per-token``, or ``--layers/--kv-heads/--head-dim`` (``--dtype``)."""
    shape = (layers, kv_heads, head_dim)
    given = sum((model is not None, per_token is not None, any(v is not None for v in shape)))
    if given != 1:
        raise typer.BadParameter(
            "give exactly one of --model, --kv-bytes-per-token, or --layers/--kv-heads/--head-dim",
            param_hint="--model",
        )
    if model is not None:
        preset = PRESETS.get(model.lower())
        if preset is None:
            raise typer.BadParameter(
                f"unknown model {model!r}; presets: {', '.join(PRESETS)}", param_hint="--model"
            )
        m = ModelKV(preset.layers, preset.kv_heads, preset.head_dim, dtype, preset.name)
        return m.bytes_per_token, f"{m.name} ({dtype})"
    if per_token is not None:
        return per_token, ""
    if any(v is None for v in shape):
        raise typer.BadParameter("--layers, --kv-heads and --head-dim go together", param_hint="--layers")
    m = ModelKV(layers or 0, kv_heads or 0, head_dim or 0, dtype)
    return m.bytes_per_token, f"{layers} layers x {kv_heads} KV heads x {head_dim} ({dtype})"


def _is_class(model: str) -> bool:
    key = model.lower()
    return key in CLASS_ALIASES or key.removesuffix("-class") in CLASS_PRESETS


def cluster_kv(
    model: str | None,
    per_token: int | None,
    layers: int | None,
    kv_heads: int | None,
    head_dim: int | None,
    dtype: str,
) -> ModelKV | None:
    """The KV shape for ``--cluster``: a class preset (None: the class's own, in bf16), a KV preset,
    or ``--layers/--kv-heads/--head-dim``; not ``--kv-bytes-per-token`` (the per-block READ needs
    the layers)."""
    shape = (layers, kv_heads, head_dim)
    if per_token is not None:
        raise typer.BadParameter(
            "--cluster needs the model's shape: --model or --layers/--kv-heads/--head-dim",
            param_hint="--kv-bytes-per-token",
        )
    if model is not None and any(v is not None for v in shape):
        raise typer.BadParameter(
            "give --model or --layers/--kv-heads/--head-dim, not both", param_hint="--model"
        )
    if model is not None:
        if _is_class(model):
            key = CLASS_ALIASES.get(model.lower(), model.lower().removesuffix("-class"))
            base = CLASS_PRESETS[key].kv
        elif model.lower() in PRESETS:
            base = PRESETS[model.lower()]
        else:
            names = ", ".join([*CLASS_PRESETS, *PRESETS])
            raise typer.BadParameter(
                f"unknown model {model!r}; with --cluster: {names}", param_hint="--model"
            )
        return ModelKV(base.layers, base.kv_heads, base.head_dim, dtype, base.name)
    if any(v is None for v in shape):
        raise typer.BadParameter(
            "--cluster needs --model (8b, 32b, 70b) or --layers, --kv-heads and --head-dim",
            param_hint="--model",
        )
    return ModelKV(layers or 0, kv_heads or 0, head_dim or 0, dtype)


def _cluster_option(default: Any, *flags: str, **kwargs: Any) -> Any:
    """An option of ``--cluster`` mode (its own panel in ``--help``)."""
    return typer.Option(default, *flags, rich_help_panel="Cluster", **kwargs)


def _warn_malformed(err: Console, source: dict[str, Any]) -> None:
    if source.get("malformed"):
        err.print(f"warning: {source['malformed']:,} malformed records skipped", highlight=False)


def plan_command(
    file: Path = typer.Argument(
        ...,
        dir_okay=False,
        callback=input_path,
        help="Turn log, request log, vLLM stats or Mooncake trace; - reads standard input.",
    ),
    model: str | None = typer.Option(None, "--model", help=f"A preset: {', '.join(PRESETS)}."),
    per_token: int | None = typer.Option(None, "--kv-bytes-per-token", min=1, help="KV bytes per token."),
    layers: int | None = typer.Option(
        None, "--layers", min=1, help="Model layers (with --kv-heads, --head-dim)."
    ),
    kv_heads: int | None = typer.Option(None, "--kv-heads", min=1, help="KV heads (GQA groups)."),
    head_dim: int | None = typer.Option(None, "--head-dim", min=1, help="Head dimension."),
    dtype: str = typer.Option("bf16", "--dtype", help=f"KV cache dtype: {', '.join(DTYPE_BYTES)}."),
    nodes: int = typer.Option(1, "--nodes", min=1, help="Decode nodes (conversations hashed to nodes)."),
    caps: list[str] | None = typer.Option(
        None,
        "--cap",
        help="Retention cap per node to try, e.g. 40GiB (repeat); "
        "default: caps halving down from the uncapped need.",
    ),
    points: int = typer.Option(DEFAULT_POINTS, "--points", min=0, help="Caps in the default sweep."),
    ttl: float = typer.Option(
        DEFAULT_TTL, "--ttl", min=0, help="Fixed TTL (upstream vLLM's decoder_kv_blocks_ttl)."
    ),
    max_idle: float = typer.Option(DEFAULT_MAX_IDLE, "--max-idle", min=0, help="Lease max-idle, seconds."),
    block_size: int = typer.Option(DEFAULT_BLOCK_SIZE, "--block-size", min=1, help="KV block size, tokens."),
    node_kv: str | None = typer.Option(
        None,
        "--node-kv-bytes",
        help="KV cache of one decode node, e.g. 60GiB (to recommend max_retained_fraction).",
    ),
    target: float = typer.Option(
        DEFAULT_TARGET,
        "--target",
        min=0.0,
        max=1.0,
        help="Share of the uncapped lease hits the recommended cap keeps.",
    ),
    release_on_close: bool = typer.Option(
        False,
        "--release-on-close",
        help="Leases: the client releases when a conversation closes (its last turn retains nothing).",
    ),
    input_format: InputFormat | None = typer.Option(
        None, "--format", case_sensitive=False, help="Input format."
    ),
    strict: bool = typer.Option(False, "--strict", help="Fail on the first malformed record (exit 1)."),
    mooncake_block_size: int = typer.Option(MOONCAKE_BLOCK_SIZE, "--mooncake-block-size", min=1),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON on stdout."),
    plot: Path | None = typer.Option(
        None,
        "--plot",
        dir_okay=False,
        help="Write a PNG: hit rate and reused tokens against the retention cap per node.",
    ),
    cluster: bool = _cluster_option(
        False,
        "--cluster",
        help="Session-level mode: simulate P and D nodes, tiers and TTFT for five policies "
        "(models 8b, 32b, 70b; --nodes counts D nodes).",
    ),
    p_nodes: int | None = _cluster_option(None, "--p-nodes", min=1, help="Prefill nodes (default: --nodes)."),
    gpus: int | None = _cluster_option(None, "--gpus", min=1, help="GPUs per node (default: the class's)."),
    prefill_tps: float | None = _cluster_option(
        None, "--prefill-tps", min=0, help="Prefill tokens/s per P node."
    ),
    decode_tps: float | None = _cluster_option(
        None, "--decode-tps", min=0, help="Decode tokens/s of one sequence."
    ),
    hbm_kv: str | None = _cluster_option(None, "--hbm-kv", help="KV cache (HBM) per node, e.g. 60GB."),
    host_mem: str | None = _cluster_option(None, "--host-mem", help="Host arena per D node, e.g. 1TB."),
    p_cache: str | None = _cluster_option(None, "--p-cache", help="P's prefix cache per P node (0: off)."),
    nic_gbps: float | None = _cluster_option(
        None, "--nic-gbps", min=0, help="NIC GB/s per GPU (default 50)."
    ),
    host_pull_gbps: float | None = _cluster_option(
        None, "--host-pull-gbps", min=0, help="Host tier pull GB/s (default 0.9, measured)."
    ),
    demote_gbps: float | None = _cluster_option(
        None, "--demote-gbps", min=0, help="D2H demotion GB/s (default 53, measured)."
    ),
    per_block_pull: bool = _cluster_option(
        False, "--per-block-pull", help="Device pulls as per-block READs, not staged."
    ),
    retained_fraction: float = _cluster_option(
        0.5, "--retained-fraction", min=0.0, max=1.0, help="Leases' cap: share of D's KV cache."
    ),
    ttft_target: float = _cluster_option(
        2.0, "--ttft-target", min=0.0, help="TTFT p90 target, seconds (the sessions sweep)."
    ),
    sessions: int | None = _cluster_option(
        None,
        "--sessions",
        min=1,
        help="Load: this many concurrent sessions (default: the trace's start times).",
    ),
    sweep: bool = _cluster_option(
        True, "--sweep/--no-sweep", help="Find the sessions per D node under the TTFT target."
    ),
    jobs: int | None = _cluster_option(
        None, "--jobs", min=1, help="Processes for the policies (default: one per CPU on large traces)."
    ),
    per_turn: Path | None = _cluster_option(
        None, "--per-turn", dir_okay=False, help="Write each simulated turn (policy, source, TTFT) as JSONL."
    ),
) -> None:
    """How much decode memory would leases hold for this traffic, and what hit rate does each amount buy?

    Replays the trace through a model of decode-side KV retention (fixed TTL as upstream vLLM, heartbeat leases with max-idle as kvlease, leases under a per-node cap evicting the oldest deadline first) and recommends a lease TTL, max-idle and max_retained_fraction. With --cluster: simulates the sessions on P and D nodes under five policies (no reuse, fixed TTL, leases in HBM, write-through leases in the host arena, an LRU host tier) and reports TTFT, hit sources, memory and the sessions a decode node sustains.
    """
    err = Console(stderr=True)
    if cluster:
        if plot is not None:
            raise typer.BadParameter(
                "--plot draws the retention sweep; not with --cluster", param_hint="--plot"
            )
        if dtype not in DTYPE_BYTES:
            raise typer.BadParameter(f"one of {', '.join(DTYPE_BYTES)}", param_hint="--dtype")
        kv = cluster_kv(model, per_token, layers, kv_heads, head_dim, dtype)
        try:
            ccfg = cluster_config(
                model if model is not None and _is_class(model) else None,
                p_nodes=p_nodes or nodes,
                d_nodes=nodes,
                kv=kv,
                gpus=gpus,
                prefill_tps=prefill_tps,
                decode_tps=decode_tps,
                hbm_kv=None if hbm_kv is None else parse_bytes(hbm_kv),
                host_bytes=None if host_mem is None else parse_bytes(host_mem),
                p_cache=None if p_cache is None else parse_bytes(p_cache),
                nic_gbps=nic_gbps,
                host_pull_gbps=host_pull_gbps,
                demote_gbps=demote_gbps,
                per_block=per_block_pull,
                ttl=ttl,
                max_idle=max_idle,
                retained_fraction=retained_fraction,
                release_on_close=release_on_close,
                block_size=block_size,
                ttft_target=ttft_target,
            )
        except ClusterInputError as e:
            raise typer.BadParameter(str(e), param_hint="--cluster") from None
        with input_errors(err, file):
            cplan = plan_cluster_file(
                file,
                ccfg,
                format=input_format,
                strict=strict,
                mooncake_block_size=mooncake_block_size,
                slots=sessions,
                sweep=sweep,
                per_turn=per_turn is not None,
                jobs=jobs,
            )
        if per_turn is not None:
            with per_turn.open("w", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in per_turn_records(cplan))
        if as_json:
            sys.stdout.write(cluster_json_text(cplan) + "\n")
        else:
            render_cluster(cplan, Console())
        _warn_malformed(err, cplan.source)
        return
    if dtype not in DTYPE_BYTES:
        raise typer.BadParameter(f"one of {', '.join(DTYPE_BYTES)}", param_hint="--dtype")
    bpt, label = kv_bytes_per_token(model, per_token, layers, kv_heads, head_dim, dtype)
    config = PlanConfig(
        bytes_per_token=bpt,
        nodes=nodes,
        ttl=ttl,
        max_idle=max_idle,
        block_size=block_size,
        caps=None if not caps else tuple(parse_bytes(c) for c in caps),
        points=points,
        node_kv_bytes=None if node_kv is None else parse_bytes(node_kv),
        target=target,
        model=label,
        release_on_close=release_on_close,
    )
    if plot is not None:
        require_plotting(err)
    with input_errors(err, file):
        result = plan(
            file, config, format=input_format, strict=strict, mooncake_block_size=mooncake_block_size
        )
    if as_json:
        sys.stdout.write(to_json_text(result) + "\n")
    else:
        render(result, Console())
    _warn_malformed(err, result.source)
    if plot is not None:
        from kvlease._analyze._plan_plot import plot_plan

        plot_plan(result, plot)
        if not as_json:
            err.print(f"plot written to {escape(str(plot))}", highlight=False)
