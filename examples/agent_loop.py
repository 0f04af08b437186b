"""A tool-using agent loop on the kvlease-wrapped OpenAI client (sync).

    python examples/agent_loop.py --base-url http://127.0.0.1:8000/v1 --model tiny

Point ``--base-url`` at a kvlease router (or any OpenAI-compatible server: without the router the
turn statuses read ``None``). Each turn prints what kvlease saw: the reuse status, reused tokens and
the time to first token. The conversation keeps its KV lease alive while a tool runs (``--tool-sleep``
longer than the lease TTL shows the heartbeats at work), and leaving the ``with`` block releases it.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from openai import OpenAI

import kvlease

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the project.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]


def read_file(path: str, sleep_s: float) -> str:
    """The tool: slow on purpose (a build, a human, a web search...)."""
    time.sleep(sleep_s)
    return f"# {path}\n" + "\n".join(f"def step_{i}(x):\n    return x + {i}" for i in range(12))


def run_agent(
    client: OpenAI,
    model: str,
    *,
    turns: int = 4,
    tool_sleep: float = 0.0,
    max_tokens: int = 48,
    stream: bool = True,
) -> list[kvlease.Turn]:
    """Run the loop and return kvlease's turn records."""
    kc = kvlease.wrap(client)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful coding agent. Use tools to read files."},
        {"role": "user", "content": "Find where step_7 is defined and explain it."},
    ]
    try:
        with kc.conversation() as conv:
            for turn in range(turns):
                kwargs: dict[str, Any] = {"model": model, "messages": messages, "tools": TOOLS}
                kwargs.update(max_tokens=max_tokens, temperature=0.0)
                if stream:
                    content, calls = _stream_reply(conv, kwargs)
                else:
                    msg = conv.chat.completions.create(**kwargs).choices[0].message
                    content = msg.content or ""
                    calls = [c.model_dump() for c in msg.tool_calls or []]
                assistant: dict[str, Any] = {"role": "assistant", "content": content}
                if calls:
                    assistant["tool_calls"] = calls
                messages.append(assistant)
                t = conv.turns[-1]
                print(
                    f"turn {turn + 1}: prompt={t.prompt_tokens} status={t.status and t.status.value} "
                    f"reused={t.reused_tokens} ttft={_ms(t.ttft_s)}"
                )
                if calls:  # run the tools the model asked for
                    for call in calls:
                        args = json.loads(call["function"]["arguments"] or "{}")
                        result = read_file(str(args.get("path", "main.py")), tool_sleep)
                        messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
                else:  # no tool call (a small model rarely makes one): the tool runs anyway
                    result = read_file("steps.py", tool_sleep)
                    messages.append({"role": "user", "content": f"Tool read_file returned:\n{result}"})
            return list(conv.turns)
    finally:
        kc.close()


def _stream_reply(conv: kvlease.Conversation, kwargs: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    parts: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for chunk in conv.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta.content:
            parts.append(delta.content)
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(
                tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            slot["id"] = tc.id or slot["id"]
            if tc.function is not None:
                slot["function"]["name"] += tc.function.name or ""
                slot["function"]["arguments"] += tc.function.arguments or ""
    return "".join(parts), [calls[i] for i in sorted(calls)]


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="kvlease-example")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--tool-sleep", type=float, default=0.0, help="seconds each tool call takes")
    ap.add_argument("--no-stream", action="store_true")
    a = ap.parse_args(argv)
    client = OpenAI(base_url=a.base_url, api_key=a.api_key)
    run_agent(client, a.model, turns=a.turns, tool_sleep=a.tool_sleep, stream=not a.no_stream)


if __name__ == "__main__":
    main()
