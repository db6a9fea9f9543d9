"""The one place the server reads time, so tests move the clock instead of sleeping."""

from __future__ import annotations

import time

_offset = 0.0


def now() -> float:
    """Seconds since the epoch, plus whatever tests have advanced."""
    return time.time() + _offset


def monotonic() -> float:
    return time.monotonic() + _offset


def advance(seconds: float) -> None:
    """Move the clock forward (tests only)."""
    global _offset
    _offset += seconds


def reset() -> None:
    global _offset
    _offset = 0.0
