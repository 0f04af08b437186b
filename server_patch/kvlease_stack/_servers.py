"""Start, watch and stop a real vLLM prefill/decode pair on 127.0.0.1.

Each server runs in its own process group inside the caller's session (one signal to the group
stops the API server and its engine core), logs to a file, is health-polled with a deadline and
fails fast with its log tail if it dies. After start-up the threads that burn CPU while idle
(NIXL's busy-polling progress thread) are reniced to 19, and one warm-up P->D turn with logprobs is
sent, so that timings taken afterwards are sane on a small machine.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from kvlease.protocol import (
    CHAT_COMPLETIONS_PATH,
    HEALTH_PATH,
    KV_TRANSFER_PARAMS,
    METRICS_PATH,
    prefill_request_params,
)
from kvlease_stack._config import (
    Metrics,
    Ports,
    ServerRole,
    StackSpec,
    busy_threads,
    kv_transfer_config,
    parse_prometheus,
    parse_task_times,
    plugin_names,
    polling_threads,
    server_command,
    server_env,
)
from kvlease_stack._model import ensure_model
from kvlease_stack._paths import kvlease_home, logs_dir
from kvlease_stack._ports import HOST, free_port
from kvlease_stack._proc import child_setup
from kvlease_stack._venv import Progress, _stderr_progress, ensure_venv, site_packages


class StackError(RuntimeError):
    """A server of the stack failed to start, died, or did not answer in time."""


def http_json(
    url: str,
    body: Mapping[str, Any] | None = None,
    *,
    timeout: float = 60.0,
    headers: Mapping[str, str] | None = None,
) -> Any:
    """GET (no body) or POST JSON; return the decoded JSON. Raises ``StackError`` on HTTP errors."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        raise StackError(f"{url}: HTTP {e.code}: {e.read()[:2000]!r}") from e


def _http_text(url: str, *, timeout: float) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status), resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return int(e.code), ""


def tail(path: Path, n: int = 60) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 64_000))
            return "\n".join(fh.read().decode("utf-8", "replace").splitlines()[-n:])
    except OSError:
        return "<no log>"


def stop_group(pgid: int, *, timeout: float = 30.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """SIGTERM the process group, wait up to ``timeout`` for it to empty, then SIGKILL it."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        if proc is not None:
            proc.wait()
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None:
            proc.poll()  # reap the leader so the group can empty
        if not group_alive(pgid):
            break
        time.sleep(0.2)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        end = time.monotonic() + 10
        while group_alive(pgid) and time.monotonic() < end:
            if proc is not None:
                proc.poll()
            time.sleep(0.1)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def group_alive(pgid: int) -> bool:
    """True while any non-zombie process is in group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return bool(group_members(pgid))


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) PIDs whose process group is ``pgid`` (from ``/proc``)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        rest = text[text.rindex(")") + 2 :].split()
        if rest[0] != "Z" and int(rest[2]) == pgid:
            out.append(int(entry))
    return out


def _thread_times(pids: list[int]) -> dict[int, tuple[int, int]]:
    """(utime, stime) of every thread of ``pids``, by thread id (threads that vanish are skipped)."""
    times: dict[int, tuple[int, int]] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    times[int(tid)] = parse_task_times(Path(f"/proc/{pid}/task/{tid}/stat").read_text())
    return times


def _renice(tids: Iterable[int], niceness: int) -> list[int]:
    """Set ``niceness`` on each thread; return those it was set on (a thread may have ended)."""
    done = []
    for tid in tids:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
            done.append(tid)
    return done


def renice_busy_threads(pgids: list[int], *, interval_s: float = 2.5, niceness: int = 19) -> list[int]:
    """Find threads of the groups that burn CPU while idle and renice them; return their TIDs."""
    pids = [p for g in pgids for p in group_members(g)]
    before = {tid: u + s for tid, (u, s) in _thread_times(pids).items()}
    time.sleep(interval_s)
    after = {tid: u + s for tid, (u, s) in _thread_times(pids).items()}
    busy = busy_threads(before, after, interval_s=interval_s, clk_tck=os.sysconf("SC_CLK_TCK"))
    _renice(busy, niceness)
    return busy


