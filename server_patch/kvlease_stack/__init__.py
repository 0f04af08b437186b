"""The local real stack: a vLLM CPU prefill/decode pair with NIXL on 127.0.0.1.

Reading path: :mod:`._config` (the spec, the server command line and environment, pure helpers),
:mod:`._servers` (start, watch, stop), :mod:`._venv` and :mod:`._model` (provisioning, cached under
``$KVLEASE_HOME``), :mod:`.cli` (``kvlease stack up|down|status``).

This package never imports vLLM or torch: it drives a separate vLLM venv through subprocesses.
"""

from __future__ import annotations

from kvlease_stack._config import Metrics, StackSpec, default_dtype, parse_prometheus
from kvlease_stack._model import MODEL_SPECS, ensure_model
from kvlease_stack._paths import kvlease_home, venv_python
from kvlease_stack._servers import ServerHandle, Stack, StackError
from kvlease_stack._venv import ProvisionError, ensure_venv

__all__ = [
    "MODEL_SPECS",
    "Metrics",
    "ProvisionError",
    "ServerHandle",
    "Stack",
    "StackError",
    "StackSpec",
    "default_dtype",
    "ensure_model",
    "ensure_venv",
    "kvlease_home",
    "parse_prometheus",
    "venv_python",
]
