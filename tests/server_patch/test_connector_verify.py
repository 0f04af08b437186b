"""Prefix verification and handle checks of the kvlease connector (pure, no vLLM)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvlease.protocol import (
    KV,
    LEASE_HANDLE_MAC,
    ProtocolError,
    TransferParams,
    block_hashes,
    prefill_request_params,
    tail_hash,
)
from kvlease_router._reuse import capture_handle
from kvlease_vllm._config import KVLeaseConfig
from kvlease_vllm._verify import (
    HandleRejected,
    Reason,
    handle_ext,
    handle_mac,
    parse_handle,
    strip_remote,
    trim_params,
    verified_tokens,
)

BS = 16
D_TOKENS = list(range(1000, 1000 + 10 * BS + 5))  # 10 full blocks + a partial one (D's prompt + output)


def d_params(tokens: list[int] = D_TOKENS, salt: str | None = None, **over: Any) -> dict[str, Any]:
    ext = handle_ext(
        token_ids=tokens,
        num_tokens=len(tokens),
        block_size=BS,
        salt=salt,
        lease_id="d-req-1",
        engine_id="engine-d",
        control="http://127.0.0.1:9000",
    )
    n_blocks = -(-len(tokens) // BS)
    params: dict[str, Any] = {
        KV.DO_REMOTE_DECODE: True,
        KV.DO_REMOTE_PREFILL: False,
        KV.REMOTE_BLOCK_IDS: [list(range(100, 100 + n_blocks))],
        KV.REMOTE_ENGINE_ID: "engine-d",
        KV.REMOTE_REQUEST_ID: "d-req-1",
        KV.REMOTE_HOST: "127.0.0.1",
        KV.REMOTE_PORT: 5601,
        KV.REMOTE_NUM_TOKENS: len(tokens),
        KV.REMOTE_BLOCKS_EXPIRY_TIME: 12345.6,
        KV.TP_SIZE: 1,
        KV.KVLEASE: ext.to_json(),
    }
    params.update(over)
    return params


def parse(params: dict[str, Any], allowed: tuple[str, ...] | None = None) -> Any:
    cfg = KVLeaseConfig(allowed_remote_hosts=allowed)
    return parse_handle(
        params, num_groups=1, host_allowed=cfg.host_allowed, max_parallel=cfg.max_remote_parallel
    )


def edit(tokens: list[int], at: int, value: int = 7) -> list[int]:
    out = list(tokens)
    out[at] = value
    return out


NEW_TURN = [5, 6, 7, 8] * 20  # the next user message (80 tokens)


FULL = 10 * BS  # D's whole blocks; D's sequence is FULL + 5 tokens


@pytest.mark.parametrize(
    ("name", "prompt", "expected_tokens"),
    [
        ("exact continuation: D's partial last block too", D_TOKENS + NEW_TURN, FULL + 5),
        ("exact, one new token", [*D_TOKENS, 9], FULL + 5),
        ("prompt exactly D's sequence: one token must stay to compute", D_TOKENS, FULL),
        ("prompt ends inside D's partial block", D_TOKENS[: FULL + 3] + NEW_TURN, FULL),
        ("partial block edited", edit(D_TOKENS, FULL + 2) + NEW_TURN, FULL),
        ("stripped reasoning at token 100", D_TOKENS[:100] + D_TOKENS[120:] + NEW_TURN, 100 // BS * BS),
        ("earlier message edited at token 37", edit(D_TOKENS, 37) + NEW_TURN, 2 * BS),
        ("first token edited", edit(D_TOKENS, 0) + NEW_TURN, 0),
        ("re-tokenized at the block boundary", D_TOKENS[:64] + [1, 2] + D_TOKENS[65:] + NEW_TURN, 4 * BS),
        ("edit in the last full block", edit(D_TOKENS, FULL - 1) + NEW_TURN, 9 * BS),
        ("prompt shorter than D's sequence", D_TOKENS[: 5 * BS + 1], 5 * BS),
        ("prompt exactly D's blocks: one token must stay to compute", D_TOKENS[: 5 * BS], 4 * BS),
        ("empty prompt", [], 0),
        ("single token prompt", D_TOKENS[:1], 0),
    ],
)
def test_verified_tokens(name: str, prompt: list[int], expected_tokens: int) -> None:
    handle = parse(d_params())
    assert verified_tokens(handle, prompt, None, BS) == expected_tokens, name


@pytest.mark.parametrize(
    ("d_tokens", "prompt", "expected"),
    [
        ("shorter than one block", D_TOKENS[:5] + NEW_TURN, 5),
        ("shorter than one block, edited", [7, *D_TOKENS[1:5], *NEW_TURN], 0),
        ("whole blocks only (no partial block)", D_TOKENS[:FULL] + NEW_TURN, FULL),
    ],
)
def test_verified_tokens_of_other_sequences(d_tokens: str, prompt: list[int], expected: int) -> None:
    held = {"shorter than one block": D_TOKENS[:5], "whole blocks only (no partial block)": D_TOKENS[:FULL]}
    tokens = held.get(d_tokens, D_TOKENS[:5])
    handle = parse(d_params(tokens))
    assert (handle.ext.tail is None) == (len(tokens) % BS == 0)
    assert verified_tokens(handle, prompt, None, BS) == expected, d_tokens


@pytest.mark.parametrize(
    ("d_salt", "p_salt", "tokens"), [("a", "a", FULL + 5), ("a", "b", 0), (None, "a", 0), ("a", None, 0)]
)
def test_cache_salt_separates_tenants(d_salt: str | None, p_salt: str | None, tokens: int) -> None:
    handle = parse(d_params(salt=d_salt))
    assert verified_tokens(handle, D_TOKENS + NEW_TURN, p_salt, BS) == tokens


def test_block_size_mismatch_is_rejected() -> None:
    handle = parse(d_params())
    with pytest.raises(HandleRejected) as e:
        verified_tokens(handle, D_TOKENS + NEW_TURN, None, 32)
    assert e.value.reason is Reason.BLOCK_SIZE


def test_handle_naming_fewer_blocks_than_hashes_limits_the_pull() -> None:
    params = d_params()
    params[KV.REMOTE_BLOCK_IDS] = [[100, 101, 102]]
    assert verified_tokens(parse(params), D_TOKENS + NEW_TURN, None, BS) == 3 * BS
    # naming the full blocks but not the partial one: whole blocks only
    params[KV.REMOTE_BLOCK_IDS] = [list(range(100, 110))]
    assert verified_tokens(parse(params), D_TOKENS + NEW_TURN, None, BS) == FULL


def test_handle_naming_fewer_tokens_than_the_tail_covers_pulls_whole_blocks() -> None:
    params = d_params()
    params[KV.REMOTE_NUM_TOKENS] = FULL + 2
    assert verified_tokens(parse(params), D_TOKENS + NEW_TURN, None, BS) == FULL


def test_trim_and_strip() -> None:
    original = d_params()
    before = copy.deepcopy(original)
    handle = parse(original)
    params = trim_params(handle, 4 * BS).to_json()
    assert params[KV.REMOTE_BLOCK_IDS] == [[100, 101, 102, 103]]
    assert params[KV.REMOTE_NUM_TOKENS] == 4 * BS
    params = trim_params(handle, FULL + 5).to_json()  # the partial last block is named too
    assert params[KV.REMOTE_BLOCK_IDS] == [list(range(100, 111))]
    assert params[KV.REMOTE_NUM_TOKENS] == FULL + 5
    params = strip_remote(params)
    assert params[KV.REMOTE_BLOCK_IDS] is None and params[KV.REMOTE_NUM_TOKENS] == 0
    assert original == before  # new handles; vLLM's dict is never edited


def test_trim_keeps_every_other_field_and_pins() -> None:
    original = d_params(_remote_blocks_processed=False, remote_future_field={"x": [1]})
    handle = parse(original)
    trimmed = trim_params(handle, 4 * BS).to_json()
    assert trimmed == {
        **original,
        KV.REMOTE_BLOCK_IDS: [[100, 101, 102, 103]],
        KV.REMOTE_NUM_TOKENS: 4 * BS,
    }
    # after a claim, D's renewed absolute deadline replaces the issued one: upstream's guard stays on
    pinned = trim_params(handle, 4 * BS, deadline=12345.5).to_json()
    assert pinned[KV.REMOTE_BLOCKS_EXPIRY_TIME] == 12345.5
    # the trimmed handle still carries D's MAC'd kvlease object unchanged
    assert pinned[KV.KVLEASE] == original[KV.KVLEASE]


def test_hashes_are_protocol_block_hashes_of_d_sequence() -> None:
    ext = d_params(salt="s")[KV.KVLEASE]
    assert ext["hashes"] == block_hashes(D_TOKENS, BS, "s")
    assert ext["tail"] == tail_hash(D_TOKENS[FULL:], ext["hashes"][-1], "s")
    # the salt seeds the chain the tail hangs on
    assert ext["tail"] != tail_hash(D_TOKENS[FULL:], block_hashes(D_TOKENS, BS, None)[-1])
    assert tail_hash(D_TOKENS[:5], None, "s") != tail_hash(D_TOKENS[:5], None, "t")
    assert ext["lease_id"] == "d-req-1" and ext["block_size"] == BS and ext["num_tokens"] == len(D_TOKENS)


def _without(key: str) -> dict[str, Any]:
    p = d_params()
    del p[key]
    return p


def _ext(**over: Any) -> dict[str, Any]:
    p = d_params()
    p[KV.KVLEASE] = {**p[KV.KVLEASE], **over}
    return p


HOSTILE: list[tuple[str, dict[str, Any], Reason]] = [
    ("no kvlease object", _without(KV.KVLEASE), Reason.UNVERIFIABLE),
    ("kvlease not an object", d_params(kvlease="x"), Reason.INVALID_HANDLE),
    ("kvlease wrong version", _ext(v=99), Reason.INVALID_HANDLE),
    ("hashes not hex strings", _ext(hashes=[1, 2]), Reason.INVALID_HANDLE),
    ("more hashes than tokens", _ext(num_tokens=BS), Reason.INVALID_HANDLE),
    ("no engine id", _without(KV.REMOTE_ENGINE_ID), Reason.INVALID_HANDLE),
    ("engine id wrong type", d_params(remote_engine_id=7), Reason.INVALID_HANDLE),
    ("foreign engine id", d_params(remote_engine_id="engine-x"), Reason.INVALID_HANDLE),
    ("request id not the lease", d_params(remote_request_id="other"), Reason.INVALID_HANDLE),
    ("no request id", _without(KV.REMOTE_REQUEST_ID), Reason.INVALID_HANDLE),
    ("host elsewhere", d_params(remote_host="8.8.8.8"), Reason.INVALID_HANDLE),
    ("host wrong type", d_params(remote_host=["127.0.0.1"]), Reason.INVALID_HANDLE),
    ("no host", _without(KV.REMOTE_HOST), Reason.INVALID_HANDLE),
    ("port out of range", d_params(remote_port=70000), Reason.INVALID_HANDLE),
    ("port as string", d_params(remote_port="5601"), Reason.INVALID_HANDLE),
    ("huge tp_size", d_params(tp_size=10**9), Reason.INVALID_HANDLE),
    ("tp_size zero", d_params(tp_size=0), Reason.INVALID_HANDLE),
    ("tp_size float", d_params(tp_size=1.0), Reason.INVALID_HANDLE),
    ("huge pp_size", d_params(pp_size=1 << 20), Reason.INVALID_HANDLE),
    ("block ids flat list", d_params(remote_block_ids=[1, 2, 3]), Reason.INVALID_HANDLE),
    ("block ids two groups", d_params(remote_block_ids=[[1], [2]]), Reason.INVALID_HANDLE),
    ("negative block id", d_params(remote_block_ids=[[1, -2]]), Reason.INVALID_HANDLE),
    ("block id as string", d_params(remote_block_ids=[["1"]]), Reason.INVALID_HANDLE),
    ("block ids not a list", d_params(remote_block_ids="1,2"), Reason.INVALID_HANDLE),
    ("num tokens negative", d_params(remote_num_tokens=-5), Reason.INVALID_HANDLE),
    ("num tokens missing", _without(KV.REMOTE_NUM_TOKENS), Reason.INVALID_HANDLE),
    ("expiry as string", d_params(remote_blocks_expiry_time="soon"), Reason.INVALID_HANDLE),
    ("control URL elsewhere", _ext(control="http://8.8.8.8:80"), Reason.INVALID_HANDLE),
    ("control URL bad scheme", _ext(control="file:///etc/passwd"), Reason.INVALID_HANDLE),
    ("control URL bad port", _ext(control="http://127.0.0.1:99999"), Reason.INVALID_HANDLE),
]


@pytest.mark.parametrize(("name", "params", "reason"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_handles_are_rejected_with_a_reason(
    name: str, params: dict[str, Any], reason: Reason
) -> None:
    before = copy.deepcopy(params)
    with pytest.raises(HandleRejected) as e:
        parse(params)
    assert e.value.reason is reason, name
    assert params == before  # parsing never mutates


def test_allowed_hosts_config() -> None:
    assert parse(d_params(), allowed=("127.0.0.1",)).host == "127.0.0.1"
    with pytest.raises(HandleRejected):
        parse(d_params(), allowed=("10.0.0.1",))


def test_valid_handle_parses() -> None:
    h = parse(d_params())
    assert (h.engine_id, h.request_id, h.host, h.port, h.num_tokens) == (
        "engine-d",
        "d-req-1",
        "127.0.0.1",
        5601,
        len(D_TOKENS),
    )
    assert h.block_ids == (tuple(range(100, 111)),)


def _signed(**over: Any) -> dict[str, Any]:
    p = d_params()
    p[KV.KVLEASE][LEASE_HANDLE_MAC] = handle_mac("k", p)
    p.update(over)
    return p


@pytest.mark.parametrize(
    ("name", "params", "ok"),
    [
        ("signed", _signed(), True),
        ("unsigned", d_params(), False),
        ("block ids edited", _signed(remote_block_ids=[list(range(200, 211))]), False),
        ("engine edited", _signed(remote_engine_id="engine-x"), False),
        ("port edited", _signed(remote_port=5602), False),
        ("tp_size edited", _signed(tp_size=2), False),
        ("expiry updated by a router: not covered", _signed(remote_blocks_expiry_time=1.0), True),
    ],
)
def test_mac_guards_every_routing_field(name: str, params: dict[str, Any], ok: bool) -> None:
    cfg = KVLeaseConfig()
    kw: dict[str, Any] = {
        "num_groups": 1,
        "host_allowed": cfg.host_allowed,
        "max_parallel": 64,
        "secret": "k",
    }
    if ok:
        assert parse_handle(params, **kw).request_id == "d-req-1", name
    else:
        with pytest.raises(HandleRejected, match="MAC"):
            parse_handle(params, **kw)
    with pytest.raises(HandleRejected, match="MAC"):
        parse_handle(_signed(), **{**kw, "secret": "other"})


def test_mac_over_edited_hashes_fails() -> None:
    p = _signed()
    p[KV.KVLEASE]["hashes"] = list(reversed(p[KV.KVLEASE]["hashes"]))
    with pytest.raises(HandleRejected, match="MAC"):
        parse_handle(p, num_groups=1, host_allowed=KVLeaseConfig().host_allowed, max_parallel=64, secret="k")


# ---- one parser of the handle: TransferParams, for P and for the router ---------------------------

#: Rejected by P because of the handle's own shape (not P's policy: hosts, groups, limits, presence).
SHAPE = {
    "kvlease not an object",
    "kvlease wrong version",
    "hashes not hex strings",
    "more hashes than tokens",
    "engine id wrong type",
    "foreign engine id",
    "request id not the lease",
    "host wrong type",
    "port out of range",
    "port as string",
    "huge tp_size",
    "tp_size zero",
    "tp_size float",
    "huge pp_size",
    "negative block id",
    "block id as string",
    "block ids not a list",
    "num tokens negative",
    "expiry as string",
    "control URL bad scheme",
    "control URL bad port",
}


assert {h[0] for h in HOSTILE} >= SHAPE


@pytest.mark.parametrize(
    ("name", "params", "reason"),
    [h for h in HOSTILE if h[0] in SHAPE],
    ids=[h[0] for h in HOSTILE if h[0] in SHAPE],
)
def test_the_one_parser_rejects_what_p_rejects(name: str, params: dict[str, Any], reason: Reason) -> None:
    """The router captures with P's strictness: a handle P refuses for its shape is never stored."""
    with pytest.raises(ProtocolError):
        TransferParams.from_json(params)
    for kvlease in (True, False):
        assert capture_handle(params, kvlease_mode=kvlease, node_control=None) is None, name


