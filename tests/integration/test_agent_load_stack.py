"""The agent-load benchmark's replay on the real stack (the shared default pair: kvlease connector,
leases in D's KV cache): recorded sessions through the router and the SDK, gaps scaled down. No
turn fails, and follow-up turns reuse D's KV."""

from __future__ import annotations

import asyncio
import importlib
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvlease_stack import Stack, StackSpec
from kvlease_stack.demo import router_process

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_quick_replay_of_the_kvlease_device_arm(stack_factory: Callable[[StackSpec], Stack]) -> None:
    sys.path.insert(0, str(BENCH))
    A = importlib.import_module("agent_load")
    S = importlib.import_module("_agent_sessions")
    stack = stack_factory(StackSpec())  # the shared pair; its D placement is the default, device
    arm = next(a for a in A.ARMS if a.name == "kvlease-device")
    plan = A.Plan((arm,), (2,), duration_s=30.0, gap_scale=0.1, ttl_s=stack.spec.ttl, d_blocks=0, sizing="")
    sessions = S.load_sessions()
    with router_process(stack) as router:
        r = asyncio.run(A._replay(arm, stack, router, sessions, 2, plan))
    assert r["failed_turns"] == 0, r["errors"]
    assert r["follow_up_turns"] > 0 and r["statuses"].get("hit", 0) >= 1, r["statuses"]
    assert r["reused_token_share"] > 0
    # the status breakdown comes from the connectors' own counters, over this run only
    decisions = r["connector_counters"]["p_control"]
    assert decisions.get('kvlease_pull_decisions_total{reason="pull"}', 0) >= r["statuses"]["hit"], decisions
