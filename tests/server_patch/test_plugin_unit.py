"""The vLLM-free core of the streaming-handle plugin, driven with plain outputs and SSE strings."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import pytest

from kvlease.protocol import KV_TRANSFER_PARAMS
from kvlease_vllm._plugin_stream import DONE_EVENT, ResultTap, annotate_final_chunk, inject_into_event
from kvlease_vllm.plugin import TARGETS, PatchTarget, apply, register

HANDLE = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "e"}


@dataclass
class Output:
    """The two attributes of vLLM's ``RequestOutput`` the tap reads."""

    finished: bool
    kv_transfer_params: dict[str, Any] | None = None


async def agen(items: Iterable[Any]) -> AsyncGenerator[Any, None]:
    for item in items:
        yield item


def event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def chunk(text: str, finish: str | None = None) -> str:
    return event({"id": "c", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]})


async def stream_generator(results: AsyncIterator[Any], *, usage: bool = False) -> AsyncGenerator[str, None]:
    """A stand-in for vLLM's stream generator: one chunk per output, optional usage, ``[DONE]``."""
    async for res in results:
        out = res[1] if isinstance(res, tuple) else res
        yield chunk("t", "stop" if out.finished else None)
    if usage:
        yield event({"id": "c", "choices": [], "usage": {"completion_tokens": 3}})
    yield DONE_EVENT


async def collect(stream: AsyncIterator[str]) -> list[str]:
    return [e async for e in stream]


def params_of(events: list[str]) -> list[Any]:
    """``kv_transfer_params`` of every JSON event (``None`` where absent)."""
    out = []
    for e in events:
        if e != DONE_EVENT:
            out.append(json.loads(e.removeprefix("data: ")).get(KV_TRANSFER_PARAMS))
    return out


@pytest.mark.parametrize(
    ("outputs", "usage", "expected"),
    [
        # the finishing chunk is the last before [DONE]: it carries the handle
        ([Output(False), Output(False), Output(True, HANDLE)], False, [None, None, HANDLE]),
        # with include_usage the usage chunk is the final one
        ([Output(False), Output(True, HANDLE)], True, [None, None, HANDLE]),
        # prefill side: the only output is the final one
        ([Output(True, HANDLE)], False, [HANDLE]),
        # the engine returned no handle: stream unchanged
        ([Output(False), Output(True, None)], True, [None, None, None]),
    ],
)
async def test_handle_lands_on_last_json_chunk(
    outputs: list[Output], usage: bool, expected: list[Any]
) -> None:
    tap = ResultTap(agen(outputs))
    events = await collect(annotate_final_chunk(stream_generator(tap, usage=usage), tap))
    assert events[-1] == DONE_EVENT
    assert params_of(events) == expected
    assert tap.finished


async def test_chunks_before_the_final_output_are_not_held_back() -> None:
    """Each token's chunk leaves before the next engine output is requested (no added latency)."""
    pulled: list[int] = []

    async def engine() -> AsyncGenerator[Output, None]:
        for i in range(3):
            pulled.append(i)
            yield Output(i == 2, HANDLE if i == 2 else None)

    tap = ResultTap(engine())
    stream = annotate_final_chunk(stream_generator(tap), tap)
    first = await stream.__anext__()
    assert pulled == [0] and params_of([first]) == [None]
    second = await stream.__anext__()
    assert pulled == [0, 1] and params_of([second]) == [None]
    rest = await collect(stream)
    assert params_of(rest) == [HANDLE]


async def test_indexed_outputs_wait_for_every_prompt_and_use_prompt_zero() -> None:
    other = {"remote_block_ids": [9]}
    results = [(1, Output(True, other)), (0, Output(False)), (0, Output(True, HANDLE))]
    tap = ResultTap(agen(results), indexed=True, num_prompts=2)
    events = await collect(annotate_final_chunk(stream_generator(tap), tap))
    assert params_of(events) == [None, None, HANDLE]


async def test_unfinished_stream_is_forwarded_unchanged() -> None:
    """A stream that dies before the final output (error, abort) never gets a handle."""

    async def failing() -> AsyncGenerator[str, None]:
        yield chunk("a")
        yield event({"error": {"message": "boom"}})
        yield DONE_EVENT

    tap = ResultTap(agen([Output(False)]))
    events = await collect(annotate_final_chunk(failing(), tap))
    assert events == [chunk("a"), event({"error": {"message": "boom"}}), DONE_EVENT]


async def test_error_event_after_final_output_is_not_annotated() -> None:
    async def gen(tap: ResultTap) -> AsyncGenerator[str, None]:
        async for _ in tap:
            yield chunk("a", "stop")
        yield event({"error": {"message": "late"}})
        yield DONE_EVENT

    tap = ResultTap(agen([Output(True, HANDLE)]))
    events = await collect(annotate_final_chunk(gen(tap), tap))
    assert params_of(events) == [HANDLE, None]


async def test_closing_the_stream_closes_the_engine_generator() -> None:
    closed: list[str] = []

    async def engine() -> AsyncGenerator[Output, None]:
        try:
            yield Output(False)
            yield Output(True, HANDLE)
        finally:
            closed.append("engine")

    tap = ResultTap(engine())
    stream = annotate_final_chunk(stream_generator(tap), tap)
    await stream.__anext__()
    await stream.aclose()
    await tap.aclose()
    assert closed == ["engine"]


