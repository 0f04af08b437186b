"""``kvlease plan --cluster`` through typer's CliRunner: the costs named with their sources, JSON,
the per-turn JSONL, every input format, and usage errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvlease._analyze.plan_cli import plan_command

DATA = Path(__file__).resolve().parents[2] / "data"
AGENTS = DATA / "agents.jsonl"

app = typer.Typer()
app.command()(plan_command)
runner = CliRunner()


def invoke(*args: object) -> tuple[int, str, str]:
    res = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "260"})
    return res.exit_code, res.stdout, res.stderr


def test_table_names_each_cost_with_its_source() -> None:
    code, out, err = invoke(AGENTS, "--cluster", "--model", "32b", "--nodes", "2", "--no-sweep")
    assert code == 0, err
    for name, source in (
        ("prefill rate per P node", "override with --prefill-tps"),
        ("decode rate per sequence", "override with --decode-tps"),
        ("device pull, fixed cost", "benchmarks/RESULTS.md: staged pull 5.3 ms at 1k, 18.1 ms at 24k"),
        ("host arena pull rate", "gpu_nixl_pull.py --arena"),
        ("demotion rate (D2H gather)", "6 GiB in 120.5 ms"),
        ("NIC per node", "50 GB/s per GPU"),
    ):
        line = next(ln for ln in out.splitlines() if name in ln)
        assert source in line, line
    assert "64 layers x 8 KV heads x 128 x 2 (K, V) x 2 B (bf16) = 262,144 B/token" in out
    for policy in ("no-reuse", "ttl", "lease", "write-through", "lru-host"):
        assert policy in out


def test_json_and_the_sweep() -> None:
    code, out, err = invoke(AGENTS, "--cluster", "--model", "32b", "--json", "--ttft-target", "1.5")
    assert code == 0, err
    data = json.loads(out)
    assert data["p_nodes"] == data["d_nodes"] == 1 and data["kv_bytes_per_token"] == 262144
    assert {c["name"] for c in data["costs"]} >= {"prefill rate per P node", "host arena pull rate"}
    assert all(c["source"] for c in data["costs"])
    wt, lease = data["policies"]["write-through"], data["policies"]["lease"]
    assert wt["hbm_retained_gib_s"] == 0 < lease["hbm_retained_gib_s"]
    assert any(p["sessions_per_decode_node"] > 0 for p in data["policies"].values())
    for p in data["policies"].values():
        assert sum(p["hit_rate_by_source"].values()) == pytest.approx(1.0)
        assert p["ttft"]["p50_s"] <= p["ttft"]["p90_s"] <= p["ttft"]["p99_s"]
        n = p["sessions_per_decode_node"]
        ok = [s["sessions"] for s in p["sweep"] if s["ttft_p90_s"] is not None and s["ttft_p90_s"] <= 1.5]
        assert n == 0 or n in ok


def test_overrides_replace_the_sources() -> None:
    code, out, err = invoke(
        AGENTS, "--cluster", "--model", "70b", "--json", "--no-sweep",
        "--prefill-tps", "9000", "--host-pull-gbps", "55", "--hbm-kv", "100GB", "--sessions", "20",
    )  # fmt: skip
    assert code == 0, err
    costs = {c["name"]: c for c in json.loads(out)["costs"]}
    assert costs["prefill rate per P node"] == {
        "name": "prefill rate per P node", "value": 9000.0, "unit": "tokens/s", "source": "given (--prefill-tps)",
    }  # fmt: skip
    assert costs["host arena pull rate"]["value"] == 55e9
    assert costs["KV cache per node (HBM)"]["value"] == 100e9
    assert json.loads(out)["load"] == "20 concurrent sessions"


def test_per_turn_jsonl(tmp_path: Path) -> None:
    out_file = tmp_path / "turns.jsonl"
    code, _, err = invoke(
        AGENTS, "--cluster", "--model", "8b", "--no-sweep", "--per-turn", out_file, "--json"
    )
    assert code == 0, err
    recs = [json.loads(line) for line in out_file.read_text().splitlines()]
    turns = sum(1 for _ in AGENTS.open())
    assert len(recs) == 5 * turns
    lease = [r for r in recs if r["policy"] == "lease"]
    assert {r["source"] for r in lease} <= {"first", "device", "host", "p_local", "miss"}
    assert sum(r["turn"] == 0 for r in lease) == 100 and any(r["hit"] for r in lease)


@pytest.mark.parametrize("name", ["turnlog_small.jsonl", "vllm_multiturn_stats.json", "mooncake_small.jsonl"])
def test_every_analyzer_format(name: str) -> None:
    code, out, err = invoke(DATA / name, "--cluster", "--model", "8b", "--json", "--no-sweep")
    assert code == 0, err
    assert json.loads(out)["turns"] > 0


def test_other_shapes_need_their_costs() -> None:
    shape = ["--layers", "16", "--kv-heads", "8", "--head-dim", "64"]
    code, _, err = invoke(AGENTS, "--cluster", *shape, "--no-sweep")
    assert code == 2 and "--prefill-tps, --decode-tps, --hbm-kv" in err
    code, out, err = invoke(
        AGENTS, "--cluster", *shape, "--no-sweep", "--json",
        "--prefill-tps", "50000", "--decode-tps", "100", "--hbm-kv", "60GB",
    )  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["kv_bytes_per_token"] == 32768


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kv-bytes-per-token", "1024"], "needs the model's shape"),
        (["--model", "13b"], "unknown model"),
        (["--model", "8b", "--layers", "4"], "not both"),
        (["--model", "8b", "--plot", "x.png"], "not with --cluster"),
        (["--model", "8b", "--retained-fraction", "2"], "retained-fraction"),
        (["--model", "8b", "--hbm-kv", "lots"], "not a size"),
        (["--model", "8b", "--sessions", "0"], "--sessions"),
        (["--model", "8b", "--hbm-kv", "0"], "KV cache per node"),
    ],
)
def test_usage_errors(args: list[str], message: str) -> None:
    code, _, err = invoke(AGENTS, "--cluster", "--no-sweep", *args)
    assert code == 2 and message in " ".join(err.split()), err
