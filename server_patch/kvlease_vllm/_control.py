"""The connector's control endpoint: ``GET /info``, ``POST /renew``, ``POST /release``, ``GET /metrics``,
and on P ``POST /sendcheck`` (D's post-read check of a P->D send, :mod:`kvlease_vllm._sendcheck`).

``/info`` is the node's facts plus its lease table now (:class:`~kvlease.protocol.LeaseStatus`:
leases and blocks per tenant tag, the top few; leases are tagged when D creates them).

Opened by the scheduler-side connector (like NIXL's side channel) in a daemon thread of vLLM's
engine-core process. Request threads never touch scheduler state directly: they update the lease
table under a short lock (:class:`LeaseDesk`) and the scheduler thread takes the resulting deadline
changes when it builds the next step's connector metadata, so the scheduler loop never waits on HTTP.

Auth: ``Authorization: Bearer <secret>`` (compared in constant time). Without a configured secret
``/info`` and ``/metrics`` stay readable and ``/renew``/``/release``/``/sendcheck`` answer 403.

Bounded, whatever the peers do (:class:`_Server`): a fixed pool of worker threads (never a thread per
connection) serves one request at a time; idle keep-alive connections wait in one selector thread,
not in a worker, and are closed after ``idle_timeout``; a request must arrive whole within
``request_timeout`` (a trickling client holds a worker for at most that long); past the queue's
bound new work is refused by closing the connection. A body the endpoint does not read (401, 413,
404...) is drained when small, else the connection is closed.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any, Final

from kvlease.protocol import (
    CONTROL_AUTH_HEADER,
    CONTROL_INFO_PATH,
    CONTROL_METRICS_PATH,
    CONTROL_RELEASE_PATH,
    CONTROL_RENEW_PATH,
    ControlClient,
    ControlInfo,
    ControlReleaseRequest,
    ControlReleaseResponse,
    ControlRenewRequest,
    ControlRenewResponse,
    ErrorBody,
    ProtocolError,
)
from kvlease.protocol._control import CONTROL_SEND_CHECK_PATH, SendCheckRequest, SendCheckResponse
from kvlease_vllm._control_http import Conn, PooledHTTPServer, Writer
from kvlease_vllm._desk import LeaseDesk
from kvlease_vllm._metrics import CONTENT_TYPE_LATEST
from kvlease_vllm._sendcheck import SendDesk

logger = logging.getLogger("vllm.kvlease.control")  # under vLLM's handler inside a server

MAX_BODY_BYTES: Final = 1 << 20
#: An unread body up to this size is drained (keep-alive survives); a larger one closes the connection.
DRAIN_MAX_BYTES: Final = 64 << 10


class _Handler(BaseHTTPRequestHandler):
    """Serves exactly one request of a connection (the server re-parks the connection after)."""

    server: _Server  # type: ignore[assignment]
    protocol_version = "HTTP/1.1"

    def __init__(self, conn: Conn, server: _Server) -> None:
        self._conn = conn
        self._body_read = False
        super().__init__(conn.sock, conn.addr, server)  # type: ignore[arg-type]

    def setup(self) -> None:
        self.connection = self.request
        self.rfile = self._conn.reader  # type: ignore[assignment]
        self.wfile = Writer(self.connection, self.server.request_timeout)  # type: ignore[assignment]

    def handle(self) -> None:
        self.close_connection = True
        self.handle_one_request()

    def finish(self) -> None:
        pass

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("control %s - " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        routes = {
            CONTROL_INFO_PATH: ("GET", self._info, False),
            CONTROL_METRICS_PATH: ("GET", self._metrics, False),
            CONTROL_RENEW_PATH: ("POST", self._renew, True),
            CONTROL_RELEASE_PATH: ("POST", self._release, True),
            CONTROL_SEND_CHECK_PATH: ("POST", self._send_check, True),
        }
        route = routes.get(path)
        try:
            if route is None:
                return self._error(HTTPStatus.NOT_FOUND, f"no such path {path}")
            want, fn, mutating = route
            if method != want:
                return self._error(HTTPStatus.METHOD_NOT_ALLOWED, f"{path} takes {want}")
            if not self._authorized(mutating):
                return None
            body = self._body() if method == "POST" else None
            if body is _TOO_LARGE:
                return self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "body too large")
            return fn(body)
        except ProtocolError as e:
            return self._error(HTTPStatus.BAD_REQUEST, str(e))
        except OSError:  # the peer was too slow or went away: nothing more to say on this connection
            self.close_connection = True
            return None
        except Exception:  # never let one request kill the endpoint
            logger.exception("kvlease control endpoint error")
            return self._error(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error")

    def _authorized(self, mutating: bool) -> bool:
        secret = self.server.secret
        if secret is None:
            if mutating:
                self._error(HTTPStatus.FORBIDDEN, "no control secret configured on this node")
                return False
            return True
        got = self.headers.get(CONTROL_AUTH_HEADER, "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), secret.encode()):
            self._error(
                HTTPStatus.UNAUTHORIZED, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"}
            )
            return False
        return True

    def _body(self) -> object:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            raise ProtocolError("bad Content-Length") from None
        if length > MAX_BODY_BYTES:
            return _TOO_LARGE
        self._body_read = True
        raw = self.rfile.read(length) if length > 0 else b""
        if len(raw) < length:
            raise ProtocolError("body shorter than its Content-Length")
        try:
            return json.loads(raw or b"null")
        except (ValueError, UnicodeDecodeError):
            raise ProtocolError("body is not valid JSON") from None

    def _info(self, _body: object) -> None:
        info = replace(self.server.info(), leases=self.server.desk.status())  # the table now, per tenant
        self._json(HTTPStatus.OK, info.to_json())

    def _metrics(self, _body: object) -> None:
        self._send(HTTPStatus.OK, self.server.desk.metrics.render(), CONTENT_TYPE_LATEST)

    def _renew(self, body: object) -> None:
        req = ControlRenewRequest.from_json(body)
        ttl = min(req.ttl, self.server.max_ttl)
        deadlines: dict[str, float] | None = {} if req.claim else None
        expires = self.server.desk.renew(
            req.request_ids, ttl, pin=req.claim, claimant=req.claimant, deadlines=deadlines, tenant=req.tenant
        )
        self._json(HTTPStatus.OK, ControlRenewResponse(expires, deadlines).to_json())

    def _release(self, body: object) -> None:
        req = ControlReleaseRequest.from_json(body)
        desk = self.server.desk
        released = (
            desk.release(req.request_ids)
            if req.claimant is None
            else desk.unclaim(req.request_ids, req.claimant)
        )
        self._json(HTTPStatus.OK, ControlReleaseResponse(released).to_json())

    def _send_check(self, body: object) -> None:
        req = SendCheckRequest.from_json(body)
        sends = self.server.sends
        intact = sends.check(req.request_ids) if sends is not None else dict.fromkeys(req.request_ids, False)
        self._json(HTTPStatus.OK, SendCheckResponse(intact).to_json())

    def _error(self, status: HTTPStatus, message: str, headers: dict[str, str] | None = None) -> None:
        self._json(status, ErrorBody.for_status(int(status), message).to_json(), headers)

    def _json(self, status: HTTPStatus, obj: object, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json", headers)

    def _settle_body(self) -> bool:
        """Before answering without reading the body: drain a small one; False: close instead."""
        if self._body_read:
            return True
        self._body_read = True
        if self.headers.get("Transfer-Encoding"):
            return False
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            return False
        if length <= 0:
            return length == 0
        if length > DRAIN_MAX_BYTES:
            return False
        try:
            return len(self.rfile.read(length)) == length
        except OSError:
            return False

    def _send(
        self, status: HTTPStatus, data: bytes, ctype: str, headers: dict[str, str] | None = None
    ) -> None:
        if not self._settle_body():
            headers = {**(headers or {}), "Connection": "close"}  # send_header sets close_connection
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)


_TOO_LARGE: Final = object()


class _Server(PooledHTTPServer):
    def __init__(
        self,
        addr: tuple[str, int],
        desk: LeaseDesk,
        info: Callable[[], ControlInfo],
        secret: str | None,
        max_ttl: float,
        sends: SendDesk | None = None,
        **limits: Any,
    ) -> None:
        self.desk = desk
        self.info = info
        self.secret = secret
        self.max_ttl = max_ttl
        self.sends = sends
        super().__init__(addr, self._serve_one, **limits)

    def _serve_one(self, conn: Conn) -> bool:
        return not _Handler(conn, self).close_connection


class ControlServer:
    """The control endpoint, serving in a daemon thread until :meth:`stop` (bounded: see
    :class:`_Server`)."""

    def __init__(
        self,
        desk: LeaseDesk,
        info: Callable[[], ControlInfo],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: str | None = None,
        max_ttl: float = 3600.0,
        workers: int = 8,
        request_timeout: float = 5.0,
        idle_timeout: float = 30.0,
        sends: SendDesk | None = None,
    ) -> None:
        self._server = _Server(
            (host, port),
            desk,
            info,
            secret,
            max_ttl,
            sends,
            workers=workers,
            request_timeout=request_timeout,
            idle_timeout=idle_timeout,
        )
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.5},
            name="kvlease-control",
            daemon=True,
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def refused(self) -> int:
        """Connections closed unserved because the endpoint was full."""
        return self._server.refused

    def url(self, advertise_host: str) -> str:
        host = f"[{advertise_host}]" if ":" in advertise_host else advertise_host
        return f"http://{host}:{self.port}"

    def start(self) -> ControlServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def claim(
    url: str,
    lease_id: str,
    hold_s: float,
    secret: str | None,
    timeout: float,
    claimant: str | None = None,
    tenant: str | None = None,
) -> ClaimResult:
    """Claim (renew and pin) ``lease_id`` at a decode node's control endpoint, for ``claimant``.

    Returns the seconds left on the lease (None when D no longer holds it or another reader holds
    the claim) and D's absolute deadline when D reports it. Raises ``OSError`` / ``ValueError``
    when D does not answer properly (the caller recomputes). Uses the control API's one request
    client (:class:`kvlease.protocol.ControlClient`, standard library only), sync: it runs in a thread of vLLM's engine process.
    ``tenant``: the opaque tenant tag of the lease (D's per-tenant retention quota): the router's tag
    in P's request (D tagged the lease with the same one when it created it), or None.
    """
    client = ControlClient(url, secret=secret, timeout=timeout)
    answer = client.renew([lease_id], hold_s, claim=True, claimant=claimant, tenant=tenant)
    left = answer.expires_in.get(lease_id)
    deadline = (answer.deadlines or {}).get(lease_id) if left is not None else None
    return ClaimResult(left, deadline)


def unclaim(url: str, lease_id: str, secret: str | None, timeout: float, claimant: str) -> bool:
    """End ``claimant``'s pin of ``lease_id`` on D (P claimed it and will not read it after all);
    the lease stays retained. Whether D held such a pin; raises like :func:`claim`."""
    client = ControlClient(url, secret=secret, timeout=timeout)
    return bool(client.release([lease_id], claimant=claimant).released > 0)


@dataclass(frozen=True)
class ClaimResult:
    left: float | None  # seconds left on D's lease; None: gone, or claimed by another reader
    deadline: float | None = None  # D's absolute deadline (D's clock), when D reports it
