"""Fixtures for the real local stack (vLLM CPU prefill/decode with NIXL on 127.0.0.1).

The fixtures provision what they need on a fresh machine (the vLLM venv and the models, cached
under ``$KVLEASE_HOME``) and run one pair at a time: ``stack_factory(spec)`` reuses the running
pair when the spec is equal, else stops it before starting the new one. Everything is stopped at
the end of the session, also when a test fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvlease_stack import Stack, StackSpec, ensure_venv

#: Start-up deadline per server (and for the warm-up turn). Generous: CPU is scarce here (a start
#: takes 45-80 s on a quiet machine, over 200 s on a loaded one), but short enough that a stuck start
#: fails with the server's log tail and gets its one retry inside the test's own time limit.
STACK_TIMEOUT_S = float(os.environ.get("KVLEASE_STACK_TIMEOUT", "420"))
#: Time limit of an integration test (pytest-timeout): room for a start, its retry and the test.
INTEGRATION_TEST_TIMEOUT_S = 4 * STACK_TIMEOUT_S


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("integration") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(INTEGRATION_TEST_TIMEOUT_S))


def _setup_progress(config: pytest.Config) -> Callable[[str], None]:
    """Provisioning's progress: every line to stderr (captured like other output), and its
    ``one-time set-up`` steps (what, how long it usually takes, where it is cached) to the terminal
    as well, so a fresh machine's first integration test does not sit silent for minutes."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")

    def say(msg: str) -> None:
        print(f"[kvlease stack] {msg}", file=sys.stderr, flush=True)
        if msg.startswith("one-time set-up") and reporter is not None:
            reporter.write_line(f"[kvlease stack] {msg}")

    return say


class _StackPool:
    """Holds at most one running pair. A start that fails is retried once, on fresh ports (a start
    can get stuck on a crowded machine); a spec that failed both times fails again at once (with
    the first error) instead of costing more start-up deadlines in every following test."""

    def __init__(self, progress: Callable[[str], None] | None = None) -> None:
        self.progress = progress
        self.current: Stack | None = None
        self.failed: list[tuple[StackSpec, BaseException]] = []

    def get(self, spec: StackSpec) -> Stack:
        cur = self.current
        if cur is not None and cur.spec == spec and cur.alive():
            return cur
        for bad, err in self.failed:
            if bad == spec:
                raise RuntimeError(f"the stack for this spec failed to start earlier in the session: {err}")
        self.close()
        try:
            self.current = Stack.start(spec, timeout=STACK_TIMEOUT_S, progress=self.progress)
        except Exception as first:
            print(f"stack start failed, retrying once: {first}", file=sys.stderr)
            try:
                self.current = Stack.start(spec, timeout=STACK_TIMEOUT_S, progress=self.progress)
            except Exception as err:
                self.failed.append((spec, err))
                raise
        return self.current

    def close(self) -> None:
        if self.current is not None:
            try:
                self.current.stop()
            finally:
                self.current = None


@pytest.fixture(scope="session")
def stack_pool(pytestconfig: pytest.Config) -> Iterator[_StackPool]:
    """The session's one running pair (``.get(spec)``, ``.close()`` to stop it)."""
    pool = _StackPool(_setup_progress(pytestconfig))
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="session")
def stack_factory(stack_pool: _StackPool) -> Callable[[StackSpec], Stack]:
    """``stack_factory(spec)`` -> a running :class:`Stack` for ``spec`` (one pair at a time)."""
    return stack_pool.get


@pytest.fixture()
def stack(stack_factory: Callable[[StackSpec], Stack]) -> Stack:
    """The pair with the default spec (tiny trained model, kvlease connector, bidirectional)."""
    return stack_factory(StackSpec())


@pytest.fixture(scope="session")
def vllm_python(pytestconfig: pytest.Config) -> Path:
    """The vLLM venv's interpreter (provisioned if missing)."""
    return Path(ensure_venv(progress=_setup_progress(pytestconfig)))


@pytest.fixture(scope="session")
def run_in_vllm_venv(vllm_python: Path) -> Callable[..., str]:
    """``run_in_vllm_venv(code_or_path, *args, timeout=300, env=None)`` -> stdout.

    Runs a Python snippet (a string) or file (a :class:`~pathlib.Path`) with the vLLM venv's
    interpreter, in its own process group; raises ``AssertionError`` with stderr on a non-zero exit.
    """

    def run(code: str | Path, *args: str, timeout: float = 300.0, env: dict[str, str] | None = None) -> str:
        cmd = (
            [str(vllm_python), str(code), *args]
            if isinstance(code, Path)
            else [str(vllm_python), "-c", code, *args]
        )
        full_env = {**os.environ, **(env or {})}
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=full_env,
            preexec_fn=os.setpgrp,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, err = proc.communicate()
            raise AssertionError(f"timed out after {timeout} s: {cmd[:3]}\n{err[-4000:]}") from None
        if proc.returncode != 0:
            raise AssertionError(
                f"exit {proc.returncode}: {cmd[:3]}\nstdout:\n{out[-2000:]}\nstderr:\n{err[-4000:]}"
            )
        return out

    return run
