"""kvlease's own exception and warning tree.

Errors of other libraries (httpx / httpx2, openai, json) are mapped to these at the boundary where
kvlease itself raises. Errors of calls the *user* makes through the wrapped client are never
mapped: a router error surfaces as the openai exception users already catch.
"""

from __future__ import annotations

from kvlease.protocol import InvalidConversationId, ProtocolError

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
    content, changed tool calls, rewritten history): KV reuse was switched off for that turn.
    Issued once per conversation; the message names the cause and the fix."""
