"""PyTorch's GPU faked at its device, inside a real kernel: CPU storages registered here stand
for GPU memory, and the kernel agent's PyTorch adapter moves them through its real code (the
fast path's seam, as ``tests/test_offload_fast.py``'s ``FakeGPUs`` drives it in process).

In the kernel::

    import sys; sys.path.insert(0, REPO)
    from tests.fakes import fake_torch_gpu as tg
    tg.install()
    w = tg.put(torch.zeros(1 << 18))

``reports`` holds every release's and pre-copy's report (``OffloadReport``), in order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from jupyter_gpushare.kernel import offload
from jupyter_gpushare.kernel.offload.base import OffloadReport
from jupyter_gpushare.kernel.offload.pinned import PinnedPool
from jupyter_gpushare.kernel.offload.torch_adapter import (
    StreamCopies,
    TorchAdapter,
    _storage_shared,
)

_on_device: dict[int, tuple[Any, int]] = {}  # storage _cdata -> (weak storage, bytes)
reports: list[tuple[str, OffloadReport]] = []


def put(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s storage lives on the fake GPU from now on."""
    storage = tensor.untyped_storage()
    _on_device[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
    return tensor


def _on(storage: Any) -> bool:
    found = _on_device.get(storage._cdata)
    return found is not None and not found[0].expired()


def _alloc_device(nbytes: int, device: Any) -> Any:
    return put(torch.empty(nbytes, dtype=torch.uint8)).untyped_storage()


def _alloc_host(nbytes: int) -> Any:
    host = torch.UntypedStorage(nbytes)
    _on_device.pop(host._cdata, None)  # an address a freed "device" storage had
    return host


def _copy(dst: Any, src: Any, device: Any) -> None:
    dst.copy_(src)


_pool = PinnedPool(_alloc_host, limit=1 << 30, shared=_storage_shared)


class Adapter(TorchAdapter):
    """The PyTorch adapter on the fake GPU; records its reports."""

    def __init__(self) -> None:
        copies = StreamCopies(pool=_pool, alloc_device=_alloc_device, copy=_copy,
                              sync=lambda device: None)
        super().__init__(is_device=lambda t: _on(t.untyped_storage()),
                         device_of=lambda storage: "gpu0", copies=copies)

    def device_bytes(self) -> int:
        return sum(n for ref, n in _on_device.values() if not ref.expired())

    def allocated_bytes(self) -> int:
        return self.device_bytes()

    def offload(self, namespace: dict[str, Any]) -> OffloadReport:
        report = super().offload(namespace)
        reports.append(("offload", report))
        return report

    def precopy(self, namespace: dict[str, Any], stop: Any = None) -> OffloadReport:
        report = super().precopy(namespace, stop)
        reports.append(("precopy", report))
        return report


def install() -> None:
    """The agent's PyTorch adapter is this one from now on."""
    offload.ADAPTERS[:] = [(module, f"{__name__}:Adapter" if module == "torch" else spec)
                           for module, spec in offload.ADAPTERS]
