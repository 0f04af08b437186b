"""Pure parts of the local stack: config JSON, command line, environment, Prometheus, busy threads."""

from __future__ import annotations

import contextlib
import json
import socket
from pathlib import Path

import pytest

from kvlease.protocol import CONTROL_SECRET_ENV
from kvlease_stack import Metrics, StackSpec, parse_prometheus
from kvlease_stack._config import (
    CHAT_TEMPLATE,
    TOOL_CALL_PARSER,
    busy_threads,
    kv_transfer_config,
    parse_task_stat,
    parse_task_times,
    plugin_names,
    polling_threads,
    sample_key,
    server_command,
    server_env,
)
from kvlease_stack._paths import source_root
from kvlease_stack._venv import changed_pins

# -- kv_transfer_config ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "role", "expected"),
    [
        (
            StackSpec(connector="nixl"),
            "prefill",
            {
                "kv_role": "kv_producer",
                "kv_buffer_device": "cpu",
                "kv_connector": "NixlConnector",
                "kv_connector_extra_config": {
                    "bidirectional_kv_xfer": True,
                    "kv_recompute_threshold": 64,
                    "decoder_kv_blocks_ttl": 120.0,
                },
                "kv_load_failure_policy": "recompute",
            },
        ),
        (
            StackSpec(connector="nixl", bidir=False, ttl=20.0, recompute_threshold=0),
            "decode",
            {
                "kv_role": "kv_consumer",
                "kv_buffer_device": "cpu",
                "kv_connector": "NixlConnector",
                "kv_connector_extra_config": {
                    "bidirectional_kv_xfer": False,
                    "kv_recompute_threshold": 0,
                    "decoder_kv_blocks_ttl": 20.0,
                },
            },
        ),
        (
            StackSpec(kvlease={"retention_fraction": 0.5}),
            "decode",
            {
                "kv_role": "kv_consumer",
                "kv_buffer_device": "cpu",
                "kv_connector": "KVLeaseConnector",
                "kv_connector_module_path": "kvlease_vllm.connector",
                "kv_connector_extra_config": {
                    "bidirectional_kv_xfer": True,
                    "kv_recompute_threshold": 64,
                    "decoder_kv_blocks_ttl": 120.0,
                    "kvlease": {
                        "retention_fraction": 0.5,
                        "control_host": "127.0.0.1",
                        "control_port": 5555,
                        "control_secret": "s3cret",
                    },
                },
            },
        ),
        (
            StackSpec(),
            "prefill",
            {
                "kv_role": "kv_producer",
                "kv_buffer_device": "cpu",
                "kv_connector": "KVLeaseConnector",
                "kv_connector_module_path": "kvlease_vllm.connector",
                "kv_connector_extra_config": {
                    "bidirectional_kv_xfer": True,
                    "kv_recompute_threshold": 64,
                    "decoder_kv_blocks_ttl": 120.0,
                    "kvlease": {
                        "control_host": "127.0.0.1",
                        "control_port": 5555,
                        "control_secret": "s3cret",
                    },
                },
                "kv_load_failure_policy": "recompute",
            },
        ),
    ],
)
def test_kv_transfer_config(spec: StackSpec, role: str, expected: dict[str, object]) -> None:
    got = kv_transfer_config(spec, role, control_port=5555, control_secret="s3cret")  # type: ignore[arg-type]
    assert got == expected
    assert json.loads(json.dumps(got)) == expected  # JSON-able as given to --kv-transfer-config


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model": "huge"}, "model"),
        ({"connector": "lmcache"}, "connector"),
        ({"ttl": 0}, "ttl"),
        ({"recompute_threshold": -1}, "recompute_threshold"),
        ({"max_model_len": 4}, "max_model_len"),
        ({"kvlease": {"control_port": 1}}, "control_port"),
    ],
)
def test_spec_rejects_bad_values(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StackSpec(**kwargs)  # type: ignore[arg-type]


def test_equal_specs_compare_equal() -> None:
    assert StackSpec(kvlease={"a": 1}) == StackSpec(kvlease={"a": 1})
    assert StackSpec(kvlease={"a": 1}) != StackSpec(kvlease={"a": 2})
    assert StackSpec(connector="nixl") != StackSpec()


# -- command line and environment --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prefix_caching", "role", "has_flag"),
    [(True, "prefill", False), (False, "prefill", True), (False, "decode", False)],
)
def test_server_command(prefix_caching: bool, role: str, has_flag: bool) -> None:
    spec = StackSpec(model="small", prefix_caching=prefix_caching, max_model_len=2048)
    cmd = server_command("/v/bin/python", spec, role, model_dir="/m", port=8100, kv_config={"a": 1})  # type: ignore[arg-type]
    assert cmd[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    opts = dict(zip(cmd[3::2], cmd[4::2]))
    assert opts["--model"] == "/m"
    assert opts["--served-model-name"] == "small"
    assert opts["--host"] == "127.0.0.1"
    assert opts["--port"] == "8100"
    assert opts["--max-model-len"] == "2048"
    assert opts["--dtype"] == spec.dtype in ("float32", "bfloat16")
    assert json.loads(cmd[cmd.index("--kv-transfer-config") + 1]) == {"a": 1}
    # Both servers render tools and parse tool calls the same way (the router sends P and D the same body).
    assert cmd[cmd.index("--chat-template") + 1] == CHAT_TEMPLATE
    assert "--enable-auto-tool-choice" in cmd
    assert cmd[cmd.index("--tool-call-parser") + 1] == TOOL_CALL_PARSER == "hermes"
    assert "--enforce-eager" in cmd
    assert ("--no-enable-prefix-caching" in cmd) is has_flag


@pytest.mark.parametrize(
    ("plugin", "base", "installed", "expected"),
    [
        (True, {"VLLM_PLUGINS": "x"}, {"kvlease", "lora"}, None),
        (False, {}, {"kvlease", "lora_a", "lora_b"}, "lora_a,lora_b"),
        (False, {}, {"kvlease"}, ""),
        (False, {}, set(), ""),
    ],
)
def test_server_env_plugins(
    plugin: bool, base: dict[str, str], installed: set[str], expected: str | None
) -> None:
    env = server_env(
        base,
        StackSpec(plugin=plugin),
        "decode",
        side_channel_port=5601,
        control_secret="k",
        installed_plugins=installed,
    )
    assert env.get("VLLM_PLUGINS") == expected
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5601"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env[CONTROL_SECRET_ENV] == "k"


def test_server_env_extra_env_wins_and_base_kept() -> None:
    spec = StackSpec(extra_env={"VLLM_CPU_KVCACHE_SPACE": "2", "FOO": "bar"})
    env = server_env({"PATH": "/bin"}, spec, "prefill", side_channel_port=1, control_secret="k")
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["FOO"] == "bar"
    assert env["PATH"] == "/bin"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0"


def test_plugin_names_reads_only_vllm_groups() -> None:
    texts = [
        "[console_scripts]\nvllm = vllm.entrypoints.cli.main:main\n\n"
        "[vllm.general_plugins]\nlora_fs = vllm.plugins.x:register\n# comment\n",
        "[vllm.general_plugins]\nkvlease = kvlease_vllm.plugin:register\n[vllm.platform_plugins]\nplat = p:f\n",
        "[other.group]\nnot_me = a:b\n",
    ]
    assert plugin_names(texts) == {"lora_fs", "kvlease", "plat"}


# -- Prometheus --------------------------------------------------------------------------------------

PROM = """\
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 128.0
# HELP vllm:external_prefix_cache_hits_total External prefix cache hits.
# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="tiny"} 64.0
vllm:external_prefix_cache_hits_total{engine="1",model_name="tiny"} 16.0
# HELP vllm:num_requests_running Number of requests.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
# HELP kvlease_pulls_total Pulls.
# TYPE kvlease_pulls_total counter
kvlease_pulls_total{reason="verified"} 3.0
kvlease_pulls_total{reason="below_threshold"} 2.0
# TYPE process_open_fds gauge
process_open_fds 42
"""


def test_parse_prometheus_keys_and_values() -> None:
    m = parse_prometheus(PROM)
    assert isinstance(m, Metrics)
    assert m['vllm:prefix_cache_hits_total{engine="0",model_name="tiny"}'] == 128.0
    assert m["process_open_fds"] == 42.0
    assert m['kvlease_pulls_total{reason="verified"}'] == 3.0


@pytest.mark.parametrize(
    ("name", "labels", "expected"),
    [
        ("vllm:external_prefix_cache_hits_total", {}, 80.0),
        ("vllm:external_prefix_cache_hits_total", {"engine": "1"}, 16.0),
        ("vllm:external_prefix_cache_hits_total", {"engine": "7"}, 0.0),
        ("kvlease_pulls_total", {}, 5.0),
        ("kvlease_pulls_total", {"reason": "below_threshold"}, 2.0),
        ("vllm:num_requests_running", {}, 0.0),
        ("absent_metric", {}, 0.0),
    ],
)
def test_metrics_total(name: str, labels: dict[str, str], expected: float) -> None:
    assert parse_prometheus(PROM).total(name, **labels) == expected


def test_metrics_names_and_sample_key() -> None:
    m = parse_prometheus(PROM)
    assert "vllm:num_requests_running" in m.names()
    assert sample_key("a", {}) == "a"
    assert sample_key("a", {"z": "1", "b": "2"}) == 'a{b="2",z="1"}'


# -- busy threads ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("before", "after", "interval", "expected"),
    [
        # 100 ticks/s: a busy poller uses ~250 ticks in 2.5 s; an idle thread ~0.
        ({1: 0, 2: 10, 3: 500}, {1: 250, 2: 11, 3: 540}, 2.5, [1]),
        ({1: 0, 2: 0}, {1: 49, 2: 50}, 2.5, [2]),  # threshold: a fifth of a core
        ({1: 0}, {1: 0, 9: 10_000}, 2.5, []),  # a thread born during the sample is ignored
        ({1: 0, 2: 0}, {2: 300}, 2.0, [2]),  # a thread that ended is ignored
        ({}, {}, 1.0, []),
    ],
)
def test_busy_threads(
    before: dict[int, int], after: dict[int, int], interval: float, expected: list[int]
) -> None:
    assert busy_threads(before, after, interval_s=interval, clk_tck=100) == expected


