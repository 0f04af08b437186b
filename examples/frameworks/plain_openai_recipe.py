"""Plain ``openai`` on kvlease: a tool-using conversation, the reply appended as returned.

    python examples/frameworks/plain_openai_recipe.py --base-url http://127.0.0.1:8000/v1 --model m

``messages.append(r.choices[0].message)`` keeps the reasoning and the tool calls exactly as the model
returned them, so every turn is an exact extension of the last one (full reuse). A history rebuilt
from dicts without the reasoning is detected (``history="reasoning-stripped"``); behind the kvlease
connector the token-verified prefix is still reused.
"""

from __future__ import annotations

import json
from typing import Any

import _common
from openai import OpenAI

import kvlease

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def get_weather(city: str) -> str:
    return f"sunny in {city}"


def run(base_url: str, model: str, *, strip_reasoning: bool = False) -> list[kvlease.Turn]:
    """One conversation; ``strip_reasoning`` resends replies as dicts without their reasoning."""
    with kvlease.wrap(OpenAI(base_url=base_url, api_key="EMPTY")) as kc, kc.conversation() as conv:
        messages: list[Any] = []
        for question in _common.QUESTIONS:
            messages.append({"role": "user", "content": question})
            while True:
                r = conv.chat.completions.create(model=model, messages=messages, tools=TOOLS)
                msg = r.choices[0].message
                if strip_reasoning:
                    messages.append(
                        msg.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True)
                    )
                else:
                    messages.append(msg)  # as returned: reasoning and tool calls intact
                if not msg.tool_calls:
                    break
                for call in msg.tool_calls:
                    result = get_weather(**json.loads(call.function.arguments))  # type: ignore[union-attr]
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return conv.turns


def main() -> None:
    _common.main(__doc__, run)


if __name__ == "__main__":
    main()
