"""The agent loop of ``agent_loop.py`` on ``AsyncOpenAI``: several conversations at once.

    python examples/agent_loop_async.py --base-url http://127.0.0.1:8000/v1 --model tiny --agents 3

One wrapped async client serves every conversation; its lease keeper (one asyncio task) renews all
of them with one batched request per period while the tools run.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from openai import AsyncOpenAI

import kvlease


async def one_agent(
    kc: kvlease.AsyncKVLeaseClient, model: str, name: str, turns: int, tool_sleep: float
) -> list[kvlease.Turn]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful coding agent."},
        {"role": "user", "content": f"Task {name}: summarise the module and propose one change."},
    ]
    async with kc.conversation(id=f"agent-{name}") as conv:
        for _ in range(turns):
            stream = await conv.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=48,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
            )
            parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
            messages.append({"role": "assistant", "content": "".join(parts)})
            await asyncio.sleep(tool_sleep)  # the tool runs; the keeper renews the lease meanwhile
            messages.append({"role": "user", "content": f"Tool output for {name}: 3 files changed."})
        return list(conv.turns)


async def run_agents(
    client: AsyncOpenAI, model: str, *, agents: int = 3, turns: int = 3, tool_sleep: float = 0.0
) -> dict[str, list[kvlease.Turn]]:
    async with kvlease.wrap(client) as kc:
        names = [str(i) for i in range(agents)]
        results = await asyncio.gather(*(one_agent(kc, model, n, turns, tool_sleep) for n in names))
    for name, ts in zip(names, results):
        print(f"agent {name}: " + ", ".join(f"{t.status and t.status.value}/{t.reused_tokens}" for t in ts))
    return dict(zip(names, results))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="kvlease-example")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--agents", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tool-sleep", type=float, default=0.0)
    a = ap.parse_args(argv)
    client = AsyncOpenAI(base_url=a.base_url, api_key=a.api_key)
    asyncio.run(run_agents(client, a.model, agents=a.agents, turns=a.turns, tool_sleep=a.tool_sleep))


if __name__ == "__main__":
    main()
