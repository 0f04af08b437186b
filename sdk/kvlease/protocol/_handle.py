"""Router <-> vLLM: vLLM's ``kv_transfer_params`` and the kvlease sub-object (hashes, MAC)."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from kvlease.protocol._common import PROTOCOL_VERSION, ProtocolError, _int_field

# --------------------------------------------------------------------------------------------------
# Router -> vLLM: vLLM's own P/D protocol (kv_transfer_params) plus the kvlease sub-object
# --------------------------------------------------------------------------------------------------

KV_TRANSFER_PARAMS: Final = "kv_transfer_params"
CACHE_SALT: Final = "cache_salt"


class KV:
    """Field names inside vLLM's ``kv_transfer_params`` (NixlConnector, vLLM 0.32)."""

    DO_REMOTE_DECODE: Final = "do_remote_decode"
    DO_REMOTE_PREFILL: Final = "do_remote_prefill"
    REMOTE_ENGINE_ID: Final = "remote_engine_id"
    REMOTE_BLOCK_IDS: Final = "remote_block_ids"
    REMOTE_REQUEST_ID: Final = "remote_request_id"
    REMOTE_HOST: Final = "remote_host"
    REMOTE_PORT: Final = "remote_port"
    REMOTE_NUM_TOKENS: Final = "remote_num_tokens"
    REMOTE_BLOCKS_EXPIRY_TIME: Final = "remote_blocks_expiry_time"
    TP_SIZE: Final = "tp_size"
    KVLEASE: Final = "kvlease"  # the sub-object the kvlease connector adds and reads


#: Keys of the ``kvlease`` sub-object of *P's* response params: what P's verified pull did on this
#: turn, so the router can report it. ``reused_tokens``: prompt tokens taken from D's blocks (0 if
#: none); ``reuse``: a :class:`ReuseStatus` value (``hit``, ``miss``, ``mismatch``, ``expired``).
PREFILL_REUSED_TOKENS: Final = "reused_tokens"
PREFILL_REUSE_STATUS: Final = "reuse"


def prefill_request_params() -> dict[str, Any]:
    """The ``kv_transfer_params`` a router sends to P on a turn with no handle to reuse."""
    return {
        KV.DO_REMOTE_DECODE: True,
        KV.DO_REMOTE_PREFILL: False,
        KV.REMOTE_ENGINE_ID: None,
        KV.REMOTE_BLOCK_IDS: None,
        KV.REMOTE_HOST: None,
        KV.REMOTE_PORT: None,
    }


#: Domain separation for block hashes; bump with PROTOCOL_VERSION if the scheme changes.
_HASH_DOMAIN: Final = b"kvlease/block-hash/v1"
BLOCK_HASH_BYTES: Final = 16


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[str]:
    """Chained hashes of the *full* blocks of ``token_ids`` (a partial last block is not hashed).

    ``h[i] = sha256(h[i-1] || int32le(tokens of block i))[:16]`` with ``h[-1] = sha256(domain ||
    salt)``. Equal hash at index ``i`` means equal tokens in blocks ``0..i`` (up to SHA-256
    collisions), so the longest common prefix of two hash lists is the longest common token prefix
    in whole blocks. ``cache_salt`` seeds the chain, so two tenants' blocks never match.
    """
    if block_size <= 0:
        raise ProtocolError("block_size must be positive")
    parent = _hash_seed(salt)
    out: list[str] = []
    n_full = len(token_ids) // block_size
    for i in range(n_full):
        chunk = array("i", token_ids[i * block_size : (i + 1) * block_size]).tobytes()
        parent = hashlib.sha256(parent + chunk).digest()[:BLOCK_HASH_BYTES]
        out.append(parent.hex())
    return out


def _hash_seed(salt: str | None) -> bytes:
    return hashlib.sha256(_HASH_DOMAIN + b"\x00" + (salt or "").encode("utf-8")).digest()[:BLOCK_HASH_BYTES]


