"""Pure parts of the stack: the spec, the vLLM command line and environment, Prometheus parsing and
the detection of threads that burn CPU while the server is idle. No IO here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvlease.protocol import CONTROL_SECRET_ENV, KV

ModelName = Literal["tiny", "small", "hybrid"]
ConnectorName = Literal["kvlease", "nixl"]
ServerRole = Literal["prefill", "decode"]

KVLEASE_CONNECTOR_CLASS = "KVLeaseConnector"
KVLEASE_CONNECTOR_MODULE = "kvlease_vllm.connector"
NIXL_CONNECTOR_CLASS = "NixlConnector"
#: The entry point name under ``vllm.general_plugins`` (pyproject).
PLUGIN_NAME = "kvlease"
#: vLLM's entry point groups, all filtered by ``VLLM_PLUGINS``.
VLLM_PLUGIN_GROUPS = (
    "vllm.general_plugins",
    "vllm.platform_plugins",
    "vllm.io_processor_plugins",
    "vllm.stat_logger_plugins",
    "vllm.endpoint_plugins",
)


#: The chat template both servers are given (``--chat-template``): the models' own ChatML template
#: (``_build_model.CHAT_TEMPLATE``, which renders plain messages exactly as this one does) plus
#: tool calling in the Hermes style: the tools listed in the system turn, an assistant's calls as
#: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, results as ``tool`` turns.
TOOL_CALL_PARSER = "hermes"
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    '{{- \'\\n</tools>\\nCall a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\\n\' }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set f = call['function'] if call['function'] is defined else call %}"
    "{{- '<tool_call>\\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{{- f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def default_dtype(cpuinfo: str | None = None) -> str:
    """``bfloat16`` where the CPU computes it natively (AVX512-BF16 or AMX), else ``float32``: on
    CPUs without them vLLM's bf16 path is emulated and about 3x slower than fp32 (measured: a
    3.6k-token prefill of the small model took 25 s in bf16 and 8 s in fp32 on an AVX-only CPU)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "bfloat16"
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
            break
    return "bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "float32"


@dataclass(frozen=True)
class StackSpec:
    """What to start: equal specs describe the same running pair (the test fixture reuses it)."""

    model: ModelName = "tiny"
    connector: ConnectorName = "kvlease"
    bidir: bool = True
    ttl: float = 120.0
    recompute_threshold: int = 64
    kvlease: Mapping[str, Any] = field(default_factory=dict)
    prefix_caching: bool = True
    plugin: bool = True
    max_model_len: int = 4096
    extra_env: Mapping[str, str] = field(default_factory=dict)
    #: Extra ``vllm serve`` arguments of the decode server (e.g. ``--num-gpu-blocks-override``).
    decode_args: tuple[str, ...] = ()
    #: Extra ``vllm serve`` arguments of both servers (e.g. ``--enable-lora``), before ``decode_args``.
    server_args: tuple[str, ...] = ()
    #: Model dtype of both servers (``float32`` or ``bfloat16``). The tests keep ``bfloat16`` (block
    #: counts and caps are sized for it); the demo and benchmarks take :func:`default_dtype`.
    dtype: str = "bfloat16"
    #: ``kv_load_failure_policy`` of the decode server (None: upstream's default, ``fail``; the
    #: prefill server always runs ``recompute``).
    decode_failure_policy: str | None = None

    def __post_init__(self) -> None:
        if self.model not in ("tiny", "small", "hybrid"):
            raise ValueError(f"model must be 'tiny', 'small' or 'hybrid', not {self.model!r}")
        if self.connector not in ("kvlease", "nixl"):
            raise ValueError(f"connector must be 'kvlease' or 'nixl', not {self.connector!r}")
        if self.ttl <= 0:
            raise ValueError("ttl must be > 0")
        if self.recompute_threshold < 0:
            raise ValueError("recompute_threshold must be >= 0")
        if self.decode_failure_policy not in (None, "fail", "recompute"):
            raise ValueError(
                f"decode_failure_policy must be 'fail' or 'recompute', not {self.decode_failure_policy!r}"
            )
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', not {self.dtype!r}")
        if self.max_model_len < 16:
            raise ValueError("max_model_len must be >= 16")
        reserved = {"control_host", "control_port", "control_secret"} & set(self.kvlease)
        if reserved:
            raise ValueError(f"kvlease keys set by the stack itself: {sorted(reserved)}")


