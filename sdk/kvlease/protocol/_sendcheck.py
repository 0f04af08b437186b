"""P -> D: the post-read check of an ordinary P->D transfer (:attr:`KV.SEND_CHECK` in P's response
params): where D asks, after its READ of P's blocks, whether P held them for the whole read."""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from kvlease.protocol._common import ProtocolError
from kvlease.protocol._handle import KV, LEASE_HANDLE_MAC, _check_control_url

#: Domain of :func:`send_check_mac` (a send-check MAC can never pass as a handle MAC, or back).
_SEND_CHECK_DOMAIN: Final = b"kvlease-send-check-v1"


def send_check_mac(secret: str, engine_id: str, request_id: str, control: str) -> str:
    """HMAC-SHA256 (hex), under the shared control secret, binding P's control URL to one P->D send
    (P's engine id and request id: the handle's ``remote_engine_id`` and ``remote_request_id``)."""
    msg = b"\x00".join((_SEND_CHECK_DOMAIN, engine_id.encode(), request_id.encode(), control.encode()))
    return hmac.new(secret.encode(), msg, "sha256").hexdigest()


@dataclass(frozen=True)
class SendCheck:
    """:attr:`KV.SEND_CHECK` in P's response params: where D asks, after its READ of P's blocks,
    whether P held them for the whole read (``POST /sendcheck`` on P's control endpoint).

    JSON: ``{"control": "http://host:port", "mac": "<64 hex>"}``. ``mac``: :func:`send_check_mac`
    over P's engine id, P's request id and ``control``. D contacts ``control`` only when the MAC is
    right: the URL travels through the router, and D sends its control secret to it.
    """

    control: str
    mac: str

    def to_json(self) -> dict[str, Any]:
        return {"control": self.control, LEASE_HANDLE_MAC: self.mac}

    @classmethod
    def from_json(cls, data: object) -> SendCheck:
        if not isinstance(data, Mapping):
            raise ProtocolError(f"{KV.SEND_CHECK} must be an object")
        control, mac = data.get("control"), data.get(LEASE_HANDLE_MAC)
        if not isinstance(control, str) or not control or len(control) > 2048:
            raise ProtocolError(f"{KV.SEND_CHECK}.control must be a URL")
        _check_control_url(control)
        if not isinstance(mac, str) or len(mac) != 64:
            raise ProtocolError(f"{KV.SEND_CHECK}.mac must be 64 hex characters")
        return cls(control, mac)

    def mac_ok(self, secret: str, engine_id: str, request_id: str) -> bool:
        """The MAC is right for this send (constant-time compare)."""
        return hmac.compare_digest(self.mac, send_check_mac(secret, engine_id, request_id, self.control))
