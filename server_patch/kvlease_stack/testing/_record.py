"""One request as a fake server received it (stdlib only: the SDK-only test venv imports it)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Recorded"]


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]  # keys lower-cased
    body: Any  # parsed JSON, or None
    raw: bytes = b""
    ts: float = field(default_factory=time.time)

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())
