"""Which conversation a call belongs to: table-driven tests of the pure resolution rules."""

from __future__ import annotations

import hashlib

import pytest

from kvlease.protocol import InvalidConversationId, validate_conversation_id
from kvlease_langchain._conversation import (
    conversation_id_for_thread,
    mint_conversation_id,
    resolve_conversation_id,
    thread_conversation_id,
)

DIGEST = "thread-" + hashlib.sha256(b"user 42's chat").hexdigest()[:40]


@pytest.mark.parametrize(
    ("thread_id", "expected"),
    [
        ("t1", "t1"),
        ("3f2a-uuid-like:ns.x_y", "3f2a-uuid-like:ns.x_y"),
        (42, "42"),
        ("user 42's chat", DIGEST),  # invalid characters: stable digest
        ("x" * 129, "thread-" + hashlib.sha256(b"x" * 129).hexdigest()[:40]),  # too long
        ("", None),
        (None, None),
        (True, None),
        (["t1"], None),
    ],
)
def test_conversation_id_for_thread(thread_id: object, expected: str | None) -> None:
    got = conversation_id_for_thread(thread_id)
    assert got == expected
    if got is not None:
        assert validate_conversation_id(got) == got


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (None, None),
        ({}, None),
        ({"configurable": None}, None),
        ({"configurable": {"thread_id": "t1"}}, "t1"),
        ({"configurable": {"user_id": "u"}}, None),
        ({"metadata": {"thread_id": "t1"}}, None),  # only configurable counts
    ],
)
def test_thread_conversation_id(config: dict | None, expected: str | None) -> None:
    assert thread_conversation_id(config) == expected


THREAD = {"configurable": {"thread_id": "thread-a"}}


@pytest.mark.parametrize(
    ("per_call", "field", "config", "expected"),
    [
        ("call-1", "field-1", THREAD, "call-1"),  # per-call keyword first
        (None, "field-1", THREAD, "field-1"),  # then the model's field
        (None, None, THREAD, "thread-a"),  # then the thread id
        (None, None, {"configurable": {}}, "minted"),  # else the minted id
        (None, None, None, "minted"),
    ],
)
def test_resolution_order(
    per_call: str | None, field: str | None, config: dict | None, expected: str
) -> None:
    assert resolve_conversation_id(per_call=per_call, field=field, config=config, minted="minted") == expected


@pytest.mark.parametrize("bad", ["", "a b", "x" * 129, 7])
def test_explicit_bad_id_is_an_error(bad: object) -> None:
    with pytest.raises(InvalidConversationId):
        resolve_conversation_id(per_call=bad, field=None, config=None, minted="m")


def test_minted_ids_are_valid_and_distinct() -> None:
    ids = {mint_conversation_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(validate_conversation_id(i) == i and i.startswith("lc-") for i in ids)
