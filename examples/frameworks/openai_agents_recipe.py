"""The OpenAI Agents SDK (``openai-agents``) on kvlease: one conversation, several runs.

    python examples/frameworks/openai_agents_recipe.py --base-url http://127.0.0.1:8000/v1 --model m

Glue: ``OpenAIChatCompletionsModel(model=..., openai_client=conv.client)``. The Agents SDK drops the
reasoning of earlier turns when it rebuilds the history (``reasoning-stripped``); behind the kvlease
connector the token-verified prefix is still reused. ``should_replay_reasoning_content=lambda c: True``
makes it send the reasoning back. Tracing is switched off: it would export to api.openai.com.
"""

from __future__ import annotations

from typing import Any

import _common
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

import kvlease


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


async def run(base_url: str, model: str) -> list[kvlease.Turn]:
    set_tracing_disabled(True)
    async with AsyncOpenAI(base_url=base_url, api_key="EMPTY") as raw, kvlease.wrap(raw) as kc:
        conv = kc.conversation()
        agent = Agent(
            name="weather",
            instructions="Answer briefly.",
            tools=[get_weather],
            model=OpenAIChatCompletionsModel(model=model, openai_client=conv.client),
            model_settings=ModelSettings(include_usage=True),
        )
        history: list[Any] = []
        for question in _common.QUESTIONS:
            result = await Runner.run(agent, [*history, {"role": "user", "content": question}])
            history = result.to_input_list()
        return conv.turns


def main() -> None:
    _common.main(__doc__, run)


if __name__ == "__main__":
    main()
