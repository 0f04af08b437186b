"""``kvlease demo``: the whole system on this machine, in about three minutes.

It brings up the real local stack (a vLLM CPU prefill server and a decode server with
``KVLeaseConnector`` and real NIXL transfers) and the kvlease router, then runs a scripted coding
agent through the wrapped OpenAI client:

- the model calls tools (OpenAI ``tools`` / ``tool_calls``, parsed by vLLM's Hermes tool parser);
  the agent runs each call and appends its result as a ``tool`` message, and the history is resent
  every turn;
- one tool takes longer than the decode node's retention TTL: the SDK's heartbeats keep the lease;
- one answer carries ``<think>`` reasoning that the agent strips from its history before the next
  turn (as many frameworks do): the SDK detects it and, since the router says its prefill node
  verifies tokens, leaves reuse on: the connector reuses the verified prefix before the stripped
  block, and the row says how many tokens that was;

and prints one row per turn (prompt tokens, kvlease status, reused tokens, time to first token).
Then it runs the same conversation with kvlease off (plain recompute), compares the answers
(greedy decoding: they must be identical) and prints the speed-up. Everything it started is
stopped at the end, also on Ctrl-C.

The prefill node runs with its prefix cache off, like a busy prefill node whose cache has churned
since the previous turn: what the next turn reuses then comes from the decode node alone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import typer

from kvlease.protocol import CACHE_SALT, HEADER_REUSE, REUSE_OFF, ReuseStatus

__all__ = ["DEMO_SPEC_KW", "DemoResult", "demo", "router_process", "run_demo"]

#: The stack the demo runs on: timings need the bigger random model; a short TTL keeps it quick.
DEMO_SPEC_KW: dict[str, Any] = {"model": "small", "ttl": 20.0, "prefix_caching": False, "plugin": True}

THINK_RE = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
#: Forces an answer shaped like a reasoning model's (the demo model has random weights). Short
#: enough to close within :data:`REASONING_MAX_TOKENS` even at one token a character: an answer cut
#: off inside ``<think>`` has no reasoning block to strip, and the demo would show nothing.
REASONING_REGEX = r"<think>[a-z ]{12,40}</think>[a-z ,.]{8,30}"
REASONING_MAX_TOKENS = 100

#: The agent's tools (OpenAI function tools).
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run one test file and return pytest's report.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
]


TOOL_NAMES: tuple[str, ...] = tuple(t["function"]["name"] for t in TOOLS)


def tool_call_regex(name: str) -> str:
    """A Hermes-style call of tool ``name`` on one of the test files, as a regex: the demo model has
    random weights, so structured outputs shape its answer into a well-formed call, which vLLM's
    tool parser returns as ``tool_calls`` (the model still picks the file)."""
    return (
        r'<tool_call>\n\{"name": "'
        + name
        + r'", "arguments": \{"path": "tests/test_[1-3]\.py"\}\}\n</tool_call>'
    )


def run_tool(name: str, arguments: str) -> str:
    """The agent's side of a call: deterministic results, so both arms see the same history."""
    path = json.loads(arguments or "{}").get("path", "?")
    n = sum(map(ord, path)) % 7
    if name == "read_file":
        return f"{path}:\n" + "".join(
            f"def test_case_{n}_{j}():\n    assert handler_{j}(req, store) == {j}\n" for j in range(8)
        )
    return f"$ pytest {path}\n" + "".join(
        f"{path}::test_case_{n}_{j} {'FAILED' if j % 3 == n % 3 else 'PASSED'}\n" for j in range(8)
    )


def warning_note(text: str) -> str:
    """The cause named by an SDK warning (its first clause), for the note under a row."""
    text = text.removeprefix("kvlease: ")
    return re.split(r", (?:so|but) ", text, maxsplit=1)[0]


def turn_note(t: Any, calls: str) -> str:
    """The note of a kvlease row: what the SDK detected and what it did about it, then the calls."""
    if t.verified_reuse:
        note = f"SDK: {t.history.value} -> verified prefix reused ({t.reused_tokens} tokens); {calls}"
    elif t.reuse_forced_off:
        note = f"SDK: {t.history.value} -> recompute; {calls}"
    else:
        return calls
    return note.rstrip("; ")


@dataclass
class Row:
    turn: int
    prompt_tokens: int | None
    status: str | None
    reused_tokens: int | None
    ttft_s: float | None
    note: str = ""


@dataclass
class DemoResult:
    kvlease: list[Row] = field(default_factory=list)
    baseline: list[Row] = field(default_factory=list)
    answers_equal: bool = False
    speedup: float | None = None


def _context() -> str:
    """A deterministic 'repository' the agent was given (~1.1k tokens): what each turn resends."""
    lines = [
        f"def handler_{i}(request, store):\n    return store.get(request.key_{i}) or {i}\n" for i in range(30)
    ]
    return "Repository file app/handlers.py:\n" + "".join(lines)


