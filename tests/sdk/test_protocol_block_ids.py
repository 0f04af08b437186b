"""The handle parser's fast block-id check (``_block_ids``) agrees with the one-id-at-a-time check
(``_block_ids_checked``): same handles, same refusals, for the wire shapes it speeds up and for
everything else."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlease.protocol import KV, ProtocolError, TransferParams
from kvlease.protocol._handle import _block_ids, _block_ids_checked


def _outcome(params: dict[str, Any]) -> object:
    try:
        return _block_ids_checked(params[KV.REMOTE_BLOCK_IDS])
    except ProtocolError as e:
        return ("refused", str(e))


def _ours(params: dict[str, Any]) -> object:
    try:
        return _block_ids(params[KV.REMOTE_BLOCK_IDS])
    except ProtocolError as e:
        return ("refused", str(e))


BASE = {
    KV.DO_REMOTE_PREFILL: True,
    KV.DO_REMOTE_DECODE: False,
    KV.REMOTE_ENGINE_ID: "engine-1",
    KV.REMOTE_REQUEST_ID: "req-1",
    KV.REMOTE_HOST: "127.0.0.1",
    KV.REMOTE_PORT: 5600,
    KV.REMOTE_NUM_TOKENS: 64,
    KV.TP_SIZE: 1,
}

ids = st.one_of(
    st.integers(min_value=-3, max_value=(1 << 31) + 3),
    st.sampled_from([0, 1, (1 << 31) - 1, 1 << 31, -1]),
    st.booleans(),
    st.floats(allow_nan=False, max_value=1e3, min_value=-1e3),
    st.none(),
    st.text(max_size=2),
)
id_lists = st.lists(ids, max_size=6)
block_ids = st.one_of(
    id_lists,
    st.lists(id_lists, max_size=3),
    st.lists(st.one_of(id_lists, ids), max_size=3),
    st.tuples(st.integers(0, 9), st.integers(0, 9)).map(list),
    st.none(),
    st.integers(),
    st.text(max_size=3),
)


@settings(max_examples=400, deadline=None)
@given(block_ids)
def test_same_outcome_as_the_connectors_parser(raw: object) -> None:
    params = {**BASE, KV.REMOTE_BLOCK_IDS: raw}
    assert _ours(params) == _outcome(params)


@pytest.mark.parametrize(
    "raw",
    [
        [[0, 1, 2, 3]],
        [[5, 6], [7, 8]],
        [0, 1, 2],
        [[0, (1 << 31) - 1]],
        [[0, 1 << 31]],
        [[0, -1]],
        [[0, True]],
        [True, 1],
        [[]],
        [],
        [[1], 2],
        [1, [2]],
        ([1, 2],),
        [(1, 2)],
        [[1.0]],
    ],
)
def test_same_outcome_on_the_edges(raw: object) -> None:
    params = {**BASE, KV.REMOTE_BLOCK_IDS: raw}
    assert _ours(params) == _outcome(params)


def test_same_handle_and_wire_dict_for_a_real_shape() -> None:
    params = {**BASE, KV.REMOTE_BLOCK_IDS: [list(range(200))], "vendor_field": {"x": 1}}
    ours = TransferParams.from_json(params)
    assert ours.block_ids == (tuple(range(200)),) and ours.grouped and ours.to_json() == params
    flat = {**BASE, KV.REMOTE_BLOCK_IDS: list(range(50))}
    assert TransferParams.from_json(flat).to_json() == flat
    absent = dict(BASE)
    assert TransferParams.from_json(absent).block_ids is None
