"""Leases in D's host arena on the real stack (``kvlease.placement`` host and auto).

D writes a finished turn's blocks through to its host arena and gives them back to vLLM; P's pull
is then served by D's staging listener from the arena (``host``), or from the device copy while it
is provably intact (``auto``). Every pulled turn must equal the no-pull reference token for token,
as in ``test_connector_pd``; the figures come from the nodes' own ``/metrics``.

One module, two stacks (placement host with a small arena, placement auto on a D whose KV cache is
small, so that freed lease blocks are reused by the next requests).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import pytest

from kvlease.protocol import (
    CONTROL_METRICS_PATH,
    CONTROL_RENEW_PATH,
    KV,
    PREFILL_REUSE_STATUS,
    ControlRenewRequest,
    ControlRenewResponse,
)
from kvlease.protocol._handle import LEASE_HANDLE_PLACEMENT
from kvlease_stack import Stack, StackSpec, parse_prometheus

from ._specs import ALWAYS_PULL
from .test_connector_pd import (
    ASSISTANT,
    END,
    PD,
    USER_1,
    USER_2,
    VARIANTS,
    chatml,
    pull_and_reference,
    reused,
    salt,
)

pytestmark = pytest.mark.integration

#: The tiny model in float32 on the CPU backend: 4 layers x K/V x 2 heads x 64 x 4 bytes = 4 KiB a
#: token, 512 KiB a 128-token block; a USER_1 turn (~830 tokens, 7 blocks) is 3.5 MiB.
ARENA = 12 << 20
LIFETIME = 25.0
D_BLOCKS = 40

HOST = StackSpec(
    model="tiny",
    connector="kvlease",
    ttl=20.0,
    recompute_threshold=32,
    prefix_caching=False,
    dtype="float32",
    kvlease={
        **ALWAYS_PULL,
        "staging": "always",
        "staging_timeout_s": 10.0,
        "placement": "host",
        "host_arena_bytes": ARENA,
        "max_lease_lifetime_s": LIFETIME,
    },
)
_HOST_KEYS = {k: v for k, v in HOST.kvlease.items() if k != "max_lease_lifetime_s"}
AUTO = replace(
    HOST,
    ttl=60.0,
    kvlease={**_HOST_KEYS, "placement": "auto", "host_arena_bytes": 64 << 20},
    decode_args=("--num-gpu-blocks-override", str(D_BLOCKS)),
)


@pytest.fixture(scope="module")
def host(stack_factory: Callable[[StackSpec], Stack]) -> PD:
    return PD(stack_factory(HOST))


def metrics(pd: PD, node: str) -> dict[str, float]:
    return dict(parse_prometheus(pd.control(node, CONTROL_METRICS_PATH).text))


def pulls(pd: PD, source: str) -> float:
    return metrics(pd, "prefill").get(f'kvlease_pulls_total{{source="{source}"}}', 0.0)


def d_usage(pd: PD) -> float:
    return parse_prometheus(pd.http.get(pd.stack.decode.url + "/metrics").text).total(
        "vllm:kv_cache_usage_perc"
    )


# ------------------------------------------------------------------------------- placement host
def test_host_handle_says_host_and_blocks_return_to_vllm(host: PD) -> None:
    """The handle is host-placed (v2); D's KV usage falls back to the no-lease baseline within 1 s of
    the finished turn, the lease holds no device block, and turn 2 still pulls it from the arena."""
    first = host.tok(chatml("user", USER_1) + ASSISTANT)
    baseline = d_usage(host)
    s = salt()
    t1 = host.turn(first, None, s)
    assert t1.handle is not None
    ext = t1.handle[KV.KVLEASE]
    assert ext[LEASE_HANDLE_PLACEMENT] == "host" and ext["v"] == 2
    deadline, usage = time.monotonic() + 1.0, None
    while time.monotonic() < deadline:
        usage = d_usage(host)
        if usage <= baseline:
            break
        time.sleep(0.05)
    assert usage is not None and usage <= baseline, f"D's KV usage {usage} stayed above {baseline}"
    d = metrics(host, "decode")
    assert d["kvlease_device_blocks_held"] == 0
    assert d["kvlease_host_bytes_used"] > 0
    assert d["kvlease_demotions_total"] >= 1
    before = pulls(host, "host")
    t2 = host.turn(first + t1.output + host.tok(END + chatml("user", USER_2) + ASSISTANT), t1.handle, s)
    assert t2.p_params[KV.KVLEASE][PREFILL_REUSE_STATUS] == "hit"
    assert reused(t2) > 0
    assert pulls(host, "host") == before + 1


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_host_pulls_match_no_pull_reference(host: PD, variant: str) -> None:
    build, must_pull = VARIANTS[variant]
    first = host.tok(chatml("user", USER_1) + ASSISTANT)
    before = pulls(host, "host")
    _, t2, r2 = pull_and_reference(host, first, build)
    assert t2.output == r2.output, f"{variant}: turn 2 pulled from the arena diverged from the reference"
    if must_pull:
        assert t2.p_params[KV.KVLEASE][PREFILL_REUSE_STATUS] == "hit", t2.p_params
        assert pulls(host, "host") == before + 1, "the pull was not served from the host arena"


def renew(pd: PD, lease_id: str, ttl: float = 10.0) -> float | None:
    r = pd.control("decode", CONTROL_RENEW_PATH, ControlRenewRequest((lease_id,), ttl).to_json())
    assert r.status_code == 200, r.text
    return ControlRenewResponse.from_json(r.json()).expires_in[lease_id]


def test_full_arena_evicts_the_lowest_priority_lease(host: PD) -> None:
    """Four 3.5 MiB leases in a 12 MiB arena: the one nobody renewed goes; its next turn recomputes
    (status ``expired``) with no error, and the renewed ones still pull."""
    first = host.tok(chatml("user", USER_1) + ASSISTANT)
    tail = host.tok(END + chatml("user", USER_2) + ASSISTANT)
    convs = []
    for _ in range(4):
        s = salt()
        t1 = host.turn(first, None, s)
        convs.append((s, t1, t1.handle[KV.KVLEASE]["lease_id"]))
        for _, _, lid in convs[1:]:  # heartbeats raise every lease's priority but the first's
            assert renew(host, lid) is not None
    pressure = 'kvlease_evictions_total{reason="pressure"}'
    assert metrics(host, "decode")[pressure] >= 1
    assert renew(host, convs[0][2]) is None, "the unrenewed lease is still held"
    # (each turn 2 leaves a lease of its own, which may push out the next-lowest: kept goes first)
    s, t1, _ = convs[-1]
    kept = host.turn(first + t1.output + tail, t1.handle, s)
    assert kept.p_params[KV.KVLEASE][PREFILL_REUSE_STATUS] == "hit", kept.p_params
    s, t1, _ = convs[0]
    gone = host.turn(first + t1.output + tail, t1.handle, s)
    assert gone.p_params[KV.KVLEASE][PREFILL_REUSE_STATUS] == "expired", gone.p_params


def test_lifetime_ends_a_heartbeated_lease(host: PD) -> None:
    t1 = host.turn(host.tok(chatml("user", USER_1) + ASSISTANT), None, salt())
    lid = t1.handle[KV.KVLEASE]["lease_id"]
    start = time.monotonic()
    ended = None
    while time.monotonic() - start < LIFETIME + 10:
        if renew(host, lid, ttl=5.0) is None:
            ended = time.monotonic() - start
            break
        time.sleep(1.0)
    assert ended is not None, "the lease outlived kvlease.max_lease_lifetime_s"
    # refused from renew_guard (2 s) before the hard end; never before
    assert LIFETIME - 4.0 <= ended <= LIFETIME + 2.0, ended


# ------------------------------------------------------------------------------- placement auto
@pytest.fixture(scope="module")
def auto(stack_factory: Callable[[StackSpec], Stack]) -> PD:
    return PD(stack_factory(AUTO))


def test_auto_pulls_the_device_copy_then_the_arena_once_reused(auto: PD) -> None:
    """A turn 2 right after turn 1 reads D's intact device copy; once other requests took those
    blocks (D's cache is small), turn 2 is served from the arena; both equal the reference."""
    first = auto.tok(chatml("user", USER_1) + ASSISTANT)
    tail = auto.tok(END + chatml("user", USER_2) + ASSISTANT)
    dev, hst = pulls(auto, "device"), pulls(auto, "host")
    build = VARIANTS["exact"][0]
    _, t2, r2 = pull_and_reference(auto, first, build)
    assert t2.output == r2.output
    assert t2.p_params[KV.KVLEASE][PREFILL_REUSE_STATUS] == "hit"
    assert pulls(auto, "device") == dev + 1

    s = salt()
    t1 = auto.turn(first, None, s)
    assert metrics(auto, "decode")["kvlease_device_blocks_held"] == 0
    for _ in range(3):  # fills D's 40 blocks: the lease's freed blocks are taken and overwritten
        auto.turn(first, None, salt())
    again = auto.turn(first + t1.output + tail, t1.handle, s)
    ref_s = salt()
    r1 = auto.turn(first, None, ref_s)
    ref = auto.turn(first + r1.output + tail, None, ref_s)
    assert again.output == ref.output, "turn 2 after the device copy was reused diverged"
    assert again.p_params[KV.KVLEASE][PREFILL_REUSE_STATUS] == "hit"
    assert pulls(auto, "host") == hst + 1, "the reused device copy was read instead of the arena"


def test_auto_leases_leave_d_room_for_a_burst(auto: PD) -> None:
    """Leases that would fill D's small cache under device placement cost it nothing under auto:
    after many finished leased turns a burst of new prompts runs without a preemption."""
    text = parse_prometheus(auto.http.get(auto.stack.decode.url + "/metrics").text)
    preempted = text.total("vllm:num_preemptions_total")
    first = auto.tok(chatml("user", USER_1) + ASSISTANT)
    for _ in range(8):  # 8 leases of 7 blocks: more than D's 40 blocks could hold
        auto.turn(first, None, salt())
    d = metrics(auto, "decode")
    assert d["kvlease_leases"] >= 8 and d["kvlease_device_blocks_held"] == 0
    for _ in range(4):
        auto.turn(first, None, salt())
    text = parse_prometheus(auto.http.get(auto.stack.decode.url + "/metrics").text)
    assert text.total("vllm:num_preemptions_total") == preempted


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_auto_pulls_match_no_pull_reference(auto: PD, variant: str) -> None:
    build, must_pull = VARIANTS[variant]
    first = auto.tok(chatml("user", USER_1) + ASSISTANT)
    before = pulls(auto, "device") + pulls(auto, "host")
    _, t2, r2 = pull_and_reference(auto, first, build)
    assert t2.output == r2.output, f"{variant}: turn 2 (auto placement) diverged from the reference"
    if must_pull:
        assert t2.p_params[KV.KVLEASE][PREFILL_REUSE_STATUS] == "hit", t2.p_params
        assert pulls(auto, "device") + pulls(auto, "host") == before + 1
