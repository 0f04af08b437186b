"""kvlease_vllm: the kvlease vLLM connector, the vLLM plugin and the router.

Importing this package does not import vLLM: the connector module (``kvlease_vllm.connector``) is
loaded by vLLM itself through ``kv_connector_module_path``, and the router runs without vLLM.
"""

from __future__ import annotations

__all__: list[str] = []
