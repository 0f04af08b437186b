"""The demo's agent on the real stack: tool calls, a tool pause past the TTL, stripped reasoning.

``kvlease demo`` itself starts its own pair on the small random model (for timings); here its agent
runs against the test session's pair (the tiny model, the spec of ``test_connector_pd``: D TTL 20 s,
P's prefix cache off, float32), so what is checked is the behaviour the demo shows, not its speed:

- tool calls come back as OpenAI ``tool_calls`` (vLLM's Hermes parser on the stack's template), and
  the turn after each call and its ``tool`` result reuses D's KV;
- the turn after a tool pause longer than D's TTL still hits (the SDK's heartbeats renewed it);
- the turn whose resent history lost its ``<think>`` block is detected by the SDK, which leaves reuse
  on behind the kvlease connector (the router says P verifies tokens), and P reuses the verified
  prefix;
- greedy answers are identical with and without reuse.
"""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from kvlease_stack import Stack, StackSpec
from kvlease_stack.demo import PLAN, SLOW_TOOL_TURN, run_demo

from ._specs import ALWAYS_PULL

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

D_TTL = 20.0
# float32, as test_connector_pd (the same pair): answers are compared token for token (see there).
SPEC = StackSpec(
    model="tiny",
    connector="kvlease",
    ttl=D_TTL,
    recompute_threshold=32,
    prefix_caching=False,
    dtype="float32",
    kvlease=ALWAYS_PULL,
)


def test_demo_agent_on_the_real_stack(stack_factory: object) -> None:
    stack: Stack = stack_factory(SPEC)  # type: ignore[operator]
    out = io.StringIO()
    result = run_demo(stack, pause_s=D_TTL + 4.0, console=Console(file=out, width=160))
    text = out.getvalue()

    on, off = result.kvlease, result.baseline
    assert [r.turn for r in on] == list(range(1, len(PLAN) + 1)), text
    assert result.answers_equal, text

    think = PLAN.index("think") + 1
    statuses = {r.turn: r.status for r in on}
    assert statuses[1] == "first", text
    # The turn after the stripped answer: detected, reuse left on, the verified prefix reused.
    assert on[think].note.startswith("SDK: reasoning-stripped -> verified prefix reused"), text
    # Every follow-up turn reused D's KV: the stripped one and the one after the long tool pause too.
    for r in on[1:]:
        assert r.status == "hit" and r.reused_tokens and r.reused_tokens > 0, text
    assert statuses[SLOW_TOOL_TURN + 1] == "hit", text
    assert all(r.status == "disabled" and not r.reused_tokens for r in off), text

    # The tool turns came back as tool calls (name and JSON arguments), not as text.
    for turn, action in enumerate(PLAN, start=1):
        if action in ("read_file", "run_tests"):
            assert f"{action} tests/test_" in on[turn - 1].note, text
