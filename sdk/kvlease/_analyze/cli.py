"""``kvlease analyze FILE``: the command (registered in the ``kvlease.commands`` entry-point group)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

from kvlease._analyze._api import STDIN, analyze, spilled_size
from kvlease._analyze._formats import (
    MOONCAKE_BLOCK_SIZE,
    FormatDetectionError,
    InputFormat,
    MalformedInputError,
)
from kvlease._analyze._model import DEFAULT_MAX_IDLE, DEFAULT_REORDER_WINDOW, DEFAULT_TTL
from kvlease._analyze._report import render, to_json_text


def require_plotting(err: Console) -> None:
    """Exit 1 with the reason when ``--plot`` cannot work (before a long read, not after it)."""
    from kvlease._analyze._plot import PlotUnavailableError, _matplotlib

    try:
        _matplotlib()
    except PlotUnavailableError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(1) from None


@contextmanager
def input_errors(err: Console, file: Path) -> Iterator[None]:
    """The input's errors as exit codes: an unknown format 2, a malformed record under --strict 1."""
    try:
        yield
    except FormatDetectionError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False)
        raise typer.Exit(2) from None
    except MalformedInputError as e:
        err.print(f"[red]error:[/red] {escape(f'{file}: {e}')} (--strict)", highlight=False)
        raise typer.Exit(1) from None


def input_path(value: Path) -> Path:
    """The input argument: an existing readable file, or ``-`` for standard input (checked here:
    typer's ``exists`` with ``allow_dash`` refuses ``-``)."""
    if str(value) == STDIN:
        return value
    if not value.is_file() or not os.access(value, os.R_OK):
        raise typer.BadParameter(f"file {str(value)!r} does not exist or is not a readable file")
    return value


def analyze_command(
    file: Path = typer.Argument(
        ...,
        dir_okay=False,
        callback=input_path,
        help="Turn log, request log, vLLM stats or Mooncake trace; - reads standard input.",
    ),
    ttl: float = typer.Option(
        DEFAULT_TTL, "--ttl", min=0, help="Fixed TTL of retained decode KV, seconds (vLLM's default 480)."
    ),
    max_idle: float = typer.Option(
        DEFAULT_MAX_IDLE, "--max-idle", min=0, help="Longest idle gap heartbeat leases would cover, seconds."
    ),
    input_format: InputFormat | None = typer.Option(
        None, "--format", case_sensitive=False, help="Input format; detected from the first lines if omitted."
    ),
    strict: bool = typer.Option(False, "--strict", help="Fail on the first malformed record (exit 1)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
    plot: Path | None = typer.Option(
        None, "--plot", dir_okay=False, help="Write a PNG: gaps against TTL/max-idle, share per turn index."
    ),
    reorder_window: int = typer.Option(
        DEFAULT_REORDER_WINDOW,
        "--reorder-window",
        min=0,
        help="Turns per conversation that may arrive out of order.",
    ),
    mooncake_block_size: int = typer.Option(
        MOONCAKE_BLOCK_SIZE, "--mooncake-block-size", min=1, help="Tokens per hash id in Mooncake traces."
    ),
    exact: bool = typer.Option(
        True,
        "--exact/--no-exact",
        help="Read the input again when turns arrive out of the reorder window, so the figures are exact.",
    ),
) -> None:
    """Would this traffic benefit from kvlease (bidirectional KV transfer with renewable leases)?

    Reads the file as a stream and reports follow-up turns, the repeated prompt share, how many turns arrive after the TTL and how many heartbeat leases would recover, the prefill tokens saved, and a recommendation.
    """
    err = Console(stderr=True)
    if max_idle < ttl:
        raise typer.BadParameter(
            f"--max-idle ({max_idle:g}) must be at least --ttl ({ttl:g})", param_hint="--max-idle"
        )
    if plot is not None:
        require_plotting(err)

    size = spilled_size(file)
    show_progress = not as_json and err.is_terminal and size is not None
    with input_errors(err, file):
        if show_progress:
            with Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=err,
                transient=True,
            ) as bar:
                task = bar.add_task(f"reading {file.name}", total=size)
                report = analyze(
                    file,
                    ttl=ttl,
                    max_idle=max_idle,
                    format=input_format,
                    strict=strict,
                    reorder_window=reorder_window,
                    mooncake_block_size=mooncake_block_size,
                    progress=lambda done: bar.update(task, completed=done),
                    exact=exact,
                )
        else:
            report = analyze(
                file,
                ttl=ttl,
                max_idle=max_idle,
                format=input_format,
                strict=strict,
                reorder_window=reorder_window,
                mooncake_block_size=mooncake_block_size,
                exact=exact,
            )

    if as_json:
        sys.stdout.write(to_json_text(report) + "\n")
        if report.input.malformed:
            err.print(f"warning: {report.input.malformed:,} malformed records skipped", highlight=False)
    else:
        render(report, Console())
    if plot is not None:
        from kvlease._analyze._plot import plot_report

        plot_report(report, plot)
        if not as_json:
            err.print(f"plot written to {escape(str(plot))}", highlight=False)
