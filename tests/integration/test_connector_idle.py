"""Leases without a busy engine (issue 14, item 7), on the real stack.

With ``own_block_refs`` (the default) D holds a leased request's blocks with its own reference, so
the finished request leaves vLLM's scheduler and an otherwise idle engine stops stepping empty
batches. What is asserted: a lease held this way through an idle window is still pulled correctly
(its blocks were not freed under it), and releasing the leases frees the blocks.

The figure (a goal, measured, not asserted: timings vary with the machine's load) is D's CPU (all
threads of its process group) over a window with N idle leases held against the same window with
none held, printed as one line; the goal is a difference of at most 2 % of a core (+36 % with 10
leases before). The baseline is mostly NIXL's busy-polling progress thread. The issue's benchmark
is ``KVLEASE_IDLE_WINDOW_S=60 KVLEASE_IDLE_LEASES=100 pytest -s tests/integration/test_connector_idle.py``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvlease.protocol import CONTROL_METRICS_PATH, CONTROL_RELEASE_PATH, KV, ControlReleaseRequest
from kvlease_stack import Stack, StackSpec
from kvlease_stack._config import parse_task_stat
from kvlease_stack._servers import group_members

from ._specs import ALWAYS_PULL
from .test_connector_pd import ASSISTANT, END, PD, SPEC, USER_1, USER_2, chatml, reused, salt

pytestmark = pytest.mark.integration

#: The window per measurement; the issue's benchmark asks for 60 s with 100 leases.
WINDOW_S = float(os.environ.get("KVLEASE_IDLE_WINDOW_S", "15"))
LEASES = int(os.environ.get("KVLEASE_IDLE_LEASES", "100"))
IDLE_SPEC = StackSpec(
    model=SPEC.model,
    connector="kvlease",
    ttl=3 * WINDOW_S + 120.0,
    recompute_threshold=32,
    prefix_caching=False,
    dtype="float32",
    kvlease=ALWAYS_PULL,
)


@pytest.fixture(scope="module")
def pd(stack_factory: Callable[[StackSpec], Stack]) -> PD:
    return PD(stack_factory(IDLE_SPEC))


def _cpu_ticks(pgid: int) -> int:
    total = 0
    for pid in group_members(pgid):
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                total += parse_task_stat(Path(f"/proc/{pid}/task/{tid}/stat").read_text())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def _cores(pgid: int, seconds: float) -> float:
    hz = os.sysconf("SC_CLK_TCK")
    t0, c0 = time.monotonic(), _cpu_ticks(pgid)
    time.sleep(seconds)
    return (_cpu_ticks(pgid) - c0) / hz / (time.monotonic() - t0)


def _d_metric(pd: PD, sample: str) -> float:
    text = pd.control("decode", CONTROL_METRICS_PATH).text
    return float(next(line for line in text.splitlines() if line.startswith(sample + " ")).split()[-1])


def test_idle_leases_cost_no_engine_steps(pd: PD) -> None:
    pgid = pd.stack.decode.pgid
    assert pgid is not None
    time.sleep(5.0)  # let the warm-up settle
    baseline = _cores(pgid, WINDOW_S)

    first = pd.tok(chatml("user", USER_1) + ASSISTANT)[:200]
    salts = [salt() for _ in range(LEASES)]
    turns = [pd.turn(first + [i % 50], None, salts[i]) for i in range(LEASES)]
    assert all(t.handle is not None for t in turns)
    before = _d_metric(pd, "kvlease_leases")
    assert before >= LEASES
    time.sleep(5.0)
    held = _cores(pgid, WINDOW_S)
    print(
        f"D idle over {WINDOW_S:.0f} s: {baseline:.3f} cores without leases, {held:.3f} with {LEASES} "
        f"leases held ({held - baseline:+.3f}; goal <= +0.020)"
    )

    # the leases still hold the right blocks after the idle window ...
    t = turns[0]
    follow_up = pd.tok(END + chatml("user", USER_2) + ASSISTANT)
    again = pd.turn(t.prompt + t.output + follow_up, t.handle, salts[0])
    assert reused(again) > 0
    # ... and releasing them frees the blocks (the next step's sweep reports them)
    ids = [x.handle[KV.REMOTE_REQUEST_ID] for x in turns[1:] if x.handle is not None]
    pd.control("decode", CONTROL_RELEASE_PATH, ControlReleaseRequest(tuple(ids)).to_json())
    pd.turn(first, None, salt())  # a step, so the workers' sweep runs
    deadline = time.monotonic() + 30
    while _d_metric(pd, "kvlease_leases") > before - len(ids) + 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _d_metric(pd, "kvlease_leases") <= before - len(ids) + 3
