"""``kvlease analyze`` through typer's CliRunner: exit codes, --json, --strict, --plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvlease import cli as root_cli
from kvlease._analyze.cli import analyze_command

DATA = Path(__file__).resolve().parents[2] / "data"

app = typer.Typer()
app.command()(analyze_command)
runner = CliRunner()


def invoke(*args: str) -> tuple[int, str, str]:
    res = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})
    return res.exit_code, res.stdout, res.stderr


def test_registered_as_a_single_command() -> None:
    registered = {ep.name: ep.value for ep in root_cli.commands()}
    assert registered["analyze"] == "kvlease._analyze.cli:analyze_command"


def test_table_output() -> None:
    code, out, err = invoke(str(DATA / "requests_small.jsonl"))
    assert code == 0, err
    assert "repeated prompt share, lower bound" in out and "65.2%" in out
    assert "2 malformed records skipped" in out and "line 4: not valid JSON" in out
    assert "recommendation" in out


def test_json_output_parses_and_matches_the_api() -> None:
    code, out, err = invoke(str(DATA / "requests_small.jsonl"), "--json", "--ttl", "60", "--max-idle", "600")
    assert code == 0
    data = json.loads(out)
    assert data["settings"] == {"ttl_s": 60.0, "max_idle_s": 600.0}
    assert data["repeated"]["share_lower_bound"] == pytest.approx(300 / 460)
    # gaps 10, 590, 0, 2000, 100 against 60 / 600
    assert data["gaps"]["beyond_ttl"] == 3 and data["gaps"]["recovered_by_leases"] == 2
    assert data["input"]["malformed"] == 2
    assert "malformed" in err  # the warning goes to stderr, stdout stays pure JSON


def test_strict_fails_with_the_line_number() -> None:
    code, _out, err = invoke(str(DATA / "requests_small.jsonl"), "--strict")
    assert code == 1
    assert "line 4" in err and "--strict" in err


def test_strict_passes_on_clean_input() -> None:
    code, _, err = invoke(str(DATA / "agents.jsonl"), "--strict", "--json")
    assert code == 0, err


@pytest.mark.parametrize("name", ["turnlog_small.jsonl", "vllm_multiturn_stats.json", "mooncake_small.jsonl"])
def test_other_formats(name: str) -> None:
    code, out, _ = invoke(str(DATA / name), "--json")
    assert code == 0
    assert json.loads(out)["follow_up_turns"] > 0


def test_forced_format() -> None:
    code, out, _ = invoke(str(DATA / "turnlog_small.jsonl"), "--format", "requests", "--json")
    data = json.loads(out)
    # as plain request logs, the null prompt is malformed and gap_s is ignored
    assert code == 0 and data["input"]["format"] == "requests" and data["input"]["malformed"] == 1


def test_empty_input() -> None:
    code, out, _ = invoke(str(DATA / "empty.jsonl"), "--json")
    assert code == 0
    data = json.loads(out)
    assert data["turns"] == 0 and data["recommendation"]["verdict"] == "no-data"


def test_usage_errors(tmp_path: Path) -> None:
    assert invoke(str(tmp_path / "missing.jsonl"))[0] == 2
    assert invoke(str(DATA / "agents.jsonl"), "--ttl", "600", "--max-idle", "60")[0] == 2
    assert invoke(str(DATA / "agents.jsonl"), "--format", "csv")[0] == 2
    unknown = tmp_path / "u.jsonl"
    unknown.write_text('{"hello": "world"}\n')
    code, _, err = invoke(str(unknown))
    assert code == 2 and "--format" in err


def test_plot_writes_a_png(tmp_path: Path) -> None:
    png = tmp_path / "gaps.png"
    code, _, err = invoke(str(DATA / "agents.jsonl"), "--plot", str(png))
    assert code == 0, err
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_plot_of_empty_input(tmp_path: Path) -> None:
    png = tmp_path / "empty.png"
    code, _, _ = invoke(str(DATA / "empty.jsonl"), "--json", "--plot", str(png))
    assert code == 0 and png.read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_fails_clearly(tmp_path: Path) -> None:
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import sys, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "matplotlib":
                    raise ImportError("blocked for this test")
        sys.meta_path.insert(0, Block())
        sys.argv = ["kvlease", "analyze", {str(DATA / "agents.jsonl")!r}, "--plot", {str(tmp_path / "x.png")!r}]
        from kvlease.cli import main
        main()
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "kvlease[analyze]" in out.stderr
    assert not (tmp_path / "x.png").exists()


def test_public_names() -> None:
    import kvlease._analyze as pkg

    assert set(pkg.__all__) == {
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
    }
