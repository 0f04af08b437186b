"""``POST /v1/kvlease/renew`` and ``DELETE /v1/kvlease/conversations/{id}``.

Renew sends ONE batched ``POST /renew`` per decode node's control endpoint (concurrently), asking
for the router TTL plus the margin, so D's deadline always outlives the router's. Ids are scoped by
the caller's tenant exactly like chat turns: another tenant's id is simply unknown.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import aiohttp
import orjson
from aiohttp import web

from kvlease.protocol import (
    ERROR_STORE_UNAVAILABLE,
    ControlCallError,
    ProtocolError,
    ReleaseResponse,
    RenewRequest,
    RenewResponse,
    validate_conversation_id,
)
from kvlease_router._identity import tenant_from
from kvlease_router._runtime import JSON_CT, RouterRuntime, error_response, log
from kvlease_router._store import ConversationRecord, StoreError

__all__ = ["handle_release", "handle_renew"]


async def _renew_on(
    router: RouterRuntime, control: str, lease_ids: list[str]
) -> dict[str, float | None] | None:
    """D's new ``expires_in`` per lease id, or ``None`` when the control call failed."""
    try:
        answer = await router.control(control).renew(lease_ids, router.ttl + router.settings.ttl_margin)
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
    keys = {cid: router.keyer.key(tenant, cid) for cid in ids}
    states: dict[str, ConversationRecord | None] = {}
    results = await asyncio.gather(*(router.store_get(keys[cid]) for cid in ids))
    for cid, (state, _ok) in zip(ids, results):
        states[cid] = state
    now = time.time()
    leases: dict[str, float | None] = {}
    by_control: dict[str, list[str]] = defaultdict(list)
    for cid, state in states.items():
        if state is None or state.params is None or state.expires_at <= now:
            leases[cid] = None
        elif router.settings.kvlease_mode and state.control and state.lease_id:
            by_control[state.control].append(cid)
        else:
            leases[cid] = state.expires_in(now)  # stock vLLM: no renewal, remaining time only
    controls = list(by_control)
    lease_ids = {c: [_lease_id(states[cid]) for cid in by_control[c]] for c in controls}
    answers = await asyncio.gather(*(_renew_on(router, c, lease_ids[c]) for c in controls))
    writes = []
    margin = router.settings.ttl_margin
    for control, answer in zip(controls, answers):
        for cid in by_control[control]:
            state = states[cid]
            assert state is not None and state.lease_id is not None
            if answer is None:  # D unreachable: the lease was not extended
                leases[cid] = state.expires_in(now)
                continue
            d_left = answer.get(state.lease_id)
            if d_left is None or d_left - margin <= 0:
                leases[cid] = None
                router.metrics.renewals["unknown"].inc()
                writes.append(router.store_put(keys[cid], state.without_handle()))
                continue
            left = min(router.ttl, d_left - margin)
            leases[cid] = left
            router.metrics.renewals["renewed"].inc()
            new = ConversationRecord(**{**state.__dict__, "expires_at": now + left})
            writes.append(router.store_put(keys[cid], new, left + router.settings.expired_grace))
    if writes:
        await asyncio.gather(*writes)
    body = RenewResponse({cid: leases[cid] for cid in ids}, router.ttl).to_json()
    return web.Response(body=orjson.dumps(body), content_type=JSON_CT)


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
        router.metrics.store_errors.inc()
        return error_response(503, f"state store unavailable: {e}", ERROR_STORE_UNAVAILABLE)
    released = False
    if state is not None and state.control and state.lease_id and router.settings.kvlease_mode:
        released = await router.release_on_decode(state.control, [state.lease_id])
    body = ReleaseResponse(cid, known=state is not None, released=released).to_json()
    return web.Response(body=orjson.dumps(body), content_type=JSON_CT)