def test_busy_threads_rejects_zero_interval() -> None:
    with pytest.raises(ValueError):
        busy_threads({}, {}, interval_s=0, clk_tck=100)


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        # 100 ticks/s over 2 s = 200 ticks a core. Thread 1 leads its process (tid = pid).
        ({1: (0, 0), 2: (0, 0)}, {1: (40, 150), 2: (40, 150)}, [2]),  # spinning in syscalls
        ({2: (0, 0)}, {2: (190, 5)}, []),  # busy in user mode: start-up work, left alone
        ({2: (0, 0)}, {2: (20, 79)}, []),  # under half a core
        ({2: (0, 0)}, {2: (50, 50)}, [2]),  # thresholds are inclusive
        ({2: (0, 0)}, {2: (51, 49)}, []),  # ...and the kernel share must be at least half
        ({1: (0, 0)}, {1: (0, 200), 7: (0, 400)}, []),  # born during the sample: next round
        ({2: (0, 0), 3: (10, 10)}, {3: (20, 210)}, [3]),  # ended threads are ignored
    ],
)
def test_polling_threads(
    before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], expected: list[int]
) -> None:
    assert polling_threads(before, after, interval_s=2.0, clk_tck=100, leaders={1}) == expected


def test_polling_threads_rejects_zero_interval() -> None:
    with pytest.raises(ValueError):
        polling_threads({}, {}, interval_s=0, clk_tck=100)


