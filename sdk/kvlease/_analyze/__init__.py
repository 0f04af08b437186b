"""``kvlease analyze``: would this traffic benefit from bidirectional KV transfer with leases?

Reading path: ``_model`` (the figures, sans-IO) -> ``_recommend`` -> ``_formats`` (streaming readers)
-> ``_exact`` (the second, sorting pass for unordered input) -> ``_api`` (``analyze(path)``) ->
``_report`` (table, JSON) -> ``_plot`` -> ``cli``.

``kvlease plan``, the capacity planner: ``_plan`` (the retention model and replay, sans-IO) ->
``_plan_report`` (the sweep of caps, the recommendation, the table) -> ``_plan_api`` (``plan(path)``,
through the same readers) -> ``_plan_plot`` -> ``plan_cli``. ``_synth`` generates agent traces.
``kvlease plan --cluster``, the session-level simulator: ``_cluster_costs`` (model classes and every
cost with its source) -> ``_cluster`` (sessions on P and D nodes under five policies, sans-IO) ->
``_cluster_report`` (the policies at equal load, the sessions sweep, the table) -> ``_plan_api``
(``plan_cluster_file(path)``) -> ``plan_cli``.
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
from kvlease._analyze._plan_api import plan
from kvlease._analyze._plan_report import CapacityPlan, PlanConfig
from kvlease._analyze._types import AnalysisReport, InputSummary, Recommendation, TurnIndexFigures

__all__ = [
    "DEFAULT_MAX_IDLE",
    "DEFAULT_TTL",
    "AnalysisReport",
    "AnalyzeError",
    "Analyzer",
    "CapacityPlan",
    "FormatDetectionError",
    "InputFormat",
    "InputSummary",
    "MalformedInputError",
    "MooncakeSessions",
    "PlanConfig",
    "Recommendation",
    "TurnIndexFigures",
    "analyze",
    "detect_format",
    "plan",
]
