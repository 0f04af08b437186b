"""Settings shared by the real-stack specs.

``ALWAYS_PULL``: the tests that assert a pull happened (a ``hit``) examine verification, leases and
correctness, not the cost model. On a loaded 2-core machine the cost model can learn, correctly,
that pulling the tiny model's 800 tokens costs about what recomputing them does (a pull that shares
P's step with a concurrent prefill is measured slow), and then decline with reason ``cost``. With
an exploration fraction of 1 every cost decline is pulled anyway, so those tests see the pull; the
cost model's own behaviour is tested in ``tests/server_patch/test_connector_cost.py``.
"""

from __future__ import annotations

from typing import Any

ALWAYS_PULL: dict[str, Any] = {"pull_explore_fraction": 1.0}
