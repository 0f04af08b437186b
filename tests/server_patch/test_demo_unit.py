"""The demo's scripted answers, without servers: the shapes it forces on the random-weight model."""

from __future__ import annotations

import re
import warnings

from kvlease_stack.demo import REASONING_MAX_TOKENS, REASONING_REGEX, THINK_RE, TOOL_NAMES, tool_call_regex


def _max_chars(regex: str) -> int:
    """The longest match ``regex`` allows, from the regex engine's own parser."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # sre_parse: public name, deprecated alias
        import sre_parse

    return int(sre_parse.parse(regex).getwidth()[1])


def test_reasoning_answer_closes_within_its_token_budget() -> None:
    # A byte-level BPE token covers at least one byte, and the regex allows ASCII only: the longest
    # answer it allows fits in max_tokens, so the </think> always arrives and the block can be stripped.
    assert _max_chars(REASONING_REGEX) < REASONING_MAX_TOKENS


def test_reasoning_answer_is_what_the_agent_strips() -> None:
    answer = "<think>" + "a" * 12 + "</think>" + "fix it now"
    assert re.fullmatch(REASONING_REGEX, answer)
    assert THINK_RE.sub("", answer) == "fix it now"
    assert not re.fullmatch(REASONING_REGEX, "<think>" + "a" * 41 + "</think>" + "fix it now")


def test_tool_call_regexes_name_their_tool() -> None:
    for name in TOOL_NAMES:
        assert name in tool_call_regex(name)


def test_the_stripped_turn_row_says_how_many_tokens_it_reused() -> None:
    from types import SimpleNamespace

    from kvlease import HistoryClass
    from kvlease_stack.demo import turn_note

    stripped = SimpleNamespace(
        history=HistoryClass.REASONING_STRIPPED,
        verified_reuse=True,
        reuse_forced_off=False,
        reused_tokens=912,
    )
    assert (
        turn_note(stripped, "run_tests()")
        == "SDK: reasoning-stripped -> verified prefix reused (912 tokens); run_tests()"
    )
    stock = SimpleNamespace(
        history=HistoryClass.REASONING_STRIPPED, verified_reuse=False, reuse_forced_off=True, reused_tokens=0
    )
    assert turn_note(stock, "") == "SDK: reasoning-stripped -> recompute"
    exact = SimpleNamespace(
        history=HistoryClass.EXACT, verified_reuse=False, reuse_forced_off=False, reused_tokens=5
    )
    assert turn_note(exact, "read_file()") == "read_file()"


def test_the_warning_note_is_the_cause() -> None:
    from kvlease_stack.demo import warning_note

    cause = "the <think>…</think> block was stripped from the resent assistant content"
    verified = f"kvlease: {cause}, but the router's prefill node verifies tokens, so the prefix ... Fix: ..."
    assert warning_note(verified) == cause
    assert warning_note(f"kvlease: {cause}, so KV reuse is off for this turn. Fix: ...") == cause
