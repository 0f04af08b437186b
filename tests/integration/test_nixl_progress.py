"""NIXL's progress thread with kvlease's poll delay, on real NIXL (the vLLM venv's).

Two agents in one process, as P and D: with :func:`kvlease_vllm._progress.install` in place, a READ
of D's registered memory completes with the right bytes and D receives P's notification while D
itself never calls anything (an idle decode engine does not step). The idle CPU of the spinning and
of the polling thread is printed as a figure (not asserted: it depends on the machine's load).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

pytestmark = pytest.mark.integration

SCRIPT = r"""
import resource, sys, time
import numpy as np
from kvlease_vllm import _progress

delay = int(sys.argv[1])
assert _progress.install(delay), "NIXL's _api has an unexpected shape"
assert _progress.installed_delay_us() == delay
import nixl._api as api

d = api.nixl_agent("kvlease-test-D", api.nixl_agent_config(backends=["UCX"]))
p = api.nixl_agent("kvlease-test-P", api.nixl_agent_config(backends=["UCX"]))
n = 1 << 22
src = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
dst = np.zeros(n, dtype=np.uint8)
d.register_memory(d.get_reg_descs([(src.ctypes.data, n, 0, "")], "DRAM"))
p.register_memory(p.get_reg_descs([(dst.ctypes.data, n, 0, "")], "DRAM"))
p.add_remote_agent(d.get_agent_metadata())
d.add_remote_agent(p.get_agent_metadata())

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

time.sleep(0.5)
c0, t0 = cpu(), time.monotonic()
time.sleep(3.0)
idle = (cpu() - c0) / (time.monotonic() - t0)
for i in range(5):
    dst[:] = 0
    h = p.initialize_xfer(
        "READ",
        p.get_xfer_descs([(dst.ctypes.data, n, 0)], "DRAM"),
        d.get_xfer_descs([(src.ctypes.data, n, 0)], "DRAM"),
        "kvlease-test-D",
        b"done-%d" % i,
    )
    p.transfer(h)
    end = time.monotonic() + 30
    while (state := p.check_xfer_state(h)) == "PROC":
        assert time.monotonic() < end, "READ did not complete"
    assert state == "DONE", state
    p.release_xfer_handle(h)
    assert (dst == src).all()
    end = time.monotonic() + 30
    while not d.get_new_notifs():
        assert time.monotonic() < end, "D got no notification"
        time.sleep(0.0005)
print(f"RESULT delay_us={delay} idle_cores={idle:.3f}")
"""


@pytest.mark.parametrize("delay_us", [1000, 0])
def test_reads_and_notifications_with_the_poll_delay(
    run_in_vllm_venv: Callable[..., str], delay_us: int
) -> None:
    out = run_in_vllm_venv(SCRIPT, str(delay_us), timeout=180)
    line = next(x for x in out.splitlines() if x.startswith("RESULT"))
    print(f"NIXL progress thread, two idle agents: {line.removeprefix('RESULT ')}")
    assert f"delay_us={delay_us}" in line
