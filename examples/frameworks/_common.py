"""What the framework recipes share: the questions, the command line and the per-turn printout.

Not a recipe: each ``*_recipe.py`` next to it keeps its framework's glue and imports this (a script's
own folder is on ``sys.path``, so ``python examples/frameworks/<recipe>.py`` finds it).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import kvlease

QUESTIONS = ("What is the weather in Paris?", "And tomorrow?")


def parser(doc: str | None) -> argparse.ArgumentParser:
    """``--base-url`` and ``--model``, with the recipe's docstring as the help text."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="tiny")
    return ap


def print_turns(turns: Iterable[kvlease.Turn]) -> None:
    for t in turns:
        print(
            f"turn {t.index + 1}: status={t.status and t.status.value} reused={t.reused_tokens} history={t.history.value}"
        )


def main(
    doc: str | None,
    run: Callable[[str, str], list[kvlease.Turn] | Awaitable[list[kvlease.Turn]]],
) -> None:
    """Parse the command line, run the recipe's ``run(base_url, model)`` (sync or async), print."""
    args = parser(doc).parse_args()
    out: Any = run(args.base_url, args.model)
    print_turns(asyncio.run(out) if asyncio.iscoroutine(out) else out)
