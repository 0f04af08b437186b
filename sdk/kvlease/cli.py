"""The ``kvlease`` command line shell.

The SDK owns only the shell and its own ``analyze`` command. Every package registers its
sub-commands through the ``kvlease.commands`` entry-point group (``name = "module:attribute"`` of a
``typer.Typer`` sub-app or a command function), so the SDK names no server package and imports none:
``kvlease --help`` works with only the SDK installed, and a command whose package is missing its
dependencies says which extra to install instead of disappearing.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

import typer

from kvlease import __version__

#: The entry-point group every kvlease package registers its sub-commands under.
COMMANDS_GROUP = "kvlease.commands"

app = typer.Typer(
    name="kvlease",
    help="kvlease: renewable KV leases and verified KV reuse for multi-turn agents on vLLM P/D.",
    no_args_is_help=True,
    add_completion=False,
)


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


def commands() -> list[EntryPoint]:
    """The registered sub-commands, sorted by name (one per name: the first registration wins)."""
    seen: dict[str, EntryPoint] = {}
    for ep in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: (e.name, e.value)):
        seen.setdefault(ep.name, ep)
    return list(seen.values())


def _unavailable(name: str, err: ImportError) -> typer.Typer:
    sub = typer.Typer(help=f"(unavailable: {err})", invoke_without_command=True)

    @sub.callback()
    def _explain() -> None:
        typer.echo(
            f"kvlease {name}: its package could not be imported ({err}); install the matching extra, "
            f"for example pip install 'kvlease[{name}]'",
            err=True,
        )
        raise typer.Exit(2)

    return sub


def _register() -> None:
    for ep in commands():
        try:
            sub = ep.load()
        except ImportError as err:
            sub = _unavailable(ep.name, err)
        if isinstance(sub, typer.Typer):
            app.add_typer(sub, name=ep.name)
        else:
            app.command(ep.name)(sub)


def main() -> None:
    _register()
    app()


if __name__ == "__main__":
    main()
