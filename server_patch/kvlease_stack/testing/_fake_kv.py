"""The kvlease side of the fake P/D pair: the connector's real pure modules, called the way it calls them.

vLLM is outside this project, so :mod:`kvlease_stack.testing.fake_vllm` fakes it; the kvlease logic
inside it is not faked. :class:`PrefillLogic` mirrors ``KVLeaseScheduler`` on P
(``get_num_new_matched_tokens`` → ``parse_handle`` with the MAC, ``verified_tokens`` over the
salted prompt, ``trim_params``); :class:`DecodeLeases` mirrors it on D
(``request_finished`` → ``LeaseDesk.add`` over the real :class:`RetentionTable`, the lease tagged
with the tenant tag of D's request, ``handle_ext`` with block and tail hashes, ``handle_mac``) and
the control endpoint's renew/release and lease status. What stays fake is
what vLLM's workers do: the blocks' contents, the single-use NIXL read and the expiry sweep.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

from kvlease.protocol import (
    KV,
    LEASE_HANDLE_MAC,
    PREFILL_REUSE_STATUS,
    PREFILL_REUSED_TOKENS,
    ControlReleaseRequest,
    ControlReleaseResponse,
    ControlRenewRequest,
    ControlRenewResponse,
    ReuseStatus,
    tenant_tag_of,
)
from kvlease_vllm._config import KVLeaseConfig
from kvlease_vllm._control import LeaseDesk
from kvlease_vllm._metrics import ConnectorMetrics
from kvlease_vllm._retention import RetentionTable
from kvlease_vllm._verify import (
    HandleRejected,
    Reason,
    handle_ext,
    handle_mac,
    parse_handle,
    reuse_status,
    trim_params,
    verified_tokens,
)

__all__ = ["READ_FAILED", "SWEEP_EVERY_S", "DecodeLeases", "PrefillLogic", "Reuse"]

#: How often the fake workers' expiry sweep runs at most on the request path.
SWEEP_EVERY_S = 0.05


@dataclass(frozen=True)
class Reuse:
    """P's decision on one handle: the verified tokens it may pull, and why."""

    tokens: int
    reason: Reason
    #: Overrides the connector's mapping of ``reason`` (the fake's own outcomes).
    status: ReuseStatus | None = None

    def report(self) -> dict[str, Any]:
        """The ``kvlease`` object of P's response params (the router's evidence of the pull)."""
        status = self.status or reuse_status(self.reason)
        hit = self.reason is Reason.PULL
        return {PREFILL_REUSED_TOKENS: self.tokens if hit else 0, PREFILL_REUSE_STATUS: status.value}


#: The fake read found D's blocks gone (evicted, expired, released or read): P recomputes. Upstream's
#: stale-deadline check declines such a handle before any read, which the router sees as a miss.
READ_FAILED = Reuse(0, Reason.LEASE_GONE, ReuseStatus.MISS)


class PrefillLogic:
    """P's verification of D's handle (``KVLeaseScheduler._plan``, without claim and cost model).

    The fake pulls every verified token (no recompute threshold, no prefix cache of its own), and
    does not claim at D: its single-use read of D's blocks stands in for both (so it has no claim
    to forward the tenant tag of its request on; the router's tests read the tag P was sent).
    """

    def __init__(self, cfg: KVLeaseConfig, secret: Callable[[], str | None]) -> None:
        self.cfg = cfg
        self.secret = secret

    def plan(self, params: dict[str, Any], prompt: list[int], salt: str | None, block_size: int) -> Reuse:
        """Verify ``params`` against ``prompt``: the tokens to pull (``params`` is not modified)."""
        try:
            handle = parse_handle(
                params,
                num_groups=1,
                host_allowed=self.cfg.host_allowed,
                max_parallel=self.cfg.max_remote_parallel,
                secret=self.secret(),
            )
            verified = verified_tokens(handle, prompt, salt, block_size)
        except HandleRejected as e:
            return Reuse(0, e.reason)  # the connector then strips the handle (strip_remote)
        if verified == 0:
            return Reuse(0, Reason.MISMATCH)
        trim_params(handle, verified)  # the trimmed handle P's read would use
        return Reuse(verified, Reason.PULL)


