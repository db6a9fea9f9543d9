"""Where GPU numbers come from: NVML on a real node, the simulated node elsewhere."""

from .base import GPUInfo, ProcessUsage, Telemetry, TelemetrySettings, TelemetryStatus

#: Every telemetry backend, by the name ``c.GPUShareApp.backend`` takes: where its class
#: lives (imported when chosen). A new backend is its module plus one line here.
BACKENDS: dict[str, str] = {
    "nvml": "jupyter_gpushare.telemetry.nvml:NVMLTelemetry",
    "simulated": "jupyter_gpushare.telemetry.simulated:SimulatedTelemetry",
}

__all__ = ["BACKENDS", "GPUInfo", "ProcessUsage", "Telemetry", "TelemetrySettings",
           "TelemetryStatus"]
