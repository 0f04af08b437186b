"""The control endpoint under hostile peers (issue 15, item 5): a bounded worker pool with socket
timeouts, bodies drained or the connection closed after 401/413, renew work outside the lock the
scheduler shares, and the per-tenant retention quota. Real sockets on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvlease.protocol import (
    CONTROL_AUTH_HEADER,
    CONTROL_INFO_PATH,
    CONTROL_RENEW_PATH,
    ControlClient,
    ControlInfo,
    ControlRenewRequest,
    Role,
)
from kvlease_vllm._control import ControlServer
from kvlease_vllm._desk import RENEW_CHUNK, LeaseDesk
from kvlease_vllm._metrics import ConnectorMetrics
from kvlease_vllm._retention import RetentionTable

SECRET = "s3cret"
INFO = ControlInfo(Role.DECODE, "engine-d", "0.32.0", "0.1.0", True, 20.0, 64, 16, "tiny")


def _desk(n: int = 2, capacity: int = 100_000) -> LeaseDesk:
    d = LeaseDesk(RetentionTable(capacity, max_ttl=600.0, renew_guard=0.0), ConnectorMetrics())
    for i in range(n):
        d.add(f"lease-{i}", 1, time.perf_counter() + 60)
    return d


@pytest.fixture
def server() -> Iterator[ControlServer]:
    s = ControlServer(
        _desk(), lambda: INFO, secret=SECRET, max_ttl=600.0, workers=4, request_timeout=0.5, idle_timeout=2.0
    ).start()
    try:
        yield s
    finally:
        s.stop()


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.settimeout(5)
    return sock


def _request(method: str, path: str, body: bytes = b"", auth: str | None = SECRET) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
    if auth:
        head += f"{CONTROL_AUTH_HEADER}: Bearer {auth}\r\n"
    return head.encode() + b"\r\n" + body


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    n = int(headers.get("content-length", "0"))
    while len(rest) < n:
        rest += sock.recv(65536)
    return int(lines[0].split()[1]), headers, rest[:n]


def _closed(sock: socket.socket) -> bool:
    """Did the server close ``sock`` (within a second)?"""
    sock.settimeout(1.0)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_half_sent_requests_cost_no_thread_each_and_time_out(server: ControlServer) -> None:
    before = threading.active_count()
    socks = [_connect(server.port) for _ in range(200)]
    for i, s in enumerate(socks):
        s.sendall(b"POST /renew HTTP/1.1\r\nContent-Length: 100\r\n" if i % 2 else b"")  # half-sent / silent
    time.sleep(0.2)
    assert threading.active_count() <= before  # a fixed pool, not a thread per connection
    # a legit call is served meanwhile (the half-sent ones time out after request_timeout)
    t0 = time.perf_counter()
    answer = ControlClient(server.url("127.0.0.1"), secret=SECRET, timeout=5).renew(["lease-0"], 30.0)
    assert answer.expires_in["lease-0"] is not None and time.perf_counter() - t0 < 3.0
    time.sleep(0.8)
    half_sent = [s for i, s in enumerate(socks) if i % 2]
    assert all(_closed(s) for s in half_sent)  # past request_timeout: closed
    for s in socks:
        s.close()


def test_idle_keep_alive_connections_are_closed_after_idle_timeout(server: ControlServer) -> None:
    sock = _connect(server.port)
    sock.sendall(_request("GET", CONTROL_INFO_PATH))
    assert _read_response(sock)[0] == 200
    sock.sendall(_request("GET", CONTROL_INFO_PATH))  # keep-alive works
    assert _read_response(sock)[0] == 200
    time.sleep(2.8)
    assert _closed(sock)
    sock.close()


def test_a_refused_small_body_is_drained_and_the_connection_stays_usable(server: ControlServer) -> None:
    sock = _connect(server.port)
    body = json.dumps(ControlRenewRequest(("lease-0",), 30.0).to_json()).encode()
    sock.sendall(_request("POST", CONTROL_RENEW_PATH, body, auth="wrong"))
    status, _, _ = _read_response(sock)
    assert status == 401
    # the body was drained: the next request on this connection is parsed as a request
    sock.sendall(_request("POST", CONTROL_RENEW_PATH, body))
    status, _, answer = _read_response(sock)
    assert status == 200 and json.loads(answer)["expires_in"]["lease-0"] is not None
    sock.close()


def test_a_large_refused_body_closes_the_connection(server: ControlServer) -> None:
    sock = _connect(server.port)
    head = f"POST {CONTROL_RENEW_PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: 5000000\r\n\r\n".encode()
    sock.sendall(head + b"x" * 1000)
    status, headers, _ = _read_response(sock)
    assert status == 401 and headers.get("connection") == "close"
    assert _closed(sock)
    sock.close()
    sock = _connect(server.port)
    sock.sendall(head.replace(b"\r\n\r\n", f"\r\n{CONTROL_AUTH_HEADER}: Bearer {SECRET}\r\n\r\n".encode()))
    status, headers, _ = _read_response(sock)
    assert status == 413 and headers.get("connection") == "close"
    sock.close()


class CountingLock:
    """A lock that records how many ids each hold covered (via the table's renew calls)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.holds = 0

    def __enter__(self) -> None:
        self._lock.acquire()
        self.holds += 1

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_a_big_renew_holds_the_scheduler_lock_per_chunk_only() -> None:
    desk = _desk(10_000)
    lock = CountingLock()
    desk._lock = lock  # type: ignore[assignment]
    ids = tuple(f"lease-{i}" for i in range(10_000))
    out = desk.renew(ids, 30.0, tenant="t1")
    assert sum(v is not None for v in out.values()) == 10_000
    assert lock.holds == -(-10_000 // RENEW_CHUNK)  # one short hold per chunk, not one long one
    # and a scheduler-side call gets the lock between chunks
    got: list[float] = []

    def scheduler() -> None:
        t0 = time.perf_counter()
        desk.take_updates()
        got.append(time.perf_counter() - t0)

    t = threading.Thread(target=desk.renew, args=(ids * 5, 30.0))
    t.start()
    time.sleep(0.005)
    scheduler()
    t.join()
    assert got and got[0] < 0.5


def test_the_tenant_tag_reaches_the_table_over_http(server: ControlServer) -> None:
    client = ControlClient(server.url("127.0.0.1"), secret=SECRET, timeout=5)
    client.renew(["lease-0"], 30.0, tenant="tag-a")
    lease = server._server.desk._table.get("lease-0")
    assert lease is not None and lease.tenant == "tag-a"


def test_leases_over_a_tenants_quota_go_first_under_pressure() -> None:
    table = RetentionTable(100, renew_guard=0.0, tenant_quota_fraction=0.5)
    now = 0.0
    # the victim's leases are the oldest; the greedy tenant fills 80 % of the cap with newer ones
    for i in range(2):
        table.add(f"victim-{i}", 10, 100.0 + i, now)
        table.renew(f"victim-{i}", 1.0, now, tenant="victim")
    for i in range(8):
        table.add(f"greedy-{i}", 10, 200.0 + i, now)
        table.renew(f"greedy-{i}", 1.0, now, tenant="greedy")
    result = table.add("new", 20, 300.0, now)  # over the cap by 20 blocks
    assert result.retained
    assert set(result.released) == {"greedy-0", "greedy-1"}  # not the victim's older leases
    assert "victim-0" in table and "victim-1" in table
    # once every tenant is within its quota, the order is the oldest deadline again
    table2 = RetentionTable(100, renew_guard=0.0, tenant_quota_fraction=0.5)
    for i, (lid, tag) in enumerate((("a", "x"), ("b", "y"), ("c", None))):
        table2.add(lid, 30, 100.0 + i, now)
        if tag:
            table2.renew(lid, 1.0, now, tenant=tag)
    assert table2.relieve(30, now) == ["a"]
