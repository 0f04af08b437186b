"""langchain-tests' standard unit suite for ``ChatKVLease``, with sockets disabled (pytest-socket).

Nothing here reaches a server: the suite checks construction, standard params, tool binding and
structured-output wiring. The same capabilities are exercised for real in
``tests/integration/test_langchain_standard.py``.

The suite skips exactly one test, ``test_serdes``, because ``ChatKVLease`` is not
``is_lc_serializable``: langchain-core 1.x only revives classes on its own allowlist
(``langchain_core.load.mapping``), so a third-party model cannot round-trip through ``load`` anyway,
and a serialized model would carry no conversation state.
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_tests.unit_tests import ChatModelUnitTests

from kvlease_langchain import ChatKVLease

# Nothing is served on port 9 (discard): a request that slipped through would fail loudly, and the
# socket guard stops it before that anyway.
UNREACHABLE = "http://127.0.0.1:9/v1"


@pytest.mark.disable_socket
class TestChatKVLeaseStandardUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatKVLease]:
        return ChatKVLease

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # heartbeat off: construction-only tests need no background keeper
        return {"model": "tiny", "base_url": UNREACHABLE, "heartbeat": False}

    @property
    def init_from_env_params(self) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
        return (
            {"KVLEASE_BASE_URL": UNREACHABLE, "KVLEASE_API_KEY": "sk-env"},
            {"model": "tiny", "heartbeat": False},
            {"openai_api_base": UNREACHABLE, "openai_api_key": "sk-env"},
        )

    # Tool calling and structured output are wired exactly as in ChatOpenAI (bind_tools /
    # with_structured_output are inherited); vLLM serves both (tools need a tool parser on the server).
    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True
