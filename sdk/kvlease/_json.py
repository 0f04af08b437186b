"""JSON parsing of responses on the SDK's hot path: orjson (several times faster on the small SSE
events a streamed reply is made of), falling back to the standard library for what orjson refuses
(``NaN``, ``Infinity``), so both accept the same documents.

Read-only use: orjson reads integers beyond 64 bits as floats, so request bodies, which the SDK may
write back, are parsed with the standard library."""

from __future__ import annotations

import json
from typing import Any

import orjson

__all__ = ["loads"]


def loads(data: bytes | str) -> Any:
    """Parse ``data``; :class:`ValueError` when it is not JSON."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)
