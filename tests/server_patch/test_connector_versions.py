"""vLLM 0.32 and 0.33 side by side: /info's version fields, the router's refusal of a mixed P/D
pair, the claim's wire (claimant, absolute deadlines) and the plugin stepping aside on 0.33."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from kvlease.protocol import ControlInfo, ControlRenewRequest, ControlRenewResponse, ProtocolError, Role
from kvlease_router import ConfigError
from kvlease_router._validate import NodeFacts, plan_cluster
from kvlease_stack.testing import control_info, placeholder_settings


def info(role: Role, **kw: object) -> ControlInfo:
    """A vLLM 0.33 connector's ``/info`` (NIXL 1.5.1, NIXL connector version 15)."""
    fields: dict[str, object] = {
        "vllm_version": "0.33.0",
        "kvlease_version": "0.2.0",
        "nixl_version": "1.5.1",
        "connector_version": 15,
        **kw,
    }
    return control_info(role, **fields)


def test_info_round_trips_the_version_fields() -> None:
    i = info(role=Role.DECODE, data_parallel_index=2)
    assert ControlInfo.from_json(i.to_json()) == i
    old = {
        k: v
        for k, v in i.to_json().items()
        if k not in ("nixl_version", "connector_version", "data_parallel_index")
    }
    parsed = ControlInfo.from_json(old)  # an older connector: fields unknown
    assert (parsed.nixl_version, parsed.connector_version, parsed.data_parallel_index) == (None, None, 0)
    with pytest.raises(ProtocolError):
        ControlInfo.from_json({**i.to_json(), "connector_version": "15"})


@pytest.mark.parametrize(
    ("p_kw", "d_kw", "what", "p_value", "d_value"),
    [
        ({"vllm_version": "0.32.0"}, {}, "the vLLM version", "'0.32.0'", "'0.33.0'"),
        ({"nixl_version": "1.4.0"}, {}, "the NIXL version", "'1.4.0'", "'1.5.1'"),
        ({"connector_version": 14}, {}, "the NIXL connector version", "14", "15"),
    ],
)
def test_router_refuses_mismatched_versions_naming_both_sides(
    p_kw: dict, d_kw: dict, what: str, p_value: str, d_value: str
) -> None:
    p = NodeFacts("http://p", "m", None, info(role=Role.PREFILL, **p_kw))
    d = NodeFacts("http://d", "m", None, info(role=Role.DECODE, **d_kw))
    with pytest.raises(ConfigError) as e:
        plan_cluster(placeholder_settings(), [p], [d])
    msg = str(e.value)
    assert f"disagree on {what}" in msg
    assert f"http://p: {p_value}" in msg and f"http://d: {d_value}" in msg


def test_router_accepts_a_matched_033_pair() -> None:
    p = NodeFacts("http://p", "m", None, info(role=Role.PREFILL))
    d = NodeFacts("http://d", "m", None, info(role=Role.DECODE))
    assert plan_cluster(placeholder_settings(), [p], [d]).vllm_version == "0.33.0"


def test_claim_wire_claimant_and_deadlines() -> None:
    req = ControlRenewRequest(("a",), 30.0, claim=True, claimant="p-req-1")
    assert ControlRenewRequest.from_json(req.to_json()) == req
    # a claimant without a claim is meaningless: dropped
    assert ControlRenewRequest.from_json({"request_ids": ["a"], "ttl": 3, "claimant": "x"}).claimant is None
    with pytest.raises(ProtocolError, match="claimant"):
        ControlRenewRequest.from_json({"request_ids": ["a"], "ttl": 3, "claim": True, "claimant": 5})
    ans = ControlRenewResponse({"a": 29.5, "b": None}, {"a": 1234.5})
    assert ControlRenewResponse.from_json(ans.to_json()) == ans
    assert ControlRenewResponse.from_json({"expires_in": {"a": 1.0}}).deadlines is None


@pytest.mark.parametrize(("version", "patched"), [("0.32.0", True), ("0.33.0", False)])
def test_plugin_steps_aside_where_vllm_streams_handles_itself(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, version: str, patched: bool
) -> None:
    from kvlease_vllm import plugin

    calls: list[object] = []
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version))
    monkeypatch.setattr(plugin, "apply", lambda targets=plugin.TARGETS: calls.append(targets) or {})
    with caplog.at_level(logging.INFO, logger="vllm.kvlease.plugin"):
        plugin.register()
    assert bool(calls) is patched
    if not patched:
        assert f"vLLM {version} streams kv_transfer_params itself" in caplog.text
