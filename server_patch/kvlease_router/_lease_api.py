"""``POST /v1/kvlease/renew`` and ``DELETE /v1/kvlease/conversations/{id}``.

Renew sends ONE batched ``POST /renew`` per decode node's control endpoint (concurrently), asking
for the router TTL plus the margin, so D's deadline always outlives the router's. Ids are scoped by
the caller's tenant exactly like chat turns: another tenant's id is simply unknown.

Bounded cost, whatever the caller sends:

* at most :data:`~kvlease.protocol.RENEW_MAX_IDS` ids a request (the SDK keeper's batch size is the
  same constant), keyed from one HMAC state, read with one ``get_many`` (one Redis ``MGET``) and
  written back with one ``put_many`` (one pipeline);
* a per-tenant budget of ids a second (:class:`~kvlease_router._ratelimit.TenantBuckets`): past it
  ``429`` with ``Retry-After``;
* a store error is ``503`` with ``Retry-After`` (the SDK retries), never ``200`` with every id
  ``unknown``: ``unknown`` means only that the lease is really gone;
* a control URL from a stored record is only a key into the configured decode control endpoints: a
  record naming any other URL counts as holding no lease (nothing is sent there).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

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
from kvlease_router._identity import tenant_from
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


async def _renew_on(
    router: RouterRuntime, control: str, lease_ids: list[str], tenant_tag: str | None = None
) -> dict[str, float | None] | None:
    """D's new ``expires_in`` per lease id, or ``None`` when the control call failed."""
    try:
        ttl = router.ttl + router.settings.ttl_margin
        answer = await router.control(control).renew(lease_ids, ttl, tenant=tenant_tag)
        return dict(answer.expires_in)
    except (aiohttp.ClientError, asyncio.TimeoutError, ControlCallError, ProtocolError) as e:
        router.metrics.upstream_errors["control"].inc()
        router.metrics.renewals["failed"].inc(len(lease_ids))
        log.warning("renew on %s failed: %s", control, type(e).__name__)
        return None


async def handle_renew(request: web.Request, router: RouterRuntime) -> web.Response:
    try:
        req = RenewRequest.from_json(orjson.loads(await request.read()))
    except web.HTTPRequestEntityTooLarge:
        return error_response(413, f"request body exceeds {router.settings.max_body_bytes} bytes")
    except orjson.JSONDecodeError as e:
        return error_response(400, f"request body is not valid JSON: {e}")
    except ProtocolError as e:
        return error_response(400, str(e))
    tenant = tenant_from(request.headers, router.settings.tenant_header)
    ids = list(dict.fromkeys(req.conversation_ids))
    wait = router.renew_budget.take(tenant, len(ids) + RENEW_REQUEST_COST, time.monotonic())
    if wait > 0:
        retry = TenantBuckets.retry_after(wait)
        return error_response(
            429,
            "renew budget of this tenant spent; retry later",
            ERROR_RATE_LIMITED,
            {HEADER_RETRY_AFTER: retry},
        )
    keys = router.keyer.keys(tenant, ids)
    try:
        states = await router.store.get_many(keys)
    except StoreError as e:
        return _store_unavailable(router, e)
    now = time.time()
    kvlease = router.settings.kvlease_mode
    leases: dict[str, float | None] = {}
    by_control: dict[str, list[int]] = defaultdict(list)  # control URL -> indexes into ids
    writes: list[PutItem] = []
    for i, (cid, state) in enumerate(zip(ids, states)):
        if state is None or state.params is None or state.expires_at <= now:
            leases[cid] = None
        elif not kvlease:
            leases[cid] = state.expires_in(now)  # stock vLLM: no renewal, remaining time only
        elif (
            state.lease_id and (control := router.configured_control(state.control, state.decode)) is not None
        ):
            by_control[control].append(i)
        else:  # a handle without a lease, or naming a control URL not configured: nothing to renew
            leases[cid] = None
            router.metrics.renewals["unknown"].inc()
            writes.append((keys[i], state.without_handle(), router.keep_for))
    if by_control:
        tag = router.keyer.tenant_tag(tenant)
        controls = list(by_control)
        lease_ids = [[_lease_id(states[i]) for i in by_control[c]] for c in controls]
        answers = await asyncio.gather(*(_renew_on(router, c, ls, tag) for c, ls in zip(controls, lease_ids)))
        _apply(router, now, ids, keys, states, by_control, controls, answers, leases, writes)
    if writes:
        try:
            await router.store.put_many(writes)
        except StoreError as e:  # D renewed but the router would not know: the caller retries
            return _store_unavailable(router, e)
    body = RenewResponse({cid: leases[cid] for cid in ids}, router.ttl).to_json()
    return web.Response(body=orjson.dumps(body), content_type=JSON_CT)


def _apply(
    router: RouterRuntime,
    now: float,
    ids: list[str],
    keys: list[str],
    states: list[ConversationRecord | None],
    by_control: dict[str, list[int]],
    controls: list[str],
    answers: list[dict[str, float | None] | None],
    leases: dict[str, float | None],
    writes: list[PutItem],
) -> None:
    """Fold D's answers into the lease table of the reply and the records to write back."""
    margin = router.settings.ttl_margin
    ttl, grace = router.ttl, router.settings.expired_grace
    renewed = unknown = 0
    write = writes.append
    for control, answer in zip(controls, answers):
        for i in by_control[control]:
            cid, state = ids[i], states[i]
            assert state is not None and state.lease_id is not None
            if answer is None:  # D unreachable: the lease was not extended
                leases[cid] = state.expires_at - now
                continue
            d_left = answer.get(state.lease_id)
            if d_left is None or d_left <= margin:
                leases[cid] = None
                unknown += 1
                write((keys[i], state.without_handle(), router.keep_for))
                continue
            left = d_left - margin
            if left > ttl:
                left = ttl
            leases[cid] = left
            renewed += 1
            write((keys[i], state.with_expiry(now + left), left + grace))
    if renewed:
        router.metrics.renewals["renewed"].inc(renewed)
    if unknown:
        router.metrics.renewals["unknown"].inc(unknown)


def _lease_id(state: ConversationRecord | None) -> str:
    assert state is not None and state.lease_id is not None
    return state.lease_id


async def handle_release(request: web.Request, router: RouterRuntime) -> web.Response:
    raw_id = request.match_info.get("id", "")
    try:
        cid = validate_conversation_id(raw_id)
    except ProtocolError as e:
        return error_response(400, str(e))
    key = router.keyer.key(tenant_from(request.headers, router.settings.tenant_header), cid)
    try:
        state = await router.store.delete(key)
    except StoreError as e:  # say so; the lease lapses on its own
        return _store_unavailable(router, e)
    released = False
    if state is not None and state.control and state.lease_id and router.settings.kvlease_mode:
        control = router.configured_control(state.control, state.decode)
        if control is not None:  # else: a record naming an unknown host; send it nothing
            released = await router.release_on_decode(control, [state.lease_id])
    body = ReleaseResponse(cid, known=state is not None, released=released).to_json()
    return web.Response(body=orjson.dumps(body), content_type=JSON_CT)
