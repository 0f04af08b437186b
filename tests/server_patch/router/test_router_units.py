"""Sans-IO cores, table-driven: offer decision, P's report, continuity, identity, miss-rate watchdog."""

from __future__ import annotations

from typing import Any

import pytest

from kvlease.protocol import ReuseStatus
from kvlease_router import ConversationRecord, MissRateMonitor
from kvlease_router._continuity import (
    chat_continuity,
    chat_extends,
    completion_continuity,
    completion_extends,
)
from kvlease_router._identity import IdentityError, Keyer, conversation_id_from, tenant_from
from kvlease_router._reuse import capture_handle, decide_offer, judge_prefill, strip_params

NOW = 1000.0
HANDLE = {
    "remote_block_ids": [1],
    "remote_engine_id": "d",
    "do_remote_decode": True,
    "do_remote_prefill": False,
}


def st(params: Any = HANDLE, expires_at: float = NOW + 10) -> ConversationRecord:
    return ConversationRecord("http://d", params, "lease", None, 48, expires_at)


@pytest.mark.parametrize(
    ("state", "opted_out", "enabled", "healthy", "cont", "want", "offered"),
    [
        (st(), True, True, True, None, ReuseStatus.DISABLED, False),
        (st(), False, False, True, None, ReuseStatus.DISABLED, False),
        (None, False, True, True, None, ReuseStatus.FIRST, False),
        (st(expires_at=NOW), False, True, True, None, ReuseStatus.EXPIRED, False),
        (st(params=None), False, True, True, None, ReuseStatus.MISS, False),
        (st(), False, True, False, None, ReuseStatus.MISS, False),
        (st(), False, True, True, False, ReuseStatus.MISMATCH, False),
        (st(), False, True, True, True, ReuseStatus.HIT, True),
        (st(), False, True, True, None, ReuseStatus.HIT, True),
    ],
)
def test_decide_offer(
    state: Any, opted_out: bool, enabled: bool, healthy: bool, cont: Any, want: ReuseStatus, offered: bool
) -> None:
    offer = decide_offer(
        state, NOW, opted_out=opted_out, reuse_enabled=enabled, decode_healthy=healthy, continuity_ok=cont
    )
    assert offer.status is want and (offer.handle is not None) == offered
    if offer.handle is not None:
        assert offer.handle["do_remote_decode"] is True and offer.handle is not HANDLE


@pytest.mark.parametrize(
    ("p_body", "offered", "want"),
    [
        (
            {"kv_transfer_params": {"kvlease": {"reused_tokens": 64, "reuse": "hit"}}},
            100,
            (ReuseStatus.HIT, 64),
        ),
        (
            {"kv_transfer_params": {"kvlease": {"reused_tokens": 0, "reuse": "mismatch"}}},
            100,
            (ReuseStatus.MISMATCH, 0),
        ),
        (
            {"kv_transfer_params": {"kvlease": {"reused_tokens": 0, "reuse": "expired"}}},
            100,
            (ReuseStatus.EXPIRED, 0),
        ),
        (
            {"kv_transfer_params": {"kvlease": {"reused_tokens": 0, "reuse": "weird"}}},
            100,
            (ReuseStatus.MISS, 0),
        ),
        ({"kv_transfer_params": {"kvlease": {"reused_tokens": 0}}}, 100, (ReuseStatus.MISS, 0)),
        (
            {"usage": {"prompt_tokens": 90, "prompt_tokens_details": {"cached_tokens": 80}}},
            100,
            (ReuseStatus.HIT, 80),
        ),
        (
            {"usage": {"prompt_tokens": 90, "prompt_tokens_details": {"cached_tokens": 0}}},
            100,
            (ReuseStatus.MISS, 0),
        ),
        ({"usage": {"prompt_tokens": 90}}, 100, (ReuseStatus.HIT, 89)),
        ({"usage": {"prompt_tokens": 200}}, 100, (ReuseStatus.HIT, 100)),
        ({}, 100, (ReuseStatus.HIT, 100)),
        (
            {"kv_transfer_params": {"kvlease": {"reused_tokens": True}}, "usage": "junk"},
            7,
            (ReuseStatus.HIT, 7),
        ),
    ],
)
def test_judge_prefill(p_body: dict[str, Any], offered: int, want: tuple[ReuseStatus, int]) -> None:
    assert judge_prefill(p_body, offered) == want


@pytest.mark.parametrize(
    ("params", "kvlease", "ok"),
    [
        (None, False, False),
        ("junk", False, False),
        ({"remote_block_ids": [], "remote_engine_id": "d"}, False, False),
        ({"remote_block_ids": [1], "remote_engine_id": 5}, False, False),
        (
            {
                "remote_block_ids": [1],
                "remote_engine_id": "d",
                "remote_request_id": "r",
                "remote_num_tokens": 20,
            },
            False,
            True,
        ),
        (
            {"remote_block_ids": [1], "remote_engine_id": "d"},
            True,
            False,
        ),  # kvlease mode needs verified hashes
        (
            {
                "remote_block_ids": [1],
                "remote_engine_id": "d",
                "kvlease": {
                    "v": 1,
                    "block_size": 16,
                    "num_tokens": 16,
                    "hashes": ["0" * 32],
                    "lease_id": "L",
                },
            },
            True,
            True,
        ),
    ],
)
def test_capture_handle(params: Any, kvlease: bool, ok: bool) -> None:
    cap = capture_handle(params, kvlease_mode=kvlease, node_control="http://c")
    assert (cap is not None) == ok
    if cap is not None and kvlease:
        assert cap.lease_id == "L" and cap.control == "http://c" and cap.tokens == 16


