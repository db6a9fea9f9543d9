"""How memory leaves the GPU and comes back: driver checkpoint, framework offload, simulated."""

from .base import KernelTarget, ReclaimError, ReclaimMethod, ReclaimResult, Support

__all__ = ["KernelTarget", "ReclaimError", "ReclaimMethod", "ReclaimResult", "Support"]