@pytest.mark.parametrize(
    ("comm", "utime", "stime"),
    [("python", 120, 30), ("VLLM::Worker", 5, 7), ("a (b) c", 1000, 1), ("x)", 0, 0)],
)
def test_parse_task_stat(comm: str, utime: int, stime: int) -> None:
    fields = [
        "S",
        "1",
        "2",
        "3",
        "0",
        "-1",
        "4194560",
        "0",
        "0",
        "0",
        "0",
        str(utime),
        str(stime),
        "0",
        "0",
        "20",
    ]
    text = f"1234 ({comm}) " + " ".join(fields) + "\n"
    assert parse_task_stat(text) == utime + stime
    assert parse_task_times(text) == (utime, stime)


def test_parse_task_stat_of_this_process() -> None:
    tid = Path("/proc/self/task").iterdir().__next__()
    assert parse_task_stat((tid / "stat").read_text()) >= 0


# -- provisioning helpers ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        ({"torch": "2.13.0"}, {"torch": "2.13.0", "tenacity": "9.1"}, []),
        ({"torch": "2.13.0"}, {"torch": "2.14.0"}, [("torch", "2.13.0", "2.14.0")]),
        ({"numpy": "2.2"}, {}, [("numpy", "2.2", "<removed>")]),
        ({"kvlease": "0.0.9"}, {"kvlease": "0.1.0"}, []),
    ],
)
def test_changed_pins(
    before: dict[str, str], after: dict[str, str], expected: list[tuple[str, str, str]]
) -> None:
    assert changed_pins(before, after, ignore={"kvlease"}) == expected