class DecodeLeases(MutableMapping[str, list[int]]):
    """D's leases: the real :class:`LeaseDesk` over a :class:`RetentionTable`, plus the fake workers.

    As a mapping it is what D's workers still hold (lease id -> retained tokens); deleting an entry
    is the workers freeing the blocks behind the scheduler's back (tests evict that way).
    """

    def __init__(
        self,
        cfg: KVLeaseConfig,
        capacity_blocks: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.table = RetentionTable(capacity_blocks, max_ttl=cfg.max_ttl_s, renew_guard=cfg.renew_guard_s)
        self.desk = LeaseDesk(self.table, ConnectorMetrics(), clock)
        self._blocks: dict[str, list[int]] = {}  # the workers' side: retained tokens
        self._deadlines: dict[str, float] = {}  # the workers' side: when to free them
        self._swept = -math.inf

    # ---- the scheduler side (``request_finished``) ---------------------------------------------
    def retain(
        self,
        params: dict[str, Any],
        tokens: list[int],
        *,
        block_size: int,
        salt: str | None,
        ttl: float,
        control: str | None,
        secret: str | None,
        kvlease: bool = True,
        request_params: object = None,
    ) -> bool:
        """Lease ``tokens`` for ``params``'s request and put the ``kvlease`` object into ``params``.

        False: over the retention cap, not retained (the caller returns no handle). ``kvlease``
        off: stock vLLM, the blocks are retained but the handle carries no ``kvlease`` object.
        ``request_params``: the ``kv_transfer_params`` of D's request; the lease is tagged with the
        router's tenant tag in them (``tenant_tag_of``), as the connector's ``request_finished``."""
        self.sweep(SWEEP_EVERY_S)
        rid = params[KV.REMOTE_REQUEST_ID]
        deadline = self.clock() + ttl
        blocks = sum(len(g) for g in params[KV.REMOTE_BLOCK_IDS])
        added = self.desk.add(rid, blocks, deadline, tenant_tag_of(request_params))
        if added.released:  # over the cap: older leases released early; the workers free them now
            self.sweep()
        if not added.retained:
            return False
        self._blocks[rid] = tokens
        self._deadlines[rid] = deadline
        params[KV.REMOTE_BLOCKS_EXPIRY_TIME] = deadline
        if not kvlease:
            return True
        ext = handle_ext(
            token_ids=tokens,
            num_tokens=int(params[KV.REMOTE_NUM_TOKENS]),
            block_size=block_size,
            salt=salt,
            lease_id=rid,
            engine_id=params[KV.REMOTE_ENGINE_ID],
            control=control,
        )
        params[KV.KVLEASE] = ext.to_json()
        if secret:
            params[KV.KVLEASE][LEASE_HANDLE_MAC] = handle_mac(secret, params)
        return True

    # ---- the control endpoint (``_Handler._renew`` / ``_release``) -----------------------------
    def renew(self, body: object) -> tuple[ControlRenewRequest, dict[str, Any]]:
        """Raises ``ProtocolError`` on a bad body (the endpoint answers 400)."""
        req = ControlRenewRequest.from_json(body)
        self.sweep()
        ttl = min(req.ttl, self.cfg.max_ttl_s)
        expires = self.desk.renew(
            req.request_ids, ttl, pin=req.claim, claimant=req.claimant, tenant=req.tenant
        )
        self.sweep()
        return req, ControlRenewResponse(expires).to_json()

    def release(self, body: object) -> dict[str, Any]:
        req = ControlReleaseRequest.from_json(body)
        answer = ControlReleaseResponse(self.desk.release(req.request_ids)).to_json()
        self.sweep()
        return answer

    # ---- the fake workers ----------------------------------------------------------------------
    def sweep(self, unless_within: float = 0.0) -> None:
        """The workers' step: take the scheduler's deadline changes, free what is due.

        ``unless_within``: skip it if the last one ran less than that long ago (it scans every
        lease; the hot path sweeps at most every :data:`SWEEP_EVERY_S`, like a worker step)."""
        now = self.clock()
        if now - self._swept < unless_within:
            return
        self._swept = now
        self._deadlines.update(self.desk.take_updates())
        self._free([rid for rid, deadline in self._deadlines.items() if deadline <= now])

    def read(self, request_id: object) -> bool:
        """The NIXL read of a lease's blocks: single use (D frees them once read), False if gone.

        Deadlines are current here: every renew/release sweeps, and only those change them."""
        if not isinstance(request_id, str) or request_id not in self._blocks:
            return False
        alive = self._deadlines[request_id] > self.clock()
        self._free([request_id])
        return alive

    def _free(self, ids: list[str]) -> None:
        for rid in ids:
            self._blocks.pop(rid, None)
            self._deadlines.pop(rid, None)
        self.desk.forget(ids)  # upstream's ``finished_sending``

    # ---- the mapping (what the workers hold) ---------------------------------------------------
    def __getitem__(self, rid: str) -> list[int]:
        self.sweep()
        return self._blocks[rid]

    def __setitem__(self, rid: str, tokens: list[int]) -> None:
        raise TypeError("leases are added by retain()")

    def __delitem__(self, rid: str) -> None:
        if rid not in self._blocks:
            raise KeyError(rid)
        self._free([rid])

    def __iter__(self) -> Iterator[str]:
        self.sweep()
        return iter(list(self._blocks))

    def __len__(self) -> int:
        self.sweep()
        return len(self._blocks)
