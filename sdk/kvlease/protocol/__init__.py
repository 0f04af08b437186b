"""The kvlease wire contract: the single source of truth.

Every header, body field, status value, path and JSON shape that crosses a process boundary between
the SDK, the router and the vLLM connector is spelled here and nowhere else. This module has no
dependencies beyond the standard library, so the connector (inside vLLM) and the router import it
without pulling in the SDK's HTTP stack.

Shapes are frozen dataclasses with ``to_json()`` / ``from_json()``; untrusted ``dict[str, Any]`` is
parsed once, here, at the edge, and anything malformed raises :class:`ProtocolError` (a
``ValueError``) with a message that names the field.

The contract is split by concern, and every name is re-exported here: ``_api`` (identity, headers,
statuses, the lease API), ``_handle`` (``kv_transfer_params`` and the kvlease sub-object with its
hashes and MAC), ``_control`` (the connector's control endpoint), ``_turnlog`` (the turn log) and
``_common`` (version, errors, field readers).
"""

from __future__ import annotations

from kvlease.protocol._api import (
    BODY_CONVERSATION_ID,
    BODY_PROMPT_CACHE_KEY,
    CHAT_COMPLETIONS_PATH,
    COMPLETIONS_PATH,
    CONVERSATION_ID_MAX_LEN,
    CONVERSATION_ID_PATTERN,
    CONVERSATIONS_PATH,
    DEFAULT_TENANT_HEADER,
    HEADER_CONVERSATION_ID,
    HEADER_REUSE,
    HEADER_REUSED_TOKENS,
    HEADER_SESSION_ID,
    HEADER_STATUS,
    HEADER_TTL,
    HEALTH_PATH,
    LEASE_UNKNOWN,
    METRICS_PATH,
    RENEW_PATH,
    RESPONSE_HEADERS,
    REUSE_OFF,
    STATUS_PATH,
    RenewRequest,
    RenewResponse,
    ReuseStatus,
    conversation_path,
    validate_conversation_id,
)
from kvlease.protocol._common import (  # noqa: F401
    PROTOCOL_VERSION,
    RENEW_MAX_IDS,
    InvalidConversationId,
    ProtocolError,
    _id_list,
    _int_field,
    _is_number,
    header_lookup,
)
from kvlease.protocol._control import (
    CONTROL_AUTH_HEADER,
    CONTROL_INFO_PATH,
    CONTROL_METRICS_PATH,
    CONTROL_RELEASE_PATH,
    CONTROL_RENEW_PATH,
    CONTROL_SECRET_ENV,
    ControlInfo,
    ControlReleaseRequest,
    ControlRenewRequest,
    ControlRenewResponse,
    Role,
)
from kvlease.protocol._handle import (  # noqa: F401
    _HASH_DOMAIN,
    _TAIL_TAG,
    BLOCK_HASH_BYTES,
    CACHE_SALT,
    KV,
    KV_TRANSFER_PARAMS,
    LEASE_HANDLE_MAC,
    PREFILL_REUSE_STATUS,
    PREFILL_REUSED_TOKENS,
    LeaseHandleExt,
    _hash_seed,
    block_hashes,
    common_prefix_blocks,
    prefill_request_params,
    tail_hash,
)
from kvlease.protocol._turnlog import (
    TURN_LOG_FIELDS,
    TurnLogRecord,
)

__all__ = [
    "BLOCK_HASH_BYTES",
    "BODY_CONVERSATION_ID",
    "BODY_PROMPT_CACHE_KEY",
    "CACHE_SALT",
    "CHAT_COMPLETIONS_PATH",
    "COMPLETIONS_PATH",
    "CONTROL_AUTH_HEADER",
    "CONTROL_INFO_PATH",
    "CONTROL_METRICS_PATH",
    "CONTROL_RELEASE_PATH",
    "CONTROL_RENEW_PATH",
    "CONTROL_SECRET_ENV",
    "CONVERSATIONS_PATH",
    "CONVERSATION_ID_MAX_LEN",
    "CONVERSATION_ID_PATTERN",
    "DEFAULT_TENANT_HEADER",
    "HEADER_CONVERSATION_ID",
    "HEADER_REUSE",
    "HEADER_REUSED_TOKENS",
    "HEADER_SESSION_ID",
    "HEADER_STATUS",
    "HEADER_TTL",
    "HEALTH_PATH",
    "KV",
    "KV_TRANSFER_PARAMS",
    "LEASE_HANDLE_MAC",
    "LEASE_UNKNOWN",
    "METRICS_PATH",
    "PREFILL_REUSED_TOKENS",
    "PREFILL_REUSE_STATUS",
    "PROTOCOL_VERSION",
    "RENEW_MAX_IDS",
    "RENEW_PATH",
    "RESPONSE_HEADERS",
    "REUSE_OFF",
    "STATUS_PATH",
    "TURN_LOG_FIELDS",
    "ControlInfo",
    "ControlReleaseRequest",
    "ControlRenewRequest",
    "ControlRenewResponse",
    "InvalidConversationId",
    "LeaseHandleExt",
    "ProtocolError",
    "RenewRequest",
    "RenewResponse",
    "ReuseStatus",
    "Role",
    "TurnLogRecord",
    "block_hashes",
    "common_prefix_blocks",
    "conversation_path",
    "header_lookup",
    "prefill_request_params",
    "tail_hash",
    "validate_conversation_id",
]