def test_source_root_is_this_checkout() -> None:
    root = source_root()
    assert root is not None
    assert (root / "server_patch" / "kvlease_stack").is_dir()


# -- CLI without servers -----------------------------------------------------------------------------


def test_cli_status_and_down_without_a_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from kvlease_stack.cli import app

    monkeypatch.setenv("KVLEASE_HOME", str(tmp_path))
    runner = CliRunner()
    status = runner.invoke(app, ["status"])
    assert status.exit_code == 1
    assert json.loads(status.output) == {"up": False}
    down = runner.invoke(app, ["down"])
    assert down.exit_code == 0


def test_cli_down_never_signals_a_process_that_is_not_a_vllm_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stale state file whose PIDs now belong to something else (here: this test process).
    import os

    from typer.testing import CliRunner

    from kvlease_stack.cli import app

    monkeypatch.setenv("KVLEASE_HOME", str(tmp_path))
    me = {"pid": os.getpid(), "pgid": os.getpgid(0), "url": "http://127.0.0.1:9"}
    (tmp_path / "stack.json").write_text(json.dumps({"prefill": me, "decode": me}))
    runner = CliRunner()
    status = runner.invoke(app, ["status"])
    assert status.exit_code == 1
    assert json.loads(status.output)["prefill"]["running"] is False
    down = runner.invoke(app, ["down"])
    assert down.exit_code == 0
    assert "prefill: not running" in down.output
    assert not (tmp_path / "stack.json").exists()


# -- child processes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("die_with_parent", [True, False])
def test_child_setup_own_group_and_parent_death(die_with_parent: bool) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    # An intermediate process starts `sleep` with child_setup, prints its pid, then is SIGKILLed.
    code = (
        "import subprocess, sys\n"
        "from kvlease_stack._proc import child_setup\n"
        f"p = subprocess.Popen(['sleep', '60'], preexec_fn=child_setup(die_with_parent={die_with_parent}))\n"
        "print(p.pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    mid = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert mid.stdout is not None
    child = int(mid.stdout.readline())
    try:
        assert os.getpgid(child) == child  # its own process group
        assert os.getsid(child) == os.getsid(0)  # in the caller's session
        mid.kill()
        mid.wait()
        deadline = time.monotonic() + 10
        gone = False
        while time.monotonic() < deadline and not gone:
            try:
                state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
                gone = state == "Z"
            except OSError:
                gone = True
            time.sleep(0.05)
        assert gone is die_with_parent
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child, signal.SIGKILL)


def test_decode_args_reach_only_the_decode_server() -> None:
    spec = StackSpec(decode_args=("--num-gpu-blocks-override", "48"))
    d = server_command("/py", spec, "decode", model_dir="/m", port=1, kv_config={})
    p = server_command("/py", spec, "prefill", model_dir="/m", port=2, kv_config={})
    assert d[-2:] == ["--num-gpu-blocks-override", "48"]
    assert "--num-gpu-blocks-override" not in p
    assert spec == StackSpec(decode_args=("--num-gpu-blocks-override", "48")) != StackSpec()


