"""Properties of token-exact prefix verification (hypothesis).

The connector must never report more matched tokens than truly match: D's sequence and P's prompt
are generated as a token list and a randomly edited copy, and the verified count is compared with
the brute-force common prefix (whole blocks, or all of D's sequence when it is a strict prefix of
the prompt).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvlease.protocol import KV, LEASE_HANDLE_MAC, TransferParams, block_hashes, common_prefix_blocks
from kvlease_vllm._guards import hybrid_partial_reason
from kvlease_vllm._verify import (
    HandleRejected,
    RemoteHandle,
    handle_ext,
    handle_mac,
    parse_handle,
    trim_params,
    verified_tokens,
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# a small alphabet, so random edits often re-create equal tokens (the dangerous near-misses)
tokens = st.lists(st.integers(0, 5), min_size=0, max_size=120)
block_sizes = st.sampled_from([1, 2, 3, 4, 16])


@st.composite
def edited(draw: st.DrawFn, base: list[int]) -> list[int]:
    """``base`` with a few random edits: replace, insert, delete, truncate, append."""
    out = list(base)
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["replace", "insert", "delete", "truncate", "append"]))
        i = draw(st.integers(0, len(out)))
        if op == "replace" and i < len(out):
            out[i] = draw(st.integers(0, 5))
        elif op == "insert":
            out.insert(i, draw(st.integers(0, 5)))
        elif op == "delete" and i < len(out):
            del out[i]
        elif op == "truncate":
            out = out[:i]
        else:
            out += draw(st.lists(st.integers(0, 5), max_size=40))
    return out


def true_common_blocks(a: list[int], b: list[int], bs: int) -> int:
    """Brute force: leading whole blocks that are equal token for token."""
    n = 0
    while (n + 1) * bs <= min(len(a), len(b)) and a[n * bs : (n + 1) * bs] == b[n * bs : (n + 1) * bs]:
        n += 1
    return n


def handle_for(
    d_tokens: list[int], bs: int, *, salt: str | None = None, named_blocks: int | None = None
) -> RemoteHandle:
    ext = handle_ext(
        token_ids=d_tokens,
        num_tokens=len(d_tokens),
        block_size=bs,
        salt=salt,
        lease_id="lease",
        engine_id="engine-d",
        control=None,
    )
    n_ids = -(-len(d_tokens) // bs) if named_blocks is None else named_blocks
    return RemoteHandle(ext, "engine-d", "lease", "127.0.0.1", 5600, (tuple(range(n_ids)),), len(d_tokens))


def true_verified_tokens(d_tokens: list[int], prompt: list[int], bs: int) -> int:
    """Brute force: D's whole sequence when it is a strict prefix of the prompt, else the common
    whole blocks, never all of the prompt (one token is left to compute)."""
    if len(prompt) > len(d_tokens) and prompt[: len(d_tokens)] == d_tokens:
        return len(d_tokens)
    limit = (len(prompt) - 1) // bs if prompt else 0
    return min(true_common_blocks(d_tokens, prompt, bs), limit, len(d_tokens) // bs) * bs


@SETTINGS
@given(data=st.data(), d_tokens=tokens, bs=block_sizes)
def test_verified_tokens_never_exceed_the_true_common_prefix(
    data: st.DataObject, d_tokens: list[int], bs: int
) -> None:
    prompt = data.draw(edited(d_tokens))
    n = verified_tokens(handle_for(d_tokens, bs), prompt, None, bs)
    assert n < len(prompt) or n == 0
    assert prompt[:n] == d_tokens[:n]
    # and it is exact: whole common blocks, or D's whole sequence when the prompt extends it
    assert n == true_verified_tokens(d_tokens, prompt, bs)


@SETTINGS
@given(data=st.data(), d_tokens=tokens, bs=block_sizes)
def test_handle_naming_fewer_blocks_bounds_the_pull(
    data: st.DataObject, d_tokens: list[int], bs: int
) -> None:
    prompt = data.draw(edited(d_tokens))
    named = data.draw(st.integers(0, len(d_tokens) // bs + 1))
    n = verified_tokens(handle_for(d_tokens, bs, named_blocks=named), prompt, None, bs)
    assert -(-n // bs) <= named
    assert n <= true_verified_tokens(d_tokens, prompt, bs)


@SETTINGS
@given(a=tokens, b=tokens, bs=block_sizes, salt=st.sampled_from([None, "", "tenant-a"]))
def test_hash_chains_agree_exactly_on_the_common_whole_blocks(
    a: list[int], b: list[int], bs: int, salt: str | None
) -> None:
    ha, hb = block_hashes(a, bs, salt), block_hashes(b, bs, salt)
    assert len(ha) == len(a) // bs
    assert common_prefix_blocks(ha, hb) == true_common_blocks(a, b, bs)


@SETTINGS
@given(
    d_tokens=st.lists(st.integers(0, 5), min_size=4, max_size=80),
    bs=block_sizes,
    salts=st.sampled_from([("a", "b"), (None, "a"), ("a", None)]),
)
def test_different_salts_never_match(
    d_tokens: list[int], bs: int, salts: tuple[str | None, str | None]
) -> None:
    """A tenant's ``cache_salt`` seeds the chain: the same tokens under another salt verify nothing."""
    prompt = d_tokens + [0]
    assert verified_tokens(handle_for(d_tokens, bs, salt=salts[0]), prompt, salts[1], bs) == 0


