"""pydantic-ai on kvlease: one conversation, several runs sharing ``message_history``.

    python examples/frameworks/pydantic_ai_recipe.py --base-url http://127.0.0.1:8000/v1 --model m

Glue: ``OpenAIChatModel(model, provider=OpenAIProvider(openai_client=conv.client))``. pydantic-ai
re-serializes tool arguments compactly (``{"city":"Paris"}``); vLLM parses them before the chat
template renders them, so the prompt tokens are the same and kvlease classifies the turn exact.
"""

from __future__ import annotations

from typing import Any

import _common
from openai import AsyncOpenAI
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

import kvlease


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


async def run(base_url: str, model: str) -> list[kvlease.Turn]:
    async with AsyncOpenAI(base_url=base_url, api_key="EMPTY") as raw, kvlease.wrap(raw) as kc:
        conv = kc.conversation()
        chat_model = OpenAIChatModel(model, provider=OpenAIProvider(openai_client=conv.client))
        agent = Agent(chat_model, tools=[get_weather], instructions="Answer briefly.")
        history: list[Any] = []
        for question in _common.QUESTIONS:
            result = await agent.run(question, message_history=history)
            history = result.all_messages()
        return conv.turns


def main() -> None:
    _common.main(__doc__, run)


if __name__ == "__main__":
    main()
