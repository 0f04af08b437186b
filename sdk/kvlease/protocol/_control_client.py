"""The client of the connector's control API: a sync and an async twin, thin IO shells.

Both build their request with :func:`~kvlease.protocol._control.renew_call` /
:func:`~kvlease.protocol._control.release_call` and read the answer with
``read_renew_answer`` / ``read_release_answer``; all they do is send the bytes. Users: P's claim
(:class:`ControlClient`, inside vLLM's engine process: standard library only) and the router's renew
and release (:class:`AsyncControlClient` on the router's own ``aiohttp`` session, imported lazily so
that importing :mod:`kvlease.protocol` never needs aiohttp).

Errors are the transport's own (``OSError`` / ``urllib.error.URLError`` and ``TimeoutError`` for the
sync twin; ``aiohttp.ClientError`` and ``asyncio.TimeoutError`` for the async one), plus
:class:`~kvlease.protocol._control.ControlCallError` (an ``OSError``: an HTTP error status) and
:class:`~kvlease.protocol.ProtocolError` (a ``ValueError``: an answer that is not the contract's).
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvlease.protocol._control import (
    MAX_CONTROL_ANSWER_BYTES,
    ControlCall,
    ControlReleaseResponse,
    ControlRenewResponse,
    read_release_answer,
    read_renew_answer,
    release_call,
    renew_call,
)

if TYPE_CHECKING:
    import aiohttp

__all__ = ["AsyncControlClient", "ControlClient", "send", "send_async"]


def send(call: ControlCall) -> tuple[int, bytes]:
    """Send ``call`` with urllib: (status, at most :data:`MAX_CONTROL_ANSWER_BYTES` of the body)."""
    req = urllib.request.Request(call.url, data=call.body, method=call.method, headers=dict(call.headers))
    try:
        with urllib.request.urlopen(req, timeout=call.timeout) as resp:
            return int(resp.status), resp.read(MAX_CONTROL_ANSWER_BYTES)
    except urllib.error.HTTPError as e:  # an answer, with an error status: the reader decides
        e.close()
        return int(e.code), b""


async def send_async(session: aiohttp.ClientSession, call: ControlCall) -> tuple[int, bytes]:
    """Send ``call`` on ``session``: (status, body)."""
    import aiohttp

    async with session.request(
        call.method,
        call.url,
        data=call.body,
        headers=dict(call.headers),
        timeout=aiohttp.ClientTimeout(total=call.timeout),
    ) as resp:
        return resp.status, await resp.read()


class ControlClient:
    """Sync client of one control endpoint (``url``: ``http://host:port``)."""

    def __init__(self, url: str, *, secret: str | None, timeout: float) -> None:
        self.url, self.secret, self.timeout = url, secret, timeout

    def renew(
        self,
        lease_ids: Sequence[str],
        ttl: float,
        *,
        claim: bool = False,
        claimant: str | None = None,
        tenant: str | None = None,
    ) -> ControlRenewResponse:
        call = renew_call(
            self.url,
            lease_ids,
            ttl,
            secret=self.secret,
            timeout=self.timeout,
            claim=claim,
            claimant=claimant,
            tenant=tenant,
        )
        return read_renew_answer(*send(call))

    def release(self, lease_ids: Sequence[str], *, claimant: str | None = None) -> ControlReleaseResponse:
        call = release_call(self.url, lease_ids, secret=self.secret, timeout=self.timeout, claimant=claimant)
        return read_release_answer(*send(call))


class AsyncControlClient:
    """Async twin of :class:`ControlClient`, on the caller's ``aiohttp`` session."""

    def __init__(
        self, session: aiohttp.ClientSession, url: str, *, secret: str | None, timeout: float
    ) -> None:
        self.session, self.url, self.secret, self.timeout = session, url, secret, timeout

    async def renew(
        self, lease_ids: Sequence[str], ttl: float, *, claim: bool = False, tenant: str | None = None
    ) -> ControlRenewResponse:
        call = renew_call(
            self.url, lease_ids, ttl, secret=self.secret, timeout=self.timeout, claim=claim, tenant=tenant
        )
        return read_renew_answer(*await send_async(self.session, call))

    async def release(self, lease_ids: Sequence[str]) -> ControlReleaseResponse:
        call = release_call(self.url, lease_ids, secret=self.secret, timeout=self.timeout)
        return read_release_answer(*await send_async(self.session, call))
