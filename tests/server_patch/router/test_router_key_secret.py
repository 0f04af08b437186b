"""The key secret is configuration, never Redis (issue 15, item 2): with ``--state redis://`` the
router needs it given, keeps only a verifier in Redis, deletes a clear-text secret an older router
left there, and refuses to start beside replicas that use another secret."""

from __future__ import annotations

import pytest

from kvlease_router import ConfigError, NodeSpec, RouterSettings, redis_client_from_url
from kvlease_router.cli import _REDIS_SECRET_KEY, _REDIS_VERIFIER_KEY, _check_key_secret, serve
from kvlease_stack.testing import RedisServer


async def test_redis_state_without_a_configured_key_secret_refuses_to_start() -> None:
    settings = RouterSettings(
        prefill=(NodeSpec("http://127.0.0.1:1"),),
        decode=(NodeSpec("http://127.0.0.1:2"),),
        state="redis://127.0.0.1:1/0",
    )
    with pytest.raises(ConfigError, match="key-secret"):
        await serve(settings, key_secret_given=False)


@pytest.mark.redis
async def test_only_a_verifier_sits_in_redis_and_replicas_must_agree(redis_server: RedisServer) -> None:
    client = redis_client_from_url(redis_server.url, 1.0)
    await client.set(_REDIS_SECRET_KEY, "an-old-clear-text-secret")
    await _check_key_secret(client, "replica-secret")
    await _check_key_secret(client, "replica-secret")  # a second replica, or a restart
    assert await client.get(_REDIS_SECRET_KEY) is None  # the legacy clear-text secret is gone
    values = [await client.get(k) for k in await client.keys("*")]
    assert values and all(b"replica-secret" not in (v or b"") for v in values)
    assert await client.get(_REDIS_VERIFIER_KEY) is not None
    with pytest.raises(ConfigError, match="differs"):
        await _check_key_secret(client, "another-secret")
    await client.aclose()
