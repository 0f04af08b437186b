"""``kvlease stack up|down|status``: run the local real P/D pair in the background.

``up`` records what it started (PIDs, process groups, endpoints) in ``$KVLEASE_HOME/stack.json``;
``down`` stops exactly those process groups (after checking they still run a vLLM server).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import typer

app = typer.Typer(
    help="The local real stack: a vLLM CPU prefill/decode pair with NIXL.", no_args_is_help=True
)

_SERVER_MARK = "vllm.entrypoints.openai.api_server"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def _read_state(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _ours(entry: dict[str, Any]) -> bool:
    """The recorded server is still running and is still a vLLM server (PIDs get reused)."""
    from kvlease_stack._servers import group_alive

    pid, pgid = entry.get("pid"), entry.get("pgid")
    return (
        isinstance(pid, int) and isinstance(pgid, int) and group_alive(pgid) and _SERVER_MARK in _cmdline(pid)
    )


@app.command()
def up(
    model: str = typer.Option("tiny", help="tiny (trained) or small (random, for timings)."),
    connector: str = typer.Option(
        "kvlease", help="kvlease (KVLeaseConnector) or nixl (upstream NixlConnector)."
    ),
    bidir: bool = typer.Option(
        True, "--bidir/--no-bidir", help="Bidirectional KV transfer (D's blocks back to P)."
    ),
    ttl: float = typer.Option(120.0, help="D's decoder_kv_blocks_ttl, seconds."),
    recompute_threshold: int = typer.Option(64, help="kv_recompute_threshold, tokens."),
    prefix_caching: bool = typer.Option(
        True, "--prefix-caching/--no-prefix-caching", help="P's prefix cache."
    ),
    plugin: bool = typer.Option(True, "--plugin/--no-plugin", help="Load the kvlease vLLM plugin."),
    timeout: float = typer.Option(600.0, help="Start-up deadline per server, seconds."),
) -> None:
    """Provision (once), start P on core 0 and D on core 1, print the endpoints as JSON."""
    from kvlease_stack._config import StackSpec
    from kvlease_stack._paths import state_file
    from kvlease_stack._servers import Stack

    path = state_file()
    state = _read_state(path)
    if state and any(_ours(state.get(r, {})) for r in ("prefill", "decode")):
        typer.echo(f"a stack is already up (see {path}); run `kvlease stack down` first", err=True)
        raise typer.Exit(1)
    spec = StackSpec(
        model=model,  # type: ignore[arg-type]  # validated by StackSpec
        connector=connector,  # type: ignore[arg-type]
        bidir=bidir,
        ttl=ttl,
        recompute_threshold=recompute_threshold,
        prefix_caching=prefix_caching,
        plugin=plugin,
    )
    stack = Stack.start(spec, timeout=timeout, detached=True)
    info = {**stack.endpoints(), "started_at": time.time(), "timings": stack.timings}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info, indent=2))
    tmp.replace(path)
    typer.echo(json.dumps(info, indent=2))


@app.command()
def down(timeout: float = typer.Option(30.0, help="Seconds to wait after SIGTERM before SIGKILL.")) -> None:
    """Stop the servers recorded by ``kvlease stack up``."""
    from kvlease_stack._paths import state_file
    from kvlease_stack._servers import stop_group

    path = state_file()
    state = _read_state(path)
    if state is None:
        typer.echo("no stack recorded", err=True)
        return
    for role in ("decode", "prefill"):
        entry = state.get(role, {})
        if _ours(entry):
            stop_group(int(entry["pgid"]), timeout=timeout)
            typer.echo(f"stopped {role} (process group {entry['pgid']})")
        else:
            typer.echo(f"{role}: not running")
    with contextlib.suppress(OSError):
        path.unlink()


@app.command()
def status() -> None:
    """Show the recorded stack and whether its servers are up and healthy (JSON)."""
    from kvlease.protocol import HEALTH_PATH
    from kvlease_stack._paths import state_file
    from kvlease_stack._servers import _http_text

    path = state_file()
    state = _read_state(path)
    if state is None:
        typer.echo(json.dumps({"up": False}))
        raise typer.Exit(1)
    out: dict[str, Any] = {"up": True, "state_file": str(path)}
    for role in ("prefill", "decode"):
        entry = state.get(role, {})
        running = _ours(entry)
        healthy = False
        if running:
            with contextlib.suppress(OSError):
                healthy = _http_text(str(entry["url"]) + HEALTH_PATH, timeout=5)[0] == 200
        out[role] = {"url": entry.get("url"), "pid": entry.get("pid"), "running": running, "healthy": healthy}
        out["up"] = out["up"] and running and healthy
    typer.echo(json.dumps(out, indent=2))
    if not out["up"]:
        raise typer.Exit(1)


if __name__ == "__main__":  # pragma: no cover
    app(sys.argv[1:])
