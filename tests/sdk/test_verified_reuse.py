"""Issue 16 in the SDK: verified partial reuse, a lost lease, warnings per kind, close from any
loop, the public HTTP client. Real HTTP against the fake router of ``tests/fakes``."""

from __future__ import annotations

import asyncio
import json
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
from _sdk_support import FAST_RETRY
from fakes.openai_server import FakeOpenAIServer
from openai import AsyncOpenAI, OpenAI

import kvlease
from kvlease import HistoryClass, ReuseOffWarning, ReuseStatus, protocol
from kvlease._core import Tracker
from kvlease._http import hx
from kvlease._strip import AssistantReply

USER = {"role": "user", "content": "What is the answer?"}
MORE = {"role": "user", "content": "go on"}


def _stripped(r: Any) -> dict[str, Any]:
    """The assistant message as most frameworks resend it: content only, reasoning dropped."""
    return {"role": "assistant", "content": r.choices[0].message.content}


def _reuse_headers(srv: FakeOpenAIServer) -> list[str | None]:
    return [q.header(protocol.HEADER_REUSE) for q in srv.requests_to(protocol.CHAT_COMPLETIONS_PATH)]


# ------------------------------------------------------------------------- 1. verified partial reuse


def test_a_verifying_router_keeps_reuse_on_for_a_stripped_history(
    kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer, tmp_path: Path
) -> None:
    fake_server.reply, fake_server.verified = "reasoning", True
    log_path = tmp_path / "turns.jsonl"
    with kvlease.wrap(
        OpenAI(base_url=fake_server.base_url, api_key="k", max_retries=0),
        heartbeat=False,
        turn_log=log_path,
    ) as kc2:
        conv = kc2.conversation()
        msgs: list[Any] = [USER]
        with pytest.warns(ReuseOffWarning, match="verifies tokens") as caught:
            for _ in range(3):
                r = conv.chat.completions.create(model="m", messages=msgs)
                msgs = [*msgs, _stripped(r), MORE]
        turns = conv.turns
    assert _reuse_headers(fake_server) == [None, None, None]  # no opt-out: P reuses the verified prefix
    assert [t.history for t in turns[1:]] == [HistoryClass.REASONING_STRIPPED] * 2
    assert [t.status for t in turns] == [ReuseStatus.FIRST, ReuseStatus.HIT, ReuseStatus.HIT]
    assert all(t.verified for t in turns)
    assert [t.verified_reuse for t in turns] == [False, True, True]
    assert not any(t.reuse_forced_off for t in turns)
    assert all((t.reused_tokens or 0) > 0 for t in turns[1:])
    (w,) = [x for x in caught if issubclass(x.category, ReuseOffWarning)]
    assert isinstance(w.message, ReuseOffWarning) and not w.message.reuse_off
    lines = [json.loads(line) for line in log_path.read_text().splitlines()]
    key = protocol.TurnLogKey
    assert [ln[key.VERIFIED] for ln in lines] == [True, True, True]
    assert [ln.get(key.VERIFIED_REUSE, False) for ln in lines] == [False, True, True]
    assert [ln[key.REUSED_TOKENS] > 0 for ln in lines] == [False, True, True]


@pytest.mark.parametrize("verified", [False, None], ids=["stock-vllm", "no-header"])
def test_stock_vllm_still_forces_a_full_prefill(
    kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer, verified: bool | None
) -> None:
    fake_server.reply, fake_server.verified = "reasoning", verified
    with kc.conversation() as conv, pytest.warns(ReuseOffWarning, match="reuse is off"):
        r = conv.chat.completions.create(model="m", messages=[USER])
        conv.chat.completions.create(model="m", messages=[USER, _stripped(r), MORE])
        t = conv.turns[-1]
    assert _reuse_headers(fake_server) == [None, protocol.REUSE_OFF]
    assert t.reuse_forced_off and not t.verified_reuse and t.status is ReuseStatus.DISABLED
    assert t.verified is (None if verified is None else False)


def test_a_router_whose_mode_is_not_known_yet_gets_the_opt_out() -> None:
    tracker = Tracker("warn")
    state = tracker.open("c1")
    first = state.detector.inspect([USER])
    state.detector.record(first, AssistantReply(content="hi", reasoning="think", reasoning_field="reasoning"))
    body = json.dumps({"model": "m", "messages": [USER, {"role": "assistant", "content": "hi"}, MORE]})
    assert tracker.verifies("http://r:1") is None
    with pytest.warns(ReuseOffWarning):
        p = tracker.begin("c1", "http://r:1", protocol.CHAT_COMPLETIONS_PATH, {}, body.encode(), 0.0, 0.0)
    assert p is not None and p.reuse_off and not p.verified_reuse


def test_the_opt_out_stays_for_users_who_want_it(
    kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer
) -> None:
    fake_server.verified = True
    with kc.conversation() as conv:
        r = conv.chat.completions.create(model="m", messages=[USER])
        conv.chat.completions.create(
            model="m",
            messages=[USER, r.choices[0].message, MORE],
            extra_headers={protocol.HEADER_REUSE: protocol.REUSE_OFF},
        )
        assert conv.turns[-1].status is ReuseStatus.DISABLED and not conv.turns[-1].reuse_forced_off


# ------------------------------------------------------------------------- 3. a lost lease


