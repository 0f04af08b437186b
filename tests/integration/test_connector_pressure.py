"""Retention never makes a request wait or be preempted, on the real stack with a full KV cache.

D gets a small KV cache (``--num-gpu-blocks-override``) and a high retention cap, so finished turns'
leases fill most of it. Then a long prompt arrives that needs more blocks than are free: D must
release leases (oldest deadline first) at once instead of letting the request wait for them to run
out (the TTL here is 600 s, longer than the client's timeout) or preempting a running request.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvlease.protocol import CONTROL_INFO_PATH, CONTROL_METRICS_PATH
from kvlease_stack import Stack, StackSpec, parse_prometheus

from ._specs import ALWAYS_PULL
from .test_connector_pd import ASSISTANT, PD, USER_1, chatml, reused, salt

pytestmark = pytest.mark.integration

D_BLOCKS = 48

FULL_SPEC = StackSpec(
    model="tiny",
    connector="kvlease",
    ttl=600.0,
    recompute_threshold=32,
    prefix_caching=False,
    kvlease={**ALWAYS_PULL, "max_retained_fraction": 0.9, "min_free_fraction": 0.0},
    decode_args=("--num-gpu-blocks-override", str(D_BLOCKS)),
)


@pytest.fixture(scope="module")
def pd(stack_factory: Callable[[StackSpec], Stack]) -> PD:
    return PD(stack_factory(FULL_SPEC))


def d_kvlease(pd: PD) -> dict[str, float]:
    return dict(parse_prometheus(pd.control("decode", CONTROL_METRICS_PATH).text))


def d_preemptions(pd: PD) -> float:
    return parse_prometheus(pd.http.get(pd.stack.decode.url + "/metrics").text).total(
        "vllm:num_preemptions_total"
    )


def test_a_long_prompt_gets_its_blocks_from_leases_at_once(pd: PD) -> None:
    block = int(pd.control("decode", CONTROL_INFO_PATH).json()["block_size"])
    pressure = 'kvlease_lease_releases_total{cause="pressure"}'
    preempted = d_preemptions(pd)

    # finished conversations' leases fill the cache until a long prompt no longer fits in what is free
    long_prompt = pd.tok(chatml("user", USER_1 * 8))
    long_prompt = long_prompt[: (D_BLOCKS // 2) * block - 1] + pd.tok(ASSISTANT)
    need = -(-(len(long_prompt) + 1) // block)
    convs = []
    for i in range(12):
        s = salt()
        convs.append((s, pd.turn(pd.tok(chatml("user", f"{i}: " + USER_1) + ASSISTANT), None, s)))
        m = d_kvlease(pd)
        if D_BLOCKS - m["kvlease_retained_blocks"] < need:
            break
    m = d_kvlease(pd)
    assert D_BLOCKS - m["kvlease_retained_blocks"] < need, (m, need)
    before = m[pressure]

    t = pd.turn(long_prompt, None, salt())  # would wait 600 s (past the client timeout) without relief
    assert len(t.output) > 0
    after = d_kvlease(pd)
    assert after[pressure] >= before + 1  # leases were released for it
    assert after["kvlease_retained_blocks"] <= D_BLOCKS
    assert d_preemptions(pd) == preempted  # and no running request was evicted

    # oldest deadline first: the newest conversation's lease was not needed and is still pulled
    s, last = convs[-1]
    follow = last.prompt + last.output + pd.tok("<|im_end|>\n" + chatml("user", "and then?") + ASSISTANT)
    assert reused(pd.turn(follow, last.handle, s)) > 0
