"""The simulated GPU node: run, demo and test the whole product where there is no GPU.

``simgpu``: arrays on simulated GPUs. ``device``: the process's simulated GPU, its emulated
checkpoint state machine, and fault injection for tests and demos
(``device.get_device().inject_fault("checkpoint", after=2)``). ``node``: the memory ledger
the server keeps for the simulated backend.

``simgpu`` and ``device`` (numpy) load on first use, so the server's ``sim.node`` does not
bring them along.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["device", "simgpu"]


def __getattr__(name: str) -> Any:  # `from jupyter_gpushare.sim import simgpu` still works
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
