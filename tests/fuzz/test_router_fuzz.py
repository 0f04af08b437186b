"""Fuzz the router's HTTP API: hypothesis-driven requests over every route, 0 responses with a 5xx.

The router has no OpenAPI schema (it is an aiohttp app proxying OpenAI's API), so requests are
generated directly: known and random paths, every method, header sets with odd identities, bodies
of random JSON (free-form and valid requests with one field replaced) and random bytes. The router
and the fake vLLM P/D pair run on a background event loop over real HTTP on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import gzip
import random
import threading
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import aiohttp
import httpx
import orjson
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from security._cluster import Cluster, router_errors, running_cluster

from kvlease.protocol import (
    CHAT_COMPLETIONS_PATH,
    COMPLETIONS_PATH,
    CONVERSATIONS_PATH,
    DEFAULT_TENANT_HEADER,
    HEADER_CONVERSATION_ID,
    HEADER_REUSE,
    HEADER_SESSION_ID,
    HEALTH_PATH,
    KV_TRANSFER_PARAMS,
    METRICS_PATH,
    RENEW_PATH,
    STATUS_PATH,
)

CASES = 1000

# ---- the router on a background loop -------------------------------------------------------------


class _Background:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.cluster: Cluster | None = None
        self.error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException as e:  # reported by the fixture
            self.error = e
            self.ready.set()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        # no health probes during the run: a probe that times out on a loaded machine would mark a
        # node down and turn requests into (legitimate) 502s, which is not what this test is about
        async with running_cluster(max_body_bytes=256 * 1024, health_interval=3600.0) as c:
            self.cluster = c
            self.ready.set()
            await self._stop.wait()

    def stop(self) -> None:
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(30)


@pytest.fixture(scope="module")
def router_url() -> Iterator[str]:
    bg = _Background()
    bg.thread.start()
    assert bg.ready.wait(60), "the router did not start"
    if bg.error is not None:
        raise bg.error
    assert bg.cluster is not None
    try:
        yield bg.cluster.url
    finally:
        bg.stop()


@pytest.fixture(scope="module")
def http(router_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=router_url, timeout=60.0) as c:
        yield c


# ---- strategies ----------------------------------------------------------------------------------

KNOWN = [
    CHAT_COMPLETIONS_PATH,
    COMPLETIONS_PATH,
    RENEW_PATH,
    STATUS_PATH,
    HEALTH_PATH,
    METRICS_PATH,
    "/v1/models",
]
path_chars = st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="?#/%")
segment = st.text(path_chars, min_size=1, max_size=40)  # an empty one would make "//", not a path
paths = st.one_of(
    st.sampled_from([CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH, RENEW_PATH]),  # the routes that take bodies
    st.sampled_from(KNOWN),
    segment.map(lambda s: f"{CONVERSATIONS_PATH}/{s}"),
    st.lists(segment, min_size=1, max_size=4).map(lambda parts: "/" + "/".join(parts)),
    st.sampled_from(KNOWN).map(lambda p: p + "/"),
)
methods = st.one_of(
    st.just("POST"), st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"])
)

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_values = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=12,
)
FIELDS = [
    "model",
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "tools",
    "conversation_id",
    "prompt_cache_key",
    KV_TRANSFER_PARAMS,
    "vllm_xargs",
    "conversation_ids",
]
valid_chat = st.fixed_dictionaries(
    {"model": st.just("fake-model"), "messages": st.just([{"role": "user", "content": "fuzz"}])},
    optional={"stream": st.booleans(), "max_tokens": st.integers(1, 8)},
)
mutated = st.tuples(valid_chat, st.sampled_from(FIELDS), json_values).map(lambda t: {**t[0], t[1]: t[2]})
bodies = st.one_of(
    st.none(),
    mutated.map(orjson.dumps),
    json_values.map(orjson.dumps),
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6).map(orjson.dumps),
    st.binary(max_size=300),
)
# h11 refuses to send values with outer whitespace; the rest of printable ASCII goes out as is
header_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=200).map(str.strip)
header_sets = st.dictionaries(
    st.sampled_from(
        [
            HEADER_CONVERSATION_ID,
            HEADER_SESSION_ID,
            HEADER_REUSE,
            DEFAULT_TENANT_HEADER,
            "Authorization",
            "Content-Type",
            "Accept",
            "X-Anything",
        ]
    ),
    st.one_of(header_text, st.sampled_from(["conv-1", "off", "Bearer t", "application/json"])),
    max_size=4,
)


def _tame(raw: bytes | None) -> bytes | None:
    """Cap generation lengths: the fake decode node would really generate 2**62 tokens (vLLM itself
    refuses lengths beyond the model's context with a 400)."""
    if not raw:
        return raw
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw
    if isinstance(obj, dict):
        for k in ("max_tokens", "max_completion_tokens"):
            v = obj.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v > 64:
                obj[k] = 64
        return orjson.dumps(obj)
    return raw


SEEN: dict[str, int] = {"cases": 0, "2xx": 0, "4xx": 0}


@settings(
    max_examples=CASES,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
    ],
    database=None,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],  # "explain" re-runs hundreds of requests
)
@given(method=methods, path=paths, headers=header_sets, body=bodies)
def test_no_request_gets_a_5xx(
    http: httpx.Client, method: str, path: str, headers: dict[str, str], body: bytes | None
) -> None:
    content = _tame(body) if method not in ("GET", "HEAD", "OPTIONS") else None
    r = http.request(method, path, content=content, headers=headers)
    SEEN["cases"] += 1
    SEEN["2xx" if r.status_code < 400 else "4xx"] += 1
    assert r.status_code < 500, (
        method,
        path,
        headers,
        content and content[:300],
        r.status_code,
        r.text[:300],
    )
    assert KV_TRANSFER_PARAMS.encode() not in r.content or path == METRICS_PATH
    if r.status_code >= 400 and method != "HEAD":
        assert r.content.strip(), (method, path, r.status_code)  # a message, never an empty error


