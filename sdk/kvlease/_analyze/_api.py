"""``analyze(path)``: the IO shell that streams a file through the sans-IO :class:`Analyzer`, and
reads it a second time when the exact answer needs it (``_exact``)."""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from kvlease._analyze._exact import SortingAnalyzer
from kvlease._analyze._formats import MOONCAKE_BLOCK_SIZE, InputFormat, Progress, read_into
from kvlease._analyze._model import DEFAULT_MAX_IDLE, DEFAULT_REORDER_WINDOW, DEFAULT_TTL, Analyzer
from kvlease._analyze._types import AnalysisReport

#: The path that means standard input.
STDIN = "-"
STDIN_SOURCE = "<stdin>"


def _seekable(path: str | Path) -> bool:
    with open(path, "rb") as f:
        return f.seekable()


@contextmanager
def readable_twice(path: str | Path) -> Iterator[tuple[Path, str]]:
    """``(a path that can be opened and read more than once, the name to report)``.

    ``-`` (standard input) and other inputs that cannot be read twice (pipes, FIFOs: not seekable)
    are spilled to a temporary file first, deleted afterwards; a regular file is used as it is.
    """
    if str(path) != STDIN and _seekable(path):
        yield Path(path), str(path)
        return
    source = STDIN_SOURCE if str(path) == STDIN else str(path)
    with tempfile.TemporaryDirectory(prefix="kvlease-") as tmp:
        spilled = Path(tmp) / "input"
        with open(spilled, "wb") as out:
            if str(path) == STDIN:
                shutil.copyfileobj(sys.stdin.buffer, out, 1 << 20)
            else:
                with open(path, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)
        yield spilled, source


def analyze(
    path: str | Path,
    *,
    ttl: float = DEFAULT_TTL,
    max_idle: float = DEFAULT_MAX_IDLE,
    format: InputFormat | str | None = None,
    strict: bool = False,
    reorder_window: int = DEFAULT_REORDER_WINDOW,
    mooncake_block_size: int = MOONCAKE_BLOCK_SIZE,
    progress: Progress | None = None,
    exact: bool = True,
) -> AnalysisReport:
    """Analyse a turn log, request log, vLLM multi-turn stats file or Mooncake trace.

    ``path`` ``-`` reads standard input. ``format`` is detected from the first lines when omitted.
    ``progress``, if given, is called with the number of bytes read so far (from 0 again on a second
    pass). Raises :class:`~kvlease._analyze._formats.FormatDetectionError`, and
    :class:`~kvlease._analyze._formats.MalformedInputError` on the first bad record when ``strict``;
    otherwise bad records are skipped and counted in ``report.input``.

    Exact by default: the first pass streams with a reorder window of ``reorder_window`` turns per
    conversation (the fast path; ordered logs are read once). When any turn arrived outside it, the
    input is read a second time and the conversations that had such a turn are sorted by time, so
    the figures always equal the reference definition (``report.input.passes`` is 2, and
    ``late_turns`` 0). The second pass holds the turns of those conversations in memory until the
    report (every turn, for a fully shuffled log). Standard input and other unseekable inputs are
    spilled to a temporary file first (the second pass needs the data again; memory is not used
    for it). ``exact=False`` keeps the first pass alone: late turns are counted, not paired.
    """
    fmt = None if format is None else InputFormat(format)
    with readable_twice(path) as (readable, source):
        an = Analyzer(ttl=ttl, max_idle=max_idle, reorder_window=reorder_window)
        summary = read_into(
            an, readable, fmt, strict=strict, progress=progress, mooncake_block_size=mooncake_block_size
        )
        late = an.late_conversations
        if exact and late:
            an = SortingAnalyzer(late, ttl=ttl, max_idle=max_idle, reorder_window=reorder_window)
            summary = read_into(
                an,
                readable,
                fmt,
                strict=strict,
                progress=progress,
                mooncake_block_size=mooncake_block_size,
            )
            summary = replace(summary, passes=2)
    return an.report(replace(summary, source=source))


def spilled_size(path: str | Path) -> int | None:
    """The size of ``path`` in bytes when it is a regular file, else ``None`` (for a progress bar)."""
    if str(path) == STDIN:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None
