"""The vLLM-free core of the streaming-handle plugin.

vLLM 0.32 returns ``kv_transfer_params`` (the P/D block handle) only in non-streaming responses. The
plugin makes streamed responses carry it too, on the last JSON chunk before ``data: [DONE]``. It
does so from the outside of vLLM's stream generators, with two pieces that live here:

* :class:`ResultTap` wraps the engine's result iterator that vLLM hands to its stream generator. It
  passes every output through unchanged and remembers, from the final output, the engine's
  ``kv_transfer_params``; it also says when the final output has been seen.
* :func:`annotate_final_chunk` wraps the generator's SSE strings. Before the tap has seen the final
  output it forwards each chunk at once (no buffering, so no added latency per token). From then on
  the generator only emits its closing chunks (the finishing chunk(s), the usage chunk, ``[DONE]``)
  without awaiting the engine, so holding them until ``[DONE]`` costs nothing; the last JSON chunk
  that has ``choices`` gets the params added.

Nothing here imports vLLM: outputs are read by duck typing (``finished``, ``kv_transfer_params``),
so this module is unit-tested with plain objects.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

from kvlease.protocol import KV_TRANSFER_PARAMS, SSE_DONE

__all__ = ["DONE_EVENT", "ResultTap", "annotate_final_chunk", "inject_into_event"]

#: vLLM's end-of-stream SSE event, exactly as its generators yield it.
DONE_EVENT = SSE_DONE
_DATA = "data: "


class ResultTap:
    """An async iterator over vLLM's engine outputs that records the final ``kv_transfer_params``.

    ``indexed`` is for text completions, whose stream generator receives ``(prompt_index, output)``
    pairs from several prompts; the handle is taken from prompt 0, as vLLM's non-streaming
    completion response does. Chat completions receive bare outputs of one request.

    The tap forwards ``aclose()`` to the wrapped generator, so cancelling a stream still aborts the
    engine request promptly.
    """

    __slots__ = ("_finished_prompts", "_indexed", "_num_prompts", "_source", "finished", "params")

    def __init__(self, source: AsyncIterator[Any], *, indexed: bool = False, num_prompts: int = 1) -> None:
        self._source = source
        self._indexed = indexed
        self._num_prompts = max(1, num_prompts)
        self._finished_prompts: set[int] = set()
        #: True once the final output of every prompt has passed through.
        self.finished = False
        #: The engine's ``kv_transfer_params`` from the final output (prompt 0), if any.
        self.params: dict[str, Any] | None = None

    def __aiter__(self) -> ResultTap:
        return self

    async def __anext__(self) -> Any:
        item = await self._source.__anext__()
        if self._indexed:
            index, output = item
        else:
            index, output = 0, item
        if getattr(output, "finished", False):
            if index == 0:
                params = getattr(output, "kv_transfer_params", None)
                if isinstance(params, Mapping):
                    self.params = dict(params)
            self._finished_prompts.add(index)
            if len(self._finished_prompts) >= self._num_prompts:
                self.finished = True
        return item

    async def aclose(self) -> None:
        close = getattr(self._source, "aclose", None)
        if close is not None:
            await close()


def inject_into_event(event: str, params: Mapping[str, Any]) -> str | None:
    """``event`` (one ``data: {...}`` SSE event) with ``kv_transfer_params`` added, or ``None``.

    ``None`` when the event is not a JSON object with a ``choices`` list (``[DONE]``, an error
    event, anything unexpected): such events are never modified.
    """
    if not event.startswith(_DATA):
        return None
    payload = event[len(_DATA) :]
    try:
        obj = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list):
        return None
    obj[KV_TRANSFER_PARAMS] = dict(params)
    tail = payload[len(payload.rstrip()) :] or "\n\n"
    return _DATA + json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + tail


async def annotate_final_chunk(
    stream: AsyncGenerator[str, None], tap: ResultTap
) -> AsyncGenerator[str, None]:
    """Forward ``stream``; add ``tap.params`` to its last JSON chunk before ``[DONE]``.

    Events produced before the tap saw the final engine output are forwarded as they come. Events
    after it are held until the stream ends (or reaches ``[DONE]``), then the last one that
    :func:`inject_into_event` accepts carries the params. A stream that ends without a final output
    (error, cancellation) is forwarded unchanged.
    """
    held: list[str] = []
    try:
        async for event in stream:
            if not tap.finished:
                yield event
                continue
            if event != DONE_EVENT:
                held.append(event)
                continue
            for out in _annotated(held, tap.params):
                yield out
            held = []
            yield event
        for out in _annotated(held, tap.params):
            yield out
    finally:
        await stream.aclose()


def _annotated(held: list[str], params: Mapping[str, Any] | None) -> list[str]:
    if params is None:
        return held
    for i in range(len(held) - 1, -1, -1):
        changed = inject_into_event(held[i], params)
        if changed is not None:
            return [*held[:i], changed, *held[i + 1 :]]
    return held
