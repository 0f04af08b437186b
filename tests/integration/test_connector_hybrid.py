"""KVLeaseConnector on a hybrid KV cache: the ``hybrid`` model (Gemma-3-style, three sliding-window
layers of 128 tokens and one global layer) served by vLLM's hybrid KV cache manager.

Upstream hands out only the in-window tail of a sliding-window group's blocks, so P may pull only
D's whole sequence (the token-exact continuation); any shorter verified prefix is declined
(``hybrid_partial``) and recomputed. Every comparison runs two arms with their own ``cache_salt``
(the *pull* arm sends D's handle to P, the *reference* arm sends none) and the greedy outputs of the
decode node must be identical, token for token. The histories span several 128-token blocks, so
the verified prefixes cross the sliding window.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvlease.protocol import KV, PREFILL_REUSE_STATUS
from kvlease_stack import Stack, StackSpec

from ._specs import ALWAYS_PULL
from .test_connector_pd import (
    ASSISTANT,
    END,
    PD,
    USER_1,
    USER_2,
    Turn,
    chatml,
    earlier_message_edited,
    retokenized,
    reused,
    salt,
    think_stripped,
    three_turn_arms,
)

pytestmark = pytest.mark.integration

# float32 and P's prefix cache off: see test_connector_pd.SPEC.
SPEC = StackSpec(
    model="hybrid",
    connector="kvlease",
    ttl=120.0,
    recompute_threshold=32,
    prefix_caching=False,
    dtype="float32",
    kvlease=ALWAYS_PULL,
)
HYBRID_PARTIAL = "hybrid_partial"  # kvlease_vllm._verify.Reason.HYBRID_PARTIAL (a metric label)


@pytest.fixture(scope="module")
def pd(stack_factory: Callable[[StackSpec], Stack]) -> PD:
    return PD(stack_factory(SPEC))


def _status(turn: Turn) -> str:
    return str(turn.p_params[KV.KVLEASE][PREFILL_REUSE_STATUS])


# ------------------------------------------------------------------------------ conversations
# Five first user turns of about 700 tokens each (several blocks, far past the sliding window), each
# with an ``number 14,`` to edit in its last blocks.


def _conversation(task: str, step: str) -> str:
    return f"Write a Python function that {task}. " + "".join(
        f"Step {i}: {step.format(i=i)} before moving on. " for i in range(1, 19)
    )


CONVERSATIONS = [
    USER_1,
    _conversation(
        "loads the settings of a service from a configuration file",
        "the loader reads entry number {i}, validates its key, converts the value and stores it in the settings",
    ),
    _conversation(
        "downloads a list of files over HTTP",
        "the client opens request number {i}, sends the headers, streams the body to disk and checks the size",
    ),
    _conversation(
        "schedules background jobs with retries",
        "the scheduler takes job number {i}, computes its next run time, puts it on the queue and logs it",
    ),
    _conversation(
        "renders a table of results as an HTML report",
        "the renderer formats row number {i}, escapes every cell, applies the column style and appends it",
    ),
]


def _first(pd: PD, user: str) -> list[int]:
    return pd.tok(chatml("user", user) + ASSISTANT)


def _edited(pd: PD, user: str, out1: list[int]) -> list[int]:
    edited = user.replace("number 14,", "number 41,", 1)
    assert edited != user
    return _first(pd, edited) + out1 + pd.tok(END + chatml("user", USER_2) + ASSISTANT)


def _exact(pd: PD, user: str, out1: list[int]) -> list[int]:
    return _first(pd, user) + out1 + pd.tok(END + chatml("user", USER_2) + ASSISTANT)


def _two_arms(
    pd: PD, user: str, build: Callable[[list[int]], list[int]]
) -> tuple[Turn, Turn, list[int], list[int]]:
    """(pull arm's turn 1, its turn 2, the reference's turn-2 output, the turn-2 prompt)."""
    first = _first(pd, user)
    a = salt()
    t1 = pd.turn(first, None, a)
    assert t1.handle is not None and KV.KVLEASE in t1.handle, "D returned no kvlease handle"
    prompt2 = build(t1.output)
    t2 = pd.turn(prompt2, t1.handle, a)
    b = salt()
    r1 = pd.turn(first, None, b)
    assert r1.output == t1.output
    r2 = pd.turn(build(r1.output), None, b)
    return t1, t2, r2.output, prompt2


# ------------------------------------------------------------------------------ tests


def test_decode_node_uses_the_hybrid_kv_cache_manager(pd: PD) -> None:
    """D's handle names one block list per KV cache group (full + sliding-window groups), and the
    sliding-window groups hand out only their in-window tail."""
    first = _first(pd, USER_1)
    t1 = pd.turn(first, None, salt())
    assert t1.handle is not None
    groups = t1.handle[KV.REMOTE_BLOCK_IDS]
    assert isinstance(groups, list) and len(groups) > 1, groups
    block = t1.handle[KV.KVLEASE]["block_size"]
    whole = -(-t1.handle[KV.REMOTE_NUM_TOKENS] // block)
    assert whole > 2, "the history must span several blocks"
    sizes = sorted(len(g) for g in groups)
    assert sizes[-1] == whole, (sizes, whole)  # the global layer's group: every block
    assert sizes[0] < whole, sizes  # a sliding-window group: only the tail


@pytest.mark.parametrize("user", range(3), ids=lambda i: f"conversation{i}")
def test_exact_continuation_pulls_and_matches_reference(pd: PD, user: int) -> None:
    text = CONVERSATIONS[user]
    pulls_before = pd.p_counter("pull")
    t1, t2, ref, prompt2 = _two_arms(pd, text, lambda out1: _exact(pd, text, out1))
    assert t2.output == ref, "pulled turn 2 diverged from the no-pull reference"
    assert _status(t2) == "hit", t2.p_params
    assert pd.p_counter("pull") > pulls_before
    assert t1.handle is not None
    # D's whole sequence, its partial last block included (kvlease.tail)
    assert reused(t2) == t1.handle[KV.REMOTE_NUM_TOKENS] == len(_first(pd, text)) + len(t1.output) - 1
    assert reused(t2) < len(prompt2)


PARTIAL = {
    "think_stripped": think_stripped,
    "earlier_message_edited": earlier_message_edited,
    "retokenized": retokenized,
}


@pytest.mark.parametrize("variant", list(PARTIAL))
def test_partial_prefix_declines_hybrid_partial_and_matches_reference(pd: PD, variant: str) -> None:
    """A verified prefix shorter than D's sequence: P declines (``hybrid_partial``, status ``miss``)
    and recomputes; D's output equals the reference."""
    build = PARTIAL[variant]
    declined_before = pd.p_counter(HYBRID_PARTIAL)
    _, t2, ref, _ = _two_arms(pd, USER_1, lambda out1: build(pd, out1))
    assert t2.output == ref, f"{variant}: turn 2 diverged from the no-pull reference"
    assert reused(t2) == 0, t2.p_params
    assert _status(t2) == "miss", t2.p_params
    assert pd.p_counter(HYBRID_PARTIAL) == declined_before + 1


def test_edited_history_declines_and_matches_reference_in_every_conversation(pd: PD) -> None:
    """The edited case over five conversations (a partial pull diverged in about one of ten)."""
    declined_before = pd.p_counter(HYBRID_PARTIAL)
    diverged = []
    for i, text in enumerate(CONVERSATIONS):
        _, t2, ref, _ = _two_arms(pd, text, lambda out1, text=text: _edited(pd, text, out1))
        assert reused(t2) == 0 and _status(t2) == "miss", (i, t2.p_params)
        if t2.output != ref:
            diverged.append(i)
    assert diverged == [], f"turn 2 diverged from the no-pull reference in conversations {diverged}"
    assert pd.p_counter(HYBRID_PARTIAL) == declined_before + len(CONVERSATIONS)


def test_three_turns_exact_match_reference(pd: PD) -> None:
    arms = three_turn_arms(pd, _first(pd, USER_1))
    _, t2, t3 = arms["pull"]
    assert _status(t2) == "hit" and _status(t3) == "hit", (t2.p_params, t3.p_params)
    assert reused(t3) > reused(t2) > 0
    assert [t.output for t in arms["pull"]] == [t.output for t in arms["ref"]]
