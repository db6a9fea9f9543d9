"""Where GPU numbers come from: NVML on a real node, the simulated node elsewhere."""

from ..sim.node import DEFAULT_GPUS as SIMULATED_GPUS_DEFAULT
from ..sim.shared import NODE_ENV as SIMULATED_NODE_ENV
from .base import (
    AgentHandler,
    GPUInfo,
    ProcessUsage,
    Telemetry,
    TelemetrySettings,
    TelemetryStatus,
    UnavailableTelemetry,
)

#: The built-in telemetry backends, by the name ``c.GPUShareApp.backend`` takes: where their
#: class lives (imported when chosen).
BACKENDS: dict[str, str] = {
    "nvml": "jupyter_gpushare.telemetry.nvml:NVMLTelemetry",
    "simulated": "jupyter_gpushare.telemetry.simulated:SimulatedTelemetry",
}

#: The entry point group another package registers its backends in, one line each
#: (``mysource = "mypkg.mysource:MySource"``); read when the server or ``doctor`` chooses
#: (:mod:`jupyter_gpushare.server.selection`). A name of ``BACKENDS`` (or "auto") is the built-in's:
#: a plug-in registered under it is ignored with a warning.
ENTRY_POINT_GROUP = "jupyter_gpushare.telemetry_backends"

__all__ = ["BACKENDS", "ENTRY_POINT_GROUP", "SIMULATED_GPUS_DEFAULT", "SIMULATED_NODE_ENV",
           "AgentHandler", "GPUInfo", "ProcessUsage", "Telemetry", "TelemetrySettings",
           "TelemetryStatus", "UnavailableTelemetry"]
