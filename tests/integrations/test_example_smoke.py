"""``examples/langchain_agent.py`` runs as a script against the real router (on the fake P/D pair),
whose leases really expire.

The tool sleeps longer than the lease TTL: with heartbeats the follow-up turns are ``hit``s, without
them ``expired`` (the same script, ``--no-heartbeat``), which shows the heartbeats are what kept them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvlease import protocol as p
from kvlease_stack.testing import FakeConfig, Reply, RouterOnFakePair

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "langchain_agent.py"
TTL = 6.0  # the keeper renews at 60 % of it: 2.4 s of slack for a loaded machine (1.2 s was
# not always enough at a load average of 8 on 2 cores)
TOOL_SECONDS = 8.0  # > TTL
MARGIN = 5.0  # the router's lease is D's TTL minus this margin


def _stack() -> RouterOnFakePair:
    return RouterOnFakePair(FakeConfig(ttl=TTL + MARGIN), ttl_margin=MARGIN)


def _run(router: RouterOnFakePair, *extra: str) -> subprocess.CompletedProcess[str]:
    router.script(
        Reply(reasoning="use the tool", tool_calls=[{"name": "slow_lookup", "arguments": {"query": "disk"}}])
    )
    cmd = [sys.executable, str(EXAMPLE), "--base-url", router.base_url, "--model", "fake-model"]
    cmd += ["--turns", "2", "--tool-seconds", str(TOOL_SECONDS), "--check", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_agent_keeps_its_lease_through_a_slow_tool() -> None:
    with _stack() as router:
        out = _run(router)
        renewals = router.renew_requests()
        chats = router.chat_requests()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "tool slow_lookup('disk')" in out.stdout
    assert "2/2 follow-up turns reused" in out.stdout
    lines = [line.split() for line in out.stdout.splitlines() if line[:4].strip().isdigit()]
    assert [(cols[0], cols[1]) for cols in lines] == [("0", "first"), ("1", "hit"), ("2", "hit")]
    assert len(renewals) >= 2  # each 8 s wait spans more than one 6 s lease
    # one conversation (the thread id) for the whole agent run; the tool result went back on turn 1
    ids = {c.headers[p.HEADER_CONVERSATION_ID.lower()] for c in chats}
    assert len(ids) == 1 and next(iter(ids)).startswith("agent-")
    assert chats[1].body["messages"][-1]["role"] == "tool"
    # releases the conversation on exit
    assert any(r.method == "DELETE" for r in router.requests)


@pytest.mark.slow
def test_without_heartbeats_the_leases_expire() -> None:
    with _stack() as router:
        out = _run(router, "--no-heartbeat")
        renewals = router.renew_requests()
    assert out.returncode == 1, out.stdout + out.stderr  # --check: follow-ups did not reuse
    assert "0/2 follow-up turns reused" in out.stdout
    assert renewals == []