@contextmanager
def router_process(
    stack: Any, *, extra_args: list[str] | None = None, timeout: float = 60.0
) -> Iterator[str]:
    """Run ``kvlease router`` in front of ``stack`` in its own process group; yield its base URL."""
    cmd = [sys.executable, "-m", "kvlease_router.cli"]
    cmd += ["--prefill", stack.prefill.url, "--decode", stack.decode.url, "--host", "127.0.0.1"]
    cmd += ["--port", "0", "--control-secret", stack.control_secret, "--log-level", "warning"]
    if stack.prefill.control:
        cmd += ["--prefill-control", stack.prefill.control, "--decode-control", stack.decode.control]
    elif "--node-ttl" not in (extra_args or []):  # stock vLLM: the router cannot ask D for its TTL
        cmd += ["--node-ttl", str(stack.spec.ttl)]
    cmd += extra_args or []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, process_group=0)
    try:
        deadline = time.monotonic() + timeout
        line = ""
        while time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline() if proc.stdout else ""
            if line.startswith("{"):
                break
        if not line.startswith("{"):
            err = proc.stderr.read() if proc.stderr and proc.poll() is not None else ""
            raise RuntimeError(f"the router did not start: {err[-2000:]}")
        yield str(json.loads(line)["url"])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=15)


#: What the agent asks of the model at each turn: a call of one of its tools, an answer with
#: reasoning that the agent strips from the history it resends, or a plain answer.
PLAN: tuple[str, ...] = ("read_file", "run_tests", "think", "read_file", "run_tests", "answer")
#: The tool called at this turn runs longer than the decode node's TTL.
SLOW_TOOL_TURN = 2


def _collect(stream: Any) -> tuple[str, list[dict[str, Any]]]:
    """Content and tool calls of a streamed answer (tool call deltas merged by index)."""
    parts: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta.content:
            parts.append(delta.content)
        for tc in delta.tool_calls or ():
            call = calls.setdefault(
                tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            call["id"] = tc.id or call["id"]
            if tc.function is not None:
                call["function"]["name"] += tc.function.name or ""
                call["function"]["arguments"] += tc.function.arguments or ""
    return "".join(parts), [calls[i] for i in sorted(calls)]


def _call_text(call: dict[str, Any]) -> str:
    """``read_file tests/test_2.py``: a tool call, short enough for the turn's row."""
    try:
        path = json.loads(call["function"]["arguments"]).get("path", "")
    except ValueError:
        path = call["function"]["arguments"]
    return f"{call['function']['name']} {path}"


def _create(
    conv: Any,
    model: str,
    messages: list[dict[str, Any]],
    action: str,
    extra: dict[str, Any],
    headers: dict[str, str],
) -> Any:
    """One streamed turn through the wrapped client."""
    calls_tool = action in TOOL_NAMES
    if calls_tool:
        extra = {**extra, "structured_outputs": {"regex": tool_call_regex(action)}}
    elif action == "think":
        extra = {**extra, "structured_outputs": {"regex": REASONING_REGEX}}
    return conv.chat.completions.create(
        model=model,
        messages=messages,
        # The tools are sent every turn: the template lists them in the system turn.
        tools=TOOLS,
        tool_choice="auto" if calls_tool else "none",
        max_tokens=120 if calls_tool else REASONING_MAX_TOKENS if action == "think" else 40,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
        extra_headers=headers,
    )


def _agent(
    base_url: str,
    model: str,
    *,
    reuse: bool,
    pause_s: float,
    turns: int,
    salt: str,
    say: Any,
) -> tuple[list[Row], list[str]]:
    """The scripted agent: returns one row per turn and the answers it got."""
    from openai import OpenAI

    import kvlease

    kc = kvlease.wrap(OpenAI(base_url=base_url + "/v1", api_key="kvlease-demo", max_retries=0))
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. " + _context()},
        {"role": "user", "content": "The tests fail. Read them, find the bug in app/handlers.py, fix it."},
    ]
    rows: list[Row] = []
    answers: list[str] = []
    try:
        with kc.conversation() as conv:
            for step, action in enumerate(PLAN[:turns], start=1):
                extra: dict[str, Any] = {CACHE_SALT: salt}
                headers = {} if reuse else {HEADER_REUSE: REUSE_OFF}
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always", kvlease.KVLeaseWarning)
                    answer, calls = _collect(_create(conv, model, messages, action, extra, headers))
                for w in caught:  # the SDK's warning, shown as a note under the turn's row
                    say(f"  SDK warning: {warning_note(str(w.message))}", reuse)
                answers.append(
                    json.dumps([answer, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]])
                )
                t = conv.turns[-1]
                note = turn_note(t, ", ".join(_call_text(c) for c in calls)) if reuse else ""
                rows.append(
                    Row(step, t.prompt_tokens, t.status and t.status.value, t.reused_tokens, t.ttft_s, note)
                )
                say(rows[-1], reuse)
                if calls:
                    messages.append({"role": "assistant", "content": answer or None, "tool_calls": calls})
                    if step == SLOW_TOOL_TURN and pause_s > 0:
                        say(
                            f"  the tool runs for {pause_s:.0f} s (longer than the decode TTL);"
                            " heartbeats renew the lease...",
                            reuse,
                        )
                        time.sleep(pause_s)
                    for c in calls:
                        result = run_tool(c["function"]["name"], c["function"]["arguments"])
                        messages.append({"role": "tool", "tool_call_id": c["id"], "content": result})
                elif action == "think":  # the framework drops reasoning from the history it resends
                    messages.append({"role": "assistant", "content": THINK_RE.sub("", answer)})
                    messages.append(
                        {"role": "user", "content": "Apply the fix, then read and run the tests again."}
                    )
                else:
                    messages.append({"role": "assistant", "content": answer})
    finally:
        kc.close()
    return rows, answers


