"""smolagents on kvlease: a ``ToolCallingAgent`` whose memory carries over (``reset=False``).

    python examples/frameworks/smolagents_recipe.py --base-url http://127.0.0.1:8000/v1 --model m

Glue: ``OpenAIServerModel(model_id=..., client=conv.client)``. smolagents resends its memory as text
without the assistant tool calls, so every follow-up differs from what the model returned
(``tool-calls-changed``). Behind the kvlease connector the token-verified prefix before the first
difference is still reused; against stock vLLM those turns are recomputed.
"""

from __future__ import annotations

import _common
from openai import OpenAI
from smolagents import OpenAIServerModel, ToolCallingAgent, tool

import kvlease


@tool
def get_weather(city: str) -> str:
    """The weather in a city.

    Args:
        city: the city's name.
    """
    return f"sunny in {city}"


def run(base_url: str, model: str) -> list[kvlease.Turn]:
    with kvlease.wrap(OpenAI(base_url=base_url, api_key="EMPTY")) as kc, kc.conversation() as conv:
        agent = ToolCallingAgent(
            tools=[get_weather],
            model=OpenAIServerModel(model_id=model, client=conv.client),
            max_steps=4,
            verbosity_level=0,
        )
        for i, question in enumerate(_common.QUESTIONS):
            agent.run(question, reset=i == 0)
        return conv.turns


def main() -> None:
    _common.main(__doc__, run)


if __name__ == "__main__":
    main()
