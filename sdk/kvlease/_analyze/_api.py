"""``analyze(path)``: the IO shell that streams a file through the sans-IO :class:`Analyzer`."""

from __future__ import annotations

from pathlib import Path

from kvlease._analyze._formats import MOONCAKE_BLOCK_SIZE, InputFormat, Progress, read_into
from kvlease._analyze._model import DEFAULT_MAX_IDLE, DEFAULT_REORDER_WINDOW, DEFAULT_TTL, Analyzer
from kvlease._analyze._types import AnalysisReport


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
) -> AnalysisReport:
    """Analyse a turn log, request log, vLLM multi-turn stats file or Mooncake trace.

    ``format`` is detected from the first lines when omitted. ``progress``, if given, is called with
    the number of bytes read so far. Raises :class:`~kvlease._analyze._formats.FormatDetectionError`,
    and :class:`~kvlease._analyze._formats.MalformedInputError` on the first bad record when
    ``strict``; otherwise bad records are skipped and counted in ``report.input``.
    """
    an = Analyzer(ttl=ttl, max_idle=max_idle, reorder_window=reorder_window)
    fmt = None if format is None else InputFormat(format)
    summary = read_into(
        an, path, fmt, strict=strict, progress=progress, mooncake_block_size=mooncake_block_size
    )
    return an.report(summary)
