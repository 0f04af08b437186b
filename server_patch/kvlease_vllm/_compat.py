"""The one module of kvlease that imports vLLM.

Importing it checks the installed vLLM against the supported range (``>=0.32,<0.34``) first and
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
from vllm import envs as vllm_envs  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (  # noqa: E402
    NixlConnector,
    NixlConnectorMetadata,
    NixlKVConnectorStats,
    NixlPullConnectorScheduler,
    NixlPullConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (  # noqa: E402
    NIXL_CONNECTOR_VERSION,
)
from vllm.logger import init_logger  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402


def _nixl_version() -> str | None:
    """The installed NIXL distribution's version (``nixl``, ``nixl-cu12`` or ``nixl-cu13``)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("nixl", "nixl-cu13", "nixl-cu12"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


NIXL_VERSION: str | None = _nixl_version()
PLATFORM_DEVICE_TYPE: str = str(getattr(current_platform, "device_type", ""))

__all__ = [
    "NIXL_CONNECTOR_VERSION",
    "NIXL_VERSION",
    "PLATFORM_DEVICE_TYPE",
    "VLLM_VERSION",
    "KVConnectorRole",
    "NixlConnector",
    "NixlConnectorMetadata",
    "NixlKVConnectorStats",
    "NixlPullConnectorScheduler",
    "NixlPullConnectorWorker",
    "RequestStatus",
    "init_logger",
    "vllm_envs",
]
