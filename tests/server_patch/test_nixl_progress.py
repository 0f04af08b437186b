"""``kvlease_vllm._progress``: NIXL's progress thread polls instead of spinning.

NIXL stands in here as a module of the same shape as its ``_api`` (``nixl_agent.__init__`` builds a
``nixlBind.nixlAgentConfig``, sets ``pthrDelay = 0`` and calls ``nixlBind.nixlAgent``); the real
NIXL is exercised by ``tests/integration/test_nixl_progress.py``.
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from kvlease_vllm import _progress


def fake_api() -> ModuleType:
    mod = ModuleType("fake_nixl_api")
    made: list[tuple[str, Any]] = []

    class Config(SimpleNamespace):
        pass

    bind = SimpleNamespace(
        nixlAgentConfig=Config,
        nixlAgent=lambda name, cfg: made.append((name, cfg)) or (name, cfg.pthrDelay),
        DRAM_SEG=1,
    )

    class nixl_agent:
        def __init__(self, name: str, prog: bool = True) -> None:
            cfg = mod.nixlBind.nixlAgentConfig()
            cfg.useProgThread = prog
            cfg.pthrDelay = 0
            self.agent = mod.nixlBind.nixlAgent(name, cfg)

    mod.nixlBind = bind  # type: ignore[attr-defined]
    mod.nixl_agent = nixl_agent  # type: ignore[attr-defined]
    mod.made = made  # type: ignore[attr-defined]
    return mod


def test_agents_created_after_install_poll_with_the_delay() -> None:
    api = fake_api()
    before = api.nixl_agent("a").agent  # type: ignore[attr-defined]
    assert before == ("a", 0)
    assert _progress.install(1000, api) is True
    assert api.nixl_agent("b").agent == ("b", 1000)  # type: ignore[attr-defined]
    assert _progress.installed_delay_us(api) == 1000
    assert api.nixlBind.DRAM_SEG == 1  # everything else is the real binding's  # type: ignore[attr-defined]


def test_install_again_updates_and_zero_restores_the_spin() -> None:
    api = fake_api()
    real = api.nixlBind  # type: ignore[attr-defined]
    assert _progress.install(1000, api) and _progress.install(50, api)
    assert api.nixl_agent("c").agent == ("c", 50)  # type: ignore[attr-defined]
    assert _progress.install(0, api) is True
    assert api.nixlBind is real  # type: ignore[attr-defined]
    assert api.nixl_agent("d").agent == ("d", 0)  # type: ignore[attr-defined]
    assert _progress.installed_delay_us(api) == 0


def test_an_agent_without_progress_thread_is_left_alone() -> None:
    api = fake_api()
    _progress.install(1000, api)
    assert api.nixl_agent("e", prog=False).agent == ("e", 0)  # type: ignore[attr-defined]


def test_an_unexpected_nixl_gets_upstream_behaviour() -> None:
    api = fake_api()
    del api.nixlBind  # type: ignore[attr-defined]
    assert _progress.install(1000, api) is False

    api = fake_api()

    class Other:  # an agent whose __init__ no longer sets pthrDelay
        def __init__(self, name: str) -> None:
            self.name = name

    api.nixl_agent = Other  # type: ignore[attr-defined]
    assert _progress.install(1000, api) is False
    assert _progress.installed_delay_us(api) == 0


def test_negative_delay_is_refused() -> None:
    with pytest.raises(ValueError, match="delay_us"):
        _progress.install(-1, fake_api())


def test_the_config_key_defaults_to_polling_and_is_validated() -> None:
    from kvlease_vllm._config import ConfigError, KVLeaseConfig, parse_kvlease_config

    assert KVLeaseConfig().nixl_progress_delay_us == 1000
    assert parse_kvlease_config({"nixl_progress_delay_us": 0}).nixl_progress_delay_us == 0
    for bad in (-1, 1.5, True, "1000", 10**7):
        with pytest.raises(ConfigError, match=r"kvlease\.nixl_progress_delay_us"):
            parse_kvlease_config({"nixl_progress_delay_us": bad})


def test_configure_logs_when_it_cannot_apply(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_progress, "_api_module", lambda: None)  # no NIXL here
    with caplog.at_level("WARNING"):
        assert _progress.configure(1000) is False
    assert "nixl_progress_delay_us=1000 not applied" in caplog.text
    assert _progress.configure(0) is False  # nothing asked, nothing said
