"""The agent channel's wire format, shared by the server and the in-kernel agent.

JSON objects, one per line (UTF-8), each line at most ``MAX_LINE`` bytes with its newline.
Three shapes:

- request:      ``{"id": 7, "op": "alloc", ...args}``   (either side may send one)
- reply:        ``{"re": 7, "ok": true, ...result}`` or ``{"re": 7, "ok": false, "error": "why"}``
- notification: ``{"op": "busy_end", ...args}``          (no id, no reply)

A request may carry ``"deadline"``: epoch seconds (``time.time()``, both ends are on one
machine) after which its sender no longer waits; the receiver does not start it after that.

The first line an agent sends is a ``hello`` request: ``{"kernel_id", "pid", "frameworks"}``.

Bounded by construction: ``encode`` never produces a line over the limit (a reply that would
be too large becomes an error reply that says so), lists that can grow are capped at the
sender (``cap_list``), and a reader (``LineBuffer``) skips an overlong line without keeping it,
so one bad line never closes the channel.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

MAX_LINE = 1 << 20  # bytes per line, newline included (1 MiB)
SOCKET_ENV = "JUPYTER_GPUSHARE_SOCKET"
KERNEL_ID_ENV = "JUPYTER_GPUSHARE_KERNEL_ID"
SIMULATED_GPUS_ENV = "JUPYTER_GPUSHARE_SIMULATED_GPUS"
#: what the agent prints before a kernel's first cell about its GPU placement (no room)
PLACEMENT_NOTE_ENV = "JUPYTER_GPUSHARE_PLACEMENT_NOTE"

#: how many entries of a growing list (e.g. an offload's ``skipped``) travel, and how long each
LIST_CAP = 50
ITEM_CHARS = 300
EXPIRED = "expired: the server stopped waiting"  # a request refused for its deadline


class ProtocolError(ValueError):
    """A line that is not a JSON object of one of the three shapes."""


class MessageTooLarge(ProtocolError):
    """A request or notification that would not fit on one line (replies are replaced)."""


class RemoteError(RuntimeError):
    """The other side answered a request with ``ok: false``; ``kind`` names its error class."""

    def __init__(self, message: str, kind: str = ""):
        super().__init__(message)
        self.kind = kind


def encode(message: dict[str, Any]) -> bytes:
    """One line for ``message``; never longer than ``MAX_LINE``.

    A reply that would be too large is replaced by an error reply that gives its size, so
    the request fails cleanly; a request or notification raises ``MessageTooLarge``."""
    # default=str: message headers carry datetimes (a cell's parent header, for progress lines)
    data = (json.dumps(message, separators=(",", ":"), default=str) + "\n").encode()
    if len(data) <= MAX_LINE:
        return data
    what = f"{len(data)} bytes, over the channel's limit of {MAX_LINE} bytes per message"
    if "re" in message:
        reply_to = message["re"]
        if not isinstance(reply_to, (int, str)) or len(str(reply_to)) > 64:
            reply_to = None  # an id that is itself too large cannot be echoed
        return encode({"re": reply_to, "ok": False, "kind": "MessageTooLarge",
                       "error": f"reply too large: {what}"})
    raise MessageTooLarge(f"{message.get('op', 'message')} too large: {what}")


def decode(line: bytes) -> dict[str, Any]:
    if len(line) > MAX_LINE:
        raise ProtocolError(f"line of {len(line)} bytes is over the limit of {MAX_LINE}")
    try:
        message = json.loads(line)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ProtocolError(f"not JSON: {e}") from None
    if not isinstance(message, dict) or not ("op" in message or "re" in message):
        raise ProtocolError("not a request, reply or notification")
    return message


def deadline_passed(message: dict[str, Any], now: float) -> bool:
    """Whether a request's ``deadline`` (if any) is before ``now``; ValueError if malformed."""
    deadline = message.get("deadline")
    if deadline is None:
        return False
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or deadline != deadline:
        raise ValueError("deadline must be a number of epoch seconds")
    return now > deadline


def cap_list(items: list[Any], limit: int = LIST_CAP, item_chars: int = ITEM_CHARS) -> list[str]:
    """At most ``limit`` entries, each at most ``item_chars`` long, then "... and N more"."""
    out = [_shorten(str(item), item_chars) for item in items[:limit]]
    if len(items) > limit:
        out.append(f"... and {len(items) - limit} more")
    return out


def _shorten(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: chars - 3] + "..."


_REPLY_ID = re.compile(rb'^\s*\{\s*"re"\s*:\s*(\d{1,18})\s*[,}]')


@dataclass
class BadLine:
    """A line that was skipped: over the limit, or not a message. ``reply_to`` is the id of
    the request it seems to answer (read from its start), when there is one."""

    size: int
    why: str
    reply_to: int | None = None


def bad_line(line: bytes, why: str, size: int | None = None) -> BadLine:
    match = _REPLY_ID.match(line[:64])
    return BadLine(len(line) if size is None else size, why, int(match.group(1)) if match else None)


class LineBuffer:
    """Splits a byte stream into lines for ``decode``; sans-IO, so both ends share it.

    ``feed`` returns each complete line, or a ``BadLine`` for a line that grew over
    ``limit``: its bytes are dropped as they arrive (never buffered past the limit), and
    reading goes on at the next newline."""

    def __init__(self, limit: int = MAX_LINE):
        self.limit = limit
        self._buf = bytearray()
        self._skipping: int | None = None  # bytes of an overlong line dropped so far
        self._skipped_head = b""

    def feed(self, data: bytes) -> list[bytes | BadLine]:
        out: list[bytes | BadLine] = []
        start = 0
        while start < len(data):
            end = data.find(b"\n", start)
            chunk = data[start:] if end < 0 else data[start:end + 1]
            start = len(data) if end < 0 else end + 1
            if self._skipping is not None:
                self._skipping += len(chunk)
                if end >= 0:
                    out.append(bad_line(self._skipped_head, "line over the limit", self._skipping))
                    self._skipping, self._skipped_head = None, b""
                continue
            self._buf += chunk
            if end >= 0 and len(self._buf) <= self.limit:
                out.append(bytes(self._buf))
                self._buf.clear()
            elif len(self._buf) > self.limit or (end < 0 and len(self._buf) >= self.limit):
                # too long already: remember its start (a reply id) and drop the rest as it comes
                if end >= 0:
                    out.append(bad_line(bytes(self._buf[:64]), "line over the limit", len(self._buf)))
                else:
                    self._skipping, self._skipped_head = len(self._buf), bytes(self._buf[:64])
                self._buf.clear()
        return out