@dataclass(frozen=True)
class Ports:
    """Ports of one server: OpenAI API, NIXL side channel, kvlease control endpoint."""

    http: int
    side_channel: int
    control: int


def kv_transfer_config(
    spec: StackSpec, role: ServerRole, *, control_port: int, control_secret: str, host: str = "127.0.0.1"
) -> dict[str, Any]:
    """The ``--kv-transfer-config`` object for one server of the pair."""
    extra: dict[str, Any] = {
        "bidirectional_kv_xfer": spec.bidir,
        "kv_recompute_threshold": spec.recompute_threshold,
        "decoder_kv_blocks_ttl": spec.ttl,
    }
    cfg: dict[str, Any] = {
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_buffer_device": "cpu",
    }
    if spec.connector == "kvlease":
        cfg["kv_connector"] = KVLEASE_CONNECTOR_CLASS
        cfg["kv_connector_module_path"] = KVLEASE_CONNECTOR_MODULE
        extra[KV.KVLEASE] = {
            **dict(spec.kvlease),
            "control_host": host,
            "control_port": control_port,
            "control_secret": control_secret,
        }
    else:
        cfg["kv_connector"] = NIXL_CONNECTOR_CLASS
    cfg["kv_connector_extra_config"] = extra
    if role == "prefill":
        cfg["kv_load_failure_policy"] = "recompute"
    elif spec.decode_failure_policy is not None:
        cfg["kv_load_failure_policy"] = spec.decode_failure_policy
    return cfg


def server_command(
    python: Path | str,
    spec: StackSpec,
    role: ServerRole,
    *,
    model_dir: Path | str,
    port: int,
    kv_config: Mapping[str, Any],
    host: str = "127.0.0.1",
) -> list[str]:
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        spec.model,
        "--host",
        host,
        "--port",
        str(port),
        "--max-model-len",
        str(spec.max_model_len),
        "--dtype",
        spec.dtype,
        "--enforce-eager",
        "--chat-template",
        CHAT_TEMPLATE,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        TOOL_CALL_PARSER,
        "--kv-transfer-config",
        json.dumps(kv_config, separators=(",", ":")),
    ]
    if role == "prefill" and not spec.prefix_caching:
        cmd.append("--no-enable-prefix-caching")
    cmd.extend(spec.server_args)
    if role == "decode":
        cmd.extend(spec.decode_args)
    return cmd


def server_env(
    base: Mapping[str, str],
    spec: StackSpec,
    role: ServerRole,
    *,
    side_channel_port: int,
    control_secret: str,
    installed_plugins: Iterable[str] = (),
    host: str = "127.0.0.1",
) -> dict[str, str]:
    """The server's environment: ``base`` plus the stack's settings plus ``spec.extra_env``.

    With ``spec.plugin`` False, ``VLLM_PLUGINS`` allows every installed vLLM plugin but kvlease's
    (vLLM loads only the listed names once the variable is set; an empty list loads none).
    """
    env = dict(base)
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": host,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
            "VLLM_CPU_OMP_THREADS_BIND": "0" if role == "prefill" else "1",
            CONTROL_SECRET_ENV: control_secret,
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
    )
    if spec.plugin:
        env.pop("VLLM_PLUGINS", None)
    else:
        env["VLLM_PLUGINS"] = ",".join(sorted(set(installed_plugins) - {PLUGIN_NAME}))
    env.update(spec.extra_env)
    return env


