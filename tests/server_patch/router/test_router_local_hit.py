"""``local_hit``: P had nothing left to pull (its prefix cache covered the verified prefix). The
router reports it as its own status, not as a ``miss``; an SDK that predates it reads no status."""

from __future__ import annotations

from kvlease._wire import reuse_status
from kvlease.protocol import ReuseStatus
from kvlease_router import MissRateMonitor
from kvlease_router._metrics import RouterMetrics
from kvlease_router._reuse import judge_prefill


def _p(reuse: str, tokens: int = 0) -> dict[str, object]:
    return {"kv_transfer_params": {"kvlease": {"reused_tokens": tokens, "reuse": reuse}}}


def test_p_reporting_local_hit_is_not_a_miss() -> None:
    assert judge_prefill(_p("local_hit"), 100) == (ReuseStatus.LOCAL_HIT, 0)
    assert judge_prefill(_p("miss"), 100) == (ReuseStatus.MISS, 0)
    # reused tokens decide first: a pull happened
    assert judge_prefill(_p("local_hit", 32), 100) == (ReuseStatus.HIT, 32)


def test_local_hit_turns_do_not_count_toward_the_miss_warning() -> None:
    m = MissRateMonitor(window_s=60, min_turns=3)
    assert [m.observe(float(t), ReuseStatus.LOCAL_HIT) for t in range(10)] == [None] * 10
    assert [m.observe(float(t), ReuseStatus.MISS) for t in (10, 11)] == [None, None]


def test_the_turn_counter_has_a_local_hit_label() -> None:
    metrics = RouterMetrics()
    metrics.turns[ReuseStatus.LOCAL_HIT].inc()
    assert b'kvlease_router_turns_total{status="local_hit"} 1.0' in metrics.render()


def test_the_header_value_parses_and_an_unknown_one_reads_as_no_status() -> None:
    assert ReuseStatus.parse("local_hit") is ReuseStatus.LOCAL_HIT
    assert reuse_status(b"local_hit") is ReuseStatus.LOCAL_HIT
    # what an older SDK does with a status it does not know (here: one newer than this SDK)
    assert ReuseStatus.parse("some_future_status") is None
    assert reuse_status(b"some_future_status") is None
