"""``POST /v1/kvlease/renew`` and ``DELETE /v1/kvlease/conversations/{id}``.

Renew sends ONE batched ``POST /renew`` per decode node's control endpoint (concurrently), asking
for the router TTL plus the margin, so D's deadline always outlives the router's. Ids are scoped by
the caller's tenant exactly like chat turns: another tenant's id is simply unknown.

Bounded cost, whatever the caller sends:

* at most :data:`~kvlease.protocol.RENEW_MAX_IDS` ids a request (the SDK keeper's batch size is the
  same constant), keyed from one primed BLAKE2b state (or the keyer's bounded cache of the ids
  found before), read with one ``get_many`` (one Redis script call, or one ``MGET``) and written
  back with one ``renew_many`` (in place in memory; one Redis script call, or one pipeline) and,
  for leases gone, one ``put_many``;
* renew budgets of ids a second (:class:`~kvlease_router._ratelimit.TenantBuckets`) per tenant,
  per client address and for the whole router (made-up bearer tokens are new tenants, not a new
  budget each): past any ``429`` with ``Retry-After``, before the body is read when a budget cannot
  pay the fixed request cost (spent, or in debt: a refused renew still charges its ids);
* a store error is ``503`` with ``Retry-After`` (the SDK retries), never ``200`` with every id
  ``unknown``: ``unknown`` means only that the lease is really gone;
* a control URL from a stored record is only a key into the configured decode control endpoints: a
  record naming any other URL counts as holding no lease (nothing is sent there).

The decisions are the lease core's (:mod:`kvlease_router._lease_core`); this module does the IO.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from itertools import compress

import aiohttp
import orjson
from aiohttp import web

from kvlease.protocol import (
    ERROR_RATE_LIMITED,
    ERROR_STORE_UNAVAILABLE,
    HEADER_RETRY_AFTER,
    ControlCallError,
    ProtocolError,
    ReleaseResponse,
    RenewRequest,
    RenewResponse,
    validate_conversation_id,
)
from kvlease_router._body import read_body, refuse_unread
from kvlease_router._clients import peer_address
from kvlease_router._identity import tenant_from
from kvlease_router._lease_core import LeaseSettings, plan_release, plan_renew, settle_renew
from kvlease_router._ratelimit import TenantBuckets
from kvlease_router._runtime import JSON_CT, RouterRuntime, error_response, log
from kvlease_router._store import ConversationRecord, PutItem, StoreError

__all__ = ["RENEW_REQUEST_COST", "handle_release", "handle_renew"]

#: What one renew request costs of its tenant's budget on top of its ids (a flood of one-id
#: renews is not free).
RENEW_REQUEST_COST = 100


def _store_unavailable(router: RouterRuntime, e: StoreError) -> web.Response:
    router.metrics.store_errors.inc()
    log.warning("state store failed during a lease call: %s", e)
    retry = TenantBuckets.retry_after(router.settings.store_backoff)
    return error_response(
        503, "state store unavailable; retry later", ERROR_STORE_UNAVAILABLE, {HEADER_RETRY_AFTER: retry}
    )


def lease_settings(router: RouterRuntime, ttl: float) -> LeaseSettings:
    """The lease core's settings (``ttl``: the cluster plan's; a release needs none)."""
    s = router.settings
    return LeaseSettings(s.kvlease_mode, ttl, s.ttl_margin, s.expired_grace, router.configured_control)


async def _renew_on(
    router: RouterRuntime,
    control: str,
    lease_ids: list[str],
    tenant_tag: str | None = None,
    ask: float | None = None,
) -> Mapping[str, float | None] | None:
    """D's new ``expires_in`` per lease id, or ``None`` when the control call failed (``ask``: the
    ``expires_in`` asked of D, by default the router's TTL plus the margin)."""
    if ask is None:
        ask = router.ttl + router.settings.ttl_margin
    try:
        answer = await router.control(control).renew(lease_ids, ask, tenant=tenant_tag)
        got: Mapping[str, float | None] = answer.expires_in
        return got
    except (aiohttp.ClientError, asyncio.TimeoutError, ControlCallError, ProtocolError) as e:
        router.metrics.upstream_errors["control"].inc()
        router.metrics.renewals["failed"].inc(len(lease_ids))
        log.warning("renew on %s failed: %s", control, type(e).__name__)
        return None


def _budgets(router: RouterRuntime, tenant: str, ip: str) -> list[tuple[TenantBuckets, str]]:
    return [(router.renew_budget, tenant), (router.renew_ip_budget, ip), (router.renew_global_budget, "")]


def _rate_limited(wait: float) -> web.Response:
    return error_response(
        429,
        "renew budget spent; retry later",
        ERROR_RATE_LIMITED,
        {HEADER_RETRY_AFTER: TenantBuckets.retry_after(wait)},
    )