def test_handle_round_trips() -> None:
    for params in (
        d_params(),
        _signed(),
        d_params(remote_block_ids=[1, 2, 3], remote_blocks_expiry_time=None, extra_key={"a": [1]}),
        prefill_request_params(),
    ):
        handle = TransferParams.from_json(params)
        assert handle.to_json() == params  # serialized from the typed handle: what was read
        assert TransferParams.from_json(handle.to_json()) == handle
    handle = TransferParams.from_json(d_params())
    assert handle.kvlease is not None and handle.kvlease.lease_id == "d-req-1"
    assert handle.block_ids == (tuple(range(100, 111)),) and handle.grouped


def test_parse_handle_keeps_the_typed_handle() -> None:
    params = _signed()
    h = parse(params)
    assert h.params == TransferParams.from_json(params)
    assert h.ext == h.params.kvlease and h.ext.mac == params[KV.KVLEASE][LEASE_HANDLE_MAC]


def test_hybrid_handle_with_sliding_window_tails_verifies_d_whole_sequence() -> None:
    """A hybrid KV cache's handle: the full-attention group names every block, the sliding-window
    groups only their in-window tail (as vLLM's hybrid manager hands them out). The token-exact
    continuation verifies all of D's tokens; before, the shortest list capped it at 2 blocks."""
    params = d_params()
    n_blocks = len(params[KV.REMOTE_BLOCK_IDS][0])
    params[KV.REMOTE_BLOCK_IDS] = [list(range(100, 100 + n_blocks))] + [
        [200 + 10 * g, 201 + 10 * g] for g in range(3)
    ]
    cfg = KVLeaseConfig()
    handle = parse_handle(
        params, num_groups=4, host_allowed=cfg.host_allowed, max_parallel=cfg.max_remote_parallel
    )
    assert verified_tokens(handle, D_TOKENS + NEW_TURN, None, BS) == len(D_TOKENS)
    # an edit inside D's sequence still verifies only the blocks before it (the connector then
    # declines the partial pull on a hybrid cache: hybrid_partial)
    assert verified_tokens(handle, edit(D_TOKENS, 3 * BS + 1) + NEW_TURN, None, BS) == 3 * BS


def test_hybrid_trim_cuts_every_group_from_its_end() -> None:
    """Upstream pairs P's blocks with the end of each of D's lists. A prefix ending one block before
    D's end hands the sliding-window groups their block at that prefix's end (D's block 9 here);
    a cut from the front would have kept the tail of D's whole sequence (block 10)."""
    params = d_params()
    params[KV.REMOTE_BLOCK_IDS] = [list(range(100, 111)), [209, 210], [309, 310]]
    cfg = KVLeaseConfig()
    handle = parse_handle(
        params, num_groups=3, host_allowed=cfg.host_allowed, max_parallel=cfg.max_remote_parallel
    )
    assert trim_params(handle, FULL).to_json()[KV.REMOTE_BLOCK_IDS] == [
        list(range(100, 110)),
        [209],
        [309],
    ]
    # D's whole sequence: every list as D named it
    assert trim_params(handle, FULL + 5).to_json()[KV.REMOTE_BLOCK_IDS] == params[KV.REMOTE_BLOCK_IDS]
    # further back than a sliding-window list reaches: nothing of it (the guard declines such a pull)
    assert trim_params(handle, 4 * BS).to_json()[KV.REMOTE_BLOCK_IDS] == [[100, 101, 102, 103], [], []]
