"""Shared values of the SDK tests (a module of its own: ``conftest`` is a name several test folders use)."""

from __future__ import annotations

from kvlease import RetryPolicy

#: Retries without real waiting (tests must not sleep for backoff).
FAST_RETRY = RetryPolicy(
    attempts=4, max_delay_s=5.0, initial_wait_s=0.001, max_wait_s=0.002, jitter_s=0.0, timeout_s=5.0
)
