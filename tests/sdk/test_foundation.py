"""The package's shape: importable without optional stacks, protocol constants, public API pinned."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import kvlease
from kvlease import protocol as p

BLOCKER = textwrap.dedent(
    """
    import sys, importlib.abc
    BLOCKED = ("vllm", "nixl", "langchain", "langchain_core", "langchain_openai", "langgraph",
               "torch", "redis", "aiohttp", "prometheus_client", "matplotlib")
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"blocked for this test: {name}")
            return None
    sys.meta_path.insert(0, Block())
    """
)


@pytest.mark.parametrize(
    "statement",
    [
        "import kvlease",
        "import kvlease.protocol",
        "import kvlease.cli",
        "import kvlease_vllm",
        "import kvlease_langchain",
        "import kvlease_router",
        "import kvlease_stack",
    ],
)
def test_imports_without_optional_stacks(statement: str) -> None:
    code = BLOCKER + "\n" + statement + "\nprint('ok')\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


def test_version_is_exposed() -> None:
    assert kvlease.__version__.count(".") == 2


@pytest.mark.parametrize(
    "value",
    ["a", "thread-42", "x" * 128, "A.b_c:d-e", "0"],
)
def test_valid_conversation_ids(value: str) -> None:
    assert p.validate_conversation_id(value) == value


@pytest.mark.parametrize(
    "value",
    ["", "x" * 129, "a b", "a/b", "é", "a\n", None, 42, ["a"]],
)
def test_invalid_conversation_ids(value: object) -> None:
    with pytest.raises(p.InvalidConversationId):
        p.validate_conversation_id(value)
    assert issubclass(p.InvalidConversationId, ValueError)


def test_status_parse() -> None:
    assert p.ReuseStatus.parse("hit") is p.ReuseStatus.HIT
    assert p.ReuseStatus.parse(" No-Id ") is p.ReuseStatus.NO_ID
    assert p.ReuseStatus.parse(None) is None
    assert p.ReuseStatus.parse("bogus") is None


def test_block_hashes_chain_and_prefix() -> None:
    a = list(range(100))
    b = list(range(50)) + [999] + list(range(51, 100))
    ha, hb = p.block_hashes(a, 16), p.block_hashes(b, 16)
    assert len(ha) == 6  # 100 // 16 full blocks; the partial block is not hashed
    # token 50 sits in block 3: blocks 0..2 agree, every later block differs (chained)
    assert p.common_prefix_blocks(ha, hb) == 3
    assert all(x != y for x, y in zip(ha[3:], hb[3:]))
    # the salt separates tenants completely
    assert p.common_prefix_blocks(ha, p.block_hashes(a, 16, salt="t2")) == 0
    assert p.block_hashes(a, 16) == ha  # deterministic


def test_lease_handle_roundtrip_and_validation() -> None:
    h = p.LeaseHandleExt(
        block_size=16, num_tokens=40, hashes=tuple(p.block_hashes(range(40), 16)), lease_id="r1"
    )
    assert p.LeaseHandleExt.from_json(h.to_json()) == h
    bad = h.to_json() | {"hashes": ["zz"]}
    with pytest.raises(p.ProtocolError, match="hashes"):
        p.LeaseHandleExt.from_json(bad)
    with pytest.raises(p.ProtocolError, match="block_size"):
        p.LeaseHandleExt.from_json(h.to_json() | {"block_size": "16"})
    with pytest.raises(p.ProtocolError, match="more blocks"):
        p.LeaseHandleExt.from_json(h.to_json() | {"num_tokens": 16})


def test_renew_shapes() -> None:
    req = p.RenewRequest.from_json({"conversation_ids": ["a", "b"]})
    assert req.to_json() == {"conversation_ids": ["a", "b"]}
    with pytest.raises(p.InvalidConversationId):
        p.RenewRequest.from_json({"conversation_ids": ["a b"]})
    with pytest.raises(p.ProtocolError):
        p.RenewRequest.from_json({"conversation_ids": "a"})
    resp = p.RenewResponse({"a": 12.5, "b": None}, ttl=30.0)
    assert p.RenewResponse.from_json(resp.to_json()) == resp
    assert resp.to_json()["leases"]["b"] == {"status": "unknown"}


def test_error_release_status_and_health_shapes() -> None:
    err = p.ErrorBody("no such conversation", p.ERROR_INVALID_REQUEST, 404)
    assert err.to_json() == {
        "error": {"message": "no such conversation", "type": "invalid_request_error", "code": 404}
    }
    assert p.ErrorBody.from_json(err.to_json()) == err
    assert "code" not in p.ErrorBody("upstream error", p.ERROR_UPSTREAM).to_json()["error"]
    assert p.ErrorBody.for_status(503, "down").type == p.ERROR_SERVER
    with pytest.raises(p.ProtocolError):
        p.ErrorBody.from_json({"error": "flat"})
    rel = p.ReleaseResponse("c1", known=True, released=False)
    assert p.ReleaseResponse.from_json(rel.to_json()) == rel
    health = p.RouterHealth(prefill_healthy=True, decode_healthy=False)
    assert health.to_json()["status"] == p.HEALTH_DEGRADED and not health.ok
    assert p.RouterHealth.from_json(health.to_json()) == health
    status = p.RouterStatus(
        kvlease_version=kvlease.__version__,
        protocol_version=p.PROTOCOL_VERSION,
        mode=p.MODE_KVLEASE,
        renewals=True,
        reuse=True,
        verified_pull=True,
        stream_capture=True,
        notes=("a note",),
        ttl_s=30.0,
        decode_ttl_s=60.0,
        ttl_margin_s=5.0,
        model="m",
        vllm_version="0.32.0",
        block_size=16,
        store="memory",
        tenant_header=None,
        uptime_s=1.0,
        prefill=({"url": "http://p"},),
        decode=({"url": "http://d"},),
    )
    assert list(status.to_json())[:3] == ["kvlease_version", "protocol_version", "mode"]
    assert p.RouterStatus.from_json(status.to_json()) == status


def test_control_shapes() -> None:
    info = p.ControlInfo(
        role=p.Role.DECODE,
        engine_id="e",
        vllm_version="0.32.0",
        kvlease_version=kvlease.__version__,
        bidirectional_kv_xfer=True,
        ttl_s=120.0,
        recompute_threshold=64,
        block_size=16,
    )
    assert p.ControlInfo.from_json(info.to_json()) == info
    with pytest.raises(p.ProtocolError, match="ttl"):
        p.ControlRenewRequest.from_json({"request_ids": ["x"], "ttl": -1})
    assert p.ControlRenewRequest.from_json({"request_ids": ["x"], "ttl": 5}).ttl == 5.0


def test_public_api_is_pinned() -> None:
    assert sorted(kvlease.__all__) == [
        "AnalysisReport",
        "AnalyzeError",
        "AssistantReply",
        "AsyncConversation",
        "AsyncKVLeaseClient",
        "AsyncLeaseKeeper",
        "ConfigError",
        "Conversation",
        "HistoryClass",
        "InvalidConversationId",
        "KVLeaseClient",
        "KVLeaseError",
        "KVLeaseWarning",
        "LeaseError",
        "LeaseKeeper",
        "ProtocolError",
        "RetryPolicy",
        "ReuseOffWarning",
        "ReuseStatus",
        "StripDetector",
        "ToolCall",
        "Turn",
        "TurnLog",
        "Verdict",
        "__version__",
        "analyze",
        "protocol",
        "wrap",
    ]
    for name in kvlease.__all__:
        assert getattr(kvlease, name) is not None
    assert issubclass(kvlease.LeaseError, kvlease.KVLeaseError)
    assert issubclass(kvlease.ReuseOffWarning, kvlease.KVLeaseWarning)
    assert issubclass(kvlease.InvalidConversationId, ValueError)


def test_protocol_import_does_not_load_the_http_stack() -> None:
    code = "import sys, kvlease.protocol; print('openai' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
