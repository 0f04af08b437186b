"""Bounded retention on the real stack: past the cap D releases the oldest-deadline lease early, and
a prefill node holding the released lease's handle recomputes (its claim finds the lease gone)
instead of reading blocks that D may already have reused.

The cap is set to a few blocks (a fraction of D's KV cache) so the second conversation's lease
pushes out the first one's.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvlease.protocol import CONTROL_METRICS_PATH, KV, PREFILL_REUSE_STATUS
from kvlease_stack import Stack, StackSpec

from ._specs import ALWAYS_PULL
from .test_connector_pd import ASSISTANT, PD, USER_1, chatml, exact, reused, salt

pytestmark = pytest.mark.integration

# D (tiny model, 1 GiB KV cache) has ~4096 blocks of 128 tokens: 0.0025 -> a cap of 10 blocks,
# room for one ~700-token conversation's lease (6 blocks), not two.
CAP_SPEC = StackSpec(
    model="tiny",
    connector="kvlease",
    ttl=120.0,
    recompute_threshold=32,
    prefix_caching=False,
    kvlease={**ALWAYS_PULL, "max_retained_fraction": 0.0025},
)


@pytest.fixture(scope="module")
def pd(stack_factory: Callable[[StackSpec], Stack]) -> PD:
    return PD(stack_factory(CAP_SPEC))


def d_metric(pd: PD, sample: str) -> float:
    text = pd.control("decode", CONTROL_METRICS_PATH).text
    return float(next(line for line in text.splitlines() if line.startswith(sample + " ")).split()[-1])


def test_cap_releases_oldest_lease_and_its_holder_recomputes(pd: PD) -> None:
    first = pd.tok(chatml("user", USER_1) + ASSISTANT)
    cap = d_metric(pd, "kvlease_retained_blocks_cap")

    sa, sb = salt(), salt()
    a1 = pd.turn(first, None, sa)  # may push out older leases (e.g. the stack's warm-up turn)
    before = d_metric(pd, 'kvlease_lease_releases_total{cause="cap"}')
    b1 = pd.turn(first + [first[-1]], None, sb)  # a second conversation, one token longer
    assert a1.handle is not None and b1.handle is not None
    # oldest deadline first: older leases (the warm-up turn's) go before a's, and a's must go too
    assert d_metric(pd, 'kvlease_lease_releases_total{cause="cap"}') >= before + 1
    assert d_metric(pd, "kvlease_retained_blocks") <= cap

    # b first: every finished turn leaves a new lease on D, and with room for one conversation a's
    # second turn would push b's lease out in turn
    b2 = pd.turn(first + [first[-1]] + b1.output + exact(pd, [])[len(first) :], b1.handle, sb)
    assert reused(b2) > 0  # the newest lease survived and is pulled

    a2 = pd.turn(exact(pd, a1.output), a1.handle, sa)  # a's lease was released early
    assert reused(a2) == 0
    assert a2.p_params[KV.KVLEASE][PREFILL_REUSE_STATUS] == "expired"

    ref = salt()
    r1 = pd.turn(first, None, ref)
    assert pd.turn(exact(pd, r1.output), None, ref).output == a2.output
