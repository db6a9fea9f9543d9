"""How memory leaves the GPU and comes back: driver checkpoint, framework offload, simulated."""

from __future__ import annotations

from .base import (
    KernelTarget,
    MethodContext,
    ReclaimError,
    ReclaimMethod,
    ReclaimResult,
    Support,
)

#: Every release method, by the name ``c.GPUShareApp.release_method`` takes: where its class
#: lives (imported when the server or ``doctor`` chooses). A new method is its module plus
#: one line here; the class's attributes (``needs_agent``, ``supports_lazy``, ``simulated``,
#: ``auto_rank``) say when it applies, so nothing else names it.
METHODS: dict[str, str] = {
    "driver": "jupyter_gpushare.reclaim.driver:DriverMethod",
    "framework": "jupyter_gpushare.reclaim.framework:FrameworkMethod",
    "simulated": "jupyter_gpushare.reclaim.simulated:SimulatedMethod",
}

__all__ = ["METHODS", "KernelTarget", "MethodContext", "ReclaimError", "ReclaimMethod",
           "ReclaimResult", "Support"]
