"""The post-read check of P->D sends (issue 29, finding 11): P's send table, its ``/sendcheck`` route
on a real control endpoint (127.0.0.1), the targets D's scheduler names, and D's worker holding a
finished read back until P answers."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from kvlease.protocol import KV, ControlCallError, ControlInfo, ProtocolError, Role
from kvlease.protocol._control import SendCheckResponse, read_send_check_answer, send_check_call
from kvlease.protocol._control_client import send
from kvlease.protocol._sendcheck import SendCheck, send_check_mac
from kvlease_vllm._control import ControlServer, LeaseDesk
from kvlease_vllm._metrics import ConnectorMetrics
from kvlease_vllm._retention import RetentionTable
from kvlease_vllm._sendcheck import TARGETS_ATTR, ReadChecks, ReadTarget, SendDesk, SendTable, read_targets

SECRET = "s3cret"
INFO = ControlInfo(Role.PREFILL, "engine-p", "0.32.0", "0.1.0", True, 20.0, 64, 16, "tiny")
ENGINE = "engine-p"


# ------------------------------------------------------------------------------ P's table


@pytest.mark.parametrize(
    ("ended_at", "intact"),
    [
        (None, True),  # still held: the read finished before D asked
        (5.0, True),  # D's notice freed it before the expiry
        (9.999, True),
        (10.0, False),  # the expiry sweep: at the expiry
        (12.0, False),  # or after it (a late notice, or the sweep)
    ],
)
def test_a_send_is_intact_while_held_or_when_it_ended_before_its_expiry(
    ended_at: float | None, intact: bool
) -> None:
    t = SendTable()
    t.start("r", 10.0, now=0.0)
    if ended_at is not None:
        assert t.end("r", ended_at) is (ended_at < 10.0)
    assert t.intact("r") is intact


def test_unknown_evicted_and_aged_sends_are_not_intact() -> None:
    t = SendTable(max_sends=2, keep_ended_s=60.0)
    assert not t.intact("never")
    assert t.end("never", 1.0) is None
    t.start("a", 100.0, now=0.0)
    t.start("b", 100.0, now=0.0)
    t.start("c", 100.0, now=0.0)  # over the bound: the oldest goes
    assert not t.intact("a") and t.intact("b") and t.intact("c")
    t.end("b", 1.0)
    assert t.end("b", 200.0) is None  # a second end changes nothing
    assert t.intact("b")
    t.start("d", 500.0, now=62.0)  # "b" ended 61 s ago: aged out
    assert not t.intact("b") and t.intact("c") and len(t) == 2


def test_issue_adds_a_check_with_a_good_mac_only_when_p_can_answer() -> None:
    out = {KV.DO_REMOTE_PREFILL: True, KV.REMOTE_ENGINE_ID: ENGINE}
    desk = SendDesk(SECRET)
    assert desk.issue("r", 10.0, out) is out  # no control URL yet
    desk.control_url = "http://127.0.0.1:9"
    assert desk.issue("r", None, out) is out  # upstream set no expiry
    assert SendDesk(None).issue("r", 10.0, out) is out  # no secret: nothing D could trust
    got = desk.issue("r", 10.0, out)
    check = SendCheck.from_json(got[KV.SEND_CHECK])
    assert check.control == "http://127.0.0.1:9"
    assert check.mac_ok(SECRET, ENGINE, "r")
    assert not check.mac_ok(SECRET, ENGINE, "other") and not check.mac_ok("x", ENGINE, "r")
    assert {k: v for k, v in got.items() if k != KV.SEND_CHECK} == out and KV.SEND_CHECK not in out


def test_a_send_check_is_parsed_strictly() -> None:
    for bad in (None, [], {"control": "ftp://x", "mac": "0" * 64}, {"control": "http://x:1", "mac": "00"}):
        with pytest.raises(ProtocolError):
            SendCheck.from_json(bad)


# ------------------------------------------------------------------------------ P's route


@pytest.fixture
def p_node() -> Iterator[tuple[SendDesk, list[float], str]]:
    now = [0.0]
    sends = SendDesk(SECRET, clock=lambda: now[0])
    leases = LeaseDesk(RetentionTable(100, max_ttl=600.0, renew_guard=0.0), ConnectorMetrics())
    server = ControlServer(leases, lambda: INFO, secret=SECRET, sends=sends).start()
    sends.control_url = server.url("127.0.0.1")
    try:
        yield sends, now, sends.control_url
    finally:
        server.stop()


def _ask(url: str, ids: list[str], secret: str | None = SECRET) -> SendCheckResponse:
    return read_send_check_answer(*send(send_check_call(url, ids, secret=secret, timeout=5.0)))


def test_the_route_answers_per_send_and_needs_the_secret(p_node: tuple[SendDesk, list[float], str]) -> None:
    sends, now, url = p_node
    out = {KV.DO_REMOTE_PREFILL: True, KV.REMOTE_ENGINE_ID: ENGINE}
    for rid in ("held", "read", "expired"):
        sends.issue(rid, 10.0, out)
    now[0] = 3.0
    sends.ended({"read"})
    now[0] = 10.5
    sends.ended({"expired"})
    answer = _ask(url, ["held", "read", "expired", "unknown"])
    assert answer.intact == {"held": True, "read": True, "expired": False, "unknown": False}
    for secret in (None, "wrong"):
        with pytest.raises(ControlCallError) as e:
            _ask(url, ["held"], secret)
        assert e.value.status == 401


def test_a_node_without_a_secret_refuses_the_route() -> None:
    leases = LeaseDesk(RetentionTable(100, max_ttl=600.0, renew_guard=0.0), ConnectorMetrics())
    server = ControlServer(leases, lambda: INFO, secret=None, sends=SendDesk(None)).start()
    try:
        with pytest.raises(ControlCallError) as e:
            _ask(server.url("127.0.0.1"), ["r"], None)
        assert e.value.status == 403
    finally:
        server.stop()


# ------------------------------------------------------------------------------ D's scheduler


def _read(params: dict[str, Any], awaiting: bool = True) -> tuple[Any, ...]:
    """An entry of upstream's ``_reqs_need_recv``: (request, blocks, cached, awaiting)."""
    return (SimpleNamespace(kv_transfer_params=params), [[1, 2]], (0,), awaiting)


