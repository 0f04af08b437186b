"""Fixtures of the SDK tests: a real fake OpenAI-compatible router on 127.0.0.1 and wrapped clients."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from _sdk_support import FAST_RETRY
from fakes.openai_server import FakeOpenAIServer
from openai import AsyncOpenAI, OpenAI

import kvlease


@pytest.fixture
def fake_server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as srv:
        yield srv


@pytest.fixture
def openai_client(fake_server: FakeOpenAIServer) -> Iterator[OpenAI]:
    client = OpenAI(base_url=fake_server.base_url, api_key="sk-test", max_retries=0)
    yield client
    client.close()


@pytest.fixture
def kc(openai_client: OpenAI) -> Iterator[kvlease.KVLeaseClient]:
    with kvlease.wrap(openai_client, heartbeat=False, retry=FAST_RETRY) as client:
        yield client


@pytest.fixture
async def akc(fake_server: FakeOpenAIServer) -> AsyncIterator[kvlease.AsyncKVLeaseClient]:
    raw = AsyncOpenAI(base_url=fake_server.base_url, api_key="sk-test", max_retries=0)
    async with kvlease.wrap(raw, heartbeat=False, retry=FAST_RETRY) as client:
        yield client
    await raw.close()
