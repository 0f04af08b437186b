"""The attackers of ``hostile_load.py``: each runs in a process of its own (``hostile_load.py
--attack NAME HOST PORT SECONDS``), from its own loopback address, until its time is up, and prints
its counts as one JSON line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import secrets
import signal
import socket
import time
from collections import Counter

import aiohttp
import orjson

from kvlease.protocol import (
    CHAT_COMPLETIONS_PATH,
    RENEW_MAX_IDS,
    RENEW_PATH,
)

ATTACKS = ("renew_flood", "renew_rotating_tokens", "anon_renew", "slow_clients", "stalled_streams", "fuzz")
#: Tokens of a stalled reader's stream (~3 MB of SSE at full length).
STALL_TOKENS = 20_000
_ADDR = {
    "renew_flood": ["127.0.0.2"],
    "renew_rotating_tokens": ["127.0.0.10"],
    "anon_renew": ["127.0.0.3"],
    "slow_clients": ["127.0.0.4", "127.0.0.5", "127.0.0.6", "127.0.0.7"],
    "stalled_streams": ["127.0.0.8"],
    "fuzz": ["127.0.0.9"],
}


# ---- attackers (``--attack NAME``: a process of their own) ----------------------------------------


class _Stop:
    def __init__(self, seconds: float) -> None:
        self.ev = asyncio.Event()
        asyncio.get_running_loop().call_later(seconds, self.ev.set)
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, self.ev.set)

    @property
    def set(self) -> bool:
        return self.ev.is_set()

    async def sleep(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.ev.wait(), seconds)


def _ready() -> None:
    print(json.dumps({"ready": True}), flush=True)


def _random_ids(n: int) -> list[str]:
    return [secrets.token_hex(8) for _ in range(n)]


async def _renewer(
    url: str, addr: str, token: str | None, n_ids: int, period: float, stop: _Stop, c: Counter[str]
) -> None:
    headers = {"Content-Type": "application/json"}
    if token and token != "rotate":
        headers["Authorization"] = token
    bodies = [orjson.dumps({"conversation_ids": _random_ids(n_ids)}) for _ in range(4)]
    connector = aiohttp.TCPConnector(local_addr=(addr, 0), limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as s:
        i = 0
        while not stop.set:
            t0 = time.monotonic()
            if token == "rotate":  # a made-up bearer token each request: a new tenant, a full budget
                headers["Authorization"] = f"Bearer {secrets.token_hex(8)}"
            try:
                async with s.post(url + RENEW_PATH, data=bodies[i % len(bodies)], headers=headers) as r:
                    await r.read()
                    c[f"http {r.status}"] += 1
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                c[type(e).__name__] += 1
            c["ms_total"] += int(1000 * (time.monotonic() - t0))
            i += 1
            if period:
                await stop.sleep(max(0.0, period - (time.monotonic() - t0)))


async def _attack_renew_flood(host: str, port: int, stop: _Stop, c: Counter[str]) -> None:
    url = f"http://{host}:{port}"
    _ready()
    await asyncio.gather(
        *(
            _renewer(url, _ADDR["renew_flood"][0], f"Bearer attacker-{i}", RENEW_MAX_IDS, 0.0, stop, c)
            for i in range(2)
        )
    )


async def _attack_renew_rotating_tokens(host: str, port: int, stop: _Stop, c: Counter[str]) -> None:
    url = f"http://{host}:{port}"
    addr = _ADDR["renew_rotating_tokens"][0]
    _ready()
    await asyncio.gather(*(_renewer(url, addr, "rotate", RENEW_MAX_IDS, 0.0, stop, c) for _ in range(2)))


async def _attack_anon_renew(host: str, port: int, stop: _Stop, c: Counter[str]) -> None:
    _ready()
    await _renewer(f"http://{host}:{port}", _ADDR["anon_renew"][0], None, 101, 1.0, stop, c)


async def _open(host: str, port: int, addr: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(asyncio.open_connection(host, port, local_addr=(addr, 0)), 10)


def _closed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    return reader.at_eof() or writer.is_closing()


async def _slowloris(
    host: str, port: int, addr: str, stop: _Stop, c: Counter[str], opened: list[int]
) -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000
    first = True
    while not stop.set:
        try:
            reader, writer = await _open(host, port, addr)
        except (OSError, asyncio.TimeoutError) as e:
            c[f"connect {type(e).__name__}"] += 1
            await stop.sleep(1.0)
            continue
        c["connections"] += 1
        if first:
            opened[0] += 1
            first = False
        t0 = time.monotonic()
        try:
            for i in range(len(head)):
                if stop.set:
                    break
                writer.write(head[i : i + 1])
                await writer.drain()
                await stop.sleep(1.0)
                if _closed(reader, writer):
                    c["closed_by_router"] += 1
                    c["held_s_total"] += int(time.monotonic() - t0)
                    break
        except (OSError, asyncio.TimeoutError):
            c["closed_by_router"] += 1
            c["held_s_total"] += int(time.monotonic() - t0)
        finally:
            writer.close()


async def _body_staller(
    host: str, port: int, addr: str, stop: _Stop, c: Counter[str], opened: list[int]
) -> None:
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer staller\r\nContent-Length: 100000\r\n\r\n{"
    )
    first = True
    while not stop.set:
        try:
            reader, writer = await _open(host, port, addr)
        except (OSError, asyncio.TimeoutError) as e:
            c[f"connect {type(e).__name__}"] += 1
            await stop.sleep(1.0)
            continue
        c["body_connections"] += 1
        if first:
            opened[0] += 1
            first = False
        try:
            writer.write(head)
            await writer.drain()
            while not stop.set:
                try:
                    line = await asyncio.wait_for(reader.readline(), 1.0)
                except asyncio.TimeoutError:
                    continue
                c[f"body answer {line[9:12].decode(errors='replace') or 'closed'}"] += 1
                break
        except OSError:
            c["body closed_by_router"] += 1
        finally:
            writer.close()


async def _attack_slow_clients(host: str, port: int, stop: _Stop, c: Counter[str]) -> None:
    opened = [0]
    addrs = _ADDR["slow_clients"]
    tasks = [
        asyncio.create_task(_slowloris(host, port, addrs[i % 3], stop, c, opened)) for i in range(300)
    ] + [asyncio.create_task(_body_staller(host, port, addrs[3], stop, c, opened)) for _ in range(50)]
    deadline = time.monotonic() + 15
    while opened[0] < 350 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    c["opened_at_ready"] = opened[0]
    _ready()
    await asyncio.gather(*tasks)


class _StalledReader(asyncio.Protocol):
    def __init__(self, request: bytes, c: Counter[str], started: asyncio.Event) -> None:
        self.request, self.c, self.started = request, c, started
        self.transport: asyncio.Transport | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.transport.write(self.request)  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        if not self.started.is_set():
            self.c[f"stream answer {data[9:12].decode(errors='replace')}"] += 1
            self.started.set()
            assert self.transport is not None
            self.transport.pause_reading()  # never read the rest

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.started.set()


async def _stalled_stream(
    host: str, port: int, i: int, stop: _Stop, c: Counter[str], started: list[int]
) -> None:
    loop = asyncio.get_running_loop()
    body = orjson.dumps(
        {
            "model": "fake-model",
            "messages": [{"role": "user", "content": f"stall {i} " * 20}],
            "stream": True,
            "max_tokens": STALL_TOKENS,
        }
    )
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer staller\r\nX-Conversation-Id: stall-%d\r\nContent-Length: %d\r\n\r\n%s"
        % (i, len(body), body)
    )
    while not stop.set:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.bind((_ADDR["stalled_streams"][0], 0))
        sock.setblocking(False)
        ev = asyncio.Event()
        try:
            await asyncio.wait_for(loop.sock_connect(sock, (host, port)), 10)
            transport, proto = await loop.create_connection(
                lambda: _StalledReader(request, c, ev),  # noqa: B023
                sock=sock,
            )
        except (OSError, asyncio.TimeoutError) as e:
            sock.close()
            c[f"connect {type(e).__name__}"] += 1
            await stop.sleep(1.0)
            continue
        started[0] += 1  # the request is out: the stream starts when the router gets to it
        while not stop.set and not proto.lost:
            await stop.sleep(0.5)
        if proto.lost:
            c["closed_by_router"] += 1
        transport.close()


async def _attack_stalled_streams(host: str, port: int, stop: _Stop, c: Counter[str]) -> None:
    started = [0]
    tasks = [asyncio.create_task(_stalled_stream(host, port, i, stop, c, started)) for i in range(50)]
    deadline = time.monotonic() + 15
    while started[0] < 50 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    c["requests_sent_at_ready"] = started[0]
    _ready()
    await asyncio.gather(*tasks)


_GOOD = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
_FUZZ_JSON: list[tuple[str, bytes, dict[str, str]]] = [
    (CHAT_COMPLETIONS_PATH, b"{not json", {}),
    (CHAT_COMPLETIONS_PATH, b'{"messages": [', {}),
    (CHAT_COMPLETIONS_PATH, b"[1, 2]", {}),
    (CHAT_COMPLETIONS_PATH, b"", {}),
    (CHAT_COMPLETIONS_PATH, b'{"messages": "\xff\xfe"}', {}),
    (CHAT_COMPLETIONS_PATH, orjson.dumps({**_GOOD, "stream": "yes"}), {}),
    (CHAT_COMPLETIONS_PATH, orjson.dumps({"model": "m", "messages": "hi"}), {"X-Conversation-Id": "x"}),
    (CHAT_COMPLETIONS_PATH, orjson.dumps(_GOOD), {"X-Conversation-Id": "a" * 129}),
    (CHAT_COMPLETIONS_PATH, orjson.dumps({**_GOOD, "conversation_id": {"$ne": 1}}), {}),
    (CHAT_COMPLETIONS_PATH, orjson.dumps({**_GOOD, "max_tokens": "lots"}), {}),
    (CHAT_COMPLETIONS_PATH, orjson.dumps({**_GOOD, "kv_transfer_params": "junk"}), {}),
    (CHAT_COMPLETIONS_PATH, orjson.dumps(_GOOD), {"Content-Encoding": "gzip"}),
    (RENEW_PATH, b"nope", {}),
    (RENEW_PATH, orjson.dumps({"conversation_ids": "abc"}), {}),
    (RENEW_PATH, orjson.dumps({"conversation_ids": ["ok", "not ok"]}), {}),
    ("/v1/kvlease/conversations/%2F..%2F", b"", {}),
    ("/v1/completions", orjson.dumps({"model": "m", "prompt": [1, "x", None]}), {}),
]
_FUZZ_RAW = [
    b"GARBAGE\r\n\r\n",
    b"POST / HTTP/9.9\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 5\r\n\r\nabc",
    b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\n\r\n",
    b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 500 + b"\r\n",
]


def _mutate(rng: random.Random) -> bytes:
    raw = bytearray(orjson.dumps({**_GOOD, "stream": rng.random() < 0.5, "max_tokens": 4}))
    for _ in range(rng.randint(1, 6)):
        raw[rng.randrange(len(raw))] = rng.randrange(256)
    return bytes(raw)


async def _attack_fuzz(host: str, port: int, stop: _Stop, c: Counter[str]) -> None:
    url = f"http://{host}:{port}"
    addr = _ADDR["fuzz"][0]
    connector = aiohttp.TCPConnector(local_addr=(addr, 0), limit=0)
    timeout = aiohttp.ClientTimeout(total=15)
    _ready()

    async def raw_one(data: bytes) -> None:
        try:
            reader, writer = await _open(host, port, addr)
        except (OSError, asyncio.TimeoutError) as e:
            c[f"connect {type(e).__name__}"] += 1
            return
        try:
            writer.write(data)
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), 15)
            code = line[9:12].decode(errors="replace") if line.startswith(b"HTTP/") else "closed"
            c[f"raw {code}"] += 1
            if code.startswith("5"):
                c["5xx"] += 1
        except (OSError, asyncio.TimeoutError) as e:
            c[f"raw {type(e).__name__}"] += 1
        finally:
            writer.close()

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s:

        async def worker(k: int) -> None:
            rng = random.Random(k)
            while not stop.set:
                pick = rng.random()
                c["requests"] += 1
                if pick < 0.2:
                    await raw_one(
                        rng.choice(_FUZZ_RAW) if rng.random() < 0.6 else rng.randbytes(rng.randint(1, 2000))
                    )
                    continue
                if pick < 0.6:
                    path, data, headers = rng.choice(_FUZZ_JSON)
                else:
                    path, data, headers = CHAT_COMPLETIONS_PATH, _mutate(rng), {}
                try:
                    async with s.post(
                        url + path, data=data, headers={"Content-Type": "application/json", **headers}
                    ) as r:
                        await r.read()
                        c[f"http {r.status}"] += 1
                        if r.status >= 500:
                            c["5xx"] += 1
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    c[type(e).__name__] += 1

        await asyncio.gather(*(worker(k) for k in range(8)))


async def _attack(name: str, host: str, port: int, seconds: float) -> dict[str, int]:
    stop = _Stop(seconds)
    c: Counter[str] = Counter()
    fn = {
        "renew_flood": _attack_renew_flood,
        "renew_rotating_tokens": _attack_renew_rotating_tokens,
        "anon_renew": _attack_anon_renew,
        "slow_clients": _attack_slow_clients,
        "stalled_streams": _attack_stalled_streams,
        "fuzz": _attack_fuzz,
    }[name]
    task = asyncio.create_task(fn(host, port, stop, c))
    await stop.ev.wait()
    try:
        await asyncio.wait_for(task, 5)  # loops end within a second or so of the stop
    except asyncio.TimeoutError:
        c["attack tasks cancelled at the stop"] += 1
    return dict(c)
