"""Interface of the framework adapters that move a kernel's GPU objects to host and back.

Adapters run inside the kernel. Each one is used only when its framework is already
imported (``present()``), so loading the agent never imports torch, cupy or jax.
"""

from __future__ import annotations

import abc
import sys
from dataclasses import dataclass, field
from typing import Any


@dataclass
class OffloadReport:
    framework: str
    bytes: int = 0  # bytes moved (offload: off the GPU; reload: back onto it)
    count: int = 0  # tensors / arrays moved
    seconds: float = 0.0
    freed_bytes: int = 0  # what the allocator gave back to the driver (after empty_cache)
    skipped: list[str] = field(default_factory=list)  # "name: why", never silently dropped


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

    @abc.abstractmethod
    def trim(self) -> int:
        """Empty allocator caches (before a driver checkpoint); return bytes freed."""
