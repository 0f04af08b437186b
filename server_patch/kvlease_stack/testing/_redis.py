"""A real ``redis-server`` on 127.0.0.1 (free port, own process group, no persistence) for tests."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from kvlease_stack._ports import free_port

__all__ = ["RedisServer", "kill_process_group"]


def kill_process_group(
    proc: subprocess.Popen[bytes] | subprocess.Popen[str], timeout: float = 60.0, pgid: int | None = None
) -> None:
    """SIGKILL ``proc``'s process group (a crash) and wait until it is gone.

    A stopped group (``SIGSTOP``, a simulated hang) gets ``SIGCONT`` first, so nothing of it sits
    stopped with a pending kill; then the leader is reaped and the group polled until no member is
    left. Bounded by ``timeout`` in all, generous on purpose: on a loaded 2-core machine a killed
    process has taken over 10 s to be reaped (the teardown flake of issue 15).
    """
    pgid = proc.pid if pgid is None else pgid
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
    deadline = time.monotonic() + timeout
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pass
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)  # any member (or unreaped zombie) of the group left?
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)


class RedisServer:
    """``RedisServer.start()``; ``.url``; ``.kill()`` (SIGKILL, like a crash); ``.restart()``; ``.stop()``."""

    def __init__(self, binary: str, port: int, workdir: Path) -> None:
        self.binary, self.port, self.dir = binary, port, workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def available(cls) -> bool:
        return shutil.which("redis-server") is not None

    @classmethod
    def start(cls, timeout: float = 10.0) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        server = cls(binary, free_port(), Path(tempfile.mkdtemp(prefix="kvlease-redis-")))
        server.restart(timeout)
        return server

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def restart(self, timeout: float = 10.0) -> None:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        self.proc = subprocess.Popen(
            [*args, "--dir", str(self.dir)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            process_group=0,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"redis-server did not answer within {timeout} s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            kill_process_group(self.proc)

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
