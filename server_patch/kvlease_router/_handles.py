"""The handle parser the router runs on every turn, twice: the connector's own, with the block ids
checked in C-level passes (sans-IO).

:meth:`kvlease.protocol.TransferParams.from_json` checks each block id in a Python generator (an
``isinstance`` pair and a range test per id): with a few hundred ids a handle, that was the largest
cost of the router's turn (P's params on their way to D, D's handle on its way to the store). Here
the common wire shapes (a list of lists of ``int``, or one flat list) are checked with ``map(type,
...)``, ``min`` and ``max``; the rest of the handle goes through ``TransferParams.from_json``
unchanged, its block ids replaced by an empty list, and the checked ids are put back. Anything else
(another container, a ``bool`` or an ``int`` subclass, an id out of range, an empty list, no block
ids at all) is left to ``TransferParams.from_json`` whole, so what is accepted, what is refused and
what comes out are the connector's. ``tests/server_patch/router/test_router_handles.py`` checks
that against the connector's parser.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from kvlease.protocol import KV, LeaseHandleExt, TransferParams

__all__ = ["parse_handle"]

#: The connector's bounds (``kvlease.protocol``): ids in ``[0, 2**31)``, at most ``MAX_BLOCKS`` a list.
_MAX_BLOCK_ID = 1 << 31
_MAX_BLOCKS = LeaseHandleExt.MAX_BLOCKS
_INT = frozenset((int,))


def _ids_ok(ids: list[Any]) -> bool:
    """Every id an exact ``int`` in range (``ids`` not empty, not over the bound)."""
    return (
        len(ids) <= _MAX_BLOCKS and set(map(type, ids)) == _INT and min(ids) >= 0 and max(ids) < _MAX_BLOCK_ID
    )


def _fast_block_ids(raw: object) -> tuple[tuple[tuple[int, ...], ...], bool] | None:
    """(groups, grouped) as the connector's parser gives them, or ``None``: not a common shape
    (the connector's parser decides)."""
    if type(raw) is not list or not raw or len(raw) > _MAX_BLOCKS:
        return None
    if type(raw[0]) is list:  # one list per KV cache group
        if not all(type(g) is list and g and _ids_ok(g) for g in raw):
            return None
        return tuple(map(tuple, raw)), True
    if not _ids_ok(raw):
        return None
    return (tuple(raw),), False


def parse_handle(params: Mapping[str, Any]) -> TransferParams:
    """``TransferParams.from_json(params)`` (same result, same ``ProtocolError``), cheaper."""
    got = _fast_block_ids(params.get(KV.REMOTE_BLOCK_IDS))
    if got is None:
        return TransferParams.from_json(params)
    handle = TransferParams.from_json({**params, KV.REMOTE_BLOCK_IDS: []})
    return replace(handle, block_ids=got[0], grouped=got[1])
