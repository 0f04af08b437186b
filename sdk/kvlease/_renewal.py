"""The lease keeper's state machine: sans-IO, takes ``now`` and returns decisions.

A :class:`RenewalSchedule` holds the open leases of one wrapped client, grouped by router. Each router has
one renewal deadline: every ``renew_fraction`` (60 %) of the shortest TTL it announced, *all* its
open conversations are renewed with one batched ``POST /v1/kvlease/renew``; so 10,000 conversations
cost one request per period and a few hundred bytes each. A conversation idle for longer than
``max_idle`` is dropped before a renewal and handed back for release; an ``unknown`` in the answer
drops that one (its next turn starts a new lease).

The period never shrinks below ``min_fraction`` (10 %) of the router's TTL: a router that answers
with a lease's remaining time without extending it (a capped lease lifetime, a lease about to be
released) must not pull the keeper into ever faster renewals. A lease whose deadline the answer left where it was does not set the
period either; renewing it sooner would not keep it longer.

:class:`LeaseWire` builds the HTTP requests and reads the answers, mapping errors to
:class:`~kvlease.LeaseError` (``transient`` ones are retried by the IO shells).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from kvlease import protocol
from kvlease._errors import LeaseError

__all__ = ["LeaseWire", "ReleaseOrder", "RenewBatch", "RenewalSchedule", "RetryPolicy", "TransientLeaseError"]

_STUCK_FRACTION: Final = 0.02  # deadlines this close (of the TTL) count as not moved by a renewal
_RETRY_STATUS: Final = frozenset({408, 425, 429, 500, 502, 503, 504})


class TransientLeaseError(LeaseError):
    """A lease request failed in a way worth retrying (network error, 5xx, 429): the leases stand
    (only an ``unknown`` in a renew answer means a lease is gone). ``retry_after``: the seconds the
    router asked for (its ``Retry-After``), if it did."""

    def __init__(
        self, message: str, *, status_code: int | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message, status_code=status_code, transient=True)
        self.retry_after = retry_after


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retries of one renew request (tenacity: attempts | delay, exponential backoff with jitter)."""

    attempts: int = 4
    max_delay_s: float = 30.0
    initial_wait_s: float = 0.5
    max_wait_s: float = 8.0
    jitter_s: float = 0.5
    timeout_s: float = 10.0  # one HTTP request


@dataclass(frozen=True, slots=True)
class RenewBatch:
    root: str
    headers: Mapping[str, str]
    conversation_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ReleaseOrder:
    root: str
    headers: Mapping[str, str]
    conversation_id: str
    explicit: bool


class _Lease:
    __slots__ = ("expires_at", "explicit", "last_active")

    def __init__(self, expires_at: float, last_active: float, explicit: bool) -> None:
        self.expires_at = expires_at
        self.last_active = last_active
        self.explicit = explicit


class _Router:
    __slots__ = ("headers", "leases", "next_due", "ttl")

    def __init__(self, ttl: float, headers: Mapping[str, str], next_due: float) -> None:
        self.ttl = ttl
        self.headers = dict(headers)
        self.next_due = next_due
        self.leases: dict[str, _Lease] = {}