async def handle_renew(request: web.Request, router: RouterRuntime) -> web.Response:
    # Before the body is read or parsed: a tenant, address or the whole router that cannot pay the
    # fixed request cost (spent, or in debt from an earlier renew) costs a 429 and no more.
    tenant = tenant_from(request.headers, router.settings.tenant_header)
    budgets = _budgets(router, tenant, peer_address(request))
    now = time.monotonic()
    wait = max(b.peek(k, RENEW_REQUEST_COST, now) for b, k in budgets)
    if wait > 0:
        return await refuse_unread(request, _rate_limited(wait))
    for b, k in budgets:
        b.charge(k, RENEW_REQUEST_COST, now)
    raw = await read_body(request, router)  # every coding, size and disconnect rule of a turn's
    if isinstance(raw, web.Response):
        return raw
    try:
        req = RenewRequest.from_json(orjson.loads(raw))
    except orjson.JSONDecodeError as e:
        return error_response(400, f"request body is not valid JSON: {e}")
    except ProtocolError as e:
        return error_response(400, str(e))
    unique: dict[str, None] = dict.fromkeys(req.conversation_ids)
    ids = list(unique)
    # the ids are charged whether or not they are served: a refused renew leaves its budgets in
    # debt, so the next ones are refused before their bodies are read until it is paid back
    now = time.monotonic()
    wait = max(b.peek(k, len(ids), now) for b, k in budgets)
    for b, k in budgets:
        b.charge(k, len(ids), now)
    if wait > 0:
        return _rate_limited(wait)
    keys, missed = router.keyer.lookup(tenant, ids)
    try:
        records = await router.store.get_many(keys)
    except StoreError as e:
        return _store_unavailable(router, e)
    if missed:  # cache the keys of the ids that have state (a keeper renews them every period)
        router.keyer.remember(tenant, _found(ids, keys, records, missed))
    settings = lease_settings(router, router.ttl)
    plan = plan_renew(ids, records, time.time(), settings, unique)
    answers: dict[str, Mapping[str, float | None] | None] = {}
    if plan.calls:
        tag = router.keyer.tenant_tag(tenant)
        controls = list(plan.calls)
        got = await asyncio.gather(
            *(_renew_on(router, c, plan.lease_ids[c], tag, settings.ask) for c in controls)
        )
        answers = dict(zip(controls, got))
    result = settle_renew(plan, answers, settings)
    if result.renewed:
        router.metrics.renewals["renewed"].inc(result.renewed)
    if result.drops:
        router.metrics.renewals["unknown"].inc(len(result.drops))
    try:
        await _write_back(router, plan.now, keys, records, result.renewals, result.drops, settings)
    except StoreError as e:  # D renewed but the router would not know: the caller retries
        return _store_unavailable(router, e)
    return web.Response(body=RenewResponse(result.leases, settings.ttl).dumps(), content_type=JSON_CT)


def _found(
    ids: list[str], keys: list[str], records: list[ConversationRecord | None], missed: Sequence[int]
) -> list[tuple[str, str]]:
    """``(id, key)`` of the ids of ``missed`` (indexes) that have a record, picked in C when all
    missed (an attacker's renew: none has one). A record is always true (no ``__len__``)."""
    if len(missed) == len(ids):
        return list(compress(zip(ids, keys), records))
    return [(ids[i], keys[i]) for i in missed if records[i] is not None]


async def _write_back(
    router: RouterRuntime,
    now: float,
    keys: list[str],
    records: list[ConversationRecord | None],
    renewals: dict[float, list[int]],
    drops: list[int],
    settings: LeaseSettings,
) -> None:
    """The renewed records' new deadlines (one ``renew_many`` per deadline: one, when D renews
    alike) and the records that lost their handle (one ``put_many``)."""
    store, grace = router.store, settings.expired_grace
    for left, indexes in renewals.items():
        if len(indexes) == len(keys):  # every one (indexes are distinct): as read, no copies
            await store.renew_many(keys, records, now + left, left + grace)  # type: ignore[arg-type]
            continue
        renewed = list(map(records.__getitem__, indexes))
        await store.renew_many(list(map(keys.__getitem__, indexes)), renewed, now + left, left + grace)  # type: ignore[arg-type]
    if drops:
        keep_for = settings.keep_for
        writes: list[PutItem] = [(keys[i], records[i].without_handle(), keep_for) for i in drops]  # type: ignore[union-attr]
        await store.put_many(writes)


async def handle_release(request: web.Request, router: RouterRuntime) -> web.Response:
    raw_id = request.match_info.get("id", "")
    try:
        cid = validate_conversation_id(raw_id)
    except ProtocolError as e:
        return error_response(400, str(e))
    key = router.keyer.key(tenant_from(request.headers, router.settings.tenant_header), cid)
    try:
        record = await router.store.delete(key)
    except StoreError as e:  # say so; the lease lapses on its own
        return _store_unavailable(router, e)
    plan = plan_release(record, lease_settings(router, 0.0))
    released = False
    if plan.control is not None:
        released = await router.release_on_decode(plan.control, list(plan.lease_ids))
    body = ReleaseResponse(cid, known=plan.known, released=released).to_json()
    return web.Response(body=orjson.dumps(body), content_type=JSON_CT)
