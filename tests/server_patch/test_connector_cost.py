"""The pull-or-recompute cost model (sans-IO)."""

from __future__ import annotations

import pytest

from kvlease_vllm._cost import CostModel
from kvlease_vllm._verify import Reason


def model(**over: float) -> CostModel:
    args = {
        "bytes_per_token": 4096.0,
        "default_bandwidth_bps": 1e9,
        "default_prefill_tokens_per_s": 4000.0,
        "fixed_latency_s": 0.005,
    }
    args.update(over)
    return CostModel(**args)


@pytest.mark.parametrize(
    ("gain", "threshold", "over", "pull", "reason"),
    [
        (0, 64, {}, False, Reason.LOCAL_HIT),
        (-16, 64, {}, False, Reason.LOCAL_HIT),
        (48, 64, {}, False, Reason.BELOW_THRESHOLD),
        (64, 64, {}, True, Reason.PULL),  # 5 ms + 0.26 ms vs 16 ms
        (1024, 0, {}, True, Reason.PULL),
        # slow link: 1024 tokens * 4 KiB at 1 MB/s = 4.2 s vs 0.26 s recompute
        (1024, 64, {"default_bandwidth_bps": 1e6}, False, Reason.COST),
        # fixed latency dominates a small gain on a fast prefill
        (64, 0, {"default_prefill_tokens_per_s": 1e6}, False, Reason.COST),
    ],
)
def test_decide(gain: int, threshold: int, over: dict[str, float], pull: bool, reason: Reason) -> None:
    d = model(**over).decide(gain, threshold)
    assert (d.pull, d.reason, d.gain_tokens) == (pull, reason, gain)
    assert ("pull" if pull else "recompute") in d.describe()


def test_defaults_until_first_observation_then_online() -> None:
    m = model()
    assert m.bandwidth_bps == 1e9 and m.prefill_tokens_per_s == 4000.0 and m.observations == (0, 0)
    m.observe_prefill(2000, 0.2)  # 10k tok/s
    assert m.prefill_tokens_per_s == pytest.approx(10000.0)
    m.observe_pull(1000, 0.005 + 4096 * 1000 / 2e8)  # 200 MB/s after the fixed latency
    assert m.bandwidth_bps == pytest.approx(2e8)
    m.observe_prefill(1000, 0.5)  # 2k tok/s: EWMA moves towards it
    assert 2000.0 < m.prefill_tokens_per_s < 10000.0
    assert m.observations == (1, 2)


def test_observations_flip_the_decision() -> None:
    m = model(default_bandwidth_bps=1e10)
    assert m.decide(512, 64).pull
    for _ in range(20):
        m.observe_pull(512, 3.0)  # pulls turn out to be very slow
    d = m.decide(512, 64)
    assert not d.pull and d.reason is Reason.COST


@pytest.mark.parametrize(
    ("tokens", "seconds"), [(0, 1.0), (-1, 1.0), (10, 0.0), (10, float("inf")), (10, float("nan"))]
)
def test_bad_observations_are_ignored(tokens: int, seconds: float) -> None:
    m = model()
    m.observe_pull(tokens, seconds)
    m.observe_prefill(tokens, seconds)
    assert m.observations == (0, 0)


def test_bad_defaults_rejected() -> None:
    with pytest.raises(ValueError):
        model(bytes_per_token=0)
