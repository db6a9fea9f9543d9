"""Byte units and how byte counts read in messages: the one place for both.

Imports nothing, so the server, the kernel agent, the magics and the simulator share it
without loading each other (the server does not load numpy or the simulated GPU to format a
number).
"""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def format_bytes(n: float, whole_below_gib: bool = False) -> str:
    """``4.0 GiB``, ``256.0 MiB``, ``512 B``: one decimal in the largest unit that fits.

    ``whole_below_gib``: MiB and KiB without decimals (``512 MiB``), for limits and free
    memory in refusals, where a tenth of a MiB is noise."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            digits = 0 if whole_below_gib and size < GiB else 1
            return f"{n / size:.{digits}f} {unit}"
    return f"{int(n)} B"