# ---- MAC-signed handles: any edit of a signed field is rejected ------------------------------------

SECRET = "control-secret"
MAC_FIELDS = [
    KV.REMOTE_ENGINE_ID,
    KV.REMOTE_REQUEST_ID,
    KV.REMOTE_HOST,
    KV.REMOTE_PORT,
    KV.REMOTE_BLOCK_IDS,
    KV.REMOTE_NUM_TOKENS,
    KV.TP_SIZE,
    KV.REMOTE_BLOCK_SIZE,
    KV.REMOTE_REGISTRATION_GENERATION,  # vLLM 0.33
    "kvlease.hashes",
    "kvlease.tail",
    "kvlease.num_tokens",
    "kvlease.block_size",
    "kvlease.lease_id",
    "kvlease.control",
    "kvlease.lora",
    "kvlease.mm",
]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


def signed_params(d_tokens: list[int], bs: int) -> dict[str, Any]:
    ext = handle_ext(
        token_ids=d_tokens,
        num_tokens=len(d_tokens),
        block_size=bs,
        salt=None,
        lease_id="lease-1",
        engine_id="engine-d",
        control="http://127.0.0.1:9100",
    )
    params: dict[str, Any] = {
        KV.DO_REMOTE_DECODE: True,
        KV.DO_REMOTE_PREFILL: False,
        KV.REMOTE_ENGINE_ID: "engine-d",
        KV.REMOTE_REQUEST_ID: "lease-1",
        KV.REMOTE_HOST: "127.0.0.1",
        KV.REMOTE_PORT: 5600,
        KV.REMOTE_BLOCK_IDS: [list(range(-(-len(d_tokens) // bs)))],
        KV.REMOTE_NUM_TOKENS: len(d_tokens),
        KV.REMOTE_BLOCKS_EXPIRY_TIME: None,
        KV.TP_SIZE: 1,
        KV.REMOTE_BLOCK_SIZE: bs,
        KV.REMOTE_REGISTRATION_GENERATION: 1,
        KV.KVLEASE: ext.to_json(),
    }
    params[KV.KVLEASE][LEASE_HANDLE_MAC] = handle_mac(SECRET, params)
    return params


def parse_signed(params: dict[str, Any]) -> RemoteHandle:
    return parse_handle(
        params, num_groups=1, host_allowed=lambda h: True, max_parallel=1 << 30, secret=SECRET
    )


@SETTINGS
@given(
    d_tokens=st.lists(st.integers(0, 5), min_size=16, max_size=64),
    field=st.sampled_from(MAC_FIELDS),
    value=json_values,
)
def test_any_edit_of_a_signed_field_is_rejected(d_tokens: list[int], field: str, value: Any) -> None:
    params = signed_params(d_tokens, 4)
    parse_signed(params)  # the untouched handle is accepted
    edited_params = copy.deepcopy(params)
    target, key = (
        (edited_params[KV.KVLEASE], field.split(".", 1)[1]) if "." in field else (edited_params, field)
    )
    assume(target.get(key) != value)
    target[key] = value
    try:
        parse_signed(edited_params)
    except HandleRejected:
        return
    raise AssertionError(f"edited {field}={value!r} was accepted")


# ---- the typed handle: parse(serialize(x)) == x ---------------------------------------------------

_ids = st.text(alphabet="abcdefgh-0123456789", min_size=1, max_size=12)


@st.composite
def transfer_params(draw: st.DrawFn) -> TransferParams:
    d_tokens = draw(st.lists(st.integers(0, 5), max_size=64))
    bs = draw(block_sizes)
    lease = draw(_ids)
    engine = draw(_ids)
    ext = draw(
        st.none()
        | st.just(
            handle_ext(
                token_ids=d_tokens,
                num_tokens=len(d_tokens),
                block_size=bs,
                salt=draw(st.none() | _ids),
                lease_id=lease,
                engine_id=engine,
                control=draw(st.none() | st.just("http://127.0.0.1:9100")),
            )
        )
    )
    grouped = draw(st.booleans())
    groups = draw(st.lists(st.lists(st.integers(0, 1 << 30), max_size=8), min_size=1, max_size=3))
    block_ids = draw(st.none() | st.just(tuple(map(tuple, groups if grouped else groups[:1]))))
    if block_ids is not None and not grouped and not block_ids[0]:
        grouped = True  # an empty flat list reads as zero groups
        block_ids = ()
    optional_int = st.none() | st.integers(1, 64)
    handle = TransferParams(
        do_remote_decode=draw(st.none() | st.booleans()),
        do_remote_prefill=draw(st.none() | st.booleans()),
        engine_id=draw(st.none() | st.just(engine)),
        block_ids=block_ids,
        grouped=grouped,
        request_id=draw(st.none() | st.just(lease)),
        host=draw(st.none() | st.just("127.0.0.1")),
        port=draw(st.none() | st.integers(1, 65535)),
        num_tokens=draw(st.none() | st.integers(0, 1 << 20)),
        expiry=draw(st.none() | st.floats(0, 1e9)),
        tp_size=draw(optional_int),
        dcp_size=draw(optional_int),
        pp_size=draw(optional_int),
        kvlease=ext,
        nulls=frozenset(draw(st.lists(st.sampled_from([KV.REMOTE_HOST, KV.REMOTE_BLOCKS_EXPIRY_TIME])))),
        extra=tuple(
            draw(st.dictionaries(st.sampled_from(["_remote_blocks_processed", "x"]), json_values)).items()
        ),
    )
    if handle.block_ids is None:
        handle = replace(handle, grouped=True)
    return handle


@SETTINGS
@given(handle=transfer_params())
def test_the_handle_round_trips(handle: TransferParams) -> None:
    wire = handle.to_json()
    assert TransferParams.from_json(wire) == handle
    assert TransferParams.from_json(copy.deepcopy(wire)).to_json() == wire


# ------------------------------------------------------------------ hybrid KV cache: what P reads
@SETTINGS
@given(
    n_tokens=st.integers(1, 200),
    bs=st.sampled_from([1, 2, 4, 16]),
    windows=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    data=st.data(),
)
def test_a_hybrid_pull_the_guard_allows_reads_the_window_of_its_own_positions(
    n_tokens: int, bs: int, windows: list[int], data: st.DataObject
) -> None:
    """D's handle as upstream hands it out (a full-attention group naming every block; each
    sliding-window group its last ``cdiv(window, bs) + 1`` blocks, null where wholly before D's
    window); P pulls ``tokens`` (whole blocks, or D's whole sequence) where
    ``hybrid_partial_reason`` allows it, and reads each group into its non-null blocks of the window,
    paired from the end of the trimmed list (upstream's rule). Every block P reads must be D's block
    of the same position, never a null one."""
    d_end = -(-n_tokens // bs)
    tokens = data.draw(st.sampled_from([n_tokens, *(b * bs for b in range(1, n_tokens // bs + 1))]))
    p_end = -(-tokens // bs)

    def block_id(group: int, pos: int) -> int:
        return 1 + group * 1000 + pos  # 0 is vLLM's null block

    def first_block(n: int, window: int) -> int:
        return max(0, n - window + 1) // bs

    groups = [[block_id(0, p) for p in range(d_end)]]
    for g, w in enumerate(windows, start=1):
        tail = range(max(0, d_end - (-(-w // bs) + 1)), d_end)
        groups.append([block_id(g, p) if p >= first_block(n_tokens, w) else 0 for p in tail])
    ext = handle_ext(
        token_ids=list(range(n_tokens)),
        num_tokens=n_tokens,
        block_size=bs,
        salt=None,
        lease_id="d",
        engine_id="e",
        control=None,
    )
    handle = RemoteHandle(ext, "e", "d", "127.0.0.1", 5600, tuple(map(tuple, groups)), n_tokens)
    why = hybrid_partial_reason(
        windows=(0, *windows),
        hybrid=True,
        verified=tokens,
        remote_tokens=n_tokens,
        block_size=bs,
        named=[len(g) for g in groups],
    )
    assume(why is None)
    trimmed = trim_params(handle, tokens).block_ids
    assert trimmed is not None and list(trimmed[0]) == groups[0][:p_end]
    for g, w in enumerate(windows, start=1):
        local = list(range(first_block(tokens, w), p_end))[-(-(-w // bs) + 1) :]  # P's clip
        remote = list(trimmed[g])
        assert len(local) <= len(remote)
        read = remote[len(remote) - len(local) :] if local else []
        assert read == [block_id(g, p) for p in local]
