"""The post-read check of ordinary P->D transfers: D trusts a READ of P only once P confirms that it
held the blocks for the whole read.

Upstream's P frees a finished request's blocks when D's read-done notice arrives or when its lease
(``kv_lease_duration``) runs out, whichever comes first. A D that reads late (starved, paused,
queued without heartbeats) reads blocks P may already have handed to another request; upstream logs
"Potentially invalid KV blocks ... They may have expired" on P and D decodes from them anyway.

P side (scheduler process, :class:`SendDesk`): each P->D send is recorded at ``request_finished``
with the expiry P gave upstream's worker (the scheduler's ``perf_counter``, the clock the worker
rebases onto and only lengthens), and its end when its id reaches ``finished_sending`` (before the
scheduler frees the blocks: the connector's hook runs first). An id is *intact* while P still holds
it, or when it ended strictly before its expiry: only D's notice, sent after all of D's reads
finished, ends a send before the expiry (the expiry sweep fires at or after it). Ended at or after
the expiry, or unknown (never recorded, or aged out of the bounded table): not intact. A heartbeat
that lengthened the worker's lease is not seen here, so such a send read after its first expiry is
refused too (a recompute, never a wrong answer). P's answer carries :class:`SendCheck` (P's control
URL and a MAC over it and the send) in its response params.

D side: the scheduler names, per read of P it starts, where to ask (:func:`read_targets`, on the
step's connector metadata); each worker (:class:`ReadChecks`) holds a finished read back from
``finished_recving``, asks P in a small thread pool (one local HTTP round trip, off the engine
thread) and reports the read on a later step: loaded when P answers intact, else also in
``failed_recving``, so vLLM's ``kv_load_failure_policy`` applies (``recompute``: D recomputes the
prompt; ``fail``: the request ends with an error). A missing or wrong MAC, an error or a timeout
fails the load too. A P that sends no check (stock vLLM, or no control secret) is read as upstream
does, and D logs that once: refusing would fail every turn of a mixed deployment.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final

from kvlease.protocol import KV, ProtocolError
from kvlease.protocol._control import read_send_check_answer, send_check_call
from kvlease.protocol._control_client import send
from kvlease.protocol._sendcheck import SendCheck, send_check_mac

logger = logging.getLogger("vllm.kvlease.sendcheck")  # under vLLM's handler inside a server

#: Attribute of the scheduler's connector metadata: D's request id -> :class:`ReadTarget`.
TARGETS_ATTR: Final = "kvlease_read_checks"
#: P: sends remembered at most (the oldest go first; an evicted send answers not intact).
MAX_SENDS: Final = 16384
#: P: seconds an ended send stays answerable (D asks right after its read).
KEEP_ENDED_S: Final = 300.0
#: D: seconds a worker waits for P's answer (a local round trip, normally a millisecond or two).
CHECK_TIMEOUT_S: Final = 5.0
#: D: reads a worker waits on at most (the oldest target is dropped first: read unchecked).
MAX_TARGETS: Final = 16384


@dataclass
class _Send:
    expiry: float
    ended: float | None = None


class SendTable:
    """P's P->D sends (sans IO: every call takes ``now``; not thread-safe, see :class:`SendDesk`)."""

    def __init__(self, max_sends: int = MAX_SENDS, keep_ended_s: float = KEEP_ENDED_S) -> None:
        self.max_sends = max_sends
        self.keep_ended_s = keep_ended_s
        self._sends: dict[str, _Send] = {}  # insertion order: oldest first

    def __len__(self) -> int:
        return len(self._sends)

    def start(self, rid: str, expiry: float, now: float) -> None:
        """A finished request whose blocks P keeps for D until ``expiry``."""
        self._sends.pop(rid, None)
        self._sends[rid] = _Send(expiry)
        self._purge(now)

    def end(self, rid: str, now: float) -> bool | None:
        """P let the send's blocks go at ``now``: whether before its expiry (None: unknown id)."""
        send = self._sends.get(rid)
        if send is None or send.ended is not None:
            return None
        send.ended = now
        return now < send.expiry

    def intact(self, rid: str) -> bool:
        """P held the blocks until every read had finished: held still, or ended before the expiry."""
        send = self._sends.get(rid)
        return send is not None and (send.ended is None or send.ended < send.expiry)

    def _purge(self, now: float) -> None:
        """Oldest first, amortised O(1) per send: past the bound, or ended more than
        ``keep_ended_s`` ago (an ended send behind a held one waits for it, or for the bound)."""
        sends = self._sends
        while sends:
            rid = next(iter(sends))
            ended = sends[rid].ended
            if len(sends) <= self.max_sends and (ended is None or now - ended <= self.keep_ended_s):
                return
            del sends[rid]


