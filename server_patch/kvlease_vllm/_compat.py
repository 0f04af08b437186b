"""The one module of kvlease that imports vLLM.

Importing it checks the installed vLLM against the supported range (``>=0.32,<0.33``) first and
raises :class:`~kvlease_vllm._config.UnsupportedVLLMVersion` with a clear message outside it, so a
server with an unsupported vLLM fails at start instead of misbehaving on the first pull.
"""

from __future__ import annotations

from kvlease_vllm._config import UnsupportedVLLMVersion, check_vllm_version

try:
    import vllm
except ImportError as e:  # pragma: no cover - only without vLLM
    raise UnsupportedVLLMVersion(
        "kvlease: KVLeaseConnector runs inside vLLM, which is not installed in this environment"
    ) from e

VLLM_VERSION: str = str(getattr(vllm, "__version__", ""))
check_vllm_version(VLLM_VERSION)

# Imports below are the whole vLLM surface kvlease touches; keep them here.
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (  # noqa: E402
    NixlConnector,
    NixlConnectorMetadata,
    NixlPullConnectorScheduler,
)
from vllm.logger import init_logger  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

__all__ = [
    "VLLM_VERSION",
    "KVConnectorRole",
    "NixlConnector",
    "NixlConnectorMetadata",
    "NixlPullConnectorScheduler",
    "RequestStatus",
    "init_logger",
]
