"""KVLeaseConnector on a hybrid KV cache: the ``hybrid`` model (Gemma-3-style, three sliding-window
layers of 128 tokens and one global layer) served by vLLM's hybrid KV cache manager.

Upstream hands out only the in-window tail of a sliding-window group's blocks (its last
``cdiv(128, 128) + 1 = 2``), so P pulls D's whole sequence (the token-exact continuation), or a
shorter verified prefix only when D still holds the window before that prefix's end (it ends in D's
last blocks: a resent prompt, an answer changed near its end); any other prefix is declined
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


BLOCK = WINDOW = 128  # the CPU backend's block; the model's sliding window


def _pullable(t1: Turn, prompt2: list[int]) -> int:
    """The tokens of D's turn-1 sequence P may pull for ``prompt2`` (0: none), by vLLM's rules.

    Whole common blocks (at least one prompt token left to compute), or D's whole sequence when
    ``prompt2`` continues it. A shorter prefix needs the sliding-window layers' KV of the blocks
    holding its last ``WINDOW - 1`` tokens, and D keeps only its last two blocks of those layers,
    minus the ones wholly before its own window.
    """
    assert t1.handle is not None
    n = int(t1.handle[KV.REMOTE_NUM_TOKENS])
    d_seq = (t1.prompt + t1.output)[:n]
    if prompt2[:n] == d_seq and len(prompt2) > n:
        return n
    blocks = 0
    while (
        blocks < min((len(prompt2) - 1) // BLOCK, n // BLOCK)
        and prompt2[blocks * BLOCK : (blocks + 1) * BLOCK] == d_seq[blocks * BLOCK : (blocks + 1) * BLOCK]
    ):
        blocks += 1
    v = blocks * BLOCK
    d_blocks = -(-n // BLOCK)
    held = max(d_blocks - 2, max(0, n - WINDOW + 1) // BLOCK)
    return v if v and max(0, v - WINDOW + 1) // BLOCK >= held else 0


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
def test_partial_prefix_pulls_only_where_d_holds_the_window_and_matches_reference(
    pd: PD, variant: str
) -> None:
    """A verified prefix shorter than D's sequence: P pulls it when it ends in D's last blocks, else
    declines (``hybrid_partial``, status ``miss``) and recomputes; D's output equals the reference."""
    build = PARTIAL[variant]
    declined_before = pd.p_counter(HYBRID_PARTIAL)
    t1, t2, ref, prompt2 = _two_arms(pd, USER_1, lambda out1: build(pd, out1))
    assert t2.output == ref, f"{variant}: turn 2 diverged from the no-pull reference"
    expected = _pullable(t1, prompt2)
    assert reused(t2) == expected, (expected, t2.p_params)
    assert _status(t2) == ("hit" if expected else "miss"), t2.p_params
    assert pd.p_counter(HYBRID_PARTIAL) == declined_before + (0 if expected else 1)


def test_edited_history_matches_reference_in_every_conversation(pd: PD) -> None:
    """The edited case over five conversations (a partial pull by length diverged in about one of
    ten): an edit in the user's message lies before D's last blocks, so every one is declined."""
    declined_before = pd.p_counter(HYBRID_PARTIAL)
    diverged = []
    for i, text in enumerate(CONVERSATIONS):
        t1, t2, ref, prompt2 = _two_arms(pd, text, lambda out1, text=text: _edited(pd, text, out1))
        assert _pullable(t1, prompt2) == 0, i
        assert reused(t2) == 0 and _status(t2) == "miss", (i, t2.p_params)
        if t2.output != ref:
            diverged.append(i)
    assert diverged == [], f"turn 2 diverged from the no-pull reference in conversations {diverged}"
    assert pd.p_counter(HYBRID_PARTIAL) == declined_before + len(CONVERSATIONS)


# Two conversations of about 2k tokens (16-17 blocks; D keeps 2 blocks of each sliding-window layer).
LONG_CONVERSATIONS = [
    "Write a Python function that downloads a list of files over HTTP. "
    + "".join(
        f"Step {i}: the client opens request number {i}, sends the headers, streams the body to disk "
        "and checks the size before moving on. "
        for i in range(1, steps)
    )
    for steps in (60, 45)
]


@pytest.mark.parametrize("user", range(len(LONG_CONVERSATIONS)), ids=lambda i: f"long{i}")
def test_two_thousand_token_conversation_pulls_d_whole_sequence(pd: PD, user: int) -> None:
    """The token-exact continuation of a 1.6k-2.2k-token conversation pulls all of D's tokens; the
    same prompt resent (a retried turn) pulls its whole blocks, which end in D's last blocks. Both
    answers equal the no-pull ones."""
    text = LONG_CONVERSATIONS[user]
    first = _first(pd, text)
    assert len(first) > 1500
    t1, t2, ref, _ = _two_arms(pd, text, lambda out1: _exact(pd, text, out1))
    assert t2.output == ref, "pulled turn 2 diverged from the no-pull reference"
    assert t1.handle is not None
    assert reused(t2) == t1.handle[KV.REMOTE_NUM_TOKENS] == len(first) + len(t1.output) - 1, t2.p_params
    assert _status(t2) == "hit"
    # a retried turn 1 with the handle of a turn 1 of its own (t1's lease was read by t2)
    s = salt()
    r1 = pd.turn(first, None, s)
    assert r1.output == t1.output and r1.handle is not None
    retry = pd.turn(first, r1.handle, s)
    assert retry.output == r1.output, "the retried turn diverged from the first answer"
    expected = _pullable(r1, first)
    assert expected == (len(first) - 1) // BLOCK * BLOCK, (
        "this conversation's prompt must end in D's last blocks"
    )
    assert reused(retry) == expected and _status(retry) == "hit", retry.p_params


def test_three_turns_exact_match_reference(pd: PD) -> None:
    arms = three_turn_arms(pd, _first(pd, USER_1))
    _, t2, t3 = arms["pull"]
    assert _status(t2) == "hit" and _status(t3) == "hit", (t2.p_params, t3.p_params)
    assert reused(t3) > reused(t2) > 0
    assert [t.output for t in arms["pull"]] == [t.output for t in arms["ref"]]
