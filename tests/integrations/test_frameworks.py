"""The framework recipes of ``examples/frameworks/`` (docs/frameworks.md), each through the real
router in front of the fake P/D pair: a tool-using conversation over several runs. Each asserts one
conversation id on the wire, the statuses, and what the strip detector found where the framework
changes the history. The frameworks' model calls go to 127.0.0.1 only."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvlease import HistoryClass, ReuseOffWarning, ReuseStatus, Turn, protocol
from kvlease_stack.testing import FakeConfig, Reply, RouterOnFakePair

RECIPES = Path(__file__).resolve().parents[2] / "examples" / "frameworks"
H, S = HistoryClass, ReuseStatus
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}  # the fake writes '{"city": "Paris"}'


def _script(field: str = "reasoning") -> list[Reply]:
    """Turn 1 calls the tool, turn 2 answers from its result, turn 3 answers the follow-up."""
    return [
        Reply(reasoning="I should look it up.", reasoning_field=field, tool_calls=[CALL]),
        Reply(content="It is sunny in Paris.", reasoning="The tool says sunny.", reasoning_field=field),
        Reply(content="Sunny tomorrow too.", reasoning="Same again.", reasoning_field=field),
    ]


def _recipe(name: str, needs: str) -> ModuleType:
    pytest.importorskip(needs)
    if str(RECIPES) not in sys.path:  # their shared ``_common``, as running the script would find it
        sys.path.insert(0, str(RECIPES))
    spec = importlib.util.spec_from_file_location(name, RECIPES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def stack() -> Iterator[RouterOnFakePair]:
    with RouterOnFakePair() as s:
        yield s


def _run(module: ModuleType, stack: RouterOnFakePair, **kwargs: Any) -> Any:
    out = module.run(stack.base_url, "fake-model", **kwargs)
    return asyncio.run(out) if asyncio.iscoroutine(out) else out


def _one_id(stack: RouterOnFakePair, header: str = protocol.HEADER_CONVERSATION_ID) -> str:
    ids = {r.header(header) for r in stack.chat_requests()}
    assert len(ids) == 1 and None not in ids, ids
    (cid,) = ids
    assert cid is not None
    return cid


def _opt_outs(stack: RouterOnFakePair) -> list[str | None]:
    return [r.header(protocol.HEADER_REUSE) for r in stack.chat_requests()]


def _verified_reuse_on(turns: list[Turn], history: HistoryClass) -> None:
    """Turns 2 and 3 changed the history: detected, reuse left on, the verified prefix reused."""
    assert [t.history for t in turns[1:]] == [history] * 2
    assert [t.verified_reuse for t in turns] == [False, True, True]
    assert all((t.reused_tokens or 0) > 0 for t in turns[1:])


def test_plain_openai(stack: RouterOnFakePair) -> None:
    stack.script(*_script())
    turns = _run(_recipe("plain_openai_recipe", "openai"), stack)
    cid = _one_id(stack)
    assert [t.status for t in turns] == [S.FIRST, S.HIT, S.HIT]
    assert [t.history for t in turns] == [H.FIRST_TURN, H.EXACT, H.EXACT]  # the message as returned
    assert stack.released == [cid]


def test_plain_openai_with_stripped_reasoning(stack: RouterOnFakePair) -> None:
    stack.script(*_script())
    with pytest.warns(ReuseOffWarning, match="verifies tokens"):
        turns = _run(_recipe("plain_openai_recipe", "openai"), stack, strip_reasoning=True)
    _one_id(stack)
    assert [t.status for t in turns] == [S.FIRST, S.HIT, S.HIT]
    _verified_reuse_on(turns, H.REASONING_STRIPPED)
    assert _opt_outs(stack) == [None] * 3


def test_plain_openai_on_stock_vllm_forces_the_full_prefill() -> None:
    with RouterOnFakePair(FakeConfig(kvlease=False)) as stack:
        stack.script(*_script())
        with pytest.warns(ReuseOffWarning, match="reuse is off"):
            turns = _run(_recipe("plain_openai_recipe", "openai"), stack, strip_reasoning=True)
        assert _opt_outs(stack) == [None, protocol.REUSE_OFF, protocol.REUSE_OFF]
    assert [t.status for t in turns] == [S.FIRST, S.DISABLED, S.DISABLED]
    assert [t.reuse_forced_off for t in turns] == [False, True, True]
    assert not any(t.verified or t.verified_reuse for t in turns)


def test_router_only(stack: RouterOnFakePair) -> None:
    module = _recipe("router_only_recipe", "openai")
    assert [s for s, _ in _run(module, stack)] == ["first", "hit", "hit"]
    assert _one_id(stack, protocol.HEADER_SESSION_ID) == "user-42"
    assert stack.renew_requests() == [] and stack.released == []  # what the SDK would add


def test_router_only_prompt_cache_key(stack: RouterOnFakePair) -> None:
    module = _recipe("router_only_recipe", "openai")
    assert [s for s, _ in _run(module, stack, session="s-7", body_key=True)] == ["first", "hit", "hit"]
    assert {r.body[protocol.BODY_PROMPT_CACHE_KEY] for r in stack.chat_requests()} == {"s-7"}


def test_openai_agents(stack: RouterOnFakePair) -> None:
    # the Agents SDK replays "reasoning" but drops "reasoning_content" from the history it rebuilds
    stack.script(*_script("reasoning_content"))
    with pytest.warns(ReuseOffWarning, match="reasoning_content"):
        turns = _run(_recipe("openai_agents_recipe", "agents"), stack)
    cid = _one_id(stack)
    assert [t.status for t in turns] == [S.FIRST, S.HIT, S.HIT]
    _verified_reuse_on(turns, H.REASONING_STRIPPED)
    assert _opt_outs(stack) == [None] * 3
    assert stack.released == [cid]


def test_pydantic_ai(stack: RouterOnFakePair) -> None:
    stack.script(*_script())
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReuseOffWarning)  # compact arguments render alike: no warning
        turns = _run(_recipe("pydantic_ai_recipe", "pydantic_ai"), stack)
    cid = _one_id(stack)
    assert [t.status for t in turns] == [S.FIRST, S.HIT, S.HIT]
    assert [t.history for t in turns] == [H.FIRST_TURN, H.EXACT, H.EXACT]
    resent = stack.chat_requests()[1].body["messages"][2]["tool_calls"][0]["function"]["arguments"]
    assert resent == '{"city":"Paris"}'  # re-serialized: not the bytes the model returned
    assert stack.released == [cid]


def test_langgraph_chat_kvlease(stack: RouterOnFakePair) -> None:
    stack.script(*_script())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        turns = _run(_recipe("langgraph_recipe", "langgraph"), stack)
    assert _one_id(stack) == "user-42"
    assert [t.status for t in turns] == [S.FIRST, S.HIT, S.HIT]
    _verified_reuse_on(turns, H.REASONING_STRIPPED)  # the default policy gives reuse
    assert _opt_outs(stack) == [None] * 3
    (w,) = [w for w in caught if issubclass(w.category, ReuseOffWarning)]
    assert 'reasoning_policy="keep"' in str(w.message)  # the hint a ChatKVLease user needs
    assert stack.released == ["user-42"]


def test_langgraph_keep_is_exact(stack: RouterOnFakePair) -> None:
    stack.script(*_script())
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReuseOffWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        turns = _run(_recipe("langgraph_recipe", "langgraph"), stack, reasoning_policy="keep")
    assert [t.history for t in turns] == [H.FIRST_TURN, H.EXACT, H.EXACT]


def test_smolagents(stack: RouterOnFakePair) -> None:
    final = [{"name": "final_answer", "arguments": {"answer": "sunny"}}]
    stack.script(
        _script()[0], Reply(reasoning="done", tool_calls=final), Reply(reasoning="again", tool_calls=final)
    )
    with pytest.warns(ReuseOffWarning, match="tool calls"):
        turns = _run(_recipe("smolagents_recipe", "smolagents"), stack)
    cid = _one_id(stack)
    assert [t.status for t in turns] == [S.FIRST, S.HIT, S.HIT]
    # its memory goes back as text without the tool calls: detected, the verified prefix reused
    _verified_reuse_on(turns, H.TOOL_CALLS_CHANGED)
    assert _opt_outs(stack) == [None] * 3
    assert stack.released == [cid]
