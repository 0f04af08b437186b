"""``kvlease analyze``: would this traffic benefit from bidirectional KV transfer with leases?

Reading path: ``_model`` (the figures, sans-IO) -> ``_recommend`` -> ``_formats`` (streaming readers)
-> ``_api`` (``analyze(path)``) -> ``_report`` (table, JSON) -> ``_plot`` -> ``cli``.
"""

from __future__ import annotations

from kvlease._analyze._api import analyze
from kvlease._analyze._formats import (
    AnalyzeError,
    FormatDetectionError,
    InputFormat,
    MalformedInputError,
    MooncakeSessions,
    detect_format,
)
from kvlease._analyze._model import DEFAULT_MAX_IDLE, DEFAULT_TTL, Analyzer
from kvlease._analyze._types import AnalysisReport, InputSummary, Recommendation, TurnIndexFigures

__all__ = [
    "DEFAULT_MAX_IDLE",
    "DEFAULT_TTL",
    "AnalysisReport",
    "AnalyzeError",
    "Analyzer",
    "FormatDetectionError",
    "InputFormat",
    "InputSummary",
    "MalformedInputError",
    "MooncakeSessions",
    "Recommendation",
    "TurnIndexFigures",
    "analyze",
    "detect_format",
]
