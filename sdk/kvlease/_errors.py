"""kvlease's own exception and warning tree.

Errors of other libraries (httpx / httpx2, openai, json) are mapped to these at the boundary where
kvlease itself raises. Errors of calls the *user* makes through the wrapped client are never
mapped: a router error surfaces as the openai exception users already catch.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import TYPE_CHECKING, Final

from kvlease.protocol import InvalidConversationId, ProtocolError

if TYPE_CHECKING:
    from kvlease._strip import HistoryClass

__all__ = [
    "ConfigError",
    "InvalidConversationId",
    "KVLeaseError",
    "KVLeaseWarning",
    "LeaseError",
    "ProtocolError",
    "ReuseOffWarning",
]


class KVLeaseError(Exception):
    """Base class of the errors kvlease raises itself (bad ids raise :class:`InvalidConversationId`,
    a ``ValueError``)."""


class ConfigError(KVLeaseError, ValueError):
    """A setting kvlease cannot accept, found at start-up; the message names the setting.

    The one configuration error of every kvlease package: the SDK, the connector inside vLLM
    (``kv_connector_extra_config``) and the router (flags, config file, what the nodes report)."""


class LeaseError(KVLeaseError):
    """A lease request (renew or release) failed: the router could not be reached, answered with an
    error status or with a malformed body. The keeper logs these; only explicit calls raise them."""

    def __init__(self, message: str, *, status_code: int | None = None, transient: bool = True) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.transient = transient


class KVLeaseWarning(UserWarning):
    """Base category of kvlease warnings (filter with ``warnings.filterwarnings``)."""


class ReuseOffWarning(KVLeaseWarning):
    """The history resent on a turn is not what the model produced (stripped reasoning, edited
    content, changed tool calls, rewritten history): KV reuse was switched off for that turn, or,
    behind a router whose prefill node verifies tokens, limited to the prefix before the change.

    Issued once per kind (``history`` and ``reuse_off``) per client, attributed to the code that
    made the call; the message names the cause and the fix, not the conversation: that is
    :attr:`conversation_id` (every conversation also gets one record on the ``kvlease`` logger).
    """

    def __init__(
        self,
        message: str,
        *,
        conversation_id: str | None = None,
        history: HistoryClass | None = None,
        reuse_off: bool = True,
    ) -> None:
        super().__init__(message)
        self.conversation_id = conversation_id
        self.history = history
        self.reuse_off = reuse_off


#: Packages whose frames lie between the user's call and kvlease's transport.
_LIBRARIES: Final = (
    "kvlease",
    "kvlease_langchain",
    "openai",
    "httpx",
    "httpx2",
    "httpcore",
    "anyio",
    "langchain_core",
    "langchain_openai",
)


def _library_dirs() -> tuple[str, ...]:
    dirs = []
    for name in _LIBRARIES:
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None)
        if isinstance(file, str):
            dirs.append(os.path.dirname(file) + os.sep)
    return tuple(dirs)


def warn_at_caller(warning: Warning) -> None:
    """``warnings.warn(warning)`` attributed to the first frame outside kvlease and the libraries it
    runs under (openai, the HTTP client, LangChain): the user's call, not kvlease's transport."""
    dirs = _library_dirs()
    frame = sys._getframe(1)
    level = 2  # warn's stacklevel of our caller's frame
    while frame is not None and frame.f_code.co_filename.startswith(dirs):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    warnings.warn(warning, stacklevel=level)
