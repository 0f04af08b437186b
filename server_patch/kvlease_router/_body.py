"""Reading a request body: the one reader of every handler that reads one (turns, renew).

Whatever the client sends, the answer is a 4xx in OpenAI's error shape, never a 5xx or a traceback:

* a ``Content-Encoding`` the router's HTTP server does not decode (anything but ``identity``,
  ``gzip``, ``deflate``, ``br``, ``zstd``; ``x-gzip`` and lists such as ``gzip, deflate`` included)
  → 415, the body left unread;
* a body that is not what its coding says (or a broken chunked encoding) → 400;
* a body over ``max_body_bytes`` (after decompression) → 413;
* a body not complete within ``body_timeout`` → 408;
* a client that resets or closes its connection mid-body → nothing to answer (logged like every
  client error: one INFO line a second per kind, no traceback).

Past a 415, 400 or 408 the connection is closed: the rest of its bytes cannot be trusted.
"""

from __future__ import annotations

import asyncio

import aiohttp
import aiohttp.http_exceptions
from aiohttp import web

from kvlease_router._guard import timeout
from kvlease_router._runtime import RouterRuntime, error_response

__all__ = ["DECODED", "answer_and_close", "read_body", "reject"]

#: Content codings the router's HTTP server (aiohttp) decodes: exactly these names (it passes any
#: other through undecoded, so the router answers 415 for it rather than read bytes it cannot).
#: ``br`` and ``zstd`` need their optional libraries; without them aiohttp refuses the request
#: itself (a 400) before any handler runs.
DECODED = frozenset(("", "identity", "gzip", "deflate", "br", "zstd"))


def reject(router: RouterRuntime, kind: str, message: str, status: int = 400) -> web.Response:
    """A client error: counted, logged at most once a second per kind, in OpenAI's shape."""
    router.metrics.client_error(kind, message)
    return error_response(status, message)


async def answer_and_close(request: web.Request, resp: web.Response) -> web.Response:
    """Send ``resp`` and close the connection: the rest of the body is unread (or unreadable), so
    no lingering read of it and no keep-alive."""
    resp.force_close()
    try:
        await resp.prepare(request)
        await resp.write_eof()
    except ConnectionError:
        pass
    request.protocol.force_close()
    return resp


async def refuse_unread(request: web.Request, resp: web.Response) -> web.Response:
    """``resp`` for a request whose body is left unread (a renew refused before reading it). A
    coded body would be decoded by aiohttp's own read of what a handler left, after the answer went
    out with keep-alive (and a lie in it would close the connection under the client's next
    request): the connection closes instead."""
    coding = request.headers.get("Content-Encoding")
    if coding is not None and coding.strip().lower() not in ("", "identity"):
        return await answer_and_close(request, resp)
    return resp


async def read_body(request: web.Request, router: RouterRuntime) -> bytes | web.Response:
    """The request's body, decoded, or the error response to return instead."""
    s = router.settings
    coding = request.headers.get("Content-Encoding")
    if coding is not None:
        coding = coding.strip().lower()
        if coding not in DECODED:  # the body is left unread: the connection closes after the answer
            return await answer_and_close(
                request, reject(router, "encoding", f"unsupported Content-Encoding {coding[:40]!r}", 415)
            )
    try:
        if request.content.is_eof():  # the whole body came with the head: reading cannot wait
            return await request.read()
        async with timeout(s.body_timeout):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        return reject(router, "too-large", f"request body exceeds {s.max_body_bytes} bytes", 413)
    except asyncio.TimeoutError:  # TimeoutError from 3.11 on; async-timeout's on 3.10
        return await answer_and_close(
            request,
            reject(router, "body-timeout", f"request body not received within {s.body_timeout:g} s", 408),
        )
    except ConnectionError as e:  # reset or closed mid-body: the answer goes nowhere
        request.protocol.force_close()
        return reject(router, "disconnect", f"client left mid-body: {type(e).__name__}")
    except (web.RequestPayloadError, aiohttp.http_exceptions.HttpProcessingError, ValueError) as e:
        # a body that is not what its Content-Encoding says (or a broken chunked encoding): the
        # rest of the connection's bytes cannot be trusted either
        return await answer_and_close(
            request, reject(router, "encoding", f"request body cannot be decoded: {type(e).__name__}")
        )