class RenewalSchedule:
    """Open leases of one client, per router (see the module docstring). Not thread-safe: the IO
    shells hold a lock around it."""

    def __init__(self, *, max_idle: float, renew_fraction: float = 0.6, min_fraction: float = 0.1) -> None:
        if not 0 < renew_fraction < 1:
            raise ValueError("renew_fraction must be in (0, 1)")
        if max_idle <= 0:
            raise ValueError("max_idle must be positive")
        if not 0 < min_fraction <= renew_fraction:
            raise ValueError("min_fraction must be in (0, renew_fraction]")
        self.max_idle = max_idle
        self.renew_fraction = renew_fraction
        self.min_fraction = min_fraction
        self._routers: dict[str, _Router] = {}
        self._where: dict[str, str] = {}  # conversation id -> router root

    def __len__(self) -> int:
        return len(self._where)

    def _period(self, router: _Router, remaining: float) -> float:
        return max(self.min_fraction * router.ttl, self.renew_fraction * remaining)

    def __contains__(self, conversation_id: object) -> bool:
        return conversation_id in self._where

    def activate(
        self,
        conversation_id: str,
        root: str,
        ttl: float,
        headers: Mapping[str, str],
        now: float,
        *,
        explicit: bool,
    ) -> float:
        """A turn ended with a lease of ``ttl`` seconds on ``root``; returns when that router's
        leases are renewed next."""
        old_root = self._where.get(conversation_id)
        if old_root != root:
            if old_root is not None:
                self._routers[old_root].leases.pop(conversation_id, None)
            self._where[conversation_id] = root
        due = now + self.renew_fraction * ttl
        router = self._routers.get(root)
        if router is None:
            router = self._routers[root] = _Router(ttl, headers, due)
        else:
            if headers and headers != router.headers:  # (the same headers every turn, mostly)
                router.headers = dict(headers)
            if not router.leases:  # none open there: a fresh schedule (a due time left is stale)
                router.ttl, router.next_due = ttl, due
            else:
                if ttl < router.ttl:
                    router.ttl = ttl
                if due < router.next_due:
                    router.next_due = due
        lease = router.leases.get(conversation_id)
        if lease is None:
            router.leases[conversation_id] = _Lease(now + ttl, now, explicit)
        else:  # a conversation's next turn: its lease, updated in place (its place in the order kept)
            lease.expires_at, lease.last_active, lease.explicit = now + ttl, now, explicit
        return router.next_due

    def forget(self, conversation_id: str) -> ReleaseOrder | None:
        """Stop renewing ``conversation_id``; what to release, if it held a lease."""
        root = self._where.pop(conversation_id, None)
        if root is None:
            return None
        router = self._routers[root]
        lease = router.leases.pop(conversation_id, None)
        return ReleaseOrder(root, router.headers, conversation_id, lease is not None and lease.explicit)

    def forget_all(self) -> list[ReleaseOrder]:
        return [o for cid in list(self._where) if (o := self.forget(cid)) is not None]

    def next_wakeup(self) -> float | None:
        dues = [r.next_due for r in self._routers.values() if r.leases]
        return min(dues) if dues else None

    def due(self, now: float, *, force: bool = False) -> tuple[list[RenewBatch], list[ReleaseOrder]]:
        """Renewals due at ``now`` (all when ``force``), and idle conversations to release."""
        batches: list[RenewBatch] = []
        idle: list[ReleaseOrder] = []
        for root, router in self._routers.items():
            if not router.leases or (not force and now < router.next_due):
                continue
            stale = [cid for cid, lease in router.leases.items() if now - lease.last_active > self.max_idle]
            for cid in stale:
                lease = router.leases.pop(cid)
                del self._where[cid]
                idle.append(ReleaseOrder(root, router.headers, cid, lease.explicit))
            ids = tuple(router.leases)
            for i in range(0, len(ids), protocol.RENEW_MAX_IDS):
                batches.append(RenewBatch(root, router.headers, ids[i : i + protocol.RENEW_MAX_IDS]))
            # until an answer comes: try again after another fraction of the TTL
            router.next_due = now + self.renew_fraction * router.ttl
        return batches, idle

    def renewed(self, batch: RenewBatch, answer: protocol.RenewResponse, now: float) -> list[str]:
        """Apply a renew answer; returns the ids the router does not know (no longer renewed)."""
        router = self._routers.get(batch.root)
        if router is None:
            return []
        if answer.ttl is not None and answer.ttl > 0:
            router.ttl = answer.ttl
        unknown: list[str] = []
        shortest = router.ttl
        for cid in batch.conversation_ids:
            lease = router.leases.get(cid)
            if lease is None:
                continue
            exp = answer.leases.get(cid)
            if exp is None:
                unknown.append(cid)
                del router.leases[cid]
                self._where.pop(cid, None)
                continue
            # a deadline the answer left where it was will not move by renewing sooner
            stuck = abs(now + exp - lease.expires_at) <= _STUCK_FRACTION * router.ttl
            lease.expires_at = now + exp
            if not stuck:
                shortest = min(shortest, exp)
        router.next_due = now + self._period(router, shortest)
        return unknown

    def failed(self, batch: RenewBatch, now: float, *, permanent: bool) -> list[str]:
        """A renew request failed after its retries. A permanent failure (4xx: the router has no lease
        API, or refuses us) stops renewing that router's conversations; returns those ids."""
        router = self._routers.get(batch.root)
        if router is None:
            return []
        if not permanent:
            router.next_due = min(router.next_due, now + 0.25 * self.renew_fraction * router.ttl)
            return []
        dropped = [cid for cid in batch.conversation_ids if router.leases.pop(cid, None) is not None]
        for cid in dropped:
            self._where.pop(cid, None)
        return dropped

    def is_idle(self, conversation_id: str, now: float) -> bool:
        root = self._where.get(conversation_id)
        if root is None:
            return False
        lease = self._routers[root].leases.get(conversation_id)
        return lease is not None and now - lease.last_active > self.max_idle


class LeaseWire:
    """HTTP requests of the lease API and the interpretation of their answers (no IO)."""

    @staticmethod
    def renew_request(batch: RenewBatch) -> tuple[str, bytes, dict[str, str]]:
        body = json.dumps(protocol.RenewRequest(batch.conversation_ids).to_json(), separators=(",", ":"))
        headers = {**batch.headers, "content-type": "application/json"}
        return batch.root + protocol.RENEW_PATH, body.encode(), headers

    @staticmethod
    def release_request(order: ReleaseOrder) -> tuple[str, dict[str, str]]:
        return order.root + protocol.conversation_path(order.conversation_id), dict(order.headers)

    @staticmethod
    def renew_answer(status_code: int, body: bytes, retry_after: str | None = None) -> protocol.RenewResponse:
        """The answer of a renew; ``retry_after``: the answer's ``Retry-After`` header, if any."""
        check_status("renew", status_code, body, retry_after)
        try:
            data: Any = json.loads(body)
            return protocol.RenewResponse.from_json(data)
        except (ValueError, protocol.ProtocolError) as e:
            raise LeaseError(f"malformed renew answer: {e}", status_code=status_code, transient=False) from e

    @staticmethod
    def release_answer(status_code: int, body: bytes) -> None:
        if status_code == 404:  # already gone: the goal of a release
            return
        check_status("release", status_code, body)


def check_status(what: str, status_code: int, body: bytes, retry_after: str | None = None) -> None:
    if 200 <= status_code < 300:
        return
    text = body[:200].decode("utf-8", "replace")
    if status_code in _RETRY_STATUS:
        raise TransientLeaseError(
            f"{what} answered HTTP {status_code}: {text}",
            status_code=status_code,
            retry_after=_seconds(retry_after),
        )
    raise LeaseError(f"{what} answered HTTP {status_code}: {text}", status_code=status_code, transient=False)


def _seconds(retry_after: str | None) -> float | None:
    """``Retry-After`` in delta-seconds (an HTTP date is ignored), bounded to an hour."""
    if retry_after is None:
        return None
    try:
        value = float(retry_after.strip())
    except ValueError:
        return None
    return min(value, 3600.0) if value >= 0 else None
