"""Framework adapters that move a kernel's device objects to host memory and back.

An adapter is used only when its framework is already imported: a kernel that never
imported torch has no torch tensors, and importing it here would cost seconds and a CUDA
context. So this package imports no framework, and adapter modules are imported lazily.

Typical use inside the kernel agent::

    adapters = present_adapters()
    reports = [a.offload(namespace) for a in adapters]   # release
    reports = [a.reload() for a in adapters]             # restore (same instances)
"""

from __future__ import annotations

import importlib
import sys

from .base import OffloadAdapter, OffloadReport

#: (framework module that must be imported, "adapter module:class"), in offload order
ADAPTERS: list[tuple[str, str]] = [
    ("torch", "jupyter_gpushare.kernel.offload.torch_adapter:TorchAdapter"),
    ("cupy", "jupyter_gpushare.kernel.offload.cupy_adapter:CupyAdapter"),
    ("jax", "jupyter_gpushare.kernel.offload.jax_adapter:JaxAdapter"),
]


def adapter_class(spec: str) -> type[OffloadAdapter]:
    module_name, _, class_name = spec.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def pinned_kept_bytes() -> int:
    """Page-locked host memory the adapters keep for the next release while the kernel is
    resident (:mod:`.pinned`); imports no framework (a pool exists only once it was used)."""
    total = 0
    for module_name, attr in (("jupyter_gpushare.kernel.offload.torch_adapter", "_default_pool"),
                              ("jupyter_gpushare.kernel.offload.cupy_adapter", "_pool")):
        pool = getattr(sys.modules.get(module_name), attr, None)
        total += pool.kept_bytes if pool is not None else 0
    return total


def present_adapters() -> list[OffloadAdapter]:
    """New adapters (default, real-device settings) for the frameworks imported right now."""
    return [adapter_class(spec)() for module, spec in ADAPTERS if module in sys.modules]


__all__ = [
    "ADAPTERS",
    "OffloadAdapter",
    "OffloadReport",
    "adapter_class",
    "pinned_kept_bytes",
    "present_adapters",
]
