"""The public surface of ``kvlease_langchain`` is pinned."""

from __future__ import annotations

import pytest

import kvlease_langchain


def test_public_api_is_pinned() -> None:
    assert kvlease_langchain.__all__ == ["ChatKVLease"]
    from kvlease_langchain._chat_model import ChatKVLease

    assert kvlease_langchain.ChatKVLease is ChatKVLease
    assert ChatKVLease.__module__ == "kvlease_langchain._chat_model"


def test_unknown_attribute() -> None:
    with pytest.raises(AttributeError, match="nope"):
        kvlease_langchain.nope  # noqa: B018
