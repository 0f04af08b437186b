"""Each example runs end to end (as a user would start it) against the real router on a fake P/D pair."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvlease_stack.testing import Reply, RouterOnFakePair

ROOT = Path(__file__).resolve().parents[2]
TOOL_CALL = {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}


def _run(script: str, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("reply", ["plain", "tool_calls"])
@pytest.mark.parametrize("stream", [True, False])
def test_agent_loop(reply: str, stream: bool) -> None:
    with RouterOnFakePair() as srv:
        if reply == "tool_calls":
            srv.script(*[Reply(tool_calls=[TOOL_CALL])] * 3)
        extra = [] if stream else ["--no-stream"]
        out = _run("agent_loop.py", "--base-url", srv.base_url, "--model", "m", "--turns", "3", *extra)
        chats = srv.requests_to("/v1/chat/completions")
        released = list(srv.released)
    assert [line.split(":")[0] for line in out.splitlines()] == ["turn 1", "turn 2", "turn 3"]
    assert "status=first" in out.splitlines()[0] and "status=hit" in out.splitlines()[2]
    assert len(chats) == 3
    # one conversation: the same id on every turn, each turn resends the whole history
    ids = {r.body["conversation_id"] for r in chats}
    assert len(ids) == 1 and released == list(ids)
    assert [len(r.body["messages"]) for r in chats] == [2, 4, 6]
    assert all(r.header("x-kvlease-reuse") is None for r in chats)  # history resent exactly


def test_agent_loop_async() -> None:
    with RouterOnFakePair() as srv:
        out = _run("agent_loop_async.py", "--base-url", srv.base_url, "--model", "m", "--agents", "3")
        chats = srv.requests_to("/v1/chat/completions")
        released = sorted(srv.released)
    assert len(chats) == 9
    assert released == ["agent-0", "agent-1", "agent-2"]
    assert out.count("first/0") == 3 and out.count("hit/") == 6
