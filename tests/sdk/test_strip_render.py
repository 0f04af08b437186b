"""Tool-call arguments are compared as vLLM's chat template renders them (issue 16, problem 2).

vLLM ``json.loads`` the argument string of every assistant tool call (``None`` or ``""`` become
``{}``) and the template writes it back with ``tojson`` (``json.dumps``: key order kept, ``null``
kept). A re-serialization that parses to the same JSON, in the same order, renders to the same
prompt tokens and is exact; anything else is a change. The rows are what each framework resends
for a call the model returned as ``{"city": "Paris", "unit": null, "days": 3}``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvlease import AssistantReply, HistoryClass, StripDetector
from kvlease._strip import rendered_arguments

H = HistoryClass
RETURNED_ARGS = '{"city": "Paris", "unit": null, "days": 3}'  # vLLM's tool parser output
USER1 = {"role": "user", "content": "Weather in Paris?"}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}


def _call(arguments: Any) -> dict[str, Any]:
    return {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def _classify(resent: dict[str, Any], returned_args: str = RETURNED_ARGS) -> HistoryClass:
    det = StripDetector()
    v1 = det.inspect([USER1])
    det.record(
        v1,
        AssistantReply.from_message(
            {"role": "assistant", "content": None, "tool_calls": [_call(returned_args)]}
        ),
    )
    return det.inspect([USER1, resent, TOOL_RESULT]).history


def _assistant(*calls: dict[str, Any], content: Any = None) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = list(calls)
    return msg


PARSED = json.loads(RETURNED_ARGS)

# (who, the resent assistant message, expected)
ROWS: list[tuple[str, dict[str, Any], HistoryClass]] = [
    # openai-agents keeps the argument string of the function-call item as it came
    ("openai-agents", _assistant(_call(RETURNED_ARGS)), H.EXACT),
    # pydantic-ai re-serializes compactly (pydantic_core.to_json)
    ("pydantic-ai", _assistant(_call('{"city":"Paris","unit":null,"days":3}')), H.EXACT),
    # LangChain keeps parsed args and sends json.dumps(args) (default separators, ASCII escapes)
    ("langchain", _assistant(_call(json.dumps(PARSED))), H.EXACT),
    ("langchain, non-ASCII", _assistant(_call(json.dumps({"city": "Zürich"}))), H.EXACT),
    # a client that pretty-prints, or passes the parsed object itself (vLLM accepts both)
    ("indented", _assistant(_call(json.dumps(PARSED, indent=2))), H.EXACT),
    ("parsed object", _assistant(_call(PARSED)), H.EXACT),
    # smolagents resends its memory as text, without the assistant's tool calls
    (
        "smolagents",
        _assistant(content="Calling tools:\n[{'id': 'call_1', 'type': 'function', 'function': {...}}]"),
        H.TOOL_CALLS_CHANGED,
    ),
    # what renders differently is a change
    ("keys reordered", _assistant(_call('{"unit": null, "city": "Paris", "days": 3}')), H.TOOL_CALLS_CHANGED),
    ("null field dropped", _assistant(_call('{"city": "Paris", "days": 3}')), H.TOOL_CALLS_CHANGED),
    ("int as float", _assistant(_call('{"city": "Paris", "unit": null, "days": 3.0}')), H.TOOL_CALLS_CHANGED),
    ("value changed", _assistant(_call('{"city": "Lyon", "unit": null, "days": 3}')), H.TOOL_CALLS_CHANGED),
    (
        "name changed",
        _assistant({**_call(RETURNED_ARGS), "function": {"name": "w", "arguments": RETURNED_ARGS}}),
        H.TOOL_CALLS_CHANGED,
    ),
]


@pytest.mark.parametrize(("who", "resent", "expected"), ROWS, ids=[r[0] for r in ROWS])
def test_framework_re_serializations(who: str, resent: dict[str, Any], expected: HistoryClass) -> None:
    returned = RETURNED_ARGS if who != "langchain, non-ASCII" else '{"city": "Zürich"}'
    assert _classify(resent, returned) is expected


@pytest.mark.parametrize(
    ("returned", "resent"),
    [("", "{}"), ("{}", None), ("{}", ""), ('{"a": [1, {"b": null}]}', '{"a":[1,{"b":null}]}')],
)
def test_empty_and_nested_arguments_render_alike(returned: str, resent: Any) -> None:
    assert rendered_arguments(returned) == rendered_arguments(resent)
    assert _classify(_assistant(_call(resent)), returned) is H.EXACT


def test_arguments_that_are_not_json_are_compared_as_they_are() -> None:
    assert _classify(_assistant(_call("not json")), "not json") is H.EXACT
    assert _classify(_assistant(_call("not  json")), "not json") is H.TOOL_CALLS_CHANGED
