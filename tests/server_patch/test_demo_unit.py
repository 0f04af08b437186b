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
