"""Where GPU numbers come from: NVML on a real node, the simulated node elsewhere."""

from .base import GPUInfo, ProcessUsage, Telemetry, TelemetryStatus

__all__ = ["GPUInfo", "ProcessUsage", "Telemetry", "TelemetryStatus"]
