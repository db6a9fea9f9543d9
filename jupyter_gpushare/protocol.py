"""The agent channel's wire format, shared by the server and the in-kernel agent.

JSON objects, one per line (UTF-8). Three shapes:

- request:      ``{"id": 7, "op": "alloc", ...args}``   (either side may send one)
- reply:        ``{"re": 7, "ok": true, ...result}`` or ``{"re": 7, "ok": false, "error": "why"}``
- notification: ``{"op": "busy_end", ...args}``          (no id, no reply)

The first line an agent sends is a ``hello`` request: ``{"kernel_id", "pid", "frameworks"}``.
"""

from __future__ import annotations

import json
from typing import Any

MAX_LINE = 1 << 20  # a line longer than this is a protocol error (1 MiB)
SOCKET_ENV = "JUPYTER_GPUSHARE_SOCKET"
KERNEL_ID_ENV = "JUPYTER_GPUSHARE_KERNEL_ID"
SIMULATED_GPUS_ENV = "JUPYTER_GPUSHARE_SIMULATED_GPUS"


class ProtocolError(ValueError):
    """A line that is not a JSON object of one of the three shapes."""


def encode(message: dict[str, Any]) -> bytes:
    # default=str: message headers carry datetimes (a cell's parent header, for progress lines)
    return (json.dumps(message, separators=(",", ":"), default=str) + "\n").encode()


def decode(line: bytes) -> dict[str, Any]:
    if len(line) > MAX_LINE:
        raise ProtocolError("line too long")
    try:
        message = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"not JSON: {e}") from None
    if not isinstance(message, dict) or not ("op" in message or "re" in message):
        raise ProtocolError("not a request, reply or notification")
    return message


class RemoteError(RuntimeError):
    """The other side answered a request with ``ok: false``; ``kind`` names its error class."""

    def __init__(self, message: str, kind: str = ""):
        super().__init__(message)
        self.kind = kind
