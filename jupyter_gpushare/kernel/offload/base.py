"""Interface of the framework adapters that move a kernel's GPU objects to host and back.

Adapters run inside the kernel. Each one is used only when its framework is already
imported (``present()``), so loading the agent never imports torch, cupy or jax.
"""

from __future__ import annotations

import abc
import os
import sys
from dataclasses import dataclass, field
from typing import Any

#: at most this many "name: why" entries per report, then one "... and N more" line: a
#: namespace with a million objects left alone must not make a reply without bound
MAX_SKIPPED = 50
#: longest entry kept (a path through deeply nested containers can be very long)
MAX_SKIPPED_CHARS = 300


@dataclass
class OffloadReport:
    framework: str
    bytes: int = 0  # bytes moved (offload: off the GPU; reload: back onto it)
    count: int = 0  # tensors / arrays moved
    seconds: float = 0.0
    freed_bytes: int = 0  # what the allocator gave back to the driver (after empty_cache)
    #: bytes actually copied (offload: those whose kept host copy was not current; a
    #: pre-copy: those it copied); ``bytes`` is what moved off the GPU either way
    copied: int = 0
    #: kept copies (bytes) the version counters call current, trusted without reading them
    #: because no code ran since they were made current (:mod:`.quiet`)
    trusted: int = 0
    checked: int = 0  # kept copies (bytes) whose fingerprint was read to check them
    stopped: bool = False  # a pre-copy that stopped early (a cell started)
    #: "name: why" for what was deliberately left alone, never silently dropped; add with
    #: ``skip``, which keeps it bounded
    skipped: list[str] = field(default_factory=list)
    left_out: int = 0  # entries beyond MAX_SKIPPED, counted in the last line of ``skipped``

    def skip(self, entry: str) -> None:
        """Record something left alone; past MAX_SKIPPED entries only count them."""
        if len(entry) > MAX_SKIPPED_CHARS:  # cut the middle of the path: the why is at the end
            half = (MAX_SKIPPED_CHARS - 5) // 2
            entry = f"{entry[:half]} ... {entry[-half:]}"
        if not self.left_out and len(self.skipped) < MAX_SKIPPED:
            self.skipped.append(entry)
            return
        if self.left_out:
            self.skipped.pop()  # the "... and N more" line, rewritten below
        self.left_out += 1
        self.skipped.append(f"... and {self.left_out} more left alone")


class OffloadAdapter(abc.ABC):
    """One framework's way to move live device objects to host memory in place."""

    #: the module name that must already be in ``sys.modules``
    module: str = ""
    name: str = ""

    @classmethod
    def present(cls) -> bool:
        return cls.module in sys.modules

    @abc.abstractmethod
    def device_bytes(self) -> int:
        """Bytes this framework holds on GPUs now (allocated plus cached)."""

    @abc.abstractmethod
    def offload(self, namespace: dict[str, Any]) -> OffloadReport:
        """Move every device object reachable from ``namespace`` to host, then free caches."""

    @abc.abstractmethod
    def reload(self) -> OffloadReport:
        """Move what ``offload`` moved back to the devices it came from, in place."""

    def pool_bytes(self) -> int:
        """The part of :meth:`device_bytes` the allocator keeps reserved whatever is moved
        (a pool that never gives memory back to the driver): no offload frees it."""
        return 0

    @abc.abstractmethod
    def trim(self) -> int:
        """Empty allocator caches (before a driver checkpoint); return bytes freed."""

    # -- host copies kept while resident (incremental releases); none by default ---------
    def precopy(self, namespace: dict[str, Any], stop: Any = None) -> OffloadReport:
        """Copy, while the kernel runs, what changed since its kept host copy (a thread of
        the agent runs it; ``stop``, a ``threading.Event``, ends it early)."""
        return OffloadReport(framework=self.name)

    def host_copies(self) -> dict[str, int]:
        """``current``: device bytes whose kept host copy is current; ``to_copy``: bytes a
        release would copy now; ``kept``: host bytes the kept copies hold; ``to_copy_new``
        (optional, else all of ``to_copy``): the part of ``to_copy`` with no kept buffer to
        be copied into, so new host memory."""
        return {"current": 0, "to_copy": 0, "kept": 0, "to_copy_new": 0}

    def drop_host_copies(self, wanted: int | None = None) -> int:
        """Free kept host copies, oldest first, until ``wanted`` bytes (None: all)."""
        return 0


#: "0": no host copy kept after a restore (every release copies everything); the PyTorch,
#: CuPy and JAX adapters keep one by default and trust it only while it is provably current
KEEP_HOST_COPY_ENV = "JUPYTER_GPUSHARE_KEEP_HOST_COPY"


def keep_host_copies(environ: dict[str, str] | None = None) -> bool:
    """Whether adapters keep host copies after a restore (``KEEP_HOST_COPY_ENV``)."""
    value = (os.environ if environ is None else environ).get(KEEP_HOST_COPY_ENV, "1")
    return value.strip().lower() not in ("0", "false", "no", "off")


#: how a release checks that a kept PyTorch host copy is still current, past the version
#: counters (which see every write through PyTorch's own ops, not those through ``.data``,
#: DLPack, NumPy or a raw pointer): "full" (the default) reads every byte of the storage on
#: its device; "sampled" reads one 32-bit word in 1,024 of a storage over 1 MiB, so it sees a
#: rewrite of a whole tensor but may miss a small one; "counters" reads nothing, so such a
#: write is lost at the next restore. CuPy, which has no version counters, reads its
#: allocations the same way under "full" and "sampled"; under "counters" it reads nothing and
#: copies again every kept copy the epoch does not vouch for. An unknown value means "full".
KEPT_CHECK_ENV = "JUPYTER_GPUSHARE_KEPT_CHECK"
KEPT_CHECKS = ("full", "sampled", "counters")


def kept_check(environ: dict[str, str] | None = None) -> str:
    """How a kept host copy is checked (``KEPT_CHECK_ENV``): one of ``KEPT_CHECKS``."""
    value = (os.environ if environ is None else environ).get(KEPT_CHECK_ENV, "full")
    value = value.strip().lower()
    return value if value in KEPT_CHECKS else "full"


def drop_oldest(kept: dict[Any, Any], lock: Any, wanted: int | None) -> int:
    """Forget kept host copies (entries with ``at`` and ``nbytes``), oldest first, until
    ``wanted`` bytes are freed (None: all), under ``lock``; the bytes forgotten. Each
    adapter's ``drop_kept`` then frees what its framework caches."""
    freed = 0
    with lock:
        for key, entry in sorted(kept.items(), key=lambda item: item[1].at):
            if wanted is not None and freed >= wanted:
                break
            del kept[key]
            freed += entry.nbytes
    return freed