def _p_params(
    rid: str = "p-1", control: str = "http://127.0.0.1:9", mac: str | None = None
) -> dict[str, Any]:
    mac = mac or send_check_mac(SECRET, ENGINE, rid, control)
    return {
        KV.REMOTE_ENGINE_ID: ENGINE,
        KV.REMOTE_REQUEST_ID: rid,
        KV.DO_REMOTE_PREFILL: False,  # upstream clears it once the read is planned
        KV.SEND_CHECK: {"control": control, "mac": mac},
    }


def test_d_names_a_target_per_checked_read(caplog: pytest.LogCaptureFixture) -> None:
    stock = {KV.REMOTE_ENGINE_ID: "stock-p", KV.REMOTE_REQUEST_ID: "x"}
    reads = {
        "good": _read(_p_params()),
        "forged": _read(_p_params(mac="0" * 64)),
        "bad": _read({**_p_params(), KV.SEND_CHECK: {"control": 3}}),
        "local-hit": _read(_p_params(), awaiting=False),
        "p-pull": _read({**_p_params(), KV.DO_REMOTE_DECODE: True}),
        "stock": _read(stock),
        "stock-2": _read(stock),
    }
    with caplog.at_level(logging.WARNING, "vllm.kvlease.sendcheck"):
        got = read_targets(reads, SECRET)
    assert got == {
        "good": ReadTarget("http://127.0.0.1:9", "p-1"),
        "forged": ReadTarget(None, "p-1"),
        "bad": ReadTarget(None, "p-1"),
    }
    assert sum("sends no post-read check" in r.getMessage() for r in caplog.records) == 1  # once
    assert read_targets({"good": _read(_p_params())}, None) == {}  # no secret: cannot verify


# ------------------------------------------------------------------------------ D's worker


