"""``X-KVLease-Verified`` on every completion response: whether P verifies tokens (issue 16).

The SDK reads it to decide whether a changed history may keep reuse on (the kvlease connector pulls
only the token-verified prefix) or must opt out (stock vLLM pulls by length)."""

from __future__ import annotations

import pytest
from _router_cluster import ClusterFactory

from kvlease.protocol import HEADER_STATUS, HEADER_VERIFIED, VERIFIED_NONE, VERIFIED_TOKENS
from kvlease_stack.testing import FakeConfig

MSGS = [{"role": "user", "content": "hello there, this is a long enough first question " * 4}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("kvlease", "expected"), [(True, VERIFIED_TOKENS), (False, VERIFIED_NONE)])
async def test_every_completion_says_whether_p_verifies(
    make_cluster: ClusterFactory, stream: bool, kvlease: bool, expected: str
) -> None:
    cluster = await make_cluster(FakeConfig(kvlease=kvlease))
    for cid in ("conv-1", None):  # with and without a conversation id
        r, _ = await cluster.chat(MSGS, cid=cid, stream=stream)
        assert r.status == 200
        assert r.headers[HEADER_VERIFIED] == expected
        assert HEADER_STATUS in r.headers


async def test_an_upstream_error_passed_through_says_it_too(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster(FakeConfig(fail_next=1, fail_status=400))
    r, _ = await cluster.chat(MSGS, cid="conv-1", stream=False)
    assert r.status == 400
    assert r.headers[HEADER_VERIFIED] == VERIFIED_TOKENS