@pytest.mark.parametrize(
    ("raw", "accepted"),
    [
        (chunk("x", "stop"), True),
        (event({"id": "c", "choices": [], "usage": {}}), True),
        (DONE_EVENT, False),
        (event({"error": {"message": "e"}}), False),
        ("data: not json\n\n", False),
        ("data: [1, 2]\n\n", False),
        (": keep-alive\n\n", False),
    ],
)
def test_inject_into_event(raw: str, accepted: bool) -> None:
    out = inject_into_event(raw, HANDLE)
    if not accepted:
        assert out is None
        return
    assert out is not None and out.startswith("data: ") and out.endswith("\n\n")
    obj = json.loads(out.removeprefix("data: "))
    assert obj[KV_TRANSFER_PARAMS] == HANDLE
    assert {k: v for k, v in obj.items() if k != KV_TRANSFER_PARAMS} == json.loads(raw.removeprefix("data: "))


def test_plugin_module_imports_without_vllm() -> None:
    """``kvlease_vllm.plugin`` must import in an environment without vLLM (vLLM is imported in register)."""
    import subprocess
    import sys

    code = (
        "import sys, kvlease_vllm.plugin, kvlease_vllm._plugin_stream\n"
        "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules), 'vllm imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------------------------------
# Registration: the checks that keep a changed vLLM from being patched, on stand-in serving classes
# (vLLM's own classes are exercised by tests/integration/test_plugin.py on the real server).
# --------------------------------------------------------------------------------------------------


@dataclass
class Request:
    kv_transfer_params: dict[str, Any] | None = None


class ChatServing:
    """Shaped like vLLM 0.32's ``OpenAIServingChat`` stream generator."""

    async def chat_completion_stream_generator(
        self, request: Request, result_generator: AsyncIterator[Output], request_id: str
    ) -> AsyncGenerator[str, None]:
        async for res in result_generator:
            yield chunk(request_id, "stop" if res.finished else None)
        yield DONE_EVENT


class CompletionServing:
    async def completion_stream_generator(
        self, request: Request, result_generator: AsyncIterator[tuple[int, Output]], num_prompts: int
    ) -> AsyncGenerator[str, None]:
        async for _, res in result_generator:
            yield chunk("t", "stop" if res.finished else None)
        yield DONE_EVENT


class Changed:
    def sync_method(self, request: Request, result_generator: Any) -> list[str]:
        return []

    async def renamed(self, request: Request, results: Any) -> AsyncGenerator[str, None]:
        yield DONE_EVENT


def target(cls: type, method: str, *, indexed: bool = False, extra: tuple[str, ...] = ()) -> PatchTarget:
    return PatchTarget(
        module=__name__,
        cls=cls.__name__,
        method=method,
        indexed=indexed,
        required_params=("self", "request", "result_generator", *extra),
    )


CHAT = target(ChatServing, "chat_completion_stream_generator")
COMPLETION = target(CompletionServing, "completion_stream_generator", indexed=True, extra=("num_prompts",))


@pytest.fixture
def restore_classes() -> Iterable[None]:
    saved = [(c, dict(c.__dict__)) for c in (ChatServing, CompletionServing, Changed)]
    yield
    for cls, attrs in saved:
        for name, value in attrs.items():
            if callable(value):
                setattr(cls, name, value)


@pytest.mark.usefixtures("restore_classes")
async def test_apply_wraps_once_and_only_p_d_requests_change() -> None:
    assert apply((CHAT, COMPLETION)) == {CHAT.qualname: "patched", COMPLETION.qualname: "patched"}
    wrapped = ChatServing.chat_completion_stream_generator
    assert apply((CHAT, COMPLETION)) == {
        CHAT.qualname: "already patched",
        COMPLETION.qualname: "already patched",
    }
    assert ChatServing.chat_completion_stream_generator is wrapped

    outputs = [Output(False), Output(True, HANDLE)]
    plain = await collect(ChatServing().chat_completion_stream_generator(Request(), agen(outputs), "id"))
    assert params_of(plain) == [None, None]
    pd = await collect(
        ChatServing().chat_completion_stream_generator(
            Request(kv_transfer_params={"do_remote_decode": True}), agen(outputs), request_id="id"
        )
    )
    assert params_of(pd) == [None, HANDLE]

    both = [(0, Output(True, HANDLE)), (1, Output(False)), (1, Output(True, None))]
    text = await collect(
        CompletionServing().completion_stream_generator(Request({"x": 1}), agen(both), num_prompts=2)
    )
    assert params_of(text) == [None, None, HANDLE]


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (target(Changed, "sync_method"), "is not an async generator function"),
        (target(Changed, "renamed"), "has no parameter(s) result_generator"),
        (target(Changed, "absent"), "not found"),
        (PatchTarget(__name__, "NoSuchClass", "m", False, ()), "not found"),
    ],
)
@pytest.mark.usefixtures("restore_classes")
def test_apply_leaves_changed_targets_stock(bad: PatchTarget, reason: str) -> None:
    before = dict(Changed.__dict__)
    assert apply((bad,)) == {bad.qualname: reason}
    assert dict(Changed.__dict__) == before


def test_apply_never_raises_on_a_missing_module() -> None:
    missing = PatchTarget("kvlease_no_such_module.serving", "C", "m", False, ())
    (outcome,) = apply((missing,)).values()
    assert outcome.startswith("failed: ModuleNotFoundError")


def test_targets_match_the_pinned_vllm_names() -> None:
    """The two vLLM 0.32 methods the plugin wraps (the real check runs in register() on the server)."""
    assert {(t.cls, t.method, t.indexed) for t in TARGETS} == {
        ("OpenAIServingChat", "chat_completion_stream_generator", False),
        ("OpenAIServingCompletion", "completion_stream_generator", True),
    }


def test_register_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's plugin loader calls register() in every process; without vLLM it only warns."""
    import importlib.util

    register()
    if importlib.util.find_spec("vllm") is None:
        assert "streams stay stock" in caplog.text
