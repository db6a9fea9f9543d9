"""Checks of the fields a peer sends (the kernel agent over its channel): each returns the
value, or raises ``ValueError`` saying what is wrong and quoting the value, cut short."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def shown(value: Any) -> str:
    """``value`` as an error message quotes it (cut to 40 characters)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def integer(msg: Mapping[str, Any], key: str, minimum: int = 0) -> int:
    value = msg.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{key} must be an integer, got {shown(value)}")
    if value < minimum:
        raise ValueError(f"{key} must be >= {minimum}, got {value}")
    return value


def optional_integer(msg: Mapping[str, Any], key: str) -> int | None:
    return None if msg.get(key) is None else integer(msg, key)


def boolean(msg: Mapping[str, Any], key: str) -> bool:
    value = msg.get(key)
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {shown(value)}")
    return value


def seconds_or_none(msg: Mapping[str, Any], key: str) -> float | None:
    value = msg.get(key)
    if value is None:
        return None
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            or not math.isfinite(value) or value < 0):
        raise ValueError(f"{key} must be a number of seconds >= 0, got {shown(value)}")
    return float(value)


def strings(msg: Mapping[str, Any], key: str, most: int = 10_000) -> list[str] | None:
    value = msg.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key} must be a list of strings")
    if len(value) > most:
        raise ValueError(f"{key} has {len(value)} entries; at most {most}")
    return value