def test_strip_params_any_depth() -> None:
    obj = {
        "kv_transfer_params": {"a": 1},
        "choices": [{"kv_transfer_params": None, "x": [{"kv_transfer_params": 2}]}],
    }
    assert strip_params(obj) in ({"a": 1}, 2)
    assert "kv_transfer_params" not in repr(obj)


MSGS = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
ANSWER = {"role": "assistant", "content": "a", "tool_calls": [], "reasoning_content": None, "refusal": None}


@pytest.mark.parametrize(
    ("new", "ok"),
    [
        ([*MSGS, {"role": "assistant", "content": "a"}, {"role": "user", "content": "n"}], True),
        (
            [*MSGS, {"role": "assistant", "content": "a", "name": None}, {"role": "user", "content": "n"}],
            True,
        ),
        ([*MSGS, {"role": "assistant", "content": "a "}, {"role": "user", "content": "n"}], False),
        ([*MSGS, {"role": "assistant", "content": "a"}], False),  # nothing new
        ([MSGS[1], {"role": "assistant", "content": "a"}, {"role": "user", "content": "n"}], False),
        ("not a list", False),
        ([*MSGS, "junk", {"role": "user", "content": "n"}], False),
    ],
)
def test_chat_continuity(new: Any, ok: bool) -> None:
    held = chat_continuity(MSGS, ANSWER)
    assert held is not None and held.prefix_len == 3
    assert chat_extends(new, held) is ok


def test_chat_continuity_refuses_answers_with_reasoning_and_junk() -> None:
    assert chat_continuity(MSGS, {**ANSWER, "reasoning_content": "thinking"}) is None
    assert chat_continuity("x", ANSWER) is None
    assert chat_continuity([object()], ANSWER) is None


def test_tool_call_continuity() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    held = chat_continuity(MSGS, {"role": "assistant", "content": None, "tool_calls": [call]})
    assert held is not None
    resent = [
        *MSGS,
        {"role": "assistant", "tool_calls": [{**call, "index": 0}]},
        {"role": "tool", "tool_call_id": "c1", "content": "r"},
    ]
    assert chat_extends(resent, held)


def test_completion_continuity() -> None:
    held = completion_continuity("abc", "def")
    assert held is not None
    assert completion_extends("abcdefg", held) and completion_extends(["abcdefX"], held)
    assert not completion_extends("abcdef", held) and not completion_extends("abXdefg", held)
    assert not completion_extends([1, 2, 3], held) and completion_continuity([1, 2], "x") is None


@pytest.mark.parametrize(
    ("headers", "body", "want"),
    [
        ({}, {}, None),
        ({"X-Conversation-Id": "h"}, {"conversation_id": "b"}, ("h", "X-Conversation-Id")),
        ({"X-Session-Id": "s"}, {"conversation_id": "b"}, ("b", "conversation_id")),
        ({"X-Session-Id": "s"}, {"prompt_cache_key": "p"}, ("s", "X-Session-Id")),
        ({}, {"prompt_cache_key": "p"}, ("p", "prompt_cache_key")),
    ],
)
def test_identity_precedence(headers: dict[str, str], body: dict[str, Any], want: Any) -> None:
    from multidict import CIMultiDict

    got = conversation_id_from(CIMultiDict(headers), body)
    assert (None if got is None else (got.conversation_id, got.source)) == want


def test_identity_invalid_names_the_source() -> None:
    from multidict import CIMultiDict

    with pytest.raises(IdentityError, match="conversation_id"):
        conversation_id_from(CIMultiDict(), {"conversation_id": "bad id"})


def test_tenant_and_keys() -> None:
    from multidict import CIMultiDict

    k = Keyer("secret")
    a = tenant_from(CIMultiDict({"Authorization": "Bearer a"}), None)
    b = tenant_from(CIMultiDict({"Authorization": "Bearer b"}), None)
    assert a != b and "Bearer" not in a and len({k.key(a, "x"), k.key(b, "x"), k.key(a, "y")}) == 3
    assert k.key(a, "x") != Keyer("other").key(a, "x")
    assert tenant_from(CIMultiDict({"X-T": "acme", "Authorization": "Bearer a"}), "X-T") == "h:acme"
    assert tenant_from(CIMultiDict(), "X-T") == "anonymous"


def test_miss_rate_monitor_warns_once_per_window_on_all_misses() -> None:
    m = MissRateMonitor(window_s=60, min_turns=5)
    warnings = [m.observe(float(t), ReuseStatus.MISS) for t in range(10)]
    assert warnings[:4] == [None] * 4 and warnings[4] is not None and warnings[5:] == [None] * 5
    assert m.observe(100.0, ReuseStatus.FIRST) is None
    m2 = MissRateMonitor(window_s=60, min_turns=5)
    for t in range(10):
        m2.observe(float(t), ReuseStatus.MISS)
        assert m2.observe(float(t), ReuseStatus.HIT) is None
    m3 = MissRateMonitor(window_s=10, min_turns=3)
    m3.observe(0.0, ReuseStatus.HIT)
    out = [m3.observe(float(t), ReuseStatus.EXPIRED) for t in (11, 12, 13)]
    assert out[-1] is not None  # the hit aged out of the window
