"""A LangGraph agent whose tool takes longer than the KV lease lasts, and the next turn still reuses.

The agent is an ordinary LangGraph loop: the model answers or calls ``slow_lookup``; the tool sleeps
``--tool-seconds`` (pass more than the router's lease TTL); then the model continues. When the model
does not call the tool (small models rarely do), a "waiting" step sleeps just as long, like a human
taking their time, and asks the next question. Meanwhile the kvlease SDK behind ``ChatKVLease``
renews the conversation's lease with heartbeats, so each follow-up turn is a ``hit``: the prefill
node pulls the decode node's KV instead of recomputing the whole history.

    python examples/langchain_agent.py --base-url http://127.0.0.1:8000/v1 --model tiny \\
        --tool-seconds 90          # longer than the router's TTL

Prints one line per model turn, from the SDK's turn records: status, reused tokens, TTFT, and the
idle gap before the turn. ``--no-heartbeat`` shows the contrast (follow-ups arrive ``expired``);
``--check`` exits with status 1 unless every follow-up turn reused KV.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

from kvlease_langchain import ChatKVLease

FOLLOW_UPS = (
    "Thanks. What should I check next?",
    "And after that?",
    "Summarize what we found in one sentence.",
    "Anything else?",
)


def build_agent(model: ChatKVLease, *, tool_seconds: float, turns: int) -> Any:
    """The agent graph: ``agent`` -> (``tools`` | ``wait``) -> ``agent`` ... until ``turns`` answers."""

    @tool
    def slow_lookup(query: str) -> str:
        """Look something up in a slow backend (takes a while)."""
        print(f"    tool slow_lookup({query!r}): sleeping {tool_seconds:g}s", flush=True)
        time.sleep(tool_seconds)
        return f"result for {query}: nothing unusual"

    agent_model = model.bind_tools([slow_lookup])

    def agent(state: MessagesState) -> dict[str, list[BaseMessage]]:
        reply = agent_model.invoke(state["messages"])
        meta = reply.response_metadata.get("kvlease", {})
        print(
            f"  turn {meta.get('turn', '?')}: status={meta.get('status')} "
            f"reused_tokens={meta.get('reused_tokens')} history={meta.get('history')}",
            flush=True,
        )
        return {"messages": [reply]}

    def wait(state: MessagesState) -> dict[str, list[BaseMessage]]:
        answered = sum(isinstance(m, AIMessage) and not m.tool_calls for m in state["messages"])
        print(f"    waiting {tool_seconds:g}s before the next question", flush=True)
        time.sleep(tool_seconds)
        return {"messages": [HumanMessage(FOLLOW_UPS[(answered - 1) % len(FOLLOW_UPS)])]}

    def route(state: MessagesState) -> str:
        last = state["messages"][-1]
        if isinstance(last, AIMessage) and last.tool_calls:
            return "tools"
        answered = sum(isinstance(m, AIMessage) and not m.tool_calls for m in state["messages"])
        return "wait" if answered < turns else END

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([slow_lookup]))
    graph.add_node("wait", wait)
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", route, {"tools": "tools", "wait": "wait", END: END})
    graph.add_edge("tools", "agent")
    graph.add_edge("wait", "agent")
    return graph.compile()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="router (or vLLM) URL ending in /v1")
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument("--api-key", default="EMPTY")
    parser.add_argument("--turns", type=int, default=3, help="answers to collect (default 3)")
    parser.add_argument(
        "--tool-seconds", type=float, default=2.0, help="how long the tool (or the user) takes; default 2"
    )
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--thread-id", default=None, help="LangGraph thread id = kvlease conversation id")
    parser.add_argument("--no-heartbeat", action="store_true", help="do not renew leases (to compare)")
    parser.add_argument("--check", action="store_true", help="exit 1 unless every follow-up turn is a hit")
    args = parser.parse_args(argv)

    model = ChatKVLease(
        model=args.model,
        base_url=args.base_url,
        api_key=args.api_key,
        temperature=0,
        max_tokens=args.max_tokens,
        reasoning_policy="keep",  # send reasoning back as returned: the prefix stays identical
        heartbeat=not args.no_heartbeat,
    )
    thread_id = args.thread_id or f"agent-{uuid.uuid4().hex[:12]}"
    agent = build_agent(model, tool_seconds=args.tool_seconds, turns=args.turns)
    print(
        f"conversation {thread_id}: {args.turns} answers, tool/user takes {args.tool_seconds:g}s", flush=True
    )
    try:
        agent.invoke(
            {
                "messages": [
                    HumanMessage("Use slow_lookup to check the disk usage, then tell me what you see.")
                ]
            },
            config={"configurable": {"thread_id": thread_id}, "recursion_limit": 8 * args.turns + 8},
        )
        conversation = model.get_conversation(thread_id)
        turns = conversation.turns if conversation is not None else []
    finally:
        model.close()

    print("\nturn  status    reused  ttft_s  gap_s  ttl_s  history")
    for t in turns:
        status = t.status.value if t.status is not None else "-"
        gap = f"{t.gap_s:6.1f}" if t.gap_s is not None else "     -"
        ttft = f"{t.ttft_s:6.3f}" if t.ttft_s is not None else "     -"
        print(
            f"{t.index:>4}  {status:<8}  {t.reused_tokens!s:>6}  {ttft}  {gap}  {t.ttl_s!s:>5}  {t.history.value}"
        )
    ttl = next((t.ttl_s for t in turns if t.ttl_s), None)
    if ttl is not None and args.tool_seconds <= ttl:
        print(f"\nnote: the tool took {args.tool_seconds:g}s, less than the {ttl:g}s lease TTL; "
              "pass --tool-seconds above it to see heartbeats carry the lease")  # fmt: skip
    follow_ups = turns[1:]
    hits = sum(1 for t in follow_ups if t.status is not None and t.status.value == "hit")
    print(f"\n{hits}/{len(follow_ups)} follow-up turns reused the decode node's KV")
    if args.check and (not follow_ups or hits != len(follow_ups)):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