@dataclass
class Results:
    """The three sets of vLLM's ``KVConnectorTransferResults``."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


def _settle_until_reported(checks: ReadChecks, *rids: str) -> Results:
    """The results of the steps until every one of ``rids`` was reported, merged."""
    got = Results()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        r = checks.settle(Results(), None)
        got.finished_recving |= r.finished_recving
        got.failed_recving |= r.failed_recving
        if got.finished_recving.issuperset(rids):
            return got
        time.sleep(0.01)
    raise AssertionError(f"{rids} never reported")


def test_d_holds_a_read_back_until_p_confirms_it(p_node: tuple[SendDesk, list[float], str]) -> None:
    sends, now, url = p_node
    out = {KV.DO_REMOTE_PREFILL: True, KV.REMOTE_ENGINE_ID: ENGINE}
    sends.issue("p-ok", 10.0, out)
    sends.issue("p-late", 10.0, out)
    now[0] = 11.0
    sends.ended({"p-late"})  # P's expiry sweep freed it before D's read was done
    checks = ReadChecks(SECRET, 5.0)
    meta = SimpleNamespace(
        **{
            TARGETS_ATTR: {
                "d-ok": ReadTarget(url, "p-ok"),
                "d-late": ReadTarget(url, "p-late"),
                "d-forged": ReadTarget(None, "p-ok"),
                "d-failed": ReadTarget(url, "p-ok"),
            }
        }
    )
    first = checks.settle(
        Results({"s"}, {"d-ok", "d-late", "d-forged", "d-failed", "unchecked"}, {"d-failed"}), meta
    )
    # at once: what needs no answer (a read upstream failed already, an unchecked one, and one whose
    # check D could not trust: failed, P is never asked); the others once P answered
    assert first.finished_recving >= {"d-failed", "unchecked", "d-forged"}
    assert first.failed_recving >= {"d-failed", "d-forged"} and first.finished_sending == {"s"}
    later = _settle_until_reported(checks, *({"d-ok", "d-late"} - first.finished_recving))
    assert (first.finished_recving | later.finished_recving) - {"unchecked", "d-failed", "d-forged"} == {
        "d-ok",
        "d-late",
    }
    assert (first.failed_recving | later.failed_recving) == {"d-failed", "d-forged", "d-late"}
    assert checks.refused == 2
    assert checks.settle(Results(), None) == Results()  # each read reported once
    checks.shutdown()


def test_an_unreachable_p_fails_the_load() -> None:
    checks = ReadChecks(SECRET, 0.5)
    meta = SimpleNamespace(**{TARGETS_ATTR: {"d": ReadTarget("http://127.0.0.1:9", "p")}})
    first = checks.settle(Results(finished_recving={"d"}), meta)  # refused at once: may come back now
    got = first if "d" in first.finished_recving else _settle_until_reported(checks, "d")
    assert got.failed_recving == {"d"}
    checks.shutdown()


def test_a_read_stays_held_back_while_p_has_not_answered() -> None:
    gate = threading.Event()

    def ask(control: str, p_rids: list[str]) -> dict[str, bool]:  # P's answer, late
        return dict.fromkeys(p_rids, gate.wait(10))

    checks = ReadChecks(SECRET, 5.0, ask=ask)
    meta = SimpleNamespace(**{TARGETS_ATTR: {"d": ReadTarget("http://127.0.0.1:9", "p")}})
    for _ in range(3):  # steps go by: the request stays waiting for its KV
        assert (
            checks.settle(Results(finished_recving={"d"} if _ == 0 else set()), meta).finished_recving
            == set()
        )
    gate.set()
    got = _settle_until_reported(checks, "d")
    assert got.finished_recving == {"d"} and got.failed_recving == set()
    checks.shutdown()


def test_one_call_per_p_for_the_reads_of_a_step() -> None:
    calls: list[tuple[str, list[str]]] = []

    def ask(control: str, p_rids: list[str]) -> dict[str, bool]:
        calls.append((control, sorted(p_rids)))
        return {"p1": True}  # P does not answer for p2: not intact

    checks = ReadChecks(SECRET, 5.0, ask=ask)
    targets = {"d1": ReadTarget("http://a:1", "p1"), "d2": ReadTarget("http://a:1", "p2")}
    targets["d3"] = ReadTarget("http://b:1", "p3")
    first = checks.settle(
        Results(finished_recving={"d1", "d2", "d3"}), SimpleNamespace(**{TARGETS_ATTR: targets})
    )
    got = _settle_until_reported(checks, *({"d1", "d2", "d3"} - first.finished_recving))
    assert sorted(calls) == [("http://a:1", ["p1", "p2"]), ("http://b:1", ["p3"])]
    assert (first.failed_recving | got.failed_recving) == {"d2", "d3"}
    checks.shutdown()