def plugin_names(entry_points_texts: Iterable[str]) -> set[str]:
    """Names of vLLM plugins declared in ``entry_points.txt`` files (any vLLM plugin group)."""
    names: set[str] = set()
    for text in entry_points_texts:
        group = None
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("[") and line.endswith("]"):
                group = line[1:-1].strip()
            elif group in VLLM_PLUGIN_GROUPS and "=" in line:
                names.add(line.split("=", 1)[0].strip())
    return names


# --------------------------------------------------------------------------------------------------
# Prometheus text
# --------------------------------------------------------------------------------------------------


def sample_key(name: str, labels: Mapping[str, str]) -> str:
    """``name`` or ``name{a="x",b="y"}`` with labels sorted: the key of :class:`Metrics`."""
    if not labels:
        return name
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


_KEY = re.compile(r"^(?P<name>[^{]+)(?:\{(?P<labels>.*)\})?$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class Metrics(dict[str, float]):
    """Parsed samples of a Prometheus text page, keyed by :func:`sample_key`."""

    def total(self, name: str, **labels: str) -> float:
        """Sum of the samples called ``name`` whose labels include ``labels``."""
        out = 0.0
        for key, value in self.items():
            m = _KEY.match(key)
            if m is None or m.group("name") != name:
                continue
            have = dict(_LABEL.findall(m.group("labels") or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                out += value
        return out

    def names(self) -> set[str]:
        return {key.split("{", 1)[0] for key in self}


def parse_prometheus(text: str) -> Metrics:
    from prometheus_client.parser import text_string_to_metric_families

    out = Metrics()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample_key(sample.name, sample.labels)] = float(sample.value)
    return out


# --------------------------------------------------------------------------------------------------
# Threads that burn CPU while idle (NIXL's progress thread busy-polls a core)
# --------------------------------------------------------------------------------------------------


def parse_task_times(text: str) -> tuple[int, int]:
    """(utime, stime) in clock ticks from the text of ``/proc/PID/task/TID/stat``."""
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    rest = text[text.rindex(")") + 2 :].split()
    # rest[0] is field 3 (state); utime and stime are fields 14 and 15.
    return int(rest[11]), int(rest[12])


def parse_task_stat(text: str) -> int:
    """utime + stime (clock ticks) from the text of ``/proc/PID/task/TID/stat``."""
    return sum(parse_task_times(text))


def polling_threads(
    before: Mapping[int, tuple[int, int]],
    after: Mapping[int, tuple[int, int]],
    *,
    interval_s: float,
    clk_tck: int,
    leaders: Iterable[int] = (),
    min_share: float = 0.5,
    min_sys_share: float = 0.5,
) -> list[int]:
    """Busy-polling threads of a server that is still starting: ids of non-leader threads that used
    at least ``min_share`` of a core, at least ``min_sys_share`` of it in the kernel.

    NIXL's progress thread spins in system calls from the moment the worker creates its agent, which
    is before the model's profiling run and warm-up; start-up work itself runs in the processes'
    main threads (the ``leaders``, thread id = process id) and mostly in user mode.
    """
    if interval_s <= 0:
        raise ValueError("interval_s must be > 0")
    budget = interval_s * clk_tck
    skip = set(leaders)
    out = []
    for tid, (u1, s1) in after.items():
        if tid in skip or tid not in before:
            continue
        u0, s0 = before[tid]
        used = (u1 - u0) + (s1 - s0)
        if used / budget >= min_share and (s1 - s0) >= min_sys_share * used:
            out.append(tid)
    return sorted(out)


def busy_threads(
    before: Mapping[int, int],
    after: Mapping[int, int],
    *,
    interval_s: float,
    clk_tck: int,
    min_share: float = 0.2,
) -> list[int]:
    """Thread ids that used at least ``min_share`` of one core between two samples of CPU ticks.

    An idle vLLM server's threads use well under 1 % of a core; a busy-polling thread uses all it
    gets, which on a crowded machine may be much less than a full core: hence the low default.
    """
    if interval_s <= 0:
        raise ValueError("interval_s must be > 0")
    budget = interval_s * clk_tck
    return sorted(
        tid for tid, t1 in after.items() if tid in before and (t1 - before[tid]) / budget >= min_share
    )
