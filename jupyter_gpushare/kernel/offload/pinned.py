"""Page-locked host buffers kept from one release/restore cycle to the next.

Allocating page-locked ("pinned") host memory is slow: the pages are faulted in and locked
one by one, often at a few GB/s, while a copy into memory that is pinned already runs at the
bus's 24-57 GB/s. A kernel that is released and restored again and again would pay that
allocation on every release. :class:`PinnedPool` keeps the buffers of the last cycle, keyed
by size (an offload of the same state asks for the same sizes), so the next release copies
into memory that is pinned already.

Host memory accounting. The kept buffers are host memory the kernel process holds while it
is resident, on top of its own: page-locked, so the OS cannot swap them out, and counted in
the process's (and its cgroup's) resident memory, which is what the server's host-memory
check reads. They are bounded three ways:

- by ``limit`` bytes (``$JUPYTER_GPUSHARE_PINNED_KEEP``, default :data:`DEFAULT_KEEP`,
  ``0`` = keep nothing, the behaviour before the pool: every cycle allocates and frees);
- by the last cycle: a buffer no offload asked for in the last cycle is freed at its end, so
  a state that shrank does not keep its old buffers;
- by sharing: a buffer something else still uses after the reload (a view the user took of
  an offloaded tensor) is never reused, only dropped.

:meth:`PinnedPool.clear` frees every kept buffer (the agent's ``trim`` calls it, before a
driver checkpoint, whose own copy needs the host memory). ``kept_bytes`` is what the pool
holds while the kernel is resident (the agent's ``census`` reports it).

Pure Python: the allocation is a callable, so the CPU tests count allocations.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

#: the environment variable that bounds the kept bytes (a number of bytes, or with a
#: K/M/G/T suffix, powers of 1024)
KEEP_ENV = "JUPYTER_GPUSHARE_PINNED_KEEP"
#: default bound of the kept bytes per framework in a kernel process
DEFAULT_KEEP = 4 << 30

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def keep_limit(environ: dict[str, str] | None = None) -> int:
    """The bound the environment sets (``DEFAULT_KEEP`` when unset or not understood)."""
    text = (os.environ if environ is None else environ).get(KEEP_ENV, "").strip().upper()
    if not text:
        return DEFAULT_KEEP
    text = text.removesuffix("IB").removesuffix("B")
    unit = text[-1:] if text[-1:] in _UNITS and not text[-1:].isdigit() else ""
    number = text[: len(text) - len(unit)] if unit else text
    try:
        value = int(float(number) * _UNITS[unit])
    except ValueError:
        return DEFAULT_KEEP
    return max(0, value)


class PinnedPool:
    """Host buffers by size, reused across cycles; see the module's text for the bounds.

    ``alloc(nbytes)``: a new page-locked buffer; ``shared(buffer)``: whether something other
    than the pool's caller still uses it (then it is never reused). A cycle is: ``take`` a
    buffer per storage (offload), ``give`` each back after the reload, ``end_cycle``."""

    def __init__(self, alloc: Callable[[int], Any], *, limit: int | None = None,
                 shared: Callable[[Any], bool] = lambda buffer: False) -> None:
        self.alloc = alloc
        self.limit = keep_limit() if limit is None else max(0, limit)
        self.shared = shared
        self._free: dict[int, list[Any]] = {}
        self._taken_in_cycle: set[int] = set()  # id() of the free buffers the cycle used
        self.kept_bytes = 0  # bytes of the free buffers the pool holds
        self.allocations = 0  # buffers allocated since the pool was made (for tests, reports)
        self.reuses = 0  # buffers taken from the pool instead

    def take(self, nbytes: int) -> Any:
        """A buffer of ``nbytes``: a kept one when there is one, else a new one."""
        kept = self._free.get(nbytes)
        if kept:
            buffer = kept.pop()
            self.kept_bytes -= nbytes
            self.reuses += 1
            return buffer
        buffer = self.alloc(nbytes)
        self.allocations += 1
        return buffer

    def give(self, buffer: Any, nbytes: int) -> bool:
        """Keep ``buffer`` for the next cycle when the bound allows and nothing else uses it;
        returns whether it was kept (otherwise the caller's last reference frees it)."""
        if nbytes <= 0 or nbytes > self.limit or self.shared(buffer):
            return False
        if self.kept_bytes + nbytes > self.limit:
            self._drop_unused(self.kept_bytes + nbytes - self.limit)  # older cycles' first
            if self.kept_bytes + nbytes > self.limit:
                return False
        self._free.setdefault(nbytes, []).append(buffer)
        self._taken_in_cycle.add(id(buffer))
        self.kept_bytes += nbytes
        return True

    def end_cycle(self) -> int:
        """Free the buffers the cycle did not use (the state shrank); returns bytes freed."""
        freed = self._drop_unused(self.kept_bytes)
        self._taken_in_cycle.clear()
        return freed

    def _drop_unused(self, wanted: int) -> int:
        """Free kept buffers this cycle has not given back, largest first, until ``wanted``
        bytes are freed or none is left; returns the bytes freed."""
        freed = 0
        for nbytes in sorted(self._free, reverse=True):
            kept = []
            for buffer in self._free[nbytes]:
                if freed < wanted and id(buffer) not in self._taken_in_cycle:
                    freed += nbytes  # the pool's reference goes; the buffer with it
                else:
                    kept.append(buffer)
            if kept:
                self._free[nbytes] = kept
            else:
                del self._free[nbytes]
        self.kept_bytes -= freed
        return freed

    def clear(self) -> int:
        """Free every kept buffer; returns the bytes freed."""
        freed = self.kept_bytes
        self._free.clear()
        self._taken_in_cycle.clear()
        self.kept_bytes = 0
        return freed

    def stats(self) -> dict[str, int]:
        return {"kept_bytes": self.kept_bytes, "limit": self.limit,
                "allocations": self.allocations, "reuses": self.reuses}
