"""What a pull must prove beyond equal tokens, and the topologies kvlease declines (sans-IO).

vLLM's own block hashes cover the LoRA adapter, multimodal features, ``cache_salt`` and prompt
embeddings (``v1/core/kv_cache_utils.py``); kvlease's chain covers tokens and salt. D therefore
records the LoRA adapter and a digest of its multimodal features in the ``kvlease`` object, and P
declines unless its own request has the same ones (:func:`uncovered_inputs`). Prompt embeddings
have no identity kvlease can prove: such a request never pulls.

Each function returns ``None`` (no objection) or the reason in words, for the decline's log line.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvlease.protocol import LeaseHandleExt, mm_digest

__all__ = [
    "context_parallel_reason",
    "control_port",
    "hybrid_partial_reason",
    "lora_tag",
    "request_mm_digest",
    "uncovered_inputs",
]


def lora_tag(lora_request: Any) -> str | None:
    """``name#id`` of a vLLM ``LoRARequest`` (None: no adapter)."""
    if lora_request is None:
        return None
    name = getattr(lora_request, "lora_name", None)
    lora_id = getattr(lora_request, "lora_int_id", None)
    return f"{name}#{lora_id}"


def request_mm_digest(mm_features: Iterable[Any] | None, upto: int) -> str | None:
    """:func:`kvlease.protocol.mm_digest` of the features whose placeholders start before ``upto``.

    Each feature is a vLLM ``MultiModalFeatureSpec`` (``identifier``: the content hash vLLM's block
    hashes use; ``mm_position``: ``offset`` and ``length`` of its placeholder tokens).
    """
    out: list[tuple[int, int, str]] = []
    for f in mm_features or ():
        pos = getattr(f, "mm_position", None)
        offset = int(getattr(pos, "offset", 0))
        if offset < upto:
            out.append((offset, int(getattr(pos, "length", 0)), str(getattr(f, "identifier", ""))))
    return mm_digest(out)


def uncovered_inputs(
    ext: LeaseHandleExt, *, lora: str | None, mm: str | None, prompt_embeds: bool
) -> str | None:
    """Why P's request and D's handle may differ in what tokens do not show, or None.

    ``mm`` is P's :func:`request_mm_digest` over D's ``num_tokens``.
    """
    if prompt_embeds:
        return "the request carries prompt embeddings, which the handle cannot prove equal"
    if lora != ext.lora:
        return f"LoRA adapter differs (D computed the KV with {ext.lora or 'none'}, this request uses {lora or 'none'})"
    if mm != ext.mm:
        if ext.mm is None:
            return "the request has multimodal inputs the handle does not cover"
        return "multimodal inputs differ from those D computed the KV with"
    return None


def hybrid_partial_reason(*, groups: int, hybrid: bool, verified: int, remote_tokens: int) -> str | None:
    """Several KV cache groups (sliding window, Mamba): pull only D's whole sequence.

    Upstream hands out only the tail of a sliding-window group's block list, so a prefix shorter than
    D's sequence would give those layers KV of the wrong positions.
    """
    if (groups > 1 or hybrid) and verified < remote_tokens:
        return (
            f"hybrid KV cache ({groups} KV cache groups): only {verified} of D's {remote_tokens} tokens "
            "verified, and a partial prefix cannot be pulled per group"
        )
    return None


def context_parallel_reason(*, local_dcp: int, local_pcp: int, remote_dcp: int | None) -> str | None:
    """Context parallel > 1 on either side: one scheduler block covers ``block_size * dcp`` tokens,
    which kvlease does not hash or trim yet."""
    parts = [
        f"{name}={n}"
        for name, n in (
            ("decode_context_parallel_size", local_dcp),
            ("prefill_context_parallel_size", local_pcp),
            ("the handle's dcp_size", remote_dcp or 1),
        )
        if n > 1
    ]
    if parts:
        return f"context parallel is not supported by kvlease yet ({', '.join(parts)})"
    return None


def control_port(port: int, data_parallel_index: int) -> int:
    """The control port of one data-parallel rank: ``port + index``, like upstream's NIXL side
    channel (``VLLM_NIXL_SIDE_CHANNEL_PORT + data_parallel_index``); 0 stays 0 (any free port)."""
    return port + data_parallel_index if port else 0