def test_a_header_tracked_conversation_survives_a_lost_lease(
    kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer
) -> None:
    fake_server.reply = "reasoning"
    headers = {protocol.HEADER_CONVERSATION_ID: "thread-9"}
    r = kc.openai.chat.completions.create(model="m", messages=[USER], extra_headers=headers)
    fake_server.leases.clear()  # the router lost the lease: the renewal answers "unknown"
    kc.keeper.renew_now()
    assert "thread-9" not in kc.keeper and kc.get_conversation("thread-9") is None
    with pytest.warns(ReuseOffWarning):
        kc.openai.chat.completions.create(
            model="m", messages=[USER, _stripped(r), MORE], extra_headers=headers
        )
    conv = kc.get_conversation("thread-9")
    assert conv is not None
    assert [t.index for t in conv.turns] == [0, 1]  # the turn records go on
    assert conv.turns[-1].history is HistoryClass.REASONING_STRIPPED
    assert _reuse_headers(fake_server) == [None, protocol.REUSE_OFF]
    assert "thread-9" in kc.keeper


# ------------------------------------------------------------------------- 4. warnings per kind


def test_one_warning_per_kind_and_one_log_record_per_conversation(
    kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer, caplog: pytest.LogCaptureFixture
) -> None:
    fake_server.reply = "reasoning"
    ids = [f"conv-{i}" for i in range(30)]
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, logger="kvlease"):
        warnings.simplefilter("always")  # every warn() call is recorded: kvlease must make one
        for cid in ids:
            conv = kc.conversation(cid)
            r = conv.chat.completions.create(model="m", messages=[USER])
            conv.chat.completions.create(model="m", messages=[USER, _stripped(r), MORE])
            conv.chat.completions.create(
                model="m", messages=[USER, {"role": "assistant", "content": "x"}, MORE]
            )
    ours = [w for w in caught if issubclass(w.category, ReuseOffWarning)]
    assert [w.message.history for w in ours] == [  # type: ignore[union-attr]
        HistoryClass.REASONING_STRIPPED,
        HistoryClass.HISTORY_REWRITTEN,
    ]
    assert all(w.filename == __file__ for w in ours)  # the caller's line, not kvlease's
    assert all(ids[0] not in str(w.message) for w in ours)
    records = [rec for rec in caplog.records if getattr(rec, "conversation_id", None) in ids]
    assert sorted(rec.conversation_id for rec in records) == sorted(ids)  # type: ignore[attr-defined]
    assert all(rec.levelno == logging.WARNING for rec in records)


async def test_async_warning_points_at_the_caller(
    akc: kvlease.AsyncKVLeaseClient, fake_server: FakeOpenAIServer
) -> None:
    fake_server.reply = "reasoning"
    conv = akc.conversation()
    r = await conv.chat.completions.create(model="m", messages=[USER])
    with pytest.warns(ReuseOffWarning) as caught:
        await conv.chat.completions.create(model="m", messages=[USER, _stripped(r), MORE])
    assert caught[0].filename == __file__
    assert caught[0].message.conversation_id == conv.id  # type: ignore[union-attr]


# ------------------------------------------------------------------------- 5. close from any loop


def test_async_close_works_from_another_event_loop(fake_server: FakeOpenAIServer) -> None:
    raw = AsyncOpenAI(base_url=fake_server.base_url, api_key="k", max_retries=0)
    akc = kvlease.wrap(raw, retry=FAST_RETRY)  # with heartbeats: a keeper task on the first loop
    first = asyncio.new_event_loop()
    try:
        conv = akc.conversation()
        first.run_until_complete(conv.chat.completions.create(model="m", messages=[USER]))
        assert conv.id in akc.keeper
        asyncio.run(akc.close())  # another loop, as asyncio.run(client.close()) in a script's atexit
        assert conv.closed and conv.id not in akc.keeper
    finally:
        first.run_until_complete(asyncio.sleep(0))  # the keeper task ends on its own loop
        first.close()


# ------------------------------------------------------------------------- 6. the public HTTP client


def test_http_client_carries_kvlease_for_frameworks_that_take_one(
    kc: kvlease.KVLeaseClient, fake_server: FakeOpenAIServer
) -> None:
    assert isinstance(kc.http_client, hx.Client)
    own = OpenAI(
        base_url=fake_server.base_url,
        api_key="k",
        http_client=kc.http_client,
        default_headers={protocol.HEADER_CONVERSATION_ID: "fw-1"},
    )
    own.chat.completions.create(model="m", messages=[USER])
    conv = kc.get_conversation("fw-1")
    assert conv is not None and [t.status for t in conv.turns] == [ReuseStatus.FIRST]
    (req,) = fake_server.requests_to(protocol.CHAT_COMPLETIONS_PATH)
    assert req.body[protocol.BODY_CONVERSATION_ID] == "fw-1"


async def test_async_http_client(akc: kvlease.AsyncKVLeaseClient, fake_server: FakeOpenAIServer) -> None:
    assert isinstance(akc.http_client, hx.AsyncClient)
    own = AsyncOpenAI(
        base_url=fake_server.base_url,
        api_key="k",
        http_client=akc.http_client,
        default_headers={protocol.HEADER_CONVERSATION_ID: "fw-2"},
    )
    await own.chat.completions.create(model="m", messages=[USER])
    conv = akc.get_conversation("fw-2")
    assert conv is not None and len(conv.turns) == 1
