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

#: The built-in release methods, by the name ``c.GPUShareApp.release_method`` takes: where
#: its class lives (imported when the server or ``doctor`` chooses). The class's attributes
#: (``needs_agent``, ``supports_lazy``, ``simulated``, ``auto_rank``) say when it applies, so
#: nothing else names it.
METHODS: dict[str, str] = {
    "driver": "jupyter_gpushare.reclaim.driver:DriverMethod",
    "framework": "jupyter_gpushare.reclaim.framework:FrameworkMethod",
    "simulated": "jupyter_gpushare.reclaim.simulated:SimulatedMethod",
}

#: The entry point group another package registers its methods in, one line each
#: (``mymethod = "mypkg.mymethod:MyMethod"``); read when the server or ``doctor`` chooses
#: (:mod:`jupyter_gpushare.server.selection`). A name of ``METHODS`` (or "auto", "off") is the
#: built-in's: a plug-in registered under it is ignored with a warning.
ENTRY_POINT_GROUP = "jupyter_gpushare.release_methods"

__all__ = ["ENTRY_POINT_GROUP", "METHODS", "KernelTarget", "MethodContext", "ReclaimError",
           "ReclaimMethod", "ReclaimResult", "Support"]
