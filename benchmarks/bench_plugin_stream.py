"""Overhead of the kvlease vLLM plugin on a streamed response (no server needed).

The plugin wraps vLLM's stream generator: a tap on the engine outputs and a pass-through of the SSE
chunks, plus one JSON re-encode of the final chunk. This drives a stand-in stream generator with
chunks shaped like vLLM's (about 250 bytes each) and prints the added time per chunk and per
request. Run: ``python benchmarks/bench_plugin_stream.py [--tokens N] [--requests R]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from kvlease_vllm._plugin_stream import DONE_EVENT, ResultTap, annotate_final_chunk, inject_into_event

HANDLE = {
    "do_remote_prefill": False,
    "do_remote_decode": True,
    "remote_block_ids": [list(range(64))],
    "remote_engine_id": "0f4c5c3e-3d7c-4f56-9f55-3f3d3c0b3a11",
    "remote_request_id": "chatcmpl-0123456789abcdef-01234567",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
    "remote_num_tokens": 1024,
    "remote_blocks_expiry_time": 12345.678,
}


@dataclass
class Output:
    finished: bool
    kv_transfer_params: dict[str, Any] | None


async def engine(n: int) -> AsyncGenerator[Output, None]:
    for i in range(n):
        yield Output(i == n - 1, HANDLE if i == n - 1 else None)


async def stream_generator(results: AsyncIterator[Output]) -> AsyncGenerator[str, None]:
    """Builds chunks like vLLM's chat generator (serialization included, as in vLLM)."""
    async for res in results:
        obj = {
            "id": "chatcmpl-0123456789abcdef",
            "object": "chat.completion.chunk",
            "created": 1796059881,
            "model": "tiny",
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": " token"},
                    "logprobs": None,
                    "finish_reason": "length" if res.finished else None,
                    "token_ids": None,
                }
            ],
        }
        yield f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
    yield DONE_EVENT


async def one(tokens: int, plugin: bool) -> float:
    t0 = time.perf_counter()
    if plugin:
        tap = ResultTap(engine(tokens))
        stream: AsyncIterator[str] = annotate_final_chunk(stream_generator(tap), tap)
    else:
        stream = stream_generator(engine(tokens))
    async for _ in stream:
        pass
    return time.perf_counter() - t0


async def measure(tokens: int, requests: int) -> dict[str, Any]:
    for plugin in (False, True):  # warm up both paths
        await one(tokens, plugin)
    base: list[float] = []
    wrapped: list[float] = []
    for _ in range(requests):
        base.append(await one(tokens, False))
        wrapped.append(await one(tokens, True))
    b, w = statistics.median(base), statistics.median(wrapped)
    final = stream_generator(engine(1))
    first = await final.__anext__()
    t0 = time.perf_counter()
    n = 2000
    for _ in range(n):
        inject_into_event(first, HANDLE)
    inject = (time.perf_counter() - t0) / n
    return {
        "chunks_per_request": tokens,
        "requests": requests,
        "stock_us_per_request": round(b * 1e6, 1),
        "plugin_us_per_request": round(w * 1e6, 1),
        "added_us_per_request": round((w - b) * 1e6, 1),
        "added_us_per_chunk": round((w - b) / tokens * 1e6, 2),
        "final_chunk_injection_us": round(inject * 1e6, 1),
    }


def run(quick: bool = False) -> dict[str, Any]:
    return asyncio.run(measure(256, 50 if quick else 200))


def print_table(res: dict[str, Any]) -> None:
    print(f"streamed request of {res['chunks_per_request']} chunks, median of {res['requests']}")
    print(f"  stock generator       {res['stock_us_per_request']:9.1f} us")
    print(f"  with kvlease plugin   {res['plugin_us_per_request']:9.1f} us")
    print(
        f"  added                 {res['added_us_per_request']:9.1f} us/request ({res['added_us_per_chunk']} us/chunk)"
    )
    print(f"  final-chunk injection {res['final_chunk_injection_us']:9.1f} us (once per request)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args()
    print_table(asyncio.run(measure(args.tokens, args.requests)))
