"""Helpers of the fault-injection tests: a router process that restarts on its own port, an agent on
the SDK-wrapped OpenAI client that records every turn, the no-reuse reference, and the tally.

The reference of a turn is the same messages sent straight to P and D (``Stack.chat_turn``, no
router, no handle) with a fresh ``cache_salt``: a full recompute that no cache of any earlier turn
can feed. Greedy (temperature 0) output of every turn must equal it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlease.protocol import CACHE_SALT, CONTROL_SECRET_ENV, ReuseStatus
from kvlease_stack import Stack
from kvlease_stack._ports import free_port
from kvlease_stack.testing._redis import kill_process_group

#: Generous, bounded waits: the machine's CPU is shared by several P/D pairs.
TURN_TIMEOUT_S = 300.0
ROUTER_START_S = 180.0
GEN = 32  # tokens per answer (``ignore_eos``: every answer has content and costs the same)
API_KEY = "fault-tests"

_SENTENCES = [
    f"Step {i}: the loader opens part {i} of the archive, checks its checksum, retries a failed read "
    "once, and appends the decoded records to the result list before moving on. "
    for i in range(1, 17)
]
FIRST = "Write a Python function that loads a multi-part archive and returns its records. " + "".join(
    _SENTENCES
)
FOLLOW_UPS = [
    "Now add unit tests for the loader, one per failure mode.",
    "Handle a missing part with a clear error message.",
    "Add type hints and a docstring.",
    "Make the retry count configurable.",
    "Log each retry at debug level.",
    "Return the records as a generator instead of a list.",
    "Explain the design in three sentences.",
]


class RouterProc:
    """``kvlease router`` in front of ``stack`` on a fixed port (so a restart keeps the agent's
    ``base_url``), in its own process group, logging to ``log_path``."""

    def __init__(self, stack: Stack, log_path: Path, *extra: str) -> None:
        assert stack.prefill.control and stack.decode.control, "the kvlease connector is required"
        self.port = free_port()
        self.log_path = log_path
        self.args = [
            sys.executable, "-m", "kvlease_router.cli",
            "--prefill", stack.prefill.url, "--prefill-control", stack.prefill.control,
            "--decode", stack.decode.url, "--decode-control", stack.decode.control,
            "--host", "127.0.0.1", "--port", str(self.port), "--startup-timeout", "120", *extra,
        ]  # fmt: skip
        # a key secret: Redis state needs one, shared by restarts (it is never kept in Redis)
        self.env = {
            **os.environ,
            CONTROL_SECRET_ENV: stack.control_secret,
            "KVLEASE_ROUTER_KEY_SECRET": "fault-key",
        }
        self.proc: subprocess.Popen[str] | None = None
        self.starts = 0
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        with open(self.log_path, "a", encoding="utf-8") as log:
            log.write(f"--- start {self.starts}\n")
            log.flush()
            self.proc = subprocess.Popen(
                self.args, stdout=subprocess.PIPE, stderr=log, text=True, env=self.env, process_group=0
            )
        line: list[str] = []
        proc = self.proc
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(ROUTER_START_S)
        if not line or not line[0].startswith("{"):
            self.stop()
            raise AssertionError(f"the router did not start; log tail:\n{self.log_path.read_text()[-3000:]}")
        assert json.loads(line[0])["url"] == self.url
        self.starts += 1

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                kill_process_group(self.proc)  # SIGCONT, SIGKILL, wait on the whole group

    def kill(self) -> None:
        """SIGKILL (a crash: nothing is flushed, background tasks are lost)."""
        if self.proc is not None and self.proc.poll() is None:
            kill_process_group(self.proc)

    def restart(self) -> None:
        self.stop()
        self.start()


# --------------------------------------------------------------------------------------------------
# The agent and the tally
# --------------------------------------------------------------------------------------------------


@dataclass
class Record:
    test: str
    index: int
    messages: list[dict[str, str]]
    content: str
    status: ReuseStatus | None
    reused: int | None
    stream: bool


@dataclass
class Tally:
    """Figures of the whole file (printed in the terminal summary)."""

    turns: int = 0
    failed: int = 0
    references: int = 0
    divergences: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [
            f"fault injection: {self.turns} turns through the SDK, {self.failed} failed, "
            f"{self.divergences} of {self.references} checked turns diverged from the no-reuse reference",
            "statuses: " + ", ".join(f"{k}={v}" for k, v in sorted(self.statuses.items())),
        ]
        return out + self.notes


class Agent:
    """One conversation through the router on ``kvlease.wrap(OpenAI(...))``; records every turn.

    ``max_retries=0``: the openai client must not hide a failed turn by sending it again.
    """

    def __init__(
        self,
        router_url: str,
        model: str,
        tally: Tally,
        test: str,
        *,
        heartbeat: bool = True,
        retry: Any = None,
    ) -> None:
        from openai import OpenAI

        import kvlease

        self.tally, self.test, self.model = tally, test, model
        self.client = kvlease.wrap(
            OpenAI(base_url=router_url + "/v1", api_key=API_KEY, max_retries=0, timeout=TURN_TIMEOUT_S),
            heartbeat=heartbeat,
            retry=retry,
        )
        self.conv = self.client.conversation()
        self.salt = uuid.uuid4().hex  # this conversation's own prefix-cache namespace
        self.messages: list[dict[str, str]] = []
        self.records: list[Record] = []

    def turn(self, *, stream: bool = False) -> Record:
        """Send the next user message (the first, then the follow-ups) with the whole history."""
        n = len(self.records)
        if n == 0:
            self.messages.append({"role": "user", "content": FIRST})
        else:
            self.messages += [
                {"role": "assistant", "content": self.records[-1].content},
                {"role": "user", "content": FOLLOW_UPS[(n - 1) % len(FOLLOW_UPS)]},
            ]
        sent = [dict(m) for m in self.messages]
        self.tally.turns += 1
        kw: dict[str, Any] = dict(
            model=self.model,
            messages=sent,
            max_tokens=GEN,
            temperature=0.0,
            extra_body={CACHE_SALT: self.salt, "ignore_eos": True},
        )
        try:
            if stream:
                content = "".join(
                    (c.choices[0].delta.content or "")
                    for c in self.conv.chat.completions.create(stream=True, **kw)
                    if c.choices
                )
            else:
                content = self.conv.chat.completions.create(**kw).choices[0].message.content or ""
        except Exception as e:  # openai.APIError and anything else: a failed client turn
            self.tally.failed += 1
            raise AssertionError(f"{self.test}: turn {n + 1} failed: {e!r}") from e
        t = self.conv.turns[-1]
        assert t.index == n and t.stream is stream, t  # the SDK recorded this very turn
        rec = Record(self.test, n + 1, sent, content, t.status, t.reused_tokens, stream)
        self.records.append(rec)
        self.tally.statuses[t.status.value if t.status else "none"] += 1
        if not content:
            self.tally.failed += 1
            raise AssertionError(f"{self.test}: turn {n + 1} returned no content")
        # the header tells the truth: reused tokens exactly on hits
        if t.status is ReuseStatus.HIT:
            assert t.reused_tokens and t.reused_tokens > 0, rec
        else:
            assert not t.reused_tokens, rec
        return rec

    def statuses(self) -> list[str | None]:
        return [r.status.value if r.status else None for r in self.records]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()


def reference(stack: Stack, messages: list[dict[str, str]]) -> str:
    """The turn recomputed on P and D directly: no router, no handle, a fresh ``cache_salt``."""
    out = stack.chat_turn(
        messages, max_tokens=GEN, timeout=TURN_TIMEOUT_S, **{CACHE_SALT: uuid.uuid4().hex, "ignore_eos": True}
    )
    return str(out["decode"]["choices"][0]["message"]["content"] or "")


def check_references(stack: Stack, agent: Agent) -> None:
    """Every recorded turn of ``agent`` equals its no-reuse reference (all turns are checked, then
    one assertion lists every divergence)."""
    bad = []
    for rec in agent.records:
        ref = reference(stack, rec.messages)
        agent.tally.references += 1
        if ref != rec.content:
            agent.tally.divergences += 1
            bad.append(
                f"turn {rec.index} ({rec.status}, stream={rec.stream}): {rec.content!r} != reference {ref!r}"
            )
    agent.tally.notes.append(f"  {agent.test}: {' '.join(str(s) for s in agent.statuses())}")
    assert not bad, f"{agent.test}: greedy output diverged from the no-reuse reference:\n" + "\n".join(bad)


# --------------------------------------------------------------------------------------------------
# Processes and logs
# --------------------------------------------------------------------------------------------------


def log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def wait_for_log(path: Path, offset: int, needles: tuple[str, ...], timeout: float) -> str | None:
    """The first of ``needles`` that appears in ``path`` after byte ``offset`` within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path, "rb") as fh:
            fh.seek(offset)
            text = fh.read().decode("utf-8", "replace")
        for n in needles:
            if n in text:
                return n
        time.sleep(0.2)
    return None


@contextlib.contextmanager
def stopped(pgid: int) -> Iterator[Callable[[], None]]:
    """SIGSTOP the process group (a node that hangs: connections are accepted, nothing answers);
    yields ``resume``; the group is always resumed on leaving."""
    resumed = False

    def resume() -> None:
        nonlocal resumed
        if not resumed:
            os.killpg(pgid, signal.SIGCONT)
            resumed = True

    os.killpg(pgid, signal.SIGSTOP)
    try:
        yield resume
    finally:
        resume()


def kill_group(pgid: int, proc: subprocess.Popen[bytes] | None, timeout: float = 30.0) -> None:
    """SIGKILL the process group (a crash; SIGCONT first, should it be stopped) and wait on it."""
    if proc is not None:
        kill_process_group(proc, max(timeout, 60.0), pgid)
        return
    for sig in (signal.SIGCONT, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)


def wait_until(cond: Callable[[], bool], timeout: float, step: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()
