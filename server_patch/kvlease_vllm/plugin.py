"""The kvlease vLLM plugin: ``kv_transfer_params`` on the final chunk of streamed completions.

vLLM loads :func:`register` through the ``vllm.general_plugins`` entry point (declared in the
project's ``pyproject.toml``) in every vLLM process; ``VLLM_PLUGINS`` filters it like any plugin
(``VLLM_PLUGINS=kvlease`` keeps it, a list without ``kvlease`` drops it).

What it changes, and the only place it touches vLLM: the stream generator methods of the OpenAI
chat and text completion serving classes (``OpenAIServingChat.chat_completion_stream_generator``,
``OpenAIServingCompletion.completion_stream_generator``). Each is replaced by a thin wrapper that,
for requests carrying ``kv_transfer_params`` (P/D traffic only), taps the engine's result iterator
and adds the engine's final ``kv_transfer_params`` to the last JSON chunk before ``data: [DONE]``,
as vLLM's non-streaming responses already carry it (upstream proposal: vllm-project/vllm#40186).
Requests without ``kv_transfer_params`` go straight to vLLM's own generator.

vLLM is imported lazily, in :func:`register`, by module name: the plugin needs only the two serving
modules, not the connector's vLLM surface in ``kvlease_vllm._compat`` (which pulls in NIXL). In
engine and worker processes that vLLM starts fresh, this imports the serving modules once (about
0.5 s at start-up); they are unused there.

vLLM 0.33 streams ``kv_transfer_params`` in the final chunk itself (the chat and completion
serving code), so from 0.33 on the plugin steps aside and patches nothing
(:func:`kvlease_vllm._config.streams_handles_natively`).

Safety: outside the supported vLLM range the plugin does nothing. Before patching, the targets are
checked (class and method present, an async generator function, parameters ``request`` and
``result_generator``; ``num_prompts`` for text completions). On any mismatch the plugin logs a
warning and leaves that target alone, so a vLLM upgrade can only switch the feature off, never
break the server. Registering twice (vLLM calls plugins in several processes, and forked processes
inherit patched classes) is a no-op.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvlease_vllm._config import check_vllm_version, streams_handles_natively
from kvlease_vllm._plugin_stream import ResultTap, annotate_final_chunk

__all__ = ["TARGETS", "PatchTarget", "apply", "is_patched", "register"]

# A child of vLLM's "vllm" logger, so these lines reach the server log with vLLM's own handler and
# format (vLLM configures only that logger tree and does not propagate it to the root).
logger = logging.getLogger("vllm.kvlease.plugin")

#: Marks a wrapper and keeps the original function: ``getattr(fn, _ORIGINAL)``.
_ORIGINAL = "__kvlease_original__"


@dataclass(frozen=True)
class PatchTarget:
    """One vLLM stream generator method the plugin wraps."""

    module: str
    cls: str
    method: str
    #: Its result iterator yields ``(prompt_index, output)`` pairs (text completions).
    indexed: bool
    #: Parameters the wrapper reads or replaces; all must exist in the method's signature.
    required_params: tuple[str, ...]

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.cls}.{self.method}"


TARGETS: tuple[PatchTarget, ...] = (
    PatchTarget(
        module="vllm.entrypoints.openai.chat_completion.serving",
        cls="OpenAIServingChat",
        method="chat_completion_stream_generator",
        indexed=False,
        required_params=("self", "request", "result_generator"),
    ),
    PatchTarget(
        module="vllm.entrypoints.openai.completion.serving",
        cls="OpenAIServingCompletion",
        method="completion_stream_generator",
        indexed=True,
        required_params=("self", "request", "result_generator", "num_prompts"),
    ),
)


def register() -> None:
    """vLLM ``general_plugins`` entry point: patch the stream generators once per process.

    Does nothing (one warning) outside the vLLM range kvlease supports: a later vLLM may stream the
    handle itself (vllm-project/vllm#40186) or have changed the targets. Never raises: a failure to
    import or to verify a target is logged and that target is skipped.
    """
    try:
        version = str(getattr(importlib.import_module("vllm"), "__version__", ""))
        check_vllm_version(version)
    except Exception as e:
        logger.warning("kvlease plugin: %s; streams stay stock", e)
        return
    if streams_handles_natively(version):
        logger.info("kvlease plugin: vLLM %s streams kv_transfer_params itself; nothing to patch", version)
        return
    apply(TARGETS)


def apply(targets: tuple[PatchTarget, ...] = TARGETS) -> dict[str, str]:
    """Patch each target; return ``{qualname: outcome}`` (``"patched"``, ``"already patched"`` or
    why it was left stock). Never raises."""
    outcome: dict[str, str] = {}
    for target in targets:
        try:
            outcome[target.qualname] = _patch(target)
        except Exception as e:  # a plugin must never take the server down
            outcome[target.qualname] = f"failed: {type(e).__name__}: {e}"
            logger.warning(
                "kvlease plugin: could not patch %s; streams stay stock", target.qualname, exc_info=True
            )
    return outcome


def is_patched(target: PatchTarget) -> bool:
    """Whether ``target`` currently carries the kvlease wrapper (imports its vLLM module)."""
    cls = getattr(importlib.import_module(target.module), target.cls, None)
    return hasattr(getattr(cls, target.method, None), _ORIGINAL)


def _patch(target: PatchTarget) -> str:
    cls = getattr(importlib.import_module(target.module), target.cls, None)
    current = None if cls is None else cls.__dict__.get(target.method)
    if current is not None and hasattr(current, _ORIGINAL):
        return "already patched"  # registered before in this process (or inherited by fork)
    problem = "not found" if current is None else _signature_problem(current, target)
    if problem is not None or current is None:
        logger.warning("kvlease plugin: %s %s; streams stay stock", target.qualname, problem)
        return problem or "not found"
    setattr(cls, target.method, _wrap(current, target))
    logger.info("kvlease plugin: streamed responses of %s carry kv_transfer_params", target.qualname)
    return "patched"


def _signature_problem(fn: object, target: PatchTarget) -> str | None:
    """Why ``fn`` cannot be wrapped for ``target``, or ``None`` if it can."""
    if not inspect.isasyncgenfunction(fn):
        return "is not an async generator function"
    params = inspect.signature(fn).parameters
    missing = [p for p in target.required_params if p not in params]
    if missing:
        return f"has no parameter(s) {', '.join(missing)}"
    return None


def _wrap(original: Callable[..., Any], target: PatchTarget) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def stream_generator(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        request = bound.arguments["request"]
        if not getattr(request, "kv_transfer_params", None):
            return original(*args, **kwargs)  # not P/D traffic: vLLM's own generator, untouched
        num_prompts = bound.arguments.get("num_prompts", 1)
        tap = ResultTap(
            bound.arguments["result_generator"],
            indexed=target.indexed,
            num_prompts=num_prompts if isinstance(num_prompts, int) else 1,
        )
        bound.arguments["result_generator"] = tap
        return annotate_final_chunk(original(*bound.args, **bound.kwargs), tap)

    setattr(stream_generator, _ORIGINAL, original)
    return stream_generator