def test_router_still_healthy_after_fuzzing(http: httpx.Client) -> None:
    r = http.get(HEALTH_PATH)
    assert r.status_code == 200
    r = http.post(
        CHAT_COMPLETIONS_PATH,
        json={"model": "m", "messages": [{"role": "user", "content": "after"}]},
        headers={HEADER_CONVERSATION_ID: "after-fuzz"},
    )
    assert r.status_code == 200
    metrics = http.get(METRICS_PATH).text
    in_flight = [line for line in metrics.splitlines() if line.startswith("kvlease_router_in_flight")]
    assert in_flight and float(in_flight[0].split()[-1]) == 0.0
    print(f"fuzz: {SEEN}")  # the counts of the run above when both ran (-s shows them)


# ---- 10,000 requests, encodings included: 0 5xx and 0 router exceptions (issue 15) ---------------

BULK = 10_000
ENCODINGS = [
    "gzip",
    "deflate",
    "br",
    "zstd",
    "identity",
    "x-unknown",
    "zstd-bogus",
    "x-gzip",
    "gzip, deflate",
    "",
]


def _bulk_request(rng: random.Random, i: int) -> tuple[str, str, bytes | None, dict[str, str]]:
    """One request: mostly chat turns (valid, mutated or garbage), with random content codings."""
    kind = rng.random()
    headers: dict[str, str] = {"Content-Type": "application/json"}
    if rng.random() < 0.5:
        headers[HEADER_CONVERSATION_ID if rng.random() < 0.5 else HEADER_SESSION_ID] = rng.choice(
            [f"c{i % 50}", "user@example.com", "sess 1", "x" * 300, "tenant/42", ""]
        )
    if rng.random() < 0.3:
        headers["Authorization"] = f"Bearer t{i % 7}"
    body: dict[str, object] = {"model": "fake-model", "messages": [{"role": "user", "content": f"b{i % 13}"}]}
    if kind < 0.45:
        raw: bytes | None = orjson.dumps(
            {**body, "stream": rng.random() < 0.5, "max_tokens": rng.randint(1, 6)}
        )
    elif kind < 0.7:
        field = rng.choice(FIELDS)
        value = rng.choice([None, 1, "x", [], {}, [1, "a"], {"a": None}, True, 1.5, "é" * 40])
        raw = orjson.dumps({**body, field: value, "max_tokens": 4})
    elif kind < 0.8:
        raw = rng.randbytes(rng.randint(0, 200))
    elif kind < 0.9:
        raw = orjson.dumps({**body, "max_tokens": 3})
        raw = raw[: rng.randint(0, len(raw))]
    else:
        raw = orjson.dumps({"conversation_ids": [f"c{j}" for j in range(rng.randint(0, 20))]})
    coding = rng.choice(ENCODINGS) if rng.random() < 0.3 else None  # renews too: one body reader
    if coding is not None:
        headers["Content-Encoding"] = coding
        if raw is not None and rng.random() < 0.5:  # sometimes really encoded, sometimes a lie
            raw = (
                gzip.compress(raw)
                if coding.startswith("gzip")
                else zlib.compress(raw)
                if coding == "deflate"
                else raw
            )
    if kind >= 0.9:
        return "POST", RENEW_PATH, raw, headers
    path = COMPLETIONS_PATH if rng.random() < 0.05 else CHAT_COMPLETIONS_PATH
    return "POST", path, raw, headers


def test_ten_thousand_requests_no_5xx_no_router_exception(router_url: str) -> None:
    rng = random.Random(15)
    statuses: Counter[int] = Counter()
    fives: list[tuple[Any, ...]] = []

    async def run() -> None:
        conn = aiohttp.TCPConnector(limit=16)
        async with aiohttp.ClientSession(connector=conn, auto_decompress=False) as s:
            queue = [_bulk_request(rng, i) for i in range(BULK)]

            async def worker(k: int) -> None:
                for j in range(k, BULK, 16):
                    method, path, raw, headers = queue[j]
                    try:
                        async with s.request(method, router_url + path, data=raw, headers=headers) as r:
                            await r.read()
                            statuses[r.status] += 1
                            if r.status >= 500:
                                fives.append((path, headers, raw and raw[:200], r.status))
                    except aiohttp.ClientError as e:  # the router closed on us: count, never hide
                        statuses[-1] += 1
                        fives.append((path, headers, raw and raw[:200], type(e).__name__))

            await asyncio.gather(*(worker(k) for k in range(16)))

    t0 = time.monotonic()
    with router_errors() as errors:
        asyncio.run(run())
    elapsed = time.monotonic() - t0
    print(f"fuzz 10k: {dict(statuses)} in {elapsed:.1f} s")
    assert sum(statuses.values()) == BULK
    assert not fives, fives[:5]
    assert not errors.records, [
        (r.name, r.getMessage(), r.exc_info and r.exc_info[1]) for r in errors.records[:5]
    ]
