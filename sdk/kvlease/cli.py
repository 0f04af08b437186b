"""The ``kvlease`` command line: ``analyze``, ``demo``, ``router``, ``stack``.

Each sub-command lives beside the code it drives and imports its heavy dependencies lazily, so
``kvlease --help`` works with only the SDK installed.
"""

from __future__ import annotations

import importlib

import typer

from kvlease import __version__

app = typer.Typer(
    name="kvlease",
    help="kvlease: renewable KV leases and verified KV reuse for multi-turn agents on vLLM P/D.",
    no_args_is_help=True,
    add_completion=False,
)

#: (command name, "module:attribute" of a typer.Typer sub-app). Sub-apps import their heavy
#: dependencies inside the command functions.
SUBCOMMANDS: list[tuple[str, str]] = [
    ("analyze", "kvlease._analyze.cli:analyze_command"),
    ("demo", "kvlease_vllm.demo:demo"),
    ("router", "kvlease_vllm.router.cli:app"),
    ("stack", "kvlease_vllm.stack.cli:app"),
]


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"kvlease {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """kvlease command line."""


def _register() -> None:
    for name, target in SUBCOMMANDS:
        module_name, attr = target.split(":")
        module = importlib.import_module(module_name)
        sub = getattr(module, attr)
        if isinstance(sub, typer.Typer):
            app.add_typer(sub, name=name)
        else:
            app.command(name)(sub)


def main() -> None:
    _register()
    app()


if __name__ == "__main__":
    main()
