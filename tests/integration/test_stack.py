"""The local real stack: a real P->D turn over NIXL, greedy determinism, clean stop and restart."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvlease.protocol import CACHE_SALT, CHAT_COMPLETIONS_PATH, KV, KV_TRANSFER_PARAMS, prefill_request_params
from kvlease_stack import Stack, StackError, StackSpec
from kvlease_stack._servers import group_members, http_json

pytestmark = pytest.mark.integration

PROMPT = "def read_config(path):\n    '''Read the configuration file and return a dict.'''\n" * 8


def turn(
    stack: Stack, content: str, *, salt: str, max_tokens: int = 16
) -> tuple[dict[str, Any], dict[str, Any]]:
    body: dict[str, Any] = {
        "model": stack.model_name,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0.0,
        CACHE_SALT: salt,
    }
    p = http_json(
        stack.prefill.url + CHAT_COMPLETIONS_PATH,
        {**body, "max_tokens": 1, KV_TRANSFER_PARAMS: prefill_request_params()},
        timeout=300,
    )
    d = http_json(
        stack.decode.url + CHAT_COMPLETIONS_PATH,
        {**body, "max_tokens": max_tokens, KV_TRANSFER_PARAMS: p[KV_TRANSFER_PARAMS]},
        timeout=300,
    )
    return p, d


def text_of(resp: dict[str, Any]) -> str:
    return str(resp["choices"][0]["message"]["content"])


def test_prefill_to_decode_turn_pulls_kv_over_nixl(stack: Stack) -> None:
    before = stack.decode.metrics()
    p, d = turn(stack, PROMPT + "# turn A", salt=uuid.uuid4().hex)

    params = p[KV_TRANSFER_PARAMS]
    assert params[KV.DO_REMOTE_PREFILL] is True
    assert params[KV.REMOTE_BLOCK_IDS], params
    assert params[KV.REMOTE_ENGINE_ID]
    prompt_tokens = int(p["usage"]["prompt_tokens"])
    assert prompt_tokens > 100
    assert d["usage"]["prompt_tokens"] == prompt_tokens
    assert d["usage"]["completion_tokens"] >= 1

    after = stack.decode.metrics()
    hits = after.total("vllm:external_prefix_cache_hits_total") - before.total(
        "vllm:external_prefix_cache_hits_total"
    )
    # D took (most of) the prompt's KV from P over NIXL instead of computing it.
    assert hits >= prompt_tokens // 2, (hits, prompt_tokens)
    assert after.total("vllm:nixl_xfer_time_seconds_count") > before.total(
        "vllm:nixl_xfer_time_seconds_count"
    )
    assert after.total("vllm:nixl_num_failed_transfers_total") == before.total(
        "vllm:nixl_num_failed_transfers_total"
    )


def test_greedy_output_is_deterministic_and_depends_on_the_prompt(stack: Stack) -> None:
    a1 = text_of(turn(stack, PROMPT + "# variant one", salt=uuid.uuid4().hex)[1])
    a2 = text_of(turn(stack, PROMPT + "# variant one", salt=uuid.uuid4().hex)[1])
    others = {
        text_of(turn(stack, content, salt=uuid.uuid4().hex)[1])
        for content in (
            "import socket\nclass Server:\n",
            "Explain the difference between a list and a tuple.",
        )
    }
    assert a1 == a2
    assert len(others | {a1}) >= 2  # the trained tiny model's greedy output depends on the prompt


def test_endpoints_and_metrics(stack: Stack) -> None:
    info = stack.endpoints()
    assert info["prefill"]["url"] == stack.prefill.url
    assert info["decode"]["pgid"] == stack.decode.pgid
    assert stack.prefill.control is not None and stack.prefill.control.startswith("http://127.0.0.1:")
    assert stack.control_secret
    assert (stack.model_dir / "tokenizer.json").is_file()
    m = stack.prefill.metrics()
    assert m.total("vllm:prompt_tokens_total") > 0  # at least the warm-up turn
    assert stack.prefill.rss_bytes() > 100 * 2**20


def test_restart_decode_keeps_ports_and_serves(stack_factory: Callable[[StackSpec], Stack]) -> None:
    stack = stack_factory(StackSpec())
    url, old_pgid = stack.decode.url, stack.decode.pgid
    stack.restart_decode()
    assert stack.decode.url == url
    assert stack.decode.pgid != old_pgid
    assert old_pgid is not None and not group_members(old_pgid)
    _, d = turn(stack, PROMPT + "# after restart", salt=uuid.uuid4().hex)
    assert d["usage"]["completion_tokens"] >= 1


def test_stop_leaves_no_process(stack_factory: Callable[[StackSpec], Stack]) -> None:
    stack = stack_factory(StackSpec(connector="nixl", plugin=False))
    assert stack.prefill.control is None
    # plugin=False: vLLM's own plugins load, kvlease's does not.
    assert "kvlease plugin" not in stack.prefill.log_text()
    _, d = turn(stack, PROMPT + "# nixl", salt=uuid.uuid4().hex)
    assert d["usage"]["completion_tokens"] >= 1
    pgids = [stack.prefill.pgid, stack.decode.pgid]
    assert all(g is not None and group_members(g) for g in pgids)
    stack.stop()
    stack.stop()  # idempotent
    for g in pgids:
        assert g is not None
        # Nothing alive is left (an exited engine process may stay a zombie until init reaps it).
        assert not group_members(g), f"processes left in group {g}"
    assert not stack.alive()


def _children() -> set[int]:
    me = os.getpid()
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            rest = stat[stat.rindex(")") + 2 :].split()
            if int(rest[1]) == me and rest[0] != "Z":
                out.add(int(entry))
    return out


def test_start_failure_fails_fast_and_leaves_nothing(stack_pool: Any) -> None:
    # A bad KV cache size makes the server exit during start-up: start must fail at once (not by
    # the health deadline) with the server's log tail, and stop what it started.
    spec = StackSpec(connector="nixl", extra_env={"VLLM_CPU_KVCACHE_SPACE": "not-a-number"})
    stack_pool.close()  # one pair at a time
    before = _children()
    with pytest.raises(StackError, match=r"exited \(rc=.*log tail") as err:
        Stack.start(spec, timeout=600, warmup=False)
    assert "VLLM_CPU_KVCACHE_SPACE" in str(err.value) or "not-a-number" in str(err.value)
    assert _children() <= before
