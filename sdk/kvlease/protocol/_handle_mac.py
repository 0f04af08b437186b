"""The MAC of a handle: D signs its ``kv_transfer_params`` with the shared control secret, P refuses
a handle whose MAC is missing or wrong (a client edited it). See :data:`LEASE_HANDLE_MAC`."""

from __future__ import annotations

import hmac
import json
from collections.abc import Mapping
from typing import Any, Final

from kvlease.protocol._handle import KV, LEASE_HANDLE_MAC, PARALLEL_FIELDS, TransferParams

#: Fields the MAC covers: the routing fields, and (separately) the kvlease object minus the MAC.
_MAC_FIELDS: Final = (
    KV.REMOTE_ENGINE_ID,
    KV.REMOTE_REQUEST_ID,
    KV.REMOTE_HOST,
    KV.REMOTE_PORT,
    KV.REMOTE_BLOCK_IDS,
    KV.REMOTE_NUM_TOKENS,
    *PARALLEL_FIELDS,
)
#: Covered only when present (so handles of a vLLM without them keep their MAC): D's block size,
#: and vLLM 0.33's registration generation (which tells P's worker to re-handshake after a sleep).
_MAC_FIELDS_IF_PRESENT: Final = (KV.REMOTE_BLOCK_SIZE, KV.REMOTE_REGISTRATION_GENERATION)


def handle_mac(secret: str, params: Mapping[str, Any] | TransferParams) -> str:
    """HMAC-SHA256 over a handle's routing fields and its ``kvlease`` object (minus the MAC).

    Over the wire dict as sent (a reader checks the dict it received, so any edit of a covered
    field fails, even one that parses to the same value); the deadline is not covered.
    """
    wire = params.to_json() if isinstance(params, TransferParams) else params
    ext = wire.get(KV.KVLEASE)
    body = {k: wire.get(k) for k in _MAC_FIELDS}
    body.update({k: wire[k] for k in _MAC_FIELDS_IF_PRESENT if k in wire})
    body[KV.KVLEASE] = (
        {k: v for k, v in ext.items() if k != LEASE_HANDLE_MAC} if isinstance(ext, Mapping) else ext
    )
    msg = json.dumps(body, sort_keys=True, separators=(",", ":"), default=list).encode()
    return hmac.new(secret.encode(), msg, "sha256").hexdigest()


def mac_ok(secret: str, params: Mapping[str, Any]) -> bool:
    """The wire handle ``params`` carries D's MAC, and it is right (constant-time compare)."""
    ext = params.get(KV.KVLEASE)
    mac = ext.get(LEASE_HANDLE_MAC) if isinstance(ext, Mapping) else None
    return isinstance(mac, str) and hmac.compare_digest(mac, handle_mac(secret, params))
