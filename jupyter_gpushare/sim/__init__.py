"""The simulated GPU node: run, demo and test the whole product where there is no GPU."""

from . import simgpu

__all__ = ["simgpu"]