class StartupRenicer:
    """Renices busy-polling threads (:func:`polling_threads`) of servers that are still starting.

    NIXL's progress thread spins from the moment a worker creates its agent, before the profiling
    run and the warm-up; with two servers starting on two cores, the two spinning threads compete
    with both servers' start-up work at equal priority. This thread samples the groups every
    ``interval_s`` until :meth:`stop` and renices what it finds; :meth:`Stack._renice` still does the
    full pass once both servers are healthy.
    """

    def __init__(
        self, pgids: Callable[[], list[int]], *, interval_s: float = 2.0, niceness: int = 19
    ) -> None:
        self._pgids = pgids
        self.interval_s = interval_s
        self.niceness = niceness
        self.reniced: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvlease-startup-renice", daemon=True)

    def __enter__(self) -> StartupRenicer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _sample(self) -> tuple[dict[int, tuple[int, int]], set[int]]:
        pids = [p for g in self._pgids() for p in group_members(g)]
        return _thread_times(pids), set(pids)

    def _run(self) -> None:
        clk = os.sysconf("SC_CLK_TCK")
        before, _ = self._sample()
        while not self._stop.wait(self.interval_s):
            after, leaders = self._sample()
            found = polling_threads(before, after, interval_s=self.interval_s, clk_tck=clk, leaders=leaders)
            self.reniced.update(_renice(set(found) - self.reniced, self.niceness))
            before = after


