"""The lease core (sans-IO): what a renew and a release decide.

``plan_renew(ids, records, now, settings) -> RenewPlan`` decides, per id from its stored
:class:`ConversationRecord`: ``unknown`` (no record, no handle, the router's lease already ended),
the remaining time (stock vLLM: nothing renews there), or a renewal on one configured decode control
endpoint with its lease id; a record whose handle cannot be renewed (no lease id, or a control URL
that is not configured: stored state is untrusted) loses its handle. ``settle_renew(plan, answers,
settings) -> RenewResult`` folds D's answers (one per control endpoint, ``None`` when the call
failed) into each id's lease and the records to renew (grouped by their new deadline) or strip.
``plan_release(record, settings) -> ReleasePlan`` says whether the router knew the conversation and
which D, if any, to release its lease on. None of them reads a clock, sleeps or does IO;
``_lease_api.py`` does the IO around them. Table-driven tests:
``tests/server_patch/router/test_router_lease_core.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat

from kvlease_router._store import ConversationRecord

__all__ = [
    "LeaseSettings",
    "ReleasePlan",
    "RenewPlan",
    "RenewResult",
    "plan_release",
    "plan_renew",
    "settle_renew",
]

#: Resolves a stored (control URL, decode URL) to a configured control endpoint, or ``None`` (send
#: nothing): ``RouterRuntime.configured_control``, a lookup in the configuration (no IO).
ControlResolver = Callable[[str | None, str | None], str | None]


@dataclass(frozen=True)
class LeaseSettings:
    """What the lease decisions depend on (from the router's settings and cluster plan)."""

    kvlease_mode: bool
    #: The router's lease TTL (the cluster plan's).
    ttl: float
    #: What D is asked for on top of ``ttl`` (D's deadline outlives the router's).
    ttl_margin: float
    #: How long a record outlives its lease (``expired`` rather than ``first``).
    expired_grace: float
    configured_control: ControlResolver

    @property
    def keep_for(self) -> float:
        """How long a record is kept after a turn (or after losing its handle)."""
        return self.ttl + self.expired_grace

    @property
    def ask(self) -> float:
        """The ``expires_in`` asked of D on a renewal."""
        return self.ttl + self.ttl_margin


@dataclass(frozen=True)
class RenewPlan:
    """The decisions of one renew before any control call."""

    ids: Sequence[str]
    records: Sequence[ConversationRecord | None]
    now: float
    #: Each id's lease, in ``ids`` order: seconds left, or ``None`` (unknown). Ids to renew hold
    #: ``None`` until :func:`settle_renew` fills them in.
    leases: dict[str, float | None]
    #: Per configured control endpoint, the indexes (into ``ids``, ascending; an index in one call
    #: at most) of the leases to renew there.
    calls: dict[str, list[int]]
    #: Per control endpoint of ``calls``, D's lease ids to renew there (in the same order).
    lease_ids: dict[str, list[str]]
    #: Indexes of records that lose their handle (nothing to renew: no lease id, or an
    #: unconfigured control URL).
    drops: list[int]


@dataclass(frozen=True)
class RenewResult:
    """One renew's answer and what it leaves in the store."""

    #: Each id's lease, in ``ids`` order (``None``: unknown, stop renewing it).
    leases: dict[str, float | None]
    #: Records D renewed, grouped by their new seconds left: each gets the lease end
    #: ``plan.now + left`` and is kept ``left + expired_grace`` (D renews alike: one group).
    renewals: dict[float, list[int]]
    #: Indexes of records that lose their handle (the plan's, and leases D no longer holds).
    drops: list[int]

    @property
    def renewed(self) -> int:
        return sum(map(len, self.renewals.values()))


def plan_renew(
    ids: Sequence[str],
    records: Sequence[ConversationRecord | None],
    now: float,
    settings: LeaseSettings,
    unique: dict[str, None] | None = None,
) -> RenewPlan:
    """Per id (``records[i]`` is the stored record of ``ids[i]``): unknown, remaining time, or a
    renewal on a configured decode control endpoint. ``unique``: ``dict.fromkeys(ids)`` where the
    caller has it (its dedup of the ids), taken over as the plan's leases instead of another one."""
    kvlease, resolve = settings.kvlease_mode, settings.configured_control
    leases: dict[str, float | None] = dict.fromkeys(ids) if unique is None else unique  # type: ignore[assignment]
    calls: dict[str, list[int]] = {}
    lease_ids: dict[str, list[str]] = {}
    drops: list[int] = []
    # a renew's records name a few D: resolve each (control, decode) pair once, and keep the
    # appends of its lists at hand
    last_url: object = ()
    last_decode: object = ()
    control: str | None = None
    add_index: Callable[[int], None] = drops.append  # (set with ``control``, used only then)
    no_call: list[str] = []
    add_lease: Callable[[str], None] = no_call.append
    for i, rec in enumerate(records):
        if rec is None or rec.params is None or rec.expires_at <= now:
            continue
        if not kvlease:
            leases[ids[i]] = rec.expires_at - now  # stock vLLM: no renewal, remaining time only
            continue
        lease_id = rec.lease_id
        if not lease_id:
            drops.append(i)
            continue
        url, decode = rec.control, rec.decode
        if url != last_url or decode != last_decode:
            last_url, last_decode, control = url, decode, resolve(url, decode)
            if control is not None:
                if control not in calls:
                    calls[control], lease_ids[control] = [], []
                add_index, add_lease = calls[control].append, lease_ids[control].append
        if control is None:  # a record naming a control URL not configured: nothing to renew
            drops.append(i)
        else:
            add_index(i)
            add_lease(lease_id)
    return RenewPlan(ids, records, now, leases, calls, lease_ids, drops)


def settle_renew(
    plan: RenewPlan, answers: Mapping[str, Mapping[str, float | None] | None], settings: LeaseSettings
) -> RenewResult:
    """Fold D's answers (per control endpoint of ``plan.calls``: D's ``expires_in`` per lease id,
    or ``None`` when the call failed) into the leases of the answer and the records to write."""
    ids, records, now = plan.ids, plan.records, plan.now
    margin, ttl = settings.ttl_margin, settings.ttl
    if len(plan.calls) == 1 and not plan.drops:  # maybe every id on one D (a keeper's renew)
        ((control, indexes),) = plan.calls.items()
        answer = answers.get(control)
        if len(indexes) == len(ids) and answer is not None:
            got = list(map(answer.get, plan.lease_ids[control]))
            first = got[0]
            if first is not None and first > margin and got.count(first) == len(got):  # D renewed alike
                left = min(first - margin, ttl)
                return RenewResult(dict.fromkeys(ids, left), {left: list(indexes)}, [])
    leases = dict(plan.leases)
    drops = list(plan.drops)
    renewals: dict[float, list[int]] = {}
    for control, indexes in plan.calls.items():
        answer = answers.get(control)
        if answer is None:  # D unreachable: the leases were not extended
            for i in indexes:
                leases[ids[i]] = records[i].expires_at - now  # type: ignore[union-attr]
            continue
        got = list(map(answer.get, plan.lease_ids[control]))
        first = got[0]
        if first is not None and first > margin and got.count(first) == len(got):  # D renewed alike
            left = min(first - margin, ttl)
            # (an id is in one call at most: a call of as many ids as the renew's holds them all)
            renewed: Iterable[str] = ids if len(indexes) == len(ids) else map(ids.__getitem__, indexes)
            leases.update(zip(renewed, repeat(left)))
            renewals.setdefault(left, []).extend(indexes)
            continue
        for i, d_left in zip(indexes, got):
            if d_left is None or d_left <= margin:  # D no longer holds it
                drops.append(i)
                continue
            left = min(d_left - margin, ttl)
            leases[ids[i]] = left
            renewals.setdefault(left, []).append(i)
    return RenewResult(leases, renewals, drops)


@dataclass(frozen=True)
class ReleasePlan:
    """What a release does: whether the router knew the conversation, and which D to release on."""

    known: bool
    #: The configured control endpoint to release on, or ``None`` (nothing to release, or a record
    #: naming an unknown host: it is sent nothing; the lease lapses on its own).
    control: str | None = None
    lease_ids: tuple[str, ...] = ()


def plan_release(record: ConversationRecord | None, settings: LeaseSettings) -> ReleasePlan:
    """The release of the conversation whose removed record is ``record`` (``None``: unknown)."""
    if record is None:
        return ReleasePlan(known=False)
    if not (settings.kvlease_mode and record.control and record.lease_id):
        return ReleasePlan(known=True)
    control = settings.configured_control(record.control, record.decode)
    if control is None:
        return ReleasePlan(known=True)
    return ReleasePlan(True, control, (record.lease_id,))
