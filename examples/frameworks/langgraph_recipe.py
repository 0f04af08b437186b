"""LangGraph on kvlease: a ReAct agent on ``ChatKVLease``, the thread id as the conversation id.

    python examples/frameworks/langgraph_recipe.py --base-url http://127.0.0.1:8000/v1 --model m

Glue: ``ChatKVLease`` instead of ``ChatOpenAI``; the ``configurable.thread_id`` of each call is the
conversation. LangChain drops reasoning from the history; by default the kvlease connector still
reuses the token-verified prefix, and ``reasoning_policy="keep"`` sends the reasoning back.
"""

from __future__ import annotations

import argparse

from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.prebuilt import create_react_agent  # langchain.agents.create_agent takes the same model

import kvlease
from kvlease_langchain import ChatKVLease

QUESTIONS = ("What is the weather in Paris?", "And tomorrow?")


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
        for question in QUESTIONS:
            agent.invoke({"messages": [("user", question)]}, config)
        conv = chat.get_conversation(thread_id)
        return conv.turns if conv is not None else []
    finally:
        chat.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="tiny")
    args = ap.parse_args()
    for t in run(args.base_url, args.model):
        print(
            f"turn {t.index + 1}: status={t.status and t.status.value} reused={t.reused_tokens} history={t.history.value}"
        )


if __name__ == "__main__":
    main()
