"""D reads P's blocks only as long as P holds them (issue 29, finding 11), on the real stack.

Upstream's P keeps a finished request's blocks for D until D's read-done notice or until its lease
(``kv_lease_duration``, 30 s) runs out; a D that reads later reads blocks P has freed (P logs
"Potentially invalid KV blocks for unrecognized request ...") and decodes from them. Here D's read
is delayed past P's lease by sending D its half of the turn only after P released the blocks: D's
worker asks P's control endpoint after the read, P answers "not intact", the load fails and D
(``kv_load_failure_policy: recompute``) recomputes the prompt. Its greedy output must equal a
plain completion on D. P's freed blocks are not reused within the test (P's cache is large), so the
output alone would not tell the paths apart: P's log shows upstream's late read, and D's and P's
logs show the refusal (the old code has neither the check nor the refusal). A timely turn must not
be refused; its cost (P's round trip, D's half of a turn with and without the check) is printed.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from kvlease.protocol import KV, KV_TRANSFER_PARAMS, prefill_request_params
from kvlease.protocol._control import read_send_check_answer, send_check_call
from kvlease.protocol._control_client import send
from kvlease.protocol._sendcheck import SendCheck
from kvlease_stack import Stack, StackSpec

from ._faults import wait_until
from .test_connector_pd import ASSISTANT, GEN, PD, USER_1, chatml

pytestmark = pytest.mark.integration

SPEC = StackSpec(model="tiny", connector="kvlease", dtype="float32", decode_failure_policy="recompute")
#: P's lease on a P->D send: upstream's ``kv_lease_duration`` default (the stack does not set it).
P_LEASE_S = 30.0
WAIT_S = 120.0
#: D's log line when P's answer refuses a read (kvlease_vllm._sendcheck).
REFUSED = "P released the blocks before this read was confirmed"


@pytest.fixture(scope="module")
def pd(stack_factory: Callable[[StackSpec], Stack]) -> PD:
    return PD(stack_factory(SPEC))


def _plain(pd: PD, url: str, prompt: list[int], n: int) -> list[int]:
    """A completion with no KV transfer (a fresh salt: no prefix hit)."""
    body = {
        "model": pd.stack.model_name,
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "cache_salt": uuid.uuid4().hex,
    }
    r = pd.http.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


def _prefill(pd: PD, prompt: list[int], salt: str) -> dict[str, Any]:
    params: dict[str, Any] = pd._complete(pd.stack.prefill.url, prompt, prefill_request_params(), salt, 1)[
        KV_TRANSFER_PARAMS
    ]
    return params


def _decode(pd: PD, prompt: list[int], p_params: dict[str, Any], salt: str) -> list[int]:
    d = pd._complete(pd.stack.decode.url, prompt, p_params, salt, GEN)
    return list(d["choices"][0]["token_ids"])


def _p_log_has(pd: PD, text: str, prompt: list[int]) -> bool:
    """P's log has ``text``; else P takes one short step (an idle P does not run its sweeps)."""
    if text in pd.stack.prefill.log_text():
        return True
    _plain(pd, pd.stack.prefill.url, prompt[:16], 1)
    return text in pd.stack.prefill.log_text()


def test_a_read_of_blocks_p_released_is_refused_and_d_recomputes(pd: PD) -> None:
    prompt = pd.tok(chatml("user", USER_1) + ASSISTANT)
    baseline = _plain(pd, pd.stack.decode.url, prompt, GEN)

    # a timely turn: checked, intact, used
    s = uuid.uuid4().hex
    timely = _prefill(pd, prompt, s)
    check = SendCheck.from_json(timely[KV.SEND_CHECK])  # P runs kvlease: its answer carries the check
    refused_before = pd.stack.decode.log_text().count(REFUSED)
    assert _decode(pd, prompt, timely, s) == baseline
    assert pd.stack.decode.log_text().count(REFUSED) == refused_before

    # what D's check costs: one round trip to P's control endpoint (D's worker does exactly this)
    rtts = []
    for _ in range(20):
        t0 = time.perf_counter()
        call = send_check_call(
            check.control, [timely[KV.REMOTE_REQUEST_ID]], secret=pd.stack.control_secret, timeout=5
        )
        read_send_check_answer(*send(call))
        rtts.append(time.perf_counter() - t0)
    print(
        f"send check round trip: median {statistics.median(rtts) * 1e3:.2f} ms, max {max(rtts) * 1e3:.2f} ms"
    )

    # what it costs a turn: D's half with the check, and with P's check taken out of the params (D
    # then reads unchecked, as from a stock P, and says so once)
    costs: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(4):
        for checked in (True, False):
            s = uuid.uuid4().hex
            params = _prefill(pd, prompt, s)
            if not checked:
                params = {k: v for k, v in params.items() if k != KV.SEND_CHECK}
            t0 = time.perf_counter()
            assert _decode(pd, prompt, params, s) == baseline
            costs[checked].append(time.perf_counter() - t0)
    checked_ms, unchecked_ms = (statistics.median(costs[c]) * 1e3 for c in (True, False))
    print(f"D's half of a turn: median {checked_ms:.1f} ms checked, {unchecked_ms:.1f} ms unchecked")
    assert "sends no post-read check" in pd.stack.decode.log_text()

    # a late turn: D gets its half only after P's lease ran out and P let the blocks go
    s = uuid.uuid4().hex
    late = _prefill(pd, prompt, s)
    p_rid = late[KV.REMOTE_REQUEST_ID]
    time.sleep(P_LEASE_S)
    expired = f"Releasing expired KV blocks for request {p_rid}"
    assert wait_until(lambda: _p_log_has(pd, expired, prompt), timeout=WAIT_S, step=2.0), "no expiry on P"
    out = _decode(pd, prompt, late, s)
    # upstream's P saw D read blocks it had released: without the check D would decode from them
    late_read = f"Potentially invalid KV blocks for unrecognized request {p_rid}"
    assert wait_until(lambda: _p_log_has(pd, late_read, prompt), timeout=WAIT_S, step=2.0), "no late read"
    assert f"kvlease {p_rid}: D's read of this P->D send is not covered" in pd.stack.prefill.log_text()
    assert pd.stack.decode.log_text().count(REFUSED) == refused_before + 1
    assert out == baseline  # D recomputed the prompt
