"""What a pull must prove beyond equal tokens, and the topologies kvlease declines (sans-IO).

vLLM's own block hashes cover the LoRA adapter, multimodal features, ``cache_salt`` and prompt
embeddings (``v1/core/kv_cache_utils.py``); kvlease's chain covers tokens and salt. D therefore
records the LoRA adapter and a digest of its multimodal features in the ``kvlease`` object, and P
declines unless its own request has the same ones (:func:`uncovered_inputs`). Prompt embeddings
have no identity kvlease can prove: such a request never pulls.

Each function returns ``None`` (no objection) or the reason in words, for the decline's log line.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvlease.protocol import LeaseHandleExt, mm_digest

__all__ = [
    "context_parallel_reason",
    "control_port",
    "group_windows",
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


#: Kinds of KV cache group (vLLM's ``KVCacheSpec`` class names) whose block list a verified prefix
#: can be cut from: full attention names every block; a sliding window keeps its last blocks.
_FULL_SPECS = frozenset({"FullAttentionSpec", "MLAAttentionSpec"})
_WINDOW_SPECS = frozenset({"SlidingWindowSpec", "SlidingWindowMLASpec"})


def group_windows(specs: Iterable[Any], block_size: int) -> tuple[int | None, ...]:
    """Per KV cache group (vLLM's ``kv_cache_spec`` of each transfer group): ``0`` for full
    attention, the tokens a sliding-window group keeps below the next token
    (``sliding_window + extra_retained_tokens``), ``None`` for any other kind (Mamba state, chunked
    local or ring attention), whose blocks hold no per-position KV a prefix can be cut from, and for
    a group whose blocks are not ``block_size`` tokens (kvlease hashes and trims by that size)."""
    out: list[int | None] = []
    for spec in specs:
        kind = type(spec).__name__
        if getattr(spec, "block_size", block_size) != block_size:
            out.append(None)
        elif kind in _FULL_SPECS:
            out.append(0)
        elif kind in _WINDOW_SPECS:
            out.append(int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0) or 0))
        else:
            out.append(None)
    return tuple(out)


def _first_window_block(tokens: int, window: int, block_size: int) -> int:
    """The first block a sliding-window group holds after ``tokens`` computed tokens: vLLM skips the
    ``tokens - window + 1`` tokens before the next token's window and nulls every block they fill."""
    return max(0, tokens - window + 1) // block_size


def hybrid_partial_reason(
    *,
    windows: Sequence[int | None],
    hybrid: bool,
    verified: int,
    remote_tokens: int,
    block_size: int,
    named: Sequence[int],
) -> str | None:
    """Several KV cache groups (sliding window, Mamba): why P cannot pull ``verified`` of D's
    ``remote_tokens`` tokens, or None.

    ``windows``: :func:`group_windows` of P's transfer groups; ``named``: the blocks D's handle names
    per group. Upstream hands out only the tail of a sliding-window group's blocks (the last
    ``cdiv(sliding_window, block_size) + 1``, of which those wholly before D's window are null), and
    P reads into its own blocks from the end of each list. A prefix ending before D's end is
    therefore pullable only when D still holds every block of the window before the prefix's end
    (:func:`kvlease_vllm._verify.trim_params` cuts each list at that end); a group of any other kind
    holds state for D's whole sequence only. D's whole sequence is always pullable.
    """
    if not (len(windows) > 1 or hybrid) or verified >= remote_tokens:
        return None
    head = f"hybrid KV cache ({len(windows)} KV cache groups): only {verified} of D's {remote_tokens} tokens verified"
    if any(w is None for w in windows):
        return (
            f"{head}, and a group without per-position KV of this block size (e.g. Mamba state) "
            "holds D's whole sequence only"
        )
    bs = block_size
    end, d_end = -(-verified // bs), -(-remote_tokens // bs)
    for window, n in zip(windows, named):
        if not window:
            continue
        need = _first_window_block(verified, window, bs)
        held = max(d_end - n, _first_window_block(remote_tokens, window, bs))
        if need < held:
            return (
                f"{head}; its sliding-window layers ({window} tokens) need the KV of blocks {need}..{end - 1}, "
                f"and D holds only blocks {held}..{d_end - 1} of that group (vLLM frees a sliding-window "
                "group's blocks behind its window and hands out only its last cdiv(window, block_size) + 1, "
                "so a shorter prefix pulls only when it ends in D's last blocks)"
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
