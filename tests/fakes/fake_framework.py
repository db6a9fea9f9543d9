"""A GPU framework faked at its device, loaded inside a real kernel: the kernel agent's
offload adapter for it runs through the real agent, channel, server and framework method.

Its arrays keep their values in Python; the "device" counts the bytes they hold there, as a
framework's allocator does (``device_bytes``, the agent's count before and after a release).
Two ways it leaves memory on the GPU, as the real frameworks do on a real one:

* an array ``held_elsewhere`` (PyTorch's tensors referenced from outside the user namespace,
  CuPy's memory owned by another library) is left alone and named in the report's skipped;
* ``pool=True``: like XLA's allocator (JAX preallocates 75 % by default), the device keeps
  what it took reserved when arrays leave it.

In the kernel::

    import sys; sys.path.insert(0, REPO)
    from tests.fakes import fake_framework as fw
    fw.install(pool=False)
    x = fw.array([1, 2, 3], nbytes=512 << 20)
"""

from __future__ import annotations

import sys
from typing import Any

from jupyter_gpushare.kernel import offload
from jupyter_gpushare.kernel.offload.base import OffloadAdapter, OffloadReport

MODULE = __name__  # the "framework" the agent sees imported


class Device:
    def __init__(self) -> None:
        self.in_use = 0  # bytes of arrays on the device
        self.reserved = 0  # what the allocator holds (a pool keeps it)
        self.pool = False

    def take(self, n: int) -> None:
        self.in_use += n
        self.reserved = max(self.reserved, self.in_use) if self.pool else self.in_use

    def give(self, n: int) -> None:
        self.in_use -= n
        if not self.pool:
            self.reserved = self.in_use


DEVICE = Device()


class Array:
    def __init__(self, values: list[Any], nbytes: int, held_elsewhere: bool = False) -> None:
        self.values = list(values)
        self.nbytes = nbytes
        self.held_elsewhere = held_elsewhere
        self.on_device = True
        DEVICE.take(nbytes)


def array(values: list[Any], nbytes: int, held_elsewhere: bool = False) -> Array:
    return Array(values, nbytes, held_elsewhere)


class Adapter(OffloadAdapter):
    module = MODULE
    name = "fake"
    moved: list[Array] = []  # class-wide: the agent makes new adapters, reload uses its own

    def device_bytes(self) -> int:
        return DEVICE.reserved

    def pool_bytes(self) -> int:
        return DEVICE.reserved if DEVICE.pool else 0

    def offload(self, namespace: dict[str, Any]) -> OffloadReport:
        report = OffloadReport(framework=self.name)
        for name, value in list(namespace.items()):
            if not isinstance(value, Array) or not value.on_device:
                continue
            if value.held_elsewhere:
                report.skip(f"{name}: referenced from outside the user namespace; left alone")
                continue
            value.on_device = False
            DEVICE.give(value.nbytes)
            Adapter.moved.append(value)
            report.bytes += value.nbytes
            report.count += 1
        return report

    def reload(self) -> OffloadReport:
        report = OffloadReport(framework=self.name)
        for value in Adapter.moved:
            value.on_device = True
            DEVICE.take(value.nbytes)
            report.bytes += value.nbytes
            report.count += 1
        Adapter.moved.clear()
        return report

    def trim(self) -> int:
        return 0


def install(pool: bool = False) -> None:
    """Make the kernel agent see this framework as imported, with an adapter for it."""
    DEVICE.pool = pool
    entry = (MODULE, f"{MODULE}:Adapter")
    if entry not in offload.ADAPTERS:
        offload.ADAPTERS.append(entry)
    assert MODULE in sys.modules