def test_default_dtype_follows_the_cpus_native_bf16() -> None:
    from kvlease_stack import default_dtype

    assert default_dtype("processor: 0\nflags\t\t: fpu avx fma f16c\n") == "float32"
    assert default_dtype("flags : fpu avx2 avx512f avx512_bf16\n") == "bfloat16"
    assert default_dtype("flags : fpu amx_bf16 amx_tile\n") == "bfloat16"
    assert StackSpec(dtype="bfloat16") != StackSpec(dtype="float32")
    with pytest.raises(ValueError, match="dtype"):
        StackSpec(dtype="float16")


# -- chat template -----------------------------------------------------------------------------------


def _render(template: str, messages: list[dict[str, object]], **kw: object) -> str:
    """Render like transformers' ``apply_chat_template`` (sandboxed, trimmed blocks, a ``tojson``
    without HTML escaping); the real servers' rendering is checked by ``tests/integration/test_demo.py``."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **_: json.dumps(x, ensure_ascii=False)
    return env.from_string(template).render(messages=messages, **kw)


PLAIN = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "bye"},
]


@pytest.mark.parametrize("gen", [True, False])
def test_stack_template_renders_plain_chats_as_the_models_own(gen: bool) -> None:
    """The servers' template only adds tools: a plain chat renders token for token as with the
    template stored in the models (which they were trained on), tools or not given."""
    from kvlease_stack._build_model import CHAT_TEMPLATE as MODEL_TEMPLATE

    want = _render(MODEL_TEMPLATE, PLAIN, add_generation_prompt=gen)
    assert _render(CHAT_TEMPLATE, PLAIN, add_generation_prompt=gen) == want
    assert _render(CHAT_TEMPLATE, PLAIN, add_generation_prompt=gen, tools=[]) == want
    assert want.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")


def test_stack_template_renders_tools_calls_and_results() -> None:
    tool = {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}
    call = {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": {"path": "a.py"}}}
    msgs = [
        *PLAIN[:2],
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "print(1)"},
    ]
    text = _render(CHAT_TEMPLATE, msgs, tools=[tool], add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are terse.\n\n# Tools\n<tools>\n"
        + json.dumps(tool)
        + '\n</tools>\nCall a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n'
        "<|im_start|>user\nhi<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>tool\nprint(1)<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # Arguments still as the JSON string of the OpenAI wire format render unchanged.
    call["function"]["arguments"] = '{"path": "a.py"}'  # type: ignore[index]
    assert _render(CHAT_TEMPLATE, msgs, tools=[tool], add_generation_prompt=True) == text
    # Without a system message the tools get a system turn of their own.
    alone = _render(CHAT_TEMPLATE, msgs[1:], tools=[tool])
    assert alone.startswith("<|im_start|>system\n# Tools\n<tools>\n") and "You are terse" not in alone


def test_server_args_reach_both_servers_before_decode_args() -> None:
    spec = StackSpec(server_args=("--enable-lora",), decode_args=("--num-gpu-blocks-override", "48"))
    d = server_command("/py", spec, "decode", model_dir="/m", port=1, kv_config={})
    p = server_command("/py", spec, "prefill", model_dir="/m", port=2, kv_config={})
    assert p[-1] == "--enable-lora"
    assert d[-3:] == ["--enable-lora", "--num-gpu-blocks-override", "48"]


def test_free_ports_lie_outside_the_ephemeral_range() -> None:
    """A port chosen for a server to bind later is one no outgoing connection can take as its
    source port meanwhile (vLLM's side channel failed with "Address already in use" when a busy
    machine's clients took a ``bind(0)`` port), and is never handed out twice."""
    from kvlease_stack._ports import _ephemeral_range, free_port

    lo, hi = _ephemeral_range()
    ports = [free_port() for _ in range(40)]
    assert len(set(ports)) == len(ports)
    assert all(not lo <= p <= hi for p in ports)
    for p in ports[:5]:  # free now: a server can bind it
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
