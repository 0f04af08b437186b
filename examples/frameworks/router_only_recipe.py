"""The router alone: any OpenAI-compatible client, ``base_url`` at the router and an id per request.

    python examples/frameworks/router_only_recipe.py --base-url http://127.0.0.1:8000/v1 --model m

For frameworks that build their own client and take neither an openai client nor an HTTP client.
Send the conversation id as the ``X-Session-Id`` header (any ``extra_headers`` / ``default_headers``)
or as the body field ``prompt_cache_key`` (ChatOpenAI, pydantic-ai's ``openai_prompt_cache_key``).

What it keeps: the router's reuse (``first``, ``hit``, ``hit``), read here from the
``X-KVLease-Status`` header. What it loses without the SDK: heartbeats (a pause past the lease TTL
comes back ``expired``), release at the end, and client-side strip detection and turn records
(behind the kvlease connector the token-verified pull keeps a changed history safe anyway).
"""

from __future__ import annotations

from typing import Any

import _common
from openai import OpenAI

from kvlease.protocol import BODY_PROMPT_CACHE_KEY, HEADER_REUSED_TOKENS, HEADER_SESSION_ID, HEADER_STATUS

QUESTIONS = ("What is the capital of France?", "And of Italy?", "And of Spain?")


def run(
    base_url: str, model: str, session: str = "user-42", *, body_key: bool = False
) -> list[tuple[str, str]]:
    """``(status, reused tokens)`` of each turn; ``body_key`` sends the id as ``prompt_cache_key``."""
    client = OpenAI(base_url=base_url, api_key="EMPTY")
    ident: dict[str, Any] = (
        {"extra_body": {BODY_PROMPT_CACHE_KEY: session}}
        if body_key
        else {"extra_headers": {HEADER_SESSION_ID: session}}
    )
    messages: list[Any] = []
    out = []
    with client:
        for question in QUESTIONS:
            messages.append({"role": "user", "content": question})
            raw = client.chat.completions.with_raw_response.create(model=model, messages=messages, **ident)
            messages.append(raw.parse().choices[0].message)
            out.append((raw.headers.get(HEADER_STATUS, "?"), raw.headers.get(HEADER_REUSED_TOKENS, "?")))
    return out


def main() -> None:
    ap = _common.parser(__doc__)
    ap.add_argument("--prompt-cache-key", action="store_true", help="send the id in the body")
    args = ap.parse_args()
    for i, (status, reused) in enumerate(run(args.base_url, args.model, body_key=args.prompt_cache_key)):
        print(f"turn {i + 1}: status={status} reused={reused}")


if __name__ == "__main__":
    main()
