"""Memory caps: how much GPU memory one kernel may hold per GPU. Pure.

A cap is a byte count per GPU (frameworks limit themselves per device: PyTorch's memory
fraction, JAX's, TensorFlow's logical device, CuPy's pool). It comes, in this order, from the
kernel itself (``%gpushare cap``, the REST API), which may lower but never raise the ceiling;
else the ceiling: the smaller of the kernelspec's ``metadata.gpushare.memory_limit`` and the
admin's default for the kernel's person (``GPUShareApp.memory_limit``, the hub service's
``caps`` table by user or group); no ceiling and no own cap: uncapped.

What a kernel holds is compared with its cap on each GPU (:func:`over`): the node's reading
of a capped framework stays under it, one that cannot be limited (raw CUDA, R, Julia) is only
watched, and flagged when over.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..units import format_bytes

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
MAX_CAP = 1 << 50  # 1 PiB per GPU: anything larger is a typo, not a cap
OFF = ("off", "none", "default")  # words that clear a kernel's own cap


class CapError(ValueError):
    """A cap that is not an amount of memory; the message says what is accepted."""


def parse_cap(value: object, what: str = "cap") -> int:
    """``8589934592``, ``"8GiB"``, ``"512 MiB"``, ``"1.5GB"`` -> bytes (> 0). CapError says why
    anything else (a negative or zero size, a percentage, a word) is refused."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise CapError(f"{what} must be an amount of memory like 8GiB or 512MiB, not {value!r:.60}")
    if isinstance(value, str) and value.strip().startswith("-"):
        raise CapError(f"{what} cannot be negative: {value.strip()[:60]!r}")
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE.match(value)
        if m is None or m.group(2).lower() not in _UNITS:
            raise CapError(f"{what} must be an amount of memory like 8GiB or 512MiB, "
                           f"not {value.strip()[:60]!r}")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 0:
        raise CapError(f"{what} cannot be negative: {value!r:.60}")
    if n == 0:
        raise CapError(f"{what} must be more than 0 bytes, not {value!r:.60}")
    if n > MAX_CAP:
        raise CapError(f"{what} must be at most {format_bytes(MAX_CAP)} per GPU, not {value!r:.60}")
    return n


def describe(cap: int) -> str:
    """``8 GiB``, ``1.5 GiB``, ``512 MiB``: a cap as people write it."""
    text = format_bytes(cap)
    return text.replace(".0 ", " ")


def ceiling(*caps: int | None) -> int | None:
    """The smallest of the caps that are set (None: none is)."""
    known = [c for c in caps if c]
    return min(known) if known else None


def effective(own: int | None, ceiling_: int | None) -> int | None:
    """The cap in effect: the kernel's own where set (never above the ceiling), else the
    ceiling."""
    if own is None:
        return ceiling_
    return own if ceiling_ is None else min(own, ceiling_)


def over(gpu_bytes: Mapping[int, int], cap: int | None, slack: int = 0) -> tuple[int, int] | None:
    """(gpu, bytes) of the GPU where the kernel holds most above ``cap`` plus ``slack`` (a CUDA
    context, which the node's reading counts and no framework's limit does); None when it
    holds no more anywhere (or has no cap)."""
    if not cap:
        return None
    worst = max(((g, b) for g, b in gpu_bytes.items() if b > cap + slack), key=lambda p: p[1],
                default=None)
    return worst


def over_text(gpu_bytes: Mapping[int, int], cap: int | None, slack: int = 0) -> str | None:
    """``holds 9.1 GiB of its 8 GiB cap on GPU 0``, or None when within it (and ``slack``)."""
    found = over(gpu_bytes, cap, slack)
    if found is None or cap is None:
        return None
    gpu, held = found
    where = f" on GPU {gpu}" if gpu >= 0 else ""
    return f"holds {format_bytes(held)} of its {describe(cap)} cap{where}"


def of_kernelspec(metadata: object) -> int | None:
    """The cap a kernelspec's ``metadata.gpushare.memory_limit`` sets (None: none); CapError
    when it is there and not an amount of memory."""
    meta = metadata.get("gpushare") if isinstance(metadata, Mapping) else None
    if not isinstance(meta, Mapping) or meta.get("memory_limit") is None:
        return None
    return parse_cap(meta["memory_limit"], "metadata.gpushare.memory_limit")
