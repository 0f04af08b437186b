"""Which kvlease conversation a LangChain call belongs to.

Pure functions, no LangChain imports: the chat model resolves the id of every call with
:func:`resolve_conversation_id` from, first found wins,

1. a per-call ``conversation_id=...`` keyword (``model.invoke(msgs, conversation_id="c1")``),
2. the model's ``conversation_id`` field,
3. ``configurable.thread_id`` of the ``RunnableConfig`` (LangGraph threads, ``invoke(..., config=...)``),
4. the id minted once per model instance.

A LangGraph thread id may hold characters a conversation id may not (the wire contract allows
1-128 characters of ``[A-Za-z0-9._:-]``); such ids are mapped to a stable digest, so the same
thread always lands on the same conversation.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping
from typing import Any

from kvlease.protocol import InvalidConversationId, validate_conversation_id

#: ``RunnableConfig["configurable"]`` key that LangGraph uses for its threads.
THREAD_ID_KEY = "thread_id"

#: Prefix of ids derived from thread ids that are not valid conversation ids as they are.
THREAD_DIGEST_PREFIX = "thread-"

#: Prefix of ids minted for a model instance.
MINTED_PREFIX = "lc-"


def mint_conversation_id() -> str:
    """A fresh random conversation id (``lc-`` and 24 hex digits)."""
    return MINTED_PREFIX + secrets.token_hex(12)


def conversation_id_for_thread(thread_id: object) -> str | None:
    """The conversation id for a LangGraph thread id, or ``None`` when there is none.

    Valid conversation ids pass unchanged; other non-empty strings (and ints) map to
    ``thread-<sha256 prefix>``, which is stable across processes.
    """
    if thread_id is None or isinstance(thread_id, bool):
        return None
    if not isinstance(thread_id, (str, int)):
        return None
    text = str(thread_id)
    if not text:
        return None
    try:
        return validate_conversation_id(text)
    except InvalidConversationId:
        return THREAD_DIGEST_PREFIX + hashlib.sha256(text.encode("utf-8")).hexdigest()[:40]


def thread_conversation_id(config: Mapping[str, Any] | None) -> str | None:
    """The conversation id carried by a ``RunnableConfig`` (its ``configurable.thread_id``)."""
    if not config:
        return None
    configurable = config.get("configurable")
    if not isinstance(configurable, Mapping):
        return None
    return conversation_id_for_thread(configurable.get(THREAD_ID_KEY))


def resolve_conversation_id(
    *,
    per_call: object = None,
    field: str | None = None,
    config: Mapping[str, Any] | None = None,
    minted: str,
) -> str:
    """The conversation id of one call; raises :class:`InvalidConversationId` for a bad explicit id."""
    if per_call is not None:
        return validate_conversation_id(per_call)
    if field is not None:
        return field
    return thread_conversation_id(config) or minted
