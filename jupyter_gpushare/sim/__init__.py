"""The simulated GPU node: run, demo and test the whole product where there is no GPU.

``simgpu``: arrays on simulated GPUs. ``device``: the process's simulated GPU, its emulated
checkpoint state machine, and fault injection for tests and demos
(``device.get_device().inject_fault("checkpoint", after=2)``).
"""

from . import device, simgpu

__all__ = ["device", "simgpu"]
