"""LangGraph on kvlease: a ReAct agent on ``ChatKVLease``, the thread id as the conversation id.

    python examples/frameworks/langgraph_recipe.py --base-url http://127.0.0.1:8000/v1 --model m

Glue: ``ChatKVLease`` instead of ``ChatOpenAI``; the ``configurable.thread_id`` of each call is the
conversation. LangChain drops reasoning from the history; by default the kvlease connector still
reuses the token-verified prefix, and ``reasoning_policy="keep"`` sends the reasoning back.
"""

from __future__ import annotations

import _common
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.prebuilt import create_react_agent  # langchain.agents.create_agent takes the same model

import kvlease
from kvlease_langchain import ChatKVLease


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def run(
    base_url: str, model: str, thread_id: str = "user-42", reasoning_policy: str = "warn"
) -> list[kvlease.Turn]:
    chat = ChatKVLease(model=model, base_url=base_url, api_key="EMPTY", reasoning_policy=reasoning_policy)  # type: ignore[arg-type]
    try:
        agent = create_react_agent(chat, [get_weather], checkpointer=InMemorySaver())
        config = {"configurable": {"thread_id": thread_id}}
        for question in _common.QUESTIONS:
            agent.invoke({"messages": [("user", question)]}, config)
        conv = chat.get_conversation(thread_id)
        return conv.turns if conv is not None else []
    finally:
        chat.close()


def main() -> None:
    _common.main(__doc__, run)


if __name__ == "__main__":
    main()
