"""Ports for the local servers (vLLM's HTTP port, NIXL side channel and control endpoint, Redis).

vLLM is told its ports before it binds them, so a port is chosen first and bound later. A port the
kernel picks for ``bind(0)`` lies in its ephemeral range, where outgoing connections take their
source ports: on a busy machine a client's connection can take the port in between, and vLLM's
side channel then fails with "Address already in use". :func:`free_port` picks outside that range.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

__all__ = ["HOST", "free_port"]

HOST = "127.0.0.1"

#: Where the kernel takes the source ports of outgoing connections (Linux's default if unreadable).
_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: Ports this process handed out: never handed out twice (a server may not have bound one yet).
_HANDED_OUT: set[int] = set()
_PORT_LOCK = threading.Lock()


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in _EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return lo, hi


def free_port() -> int:
    """A TCP port on :data:`HOST` that is free now and that no outgoing connection can take before
    a server binds it: it lies outside the kernel's ephemeral range. (A port the kernel picks for
    ``bind(0)`` lies inside it, so on a busy machine a client's connection can take it as its source
    port between this call and the server's bind: vLLM's side channel then fails with "Address
    already in use".) Falls back to ``bind(0)`` if no such port is free."""
    lo, hi = _ephemeral_range()
    ranges = [r for r in ((10_000, lo - 1), (hi + 1, 65_535)) if r[1] - r[0] >= 1_000]
    rng = random.SystemRandom()
    with _PORT_LOCK:
        for _ in range(200 if ranges else 0):
            a, b = rng.choice(ranges)
            port = rng.randint(a, b)
            if port in _HANDED_OUT:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((HOST, port))
                except OSError:
                    continue
            _HANDED_OUT.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])
