"""Staged pulls on the real stack (``kvlease.staging``): D gathers, P reads once and scatters.

The same greedy-equality variants as ``test_connector_pd`` (each pulled turn 2 must equal the
no-pull reference token for token), with ``staging: always`` on both nodes, so every pull P makes
takes the staged path; P's log proves it did (one ``staged pull of`` line per pull, no fallback).
One more case points the handle's staging port at a closed port (the MAC recomputed with the
stack's secret, as D would sign it): P's worker cannot reach D's listener, falls back to upstream's
per-block READ and the turn is still equal to the reference.
"""

from __future__ import annotations

import copy
import socket
from collections.abc import Callable

import pytest

from kvlease.protocol import KV, LEASE_HANDLE_MAC, PREFILL_REUSE_STATUS, handle_mac
from kvlease.protocol._handle import LEASE_HANDLE_STAGING
from kvlease_stack import Stack, StackSpec

from ._specs import ALWAYS_PULL
from .test_connector_pd import (
    ASSISTANT,
    PD,
    TTL,
    USER_1,
    VARIANTS,
    chatml,
    pull_and_reference,
    reused,
    salt,
)

pytestmark = pytest.mark.integration

SPEC = StackSpec(
    model="tiny",
    connector="kvlease",
    ttl=TTL,
    recompute_threshold=32,
    prefix_caching=False,
    dtype="float32",
    kvlease={**ALWAYS_PULL, "staging": "always", "staging_timeout_s": 10.0},
)
STAGED = "staged pull of"  # P's worker, once per staged pull (kvlease_vllm._worker)
FELL_BACK = "staging fell back to the per-block READ"


@pytest.fixture(scope="module")
def pd(stack_factory: Callable[[StackSpec], Stack]) -> PD:
    return PD(stack_factory(SPEC))


def p_log_count(pd: PD, needle: str) -> int:
    return pd.stack.prefill.log_text().count(needle)


def test_decode_advertises_staging(pd: PD) -> None:
    t1 = pd.turn(pd.tok(chatml("user", USER_1) + ASSISTANT), None, salt())
    assert t1.handle is not None
    ports = t1.handle[KV.KVLEASE].get(LEASE_HANDLE_STAGING)
    assert isinstance(ports, list) and len(ports) == 1 and 0 < ports[0] < 65536


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_staged_two_turns_match_no_pull_reference(pd: PD, variant: str) -> None:
    build, must_pull = VARIANTS[variant]
    first = pd.tok(chatml("user", USER_1) + ASSISTANT)
    staged_before, fallback_before = p_log_count(pd, STAGED), p_log_count(pd, FELL_BACK)

    _, t2, r2 = pull_and_reference(pd, first, build)

    assert t2.output == r2.output, f"{variant}: staged turn 2 diverged from the no-pull reference"
    if must_pull:
        assert reused(t2) > 0, t2.p_params
        assert t2.p_params[KV.KVLEASE][PREFILL_REUSE_STATUS] == "hit"
        assert p_log_count(pd, STAGED) == staged_before + 1, "the pull did not take the staged path"
        assert p_log_count(pd, FELL_BACK) == fallback_before


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_staging_falls_back_and_matches_reference(pd: PD) -> None:
    build, _ = VARIANTS["exact"]
    first = pd.tok(chatml("user", USER_1) + ASSISTANT)
    staged_before, fallback_before = p_log_count(pd, STAGED), p_log_count(pd, FELL_BACK)

    a = salt()
    t1 = pd.turn(first, None, a)
    assert t1.handle is not None
    handle = copy.deepcopy(t1.handle)
    handle[KV.KVLEASE][LEASE_HANDLE_STAGING] = [_closed_port()]
    secret = pd.stack.control_secret
    assert secret, "the stack signs handles"
    handle[KV.KVLEASE][LEASE_HANDLE_MAC] = handle_mac(secret, handle)
    t2 = pd.turn(build(pd, t1.output), handle, a)

    b = salt()
    r1 = pd.turn(first, None, b)
    r2 = pd.turn(build(pd, r1.output), None, b)

    assert t2.output == r2.output, "the fallback's turn 2 diverged from the no-pull reference"
    assert reused(t2) > 0 and t2.p_params[KV.KVLEASE][PREFILL_REUSE_STATUS] == "hit"
    assert p_log_count(pd, FELL_BACK) == fallback_before + 1
    assert p_log_count(pd, STAGED) == staged_before