@dataclass
class ServerHandle:
    """One running vLLM server of the pair."""

    role: ServerRole
    ports: Ports
    log_path: Path
    connector: str
    proc: subprocess.Popen[bytes] | None = None
    started_s: float = 0.0
    reniced: list[int] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.ports.http}"

    @property
    def control(self) -> str | None:
        return f"http://{HOST}:{self.ports.control}" if self.connector == "kvlease" else None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def pgid(self) -> int | None:
        return self.pid  # the server leads its own group

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def metrics(self, timeout: float = 30.0) -> Metrics:
        status, text = _http_text(self.url + METRICS_PATH, timeout=timeout)
        if status != 200:
            raise StackError(f"{self.role}: GET {METRICS_PATH} -> HTTP {status}")
        return parse_prometheus(text)

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def rss_bytes(self) -> int:
        """Resident memory of the server's whole process group."""
        total = 0
        if self.pgid is None:
            return 0
        for pid in group_members(self.pgid):
            with contextlib.suppress(OSError, ValueError, IndexError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        return total


_LIVE: weakref.WeakSet[Stack] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for stack in list(_LIVE):
        with contextlib.suppress(Exception):
            stack.stop()


class Stack:
    """A running prefill/decode pair. Use :meth:`start`; leave with ``with`` or :meth:`stop`."""

    def __init__(
        self,
        spec: StackSpec,
        *,
        python: Path,
        model_dir: Path,
        log_dir: Path,
        progress: Progress,
        health_timeout: float,
        detached: bool = False,
    ) -> None:
        self.spec = spec
        self.detached = detached
        self.python = python
        self.model_dir = model_dir
        self.model_name = spec.model
        self.control_secret = secrets.token_urlsafe(24)
        self.progress = progress
        self.health_timeout = health_timeout
        self.timings: dict[str, float] = {}
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.prefill = ServerHandle(
            "prefill", self._ports(), log_dir / f"{stamp}-{os.getpid()}-prefill.log", spec.connector
        )
        self.decode = ServerHandle(
            "decode", self._ports(), log_dir / f"{stamp}-{os.getpid()}-decode.log", spec.connector
        )
        self._plugins = self._installed_plugins()

    @staticmethod
    def _ports() -> Ports:
        return Ports(http=free_port(), side_channel=free_port(), control=free_port())

    @classmethod
    def start(
        cls,
        spec: StackSpec | None = None,
        *,
        timeout: float = 300.0,
        home: Path | None = None,
        progress: Progress | None = None,
        warmup: bool = True,
        detached: bool = False,
    ) -> Stack:
        """Provision (cached), start P (core 0) and D (core 1), health-poll, renice, warm up.

        ``timeout`` bounds each server's start-up (health) and the warm-up turn. On any failure
        both servers are stopped before the exception propagates. Unless ``detached``, the servers
        are also stopped when this process exits, even when it is killed: they get SIGTERM when the
        thread that started them ends (Linux parent-death signal), so start and restart stacks from
        a thread that lives as long as the stack (normally the main thread).
        """
        spec = spec or StackSpec()
        say = progress or _stderr_progress
        home = home or kvlease_home()
        python = ensure_venv(home, progress=say)
        model = ensure_model(spec.model, home, progress=say)
        log_dir = logs_dir(home)
        log_dir.mkdir(parents=True, exist_ok=True)
        stack = cls(
            spec,
            python=python,
            model_dir=model,
            log_dir=log_dir,
            progress=say,
            health_timeout=timeout,
            detached=detached,
        )
        if not detached:
            _LIVE.add(stack)
        try:
            t0 = time.monotonic()
            stack._launch(stack.prefill)
            stack._launch(stack.decode)
            with StartupRenicer(stack._pgids) as early:
                stack._wait_healthy(stack.prefill)
                stack._wait_healthy(stack.decode)
            if early.reniced:
                say(
                    f"reniced {len(early.reniced)} busy-polling thread(s) during start-up: {sorted(early.reniced)}"
                )
            stack.timings["start_s"] = time.monotonic() - t0
            stack._renice()
            if warmup:
                t1 = time.monotonic()
                stack.warm_up(timeout=timeout)
                stack.timings["warmup_s"] = time.monotonic() - t1
            say(
                f"stack up in {time.monotonic() - t0:.0f} s: P {stack.prefill.url} D {stack.decode.url} "
                f"(RSS P {stack.prefill.rss_bytes() / 2**30:.1f} GiB, D {stack.decode.rss_bytes() / 2**30:.1f} GiB)"
            )
        except BaseException:
            stack.stop()
            raise
        return stack

    # -- lifecycle -------------------------------------------------------------------------------

    def _installed_plugins(self) -> set[str]:
        venv = self.python.parent.parent
        texts = []
        with contextlib.suppress(Exception):
            for f in site_packages(venv).glob("*.dist-info/entry_points.txt"):
                with contextlib.suppress(OSError):
                    texts.append(f.read_text(encoding="utf-8", errors="replace"))
        return plugin_names(texts)

    def _launch(self, server: ServerHandle) -> None:
        kv = kv_transfer_config(
            self.spec,
            server.role,
            control_port=server.ports.control,
            control_secret=self.control_secret,
            host=HOST,
        )
        cmd = server_command(
            self.python,
            self.spec,
            server.role,
            model_dir=self.model_dir,
            port=server.ports.http,
            kv_config=kv,
        )
        env = server_env(
            os.environ,
            self.spec,
            server.role,
            side_channel_port=server.ports.side_channel,
            control_secret=self.control_secret,
            installed_plugins=self._plugins,
            host=HOST,
        )
        server.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.progress(f"starting {server.role} on {server.url} (log {server.log_path})")
        with open(server.log_path, "ab") as log:
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            server.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(self.model_dir.parent),
                preexec_fn=child_setup(die_with_parent=not self.detached),
            )
        server.started_s = time.monotonic()

    def _wait_healthy(self, server: ServerHandle) -> None:
        deadline = server.started_s + self.health_timeout
        while True:
            if not server.alive():
                rc = None if server.proc is None else server.proc.returncode
                raise StackError(
                    f"{server.role} server exited (rc={rc}) during start-up; log tail:\n{tail(server.log_path)}"
                )
            with contextlib.suppress(OSError):
                status, _ = _http_text(server.url + HEALTH_PATH, timeout=5)
                if status == 200:
                    self.timings[f"{server.role}_healthy_s"] = time.monotonic() - server.started_s
                    return
            if time.monotonic() > deadline:
                raise StackError(
                    f"{server.role} server not healthy after {self.health_timeout:.0f} s; log tail:\n{tail(server.log_path)}"
                )
            time.sleep(0.5)

    def _pgids(self) -> list[int]:
        return [s.pgid for s in (self.prefill, self.decode) if s.pgid is not None and s.alive()]

    def _renice(self, servers: list[ServerHandle] | None = None) -> None:
        servers = servers or [self.prefill, self.decode]
        pgids = [s.pgid for s in servers if s.pgid is not None]
        busy = renice_busy_threads(pgids)
        for s in servers:
            s.reniced = busy
        self.progress(f"reniced {len(busy)} busy-polling thread(s): {busy}")

    def warm_up(self, *, timeout: float = 300.0) -> dict[str, Any]:
        """One real P->D chat turn with logprobs (the first such request on a fresh server is slow)."""
        messages = [{"role": "user", "content": "def warm_up(n):\n    return n"}]
        return self.chat_turn(messages, max_tokens=4, timeout=timeout, logprobs=True)

    def chat_turn(
        self, messages: list[dict[str, Any]], *, max_tokens: int = 16, timeout: float = 120.0, **extra: Any
    ) -> dict[str, Any]:
        """Send ``messages`` to P (``max_tokens=1``, remote decode) then to D with P's handle.

        Returns ``{"prefill": P's response, "decode": D's response}``; greedy (temperature 0).
        """
        body: dict[str, Any] = {"model": self.model_name, "messages": messages, "temperature": 0.0, **extra}
        p = http_json(
            self.prefill.url + CHAT_COMPLETIONS_PATH,
            {**body, "max_tokens": 1, KV_TRANSFER_PARAMS: prefill_request_params()},
            timeout=timeout,
        )
        params = p.get(KV_TRANSFER_PARAMS)
        if not isinstance(params, dict):
            raise StackError(f"prefill returned no {KV_TRANSFER_PARAMS}: {json.dumps(p)[:1000]}")
        d = http_json(
            self.decode.url + CHAT_COMPLETIONS_PATH,
            {**body, "max_tokens": max_tokens, KV_TRANSFER_PARAMS: params},
            timeout=timeout,
        )
        return {"prefill": p, "decode": d}

    def _stop_server(self, server: ServerHandle) -> None:
        if server.proc is not None:
            stop_group(server.proc.pid, proc=server.proc)

    def stop(self) -> None:
        """Stop both servers (SIGTERM to each group, bounded wait, SIGKILL). Idempotent."""
        for server in (self.decode, self.prefill):
            self._stop_server(server)
        _LIVE.discard(self)

    def _restart(self, server: ServerHandle, timeout: float | None, warmup: bool) -> None:
        self._stop_server(server)
        if timeout is not None:
            self.health_timeout = timeout
        t0 = time.monotonic()
        self._launch(server)
        try:
            with StartupRenicer(self._pgids):
                self._wait_healthy(server)
            self._renice([server])
            if warmup:
                self.warm_up(timeout=self.health_timeout)
        except BaseException:
            self.stop()
            raise
        self.timings[f"{server.role}_restart_s"] = time.monotonic() - t0

    def restart_decode(self, timeout: float | None = None, *, warmup: bool = False) -> None:
        """Stop and start D with the same ports (fault tests); ``warmup`` sends one P->D turn.

        On failure both servers are stopped and the error propagates.
        """
        self._restart(self.decode, timeout, warmup)

    def restart_prefill(self, timeout: float | None = None, *, warmup: bool = False) -> None:
        """Stop and start P with the same ports (fault tests); ``warmup`` sends one P->D turn."""
        self._restart(self.prefill, timeout, warmup)

    def alive(self) -> bool:
        return self.prefill.alive() and self.decode.alive()

    def detach(self) -> None:
        """Do not stop the servers at this process's normal exit (see ``start(detached=True)``)."""
        _LIVE.discard(self)

    def endpoints(self) -> dict[str, Any]:
        """What ``kvlease stack up`` prints (JSON-able)."""
        return {
            "model": self.model_name,
            "model_dir": str(self.model_dir),
            "connector": self.spec.connector,
            "control_secret": self.control_secret,
            **{
                s.role: {
                    "url": s.url,
                    "control": s.control,
                    "pid": s.pid,
                    "pgid": s.pgid,
                    "log": str(s.log_path),
                    "side_channel_port": s.ports.side_channel,
                }
                for s in (self.prefill, self.decode)
            },
        }

    def __enter__(self) -> Stack:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


StackStarter = Callable[[StackSpec], Stack]