def _median_ttft(rows: list[Row], skip_first: bool = True) -> float | None:
    vals = [r.ttft_s for r in rows[1 if skip_first else 0 :] if r.ttft_s is not None]
    return statistics.median(vals) if vals else None


def run_demo(stack: Any, *, pause_s: float = 25.0, turns: int = len(PLAN), console: Any = None) -> DemoResult:
    """Run both arms against a running ``stack`` (router started and stopped here)."""
    from rich.console import Console

    con = console or Console()

    def say(item: Any, reuse: bool) -> None:
        if isinstance(item, str):
            con.print(f"[dim]{item}[/dim]")
            return
        ttft = "n/a" if item.ttft_s is None else f"{item.ttft_s * 1000:7.0f} ms"
        con.print(
            f"  turn {item.turn}  prompt {item.prompt_tokens!s:>5}  status {item.status!s:<9}"
            f" reused {item.reused_tokens!s:>5}  TTFT {ttft}  {item.note}"
        )

    result = DemoResult()
    with router_process(stack) as router:
        con.print(f"router on {router}, P {stack.prefill.url}, D {stack.decode.url}")
        con.rule("kvlease on: heartbeats, verified pulls from the decode node")
        result.kvlease, answers_on = _agent(
            router, stack.model_name, reuse=True, pause_s=pause_s, turns=turns, salt="demo-on", say=say
        )
        con.rule("kvlease off: every turn recomputed on the prefill node")
        result.baseline, answers_off = _agent(
            router, stack.model_name, reuse=False, pause_s=0.0, turns=turns, salt="demo-off", say=say
        )
    result.answers_equal = answers_on == answers_off
    on, off = _median_ttft(result.kvlease), _median_ttft(result.baseline)
    if on and off:
        result.speedup = off / on
    _summary(con, result, on, off)
    return result


def _summary(con: Any, r: DemoResult, on: float | None, off: float | None) -> None:
    from rich.table import Table

    table = Table(title="Per turn: kvlease on vs off")
    for col in ("turn", "prompt tokens", "status", "reused tokens", "TTFT on", "TTFT off"):
        table.add_column(col, justify="right" if col != "status" else "left")
    for a, b in zip(r.kvlease, r.baseline):
        table.add_row(
            str(a.turn),
            str(a.prompt_tokens),
            str(a.status),
            str(a.reused_tokens),
            "n/a" if a.ttft_s is None else f"{a.ttft_s * 1000:.0f} ms",
            "n/a" if b.ttft_s is None else f"{b.ttft_s * 1000:.0f} ms",
        )
    con.print(table)
    hits = sum(1 for x in r.kvlease if x.status == ReuseStatus.HIT.value)
    con.print(f"follow-up turns that reused decode-side KV: {hits} of {len(r.kvlease) - 1}")
    con.print(f"answers identical with and without reuse (greedy): {'yes' if r.answers_equal else 'NO'}")
    if on and off:
        con.print(
            f"median TTFT of follow-up turns: {on * 1000:.0f} ms with kvlease, {off * 1000:.0f} ms without"
            f" -> [bold]{off / on:.1f}x[/bold]"
        )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def demo(
    pause: float = typer.Option(25.0, help="Seconds the slow tool runs (longer than the 20 s TTL)."),
    turns: int = typer.Option(len(PLAN), help=f"Turns per conversation (at most {len(PLAN)})."),
    timeout: float = typer.Option(600.0, help="Bound on each server's start-up."),
) -> None:
    """Bring up vLLM P/D + router locally and run a multi-turn agent with kvlease on and off."""
    from rich.console import Console

    from kvlease_stack import Stack, StackSpec, default_dtype

    if not 2 <= turns <= len(PLAN):
        raise typer.BadParameter(f"must be between 2 and {len(PLAN)}", param_hint="--turns")
    con = Console()
    signal.signal(signal.SIGTERM, _interrupt)  # stop everything on SIGTERM as on Ctrl-C
    con.rule("kvlease demo")
    con.print(
        "Starting a vLLM prefill server and a decode server (first run installs vLLM and builds a model)..."
    )
    t0 = time.monotonic()
    with Stack.start(StackSpec(**DEMO_SPEC_KW, dtype=default_dtype()), timeout=timeout) as stack:
        con.print(f"stack up in {time.monotonic() - t0:.0f} s")
        result = run_demo(stack, pause_s=pause, turns=turns, console=con)
    con.print(f"done in {time.monotonic() - t0:.0f} s; everything started here is stopped.")
    if not result.answers_equal:
        raise typer.Exit(1)
