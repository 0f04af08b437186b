"""What the benchmarks that start their servers as processes share: a process in its own process
group that reports its address as one JSON line, stopping a group by its id, and CPU time from
Linux ``/proc``."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["Proc", "busy_seconds", "cpu_seconds", "readline", "stop_group"]


def readline(p: subprocess.Popen[str], timeout: float) -> str:
    """One line of ``p``'s stdout within ``timeout`` seconds ('' if none)."""
    assert p.stdout is not None
    r, _, _ = select.select([p.stdout], [], [], timeout)
    return p.stdout.readline() if r else ""


class Proc:
    """``args`` in a process group of its own; with ``wait_line``, its first stdout line (a JSON
    object: its address and ports) is :attr:`info`, read within ``timeout`` seconds."""

    def __init__(self, args: list[str], timeout: float = 120.0, *, wait_line: bool = True) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.p = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, process_group=0, env=env
        )
        self.info: dict[str, Any] = {}
        if wait_line:
            line = readline(self.p, timeout)
            if not line:
                self.stop()
                raise RuntimeError(f"{args[:3]} did not report its address within {timeout} s")
            self.info = json.loads(line)

    @property
    def pid(self) -> int:
        return self.p.pid

    def stop(self) -> None:
        stop_group(self.p)


def stop_group(p: subprocess.Popen[Any]) -> None:
    """SIGTERM ``p``'s process group, SIGKILL it after 10 s, and reap ``p``."""
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process (Linux ``/proc``), or ``None`` where unavailable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def busy_seconds() -> float | None:
    """CPU seconds the whole machine has been busy (``/proc/stat``: user, nice, system, irq,
    softirq, steal), or ``None`` where unavailable."""
    try:
        v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf("SC_CLK_TCK")