def tail_hash(tail_token_ids: Sequence[int], parent: str | None, salt: str | None = None) -> str:
    """Hash of a *partial* last block, chained on the hash of the last full block before it.

    ``parent`` is that full block's hash (hex), or ``None`` when the sequence is shorter than one
    block (the chain's salted seed is used). A tag keeps it apart from full-block hashes, so equal
    tails mean equal tokens up to the very last one D computed: P may then pull the partial block
    too instead of recomputing up to ``block_size - 1`` tokens.
    """
    base = _hash_seed(salt) if parent is None else bytes.fromhex(parent)
    chunk = array("i", tail_token_ids).tobytes()
    return hashlib.sha256(base + _TAIL_TAG + chunk).digest()[:BLOCK_HASH_BYTES].hex()


_TAIL_TAG: Final = b"\x01tail"


def common_prefix_blocks(ours: Sequence[str], theirs: Sequence[str]) -> int:
    """Number of leading blocks whose chained hashes agree."""
    n = 0
    for a, b in zip(ours, theirs):
        if a != b:
            break
        n += 1
    return n


#: Key of an HMAC-SHA256 (hex) that D adds to its ``kvlease`` object when its control secret is set:
#: over the handle's routing fields and the rest of the ``kvlease`` object, keyed by the shared
#: control secret. P refuses a handle whose MAC is missing or wrong (a client edited it).
LEASE_HANDLE_MAC: Final = "mac"


@dataclass(frozen=True)
class LeaseHandleExt:
    """The ``kvlease`` sub-object of D's ``kv_transfer_params``.

    JSON: ``{"v": 1, "block_size": 16, "num_tokens": 1234, "hashes": ["<32 hex>", ...],
    "tail": "<32 hex>" | null, "lease_id": "<D's request id>", "engine_id": "...",
    "control": "http://host:port" | null}``.
    ``hashes`` cover the full blocks of D's retained sequence (prompt + generated tokens); ``tail``
    (optional, :func:`tail_hash`) its partial last block, when ``num_tokens`` is not a multiple of
    ``block_size``. A reader that does not know ``tail`` simply pulls whole blocks only.
    """

    block_size: int
    num_tokens: int
    hashes: tuple[str, ...]
    lease_id: str
    engine_id: str | None = None
    control: str | None = None
    version: int = PROTOCOL_VERSION
    tail: str | None = None

    MAX_BLOCKS: Final = 1 << 20

    def to_json(self) -> dict[str, Any]:
        return {
            "v": self.version,
            "block_size": self.block_size,
            "num_tokens": self.num_tokens,
            "hashes": list(self.hashes),
            "tail": self.tail,
            "lease_id": self.lease_id,
            "engine_id": self.engine_id,
            "control": self.control,
        }

    @classmethod
    def from_json(cls, data: object) -> LeaseHandleExt:
        if not isinstance(data, Mapping):
            raise ProtocolError("kvlease must be an object")
        version = data.get("v")
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"kvlease.v is {version!r}; this build speaks {PROTOCOL_VERSION}")
        bs = _int_field(data, "block_size", 1, 1 << 16)
        nt = _int_field(data, "num_tokens", 0, 1 << 31)
        hashes = data.get("hashes")
        if not isinstance(hashes, list) or len(hashes) > cls.MAX_BLOCKS:
            raise ProtocolError("kvlease.hashes must be a list of hex strings")
        for h in hashes:
            if not isinstance(h, str) or len(h) != 2 * BLOCK_HASH_BYTES:
                raise ProtocolError("kvlease.hashes must be a list of 32-character hex strings")
        if len(hashes) > nt // bs:
            raise ProtocolError("kvlease.hashes covers more blocks than num_tokens")
        tail = data.get("tail")
        if tail is not None and (
            not isinstance(tail, str) or len(tail) != 2 * BLOCK_HASH_BYTES or nt % bs == 0
        ):
            raise ProtocolError("kvlease.tail must be null or a 32-character hex string (partial block only)")
        lease_id = data.get("lease_id")
        if not isinstance(lease_id, str) or not lease_id or len(lease_id) > 512:
            raise ProtocolError("kvlease.lease_id must be a non-empty string")
        engine_id = data.get("engine_id")
        control = data.get("control")
        return cls(
            block_size=bs,
            num_tokens=nt,
            hashes=tuple(hashes),
            lease_id=lease_id,
            engine_id=engine_id if isinstance(engine_id, str) else None,
            control=control if isinstance(control, str) else None,
            version=PROTOCOL_VERSION,
            tail=tail,
        )