class SendDesk:
    """P: the :class:`SendTable`, shared by the scheduler thread and the control endpoint's threads."""

    def __init__(
        self,
        secret: str | None,
        table: SendTable | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.secret = secret
        self.control_url: str | None = None  # set once the control endpoint listens
        self._table = table or SendTable()
        self._lock = threading.Lock()
        self.clock = clock

    # scheduler side
    def issue(self, rid: str, expiry: object, out: dict[str, Any]) -> dict[str, Any]:
        """P's response params for D (upstream's ``request_finished`` output): with a
        :class:`SendCheck` for this send when P can answer for it, else as they are."""
        engine = out.get(KV.REMOTE_ENGINE_ID)
        if not (self.secret and self.control_url and isinstance(expiry, float) and isinstance(engine, str)):
            return out
        with self._lock:
            self._table.start(rid, expiry, self.clock())
        mac = send_check_mac(self.secret, engine, rid, self.control_url)
        return {**out, KV.SEND_CHECK: SendCheck(self.control_url, mac).to_json()}

    def ended(self, ids: Collection[str]) -> None:
        """Ids in the workers' ``finished_sending`` (before the scheduler frees their blocks)."""
        if not ids or not len(self._table):
            return
        with self._lock:
            now = self.clock()
            late = [rid for rid in ids if self._table.end(rid, now) is False]
        for rid in late:
            logger.info("kvlease %s: P->D send expired before D's read was done; a check refuses it", rid)

    # control endpoint side
    def check(self, ids: Iterable[str]) -> dict[str, bool]:
        with self._lock:
            answer = {rid: self._table.intact(rid) for rid in ids}
        for rid, ok in answer.items():
            if not ok:
                logger.warning(
                    "kvlease %s: D's read of this P->D send is not covered (P released the blocks at "
                    "their expiry, or does not know the send): D must not use it",
                    rid,
                )
        return answer


# ---------------------------------------------------------------------------------------- D side


@dataclass(frozen=True)
class ReadTarget:
    """Where a worker asks after one read of P: P's control URL and P's request id; ``control``
    None: the check's MAC was missing or wrong, the read fails without asking anyone."""

    control: str | None
    request_id: str


class _Once:
    def __init__(self) -> None:
        self.said: set[str] = set()

    def __call__(self, key: str, msg: str, *args: object) -> None:
        if key not in self.said:
            self.said.add(key)
            logger.warning(msg, *args)


_once = _Once()


def read_targets(reqs_need_recv: Mapping[str, tuple[Any, ...]], secret: str | None) -> dict[str, ReadTarget]:
    """D's scheduler, per step: the reads of P it starts this step (upstream's ``_reqs_need_recv``:
    request id -> (request, blocks, cached, awaiting KV, ...)) that a worker must check."""
    out: dict[str, ReadTarget] = {}
    for rid, entry in reqs_need_recv.items():
        request, awaiting = entry[0], bool(entry[3]) if len(entry) > 3 else True
        params = getattr(request, "kv_transfer_params", None) or {}
        if not awaiting or params.get(KV.DO_REMOTE_DECODE):  # a full local hit, or P's pull from D
            continue
        raw = params.get(KV.SEND_CHECK)
        engine, p_rid = params.get(KV.REMOTE_ENGINE_ID), params.get(KV.REMOTE_REQUEST_ID)
        if raw is None:
            _once(
                f"nocheck:{engine}",
                "kvlease: prefill engine %s sends no post-read check (not a kvlease connector, or no "
                "control secret there): its P->D reads are used unchecked, as upstream does",
                engine,
            )
            continue
        if not secret:
            _once("nosecret", "kvlease: no control secret on this node: P->D reads are used unchecked")
            continue
        control: str | None = None
        try:
            check = SendCheck.from_json(raw)
            if isinstance(engine, str) and isinstance(p_rid, str) and check.mac_ok(secret, engine, p_rid):
                control = check.control
        except ProtocolError:
            pass
        if control is None:
            logger.warning("kvlease %s: P's post-read check is malformed or its MAC is wrong", rid)
        out[rid] = ReadTarget(control, str(p_rid))
    return out


class ReadChecks:
    """D's worker: holds each finished read of P back until P confirms it (see the module doc)."""

    def __init__(
        self,
        secret: str | None,
        timeout: float,
        ask: Callable[[str, list[str]], dict[str, bool]] | None = None,
    ) -> None:
        self.secret = secret
        self.timeout = timeout
        self._ask = ask or self._ask_p
        self._targets: dict[str, ReadTarget] = {}
        #: D's request id -> (P's answer for the call that asked about it, P's request id)
        self._pending: dict[str, tuple[Future[dict[str, bool]], str]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.refused = 0

    def settle(self, results: Any, meta: object) -> Any:
        """The worker's transfer results with reads still being checked held back, and the checked
        ones put back (a refused one also in ``failed_recving``). Edits ``results`` in place."""
        new = getattr(meta, TARGETS_ATTR, None)
        if new:
            self._targets.update(new)
            while len(self._targets) > MAX_TARGETS:
                del self._targets[next(iter(self._targets))]
        if not self._targets and not self._pending:
            return results
        failed = results.failed_recving
        asks: dict[str | None, list[tuple[str, str]]] = {}  # one call per P for this step's reads
        for rid in [r for r in results.finished_recving if r in self._targets]:
            target = self._targets.pop(rid)
            if rid in failed:  # upstream failed it already
                continue
            results.finished_recving.discard(rid)
            asks.setdefault(target.control, []).append((rid, target.request_id))
        for control, reads in asks.items():
            fut = self._submit(control, [p_rid for _, p_rid in reads])
            self._pending.update((rid, (fut, p_rid)) for rid, p_rid in reads)
        for rid, (fut, p_rid) in [(r, v) for r, v in self._pending.items() if v[0].done()]:
            del self._pending[rid]
            results.finished_recving.add(rid)
            if not self._verdict(rid, fut, p_rid):
                self.refused += 1
                failed.add(rid)
        return results

    def _submit(self, control: str | None, p_rids: list[str]) -> Future[dict[str, bool]]:
        if control is None:
            fut: Future[dict[str, bool]] = Future()
            fut.set_exception(
                ProtocolError("P's check names no trustworthy endpoint (malformed, or wrong MAC)")
            )
            return fut
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvlease-sendcheck")
        return self._pool.submit(self._ask, control, p_rids)

    def _verdict(self, rid: str, fut: Future[dict[str, bool]], p_rid: str) -> bool:
        try:
            ok = bool(fut.result().get(p_rid, False))
        except Exception as e:  # an error or a timeout: the read is not confirmed
            logger.warning("kvlease %s: P's post-read check failed (%s); the load fails", rid, e)
            return False
        if not ok:
            logger.warning(
                "kvlease %s: P released the blocks before this read was confirmed; the load fails", rid
            )
        return ok

    def _ask_p(self, control: str, p_rids: list[str]) -> dict[str, bool]:
        call = send_check_call(control, p_rids, secret=self.secret, timeout=self.timeout)
        return dict(read_send_check_answer(*send(call)).intact)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
