"""What a pull must prove beyond tokens, the topologies kvlease declines, and the handle fields
vLLM 0.33 adds (pure, no vLLM)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from kvlease.protocol import KV, LEASE_HANDLE_MAC, ProtocolError, TransferParams, mac_ok, mm_digest
from kvlease_vllm._guards import (
    context_parallel_reason,
    control_port,
    group_windows,
    hybrid_partial_reason,
    lora_tag,
    request_mm_digest,
    uncovered_inputs,
)
from kvlease_vllm._verify import handle_ext, handle_mac

SECRET = "s3cret"
BS = 16
TOKENS = list(range(100, 100 + 4 * BS + 3))


@dataclass
class _Lora:
    lora_name: str
    lora_int_id: int


@dataclass
class _Pos:
    offset: int
    length: int


@dataclass
class _Feature:
    identifier: str
    mm_position: _Pos


def ext(**kw: Any) -> Any:
    return handle_ext(
        token_ids=TOKENS,
        num_tokens=len(TOKENS),
        block_size=BS,
        salt=None,
        lease_id="d-1",
        engine_id="e-d",
        control="http://127.0.0.1:9000",
        **kw,
    )


def params(**over: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        KV.DO_REMOTE_DECODE: True,
        KV.DO_REMOTE_PREFILL: False,
        KV.REMOTE_BLOCK_IDS: [[1, 2, 3, 4, 5]],
        KV.REMOTE_ENGINE_ID: "e-d",
        KV.REMOTE_REQUEST_ID: "d-1",
        KV.REMOTE_HOST: "127.0.0.1",
        KV.REMOTE_PORT: 5601,
        KV.REMOTE_NUM_TOKENS: len(TOKENS),
        KV.KVLEASE: ext().to_json(),
    }
    out.update(over)
    return out


def signed(p: dict[str, Any]) -> dict[str, Any]:
    p = dict(p)
    p[KV.KVLEASE] = {**p[KV.KVLEASE], LEASE_HANDLE_MAC: handle_mac(SECRET, p)}
    return p


# ---------------------------------------------------------------- MAC and parse of new fields
@pytest.mark.parametrize(
    ("field", "value", "edited"),
    [
        (KV.REMOTE_REGISTRATION_GENERATION, 3, 4),
        (KV.REMOTE_REGISTRATION_GENERATION, 0, None),  # removed
        (KV.REMOTE_BLOCK_SIZE, BS, 32),
    ],
)
def test_mac_covers_registration_generation_and_block_size(field: str, value: int, edited: Any) -> None:
    p = signed(params(**{field: value}))
    assert mac_ok(SECRET, p)
    bad = dict(p)
    if edited is None:
        del bad[field]
    else:
        bad[field] = edited
    assert not mac_ok(SECRET, bad)


def test_mac_of_a_handle_without_the_new_fields_is_unchanged() -> None:
    """0.32 handles carry neither field: their MAC covers what it always did."""
    p = params()
    assert handle_mac(SECRET, p) == handle_mac(SECRET, {**p, "some_other_field": 1})
    assert handle_mac(SECRET, p) != handle_mac(SECRET, {**p, KV.REMOTE_REGISTRATION_GENERATION: 0})


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({KV.REMOTE_BLOCK_SIZE: 0}, "remote_block_size must be an integer"),
        ({KV.REMOTE_BLOCK_SIZE: "16"}, "remote_block_size must be an integer"),
        ({KV.REMOTE_BLOCK_SIZE: None}, "remote_block_size must be an integer"),
        ({KV.REMOTE_BLOCK_SIZE: 32}, "remote_block_size 32 does not match kvlease.block_size"),
        ({KV.REMOTE_REGISTRATION_GENERATION: -1}, "remote_registration_generation must be"),
        ({KV.REMOTE_REGISTRATION_GENERATION: True}, "remote_registration_generation must be"),
    ],
)
def test_parser_checks_the_new_fields(over: dict[str, Any], message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        TransferParams.from_json(params(**over))


def test_new_fields_round_trip() -> None:
    p = params(**{KV.REMOTE_BLOCK_SIZE: BS, KV.REMOTE_REGISTRATION_GENERATION: 2})
    t = TransferParams.from_json(p)
    assert (t.remote_block_size, t.registration_generation) == (BS, 2)
    assert t.to_json() == p


def test_lora_and_mm_round_trip_and_are_macd() -> None:
    e = ext(lora="adapter#1", mm=mm_digest([(3, 10, "img-hash")]))
    p = signed(params(**{KV.KVLEASE: e.to_json()}))
    parsed = TransferParams.from_json(p).kvlease
    assert parsed is not None and parsed.lora == "adapter#1" and parsed.mm == e.mm
    swapped = {**p, KV.KVLEASE: {**p[KV.KVLEASE], "lora": "other#2"}}
    assert not mac_ok(SECRET, swapped)
    assert "lora" not in ext().to_json() and "mm" not in ext().to_json()  # absent when unused


# ---------------------------------------------------------------- LoRA / multimodal / embeddings
def test_lora_tag_and_mm_digest() -> None:
    assert lora_tag(None) is None
    assert lora_tag(_Lora("a", 1)) == "a#1"
    feats = [_Feature("h1", _Pos(5, 10)), _Feature("h2", _Pos(100, 10))]
    assert request_mm_digest([], 50) is None
    assert request_mm_digest(feats, 50) == mm_digest([(5, 10, "h1")])  # only inside D's tokens
    assert request_mm_digest(feats, 200) != request_mm_digest(feats, 50)
    # an image swapped for one of the same size (same placeholder tokens) differs
    assert request_mm_digest([_Feature("other", _Pos(5, 10))], 50) != request_mm_digest(feats, 50)


@pytest.mark.parametrize(
    ("d_kw", "p_kw", "message"),
    [
        ({}, {"lora": "a#1"}, "LoRA adapter differs (D computed the KV with none, this request uses a#1)"),
        ({"lora": "a#1"}, {}, "LoRA adapter differs (D computed the KV with a#1, this request uses none)"),
        ({"lora": "a#1"}, {"lora": "b#2"}, "LoRA adapter differs"),
        ({}, {"mm": "0" * 32}, "multimodal inputs the handle does not cover"),
        ({"mm": "0" * 32}, {"mm": "1" * 32}, "multimodal inputs differ"),
        ({"mm": "0" * 32}, {}, "multimodal inputs differ"),
        ({}, {"prompt_embeds": True}, "prompt embeddings"),
    ],
)
def test_uncovered_inputs_decline_with_a_reason(d_kw: dict, p_kw: dict, message: str) -> None:
    kw: dict[str, Any] = {"lora": None, "mm": None, "prompt_embeds": False, **p_kw}
    why = uncovered_inputs(ext(**d_kw), **kw)
    assert why is not None and message in why


def test_same_lora_and_mm_are_covered() -> None:
    mm = "2" * 32
    assert uncovered_inputs(ext(lora="a#1", mm=mm), lora="a#1", mm=mm, prompt_embeds=False) is None
    assert uncovered_inputs(ext(), lora=None, mm=None, prompt_embeds=False) is None


# ---------------------------------------------------------------- hybrid, context parallel, DP
# D's sequence: 165 tokens in 16-token blocks (11 blocks, the last partial); a 16-token sliding window
# names its last cdiv(16, 16) + 1 = 2 blocks, as upstream hands them out.
_W = 16


@pytest.mark.parametrize(
    ("windows", "hybrid", "verified", "remote", "named", "words"),
    [
        ((0,), False, 32, 165, (11,), None),  # one full-attention group: any prefix
        ((0, _W, _W, _W), True, 165, 165, (11, 2, 2, 2), None),  # D's whole sequence
        # ends in D's last blocks: the window before it (block 9) is among D's blocks 9..10
        ((0, _W, _W, _W), True, 160, 165, (11, 2, 2, 2), None),
        ((0, _W), True, 144, 165, (11, 2), "need the KV of blocks 8..8, and D holds only blocks 9..10"),
        ((0, _W), True, 32, 165, (11, 2), "need the KV of blocks 1..1, and D holds only blocks 9..10"),
        # D's sequence ends on a block boundary: the block before its window is null on D
        ((0, _W), True, 144, 160, (10, 2), "need the KV of blocks 8..8, and D holds only blocks 9..9"),
        ((_W,), True, 160, 165, (2,), None),  # sliding-window-only model
        ((0, None), True, 160, 165, (11, 1), "Mamba"),  # state of D's whole sequence only
        ((0, None), True, 165, 165, (11, 1), None),
    ],
)
def test_hybrid_pulls_a_prefix_only_where_d_holds_its_window(
    windows: tuple[int | None, ...],
    hybrid: bool,
    verified: int,
    remote: int,
    named: tuple[int, ...],
    words: str | None,
) -> None:
    why = hybrid_partial_reason(
        windows=windows, hybrid=hybrid, verified=verified, remote_tokens=remote, block_size=16, named=named
    )
    if words is None:
        assert why is None
    else:
        assert why is not None and words in why
        assert f"{len(windows)} KV cache groups" in why and f"only {verified} of D's {remote} tokens" in why


class FullAttentionSpec:  # vLLM's kv_cache_spec kinds (v1/kv_cache_interface.py), by name
    pass


class SlidingWindowSpec:
    def __init__(self, sliding_window: int, extra_retained_tokens: int = 0) -> None:
        self.sliding_window = sliding_window
        self.extra_retained_tokens = extra_retained_tokens


class MambaSpec:
    pass


def test_group_windows_by_kind() -> None:
    specs = [FullAttentionSpec(), SlidingWindowSpec(128), SlidingWindowSpec(128, 3), MambaSpec()]
    assert group_windows(specs, 16) == (0, 128, 131, None)
    other = SlidingWindowSpec(128)
    other.block_size = 32  # type: ignore[attr-defined]  # a group of other-sized blocks
    assert group_windows([FullAttentionSpec(), other], 16) == (0, None)


@pytest.mark.parametrize(
    ("dcp", "pcp", "remote", "words"),
    [
        (1, 1, None, None),
        (1, 1, 1, None),
        (2, 1, None, "decode_context_parallel_size=2"),
        (1, 4, None, "prefill_context_parallel_size=4"),
        (1, 1, 2, "the handle's dcp_size=2"),
    ],
)
def test_context_parallel_declined(dcp: int, pcp: int, remote: int | None, words: str | None) -> None:
    why = context_parallel_reason(local_dcp=dcp, local_pcp=pcp, remote_dcp=remote)
    if words is None:
        assert why is None
    else:
        assert why is not None and "context parallel is not supported" in why and words in why


@pytest.mark.parametrize(("port", "rank", "expected"), [(8200, 0, 8200), (8200, 3, 8203), (0, 3, 0)])
def test_control_port_is_offset_by_the_data_parallel_rank(port: int, rank: int, expected: int) -> None:
    assert control_port(port, rank) == expected
