"""Per-tenant token buckets (sans-IO: every call takes ``now``)."""

from __future__ import annotations

import math
from collections import OrderedDict

__all__ = ["TenantBuckets"]


class TenantBuckets:
    """One token bucket per tenant: ``rate`` tokens a second, at most ``burst`` held.

    Bounded memory: past ``max_tenants`` the least recently seen tenant's bucket is dropped (it
    comes back full, which only ever errs towards letting a request through).
    """

    __slots__ = ("_buckets", "_max", "burst", "rate")

    def __init__(self, rate: float, burst: float, max_tenants: int = 100_000) -> None:
        if rate <= 0 or burst <= 0 or max_tenants < 1:
            raise ValueError("rate, burst and max_tenants must be positive")
        self.rate = rate
        self.burst = burst
        self._max = max_tenants
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tenant -> (tokens, at)

    def _level(self, tenant: str, now: float) -> float | None:
        """The tokens ``tenant``'s bucket holds at ``now`` (``None``: no bucket, a full one)."""
        got = self._buckets.get(tenant)
        return None if got is None else min(self.burst, got[0] + max(0.0, now - got[1]) * self.rate)

    def peek(self, tenant: str, cost: float, now: float) -> float:
        """The seconds until ``tenant``'s bucket could pay ``cost`` (0.0: now); spends nothing and
        keeps no new bucket (an unseen tenant has a full one)."""
        tokens = self._level(tenant, now)
        if tokens is None:
            return 0.0
        need = min(cost, self.burst)
        return 0.0 if tokens >= need else (need - tokens) / self.rate

    def charge(self, tenant: str, cost: float, now: float) -> None:
        """Spend ``cost`` tokens of ``tenant``'s bucket whatever it holds: a bucket may go into debt
        (at most ``burst`` of it), paid back at ``rate`` before it lets anything through again."""
        tokens = self._level(tenant, now)
        self._buckets.pop(tenant, None)
        tokens = self.burst if tokens is None else tokens
        self._buckets[tenant] = (max(-self.burst, tokens - min(cost, self.burst)), now)
        while len(self._buckets) > self._max:
            self._buckets.popitem(last=False)

    @staticmethod
    def retry_after(wait: float) -> str:
        """A ``Retry-After`` header value (whole seconds, at least 1) for ``wait`` seconds."""
        return str(max(1, math.ceil(wait)))
