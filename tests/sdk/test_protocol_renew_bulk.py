"""The renew body's bulk paths agree with the one-id-at-a-time ones (issue 15: renew at bounded
cost): ``RenewRequest.from_json`` checks 10,000 ids in a few C passes (``_valid_ids``) and must
accept and refuse exactly what :func:`validate_conversation_id` of each would, and
``RenewResponse.dumps`` joins the ids of an all-alike answer and must give the bytes
``orjson.dumps(to_json())`` gives, for every answer."""

from __future__ import annotations

import math

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlease.protocol import (
    CONVERSATION_ID_MAX_LEN,
    InvalidConversationId,
    ProtocolError,
    RenewRequest,
    RenewResponse,
    validate_conversation_id,
)
from kvlease.protocol._api import _valid_ids

_ALPHABET = "abcXYZ019._:-"
#: Ids: mostly valid, and each way one can be invalid (a newline, a space, a non-ASCII or lone
#: surrogate character, empty, too long), and things that are not strings at all.
_ITEMS = st.one_of(
    st.text(_ALPHABET, min_size=1, max_size=12),
    st.text(_ALPHABET + "\n \x00é\udcff/", max_size=12),
    st.just("a" * CONVERSATION_ID_MAX_LEN),
    st.just("a" * (CONVERSATION_ID_MAX_LEN + 1)),
    st.none(),
    st.integers(),
    st.lists(st.text(_ALPHABET, max_size=3), max_size=2),
)


def _each_valid(ids: list[object]) -> bool:
    try:
        for i in ids:
            validate_conversation_id(i)
    except InvalidConversationId:
        return False
    return True


@settings(max_examples=400, deadline=None)
@given(st.lists(_ITEMS, max_size=8))
def test_the_bulk_id_check_agrees_with_the_check_of_each(ids: list[object]) -> None:
    assert _valid_ids(ids) is _each_valid(ids)
    try:
        got: object = RenewRequest.from_json({"conversation_ids": ids}).conversation_ids
    except ProtocolError:
        got = "refused"
    assert got == (tuple(ids) if _each_valid(ids) else "refused")


@pytest.mark.parametrize(
    "ids",
    [
        ["a\nb"],  # a newline inside one id: one separator too many
        ["a", "", "b"],
        ["", ""],
        ["a" * 129],
        ["ok", "é"],
        ["ok", "\udcff"],
        ["ok", 7],
        ["ok\n"],
    ],
)
def test_each_way_an_id_is_invalid_is_refused_in_bulk(ids: list[object]) -> None:
    assert not _valid_ids(ids)
    with pytest.raises(ProtocolError):
        RenewRequest.from_json({"conversation_ids": ids})


_LEASE = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=False, width=64), st.just(-0.0))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.text(_ALPHABET + '"\\\n é', min_size=1, max_size=10), max_size=6, unique=True),
    st.lists(_LEASE, min_size=1, max_size=3),
    st.one_of(st.none(), st.floats(min_value=0, max_value=1e6)),
    st.booleans(),
)
def test_the_joined_answer_is_byte_for_byte_orjsons(
    ids: list[str], values: list[float | None], ttl: float | None, alike: bool
) -> None:
    leases = {cid: values[0] if alike else values[i % len(values)] for i, cid in enumerate(ids)}
    resp = RenewResponse(leases, ttl)
    assert resp.dumps() == orjson.dumps(resp.to_json())


def test_a_keepers_answer_is_joined_and_reads_back() -> None:
    ids = [f"conv-{i:06d}" for i in range(10_000)]
    for lease in (291.5, None, math.pi):
        resp = RenewResponse(dict.fromkeys(ids, lease), 300.0)
        raw = resp.dumps()
        assert raw == orjson.dumps(resp.to_json())
        back = RenewResponse.from_json(orjson.loads(raw))
        assert list(back.leases) == ids and set(back.leases.values()) == {
            None if lease is None else round(lease, 3)
        }
