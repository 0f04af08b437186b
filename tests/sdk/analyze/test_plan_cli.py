"""``kvlease plan`` through typer's CliRunner: model options, --json, --cap, --plot, stdin, errors."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvlease import cli as root_cli
from kvlease._analyze._synth import agent_trace, write_requests
from kvlease._analyze.plan_cli import parse_bytes, plan_command

DATA = Path(__file__).resolve().parents[2] / "data"

app = typer.Typer()
app.command()(plan_command)
runner = CliRunner()


def invoke(*args: object, input: bytes | None = None) -> tuple[int, str, str]:
    res = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"}, input=input)
    return res.exit_code, res.stdout, res.stderr


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out: Path = tmp_path_factory.mktemp("plan") / "agents.jsonl"
    return write_requests(agent_trace(300, seed=5), out)


def test_registered_next_to_analyze() -> None:
    registered = {ep.name: ep.value for ep in root_cli.commands()}
    assert registered["plan"] == "kvlease._analyze.plan_cli:plan_command"


def test_table_output(trace: Path) -> None:
    code, out, err = invoke(trace, "--model", "llama-3.1-8b", "--nodes", "2", "--node-kv-bytes", "40GiB")
    assert code == 0, err
    assert "retention cap per node" in out and "recommendation" in out
    assert "max_retained_fraction" in out or "KV cache" in out


def test_json_output(trace: Path) -> None:
    code, out, err = invoke(trace, "--kv-bytes-per-token", "131072", "--json", "--node-kv-bytes", "64GiB")
    assert code == 0, err
    data = json.loads(out)
    assert data["settings"]["kv_bytes_per_token"] == 131072 and data["settings"]["node_kv_bytes"] == 64 << 30
    assert data["conversations"] == 300 and len(data["sweep"]) == 12
    assert data["uncapped"]["lease"]["hits"] >= data["uncapped"]["ttl"]["hits"]
    rec = data["recommendation"]
    assert rec["ttl_s"] >= 60 and rec["max_idle_s"] >= rec["ttl_s"] and 0 < rec["max_retained_fraction"] <= 1


def test_the_three_ways_to_give_the_model_agree(trace: Path) -> None:
    outs = []
    for args in (
        ["--model", "qwen2.5-32b"],
        ["--kv-bytes-per-token", "262144"],
        ["--layers", "64", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bf16"],
    ):
        code, out, err = invoke(trace, *args, "--json", "--points", "3")
        assert code == 0, err
        data = json.loads(out)
        data["settings"].pop("model")
        outs.append(data)
    assert outs[0] == outs[1] == outs[2]


def test_explicit_caps(trace: Path) -> None:
    code, out, _ = invoke(trace, "--model", "llama-3.1-8b", "--cap", "1GiB", "--cap", "500MB", "--json")
    assert code == 0
    assert [p["cap_bytes"] for p in json.loads(out)["sweep"]] == [500_000_000, 1 << 30]


@pytest.mark.parametrize(
    "args",
    [
        [],  # no model
        ["--model", "llama-3.1-8b", "--kv-bytes-per-token", "1"],
        ["--model", "no-such-model"],
        ["--layers", "32"],
        ["--model", "llama-3.1-8b", "--cap", "lots"],
        ["--model", "llama-3.1-8b", "--dtype", "int3"],
        ["--model", "llama-3.1-8b", "--nodes", "0"],
    ],
)
def test_usage_errors(trace: Path, args: list[str]) -> None:
    assert invoke(trace, *args)[0] == 2


def test_missing_file(tmp_path: Path) -> None:
    assert invoke(tmp_path / "missing.jsonl", "--model", "llama-3.1-8b")[0] == 2


@pytest.mark.parametrize("name", ["turnlog_small.jsonl", "vllm_multiturn_stats.json", "mooncake_small.jsonl"])
def test_every_analyzer_format(name: str) -> None:
    code, out, err = invoke(DATA / name, "--model", "qwen3-0.6b", "--json")
    assert code == 0, err
    assert json.loads(out)["follow_up_turns"] > 0


def test_standard_input(trace: Path) -> None:
    code, out, err = invoke("-", "--model", "llama-3.1-8b", "--json", input=trace.read_bytes())
    assert code == 0, err
    data = json.loads(out)
    _, want, _ = invoke(trace, "--model", "llama-3.1-8b", "--json")
    assert data["input"]["source"] == "<stdin>"
    assert data["sweep"] == json.loads(want)["sweep"]


def test_plot_writes_a_png(trace: Path, tmp_path: Path) -> None:
    png = tmp_path / "plan.png"
    code, _, err = invoke(trace, "--model", "llama-3.1-8b", "--node-kv-bytes", "20GiB", "--plot", png)
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib(trace: Path, tmp_path: Path) -> None:
    """The planner imports and runs without matplotlib; only --plot needs it."""
    code = textwrap.dedent(
        f"""
        import sys, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "matplotlib":
                    raise ImportError("blocked for this test")
        sys.meta_path.insert(0, Block())
        plot = sys.argv[1] == "plot"
        sys.argv = ["kvlease", "plan", {str(trace)!r}, "--model", "llama-3.1-8b", "--json", "--points", "2"]
        if plot:
            sys.argv += ["--plot", {str(tmp_path / "x.png")!r}]
        from kvlease.cli import main
        main()
        """
    )
    ok = subprocess.run([sys.executable, "-c", code, "-"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["turns"] > 0
    fail = subprocess.run([sys.executable, "-c", code, "plot"], capture_output=True, text=True, timeout=120)
    assert fail.returncode == 1 and "kvlease[analyze]" in fail.stderr
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("80GiB", 80 << 30),
        ("40 GB", 40 * 10**9),
        ("512MiB", 512 << 20),
        ("1e9", 10**9),
        ("1.5KiB", 1536),
        ("7", 7),
    ],
)
def test_sizes(text: str, want: int) -> None:
    assert parse_bytes(text) == want
