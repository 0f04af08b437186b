"""Block hashes of the ``kvlease`` handle object: chained token-block hashes, the tail hash, the
multimodal digest (re-exported by :mod:`kvlease.protocol._handle` and :mod:`kvlease.protocol`)."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Final

from kvlease.protocol._common import ProtocolError

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


_MM_DOMAIN: Final = b"kvlease/mm/v1"


def mm_digest(features: Sequence[tuple[int, int, str]]) -> str | None:
    """Digest of multimodal features ``(offset, length, identifier)`` (vLLM's ``mm_hash``), or None.

    Order-independent over the features given; ``None`` for none. Two sequences with equal tokens
    and equal digests carry the same images/audio at the same placeholder positions.
    """
    if not features:
        return None
    h = hashlib.sha256(_MM_DOMAIN)
    for offset, length, ident in sorted(features):
        h.update(f"{offset}:{length}:{len(ident)}:".encode() + ident.encode("utf-8", "replace"))
    return h.digest()[:BLOCK_HASH_BYTES].hex()
