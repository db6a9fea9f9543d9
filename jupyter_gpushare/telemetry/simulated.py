"""Telemetry of the simulated GPU node: what kernels allocated through their agents."""

from __future__ import annotations

from .. import clock
from ..sim.node import DEVICE_NAME, SimNode
from .base import GPUInfo, ProcessUsage, Telemetry, TelemetryStatus


class SimulatedTelemetry(Telemetry):
    name = "simulated"

    def __init__(self, node: SimNode):
        self.node = node
        self._last_device: dict[int, float] = {}
        self._last_process: float | None = None

    def open(self) -> TelemetryStatus:
        return self.status()

    def close(self) -> None:
        pass

    def status(self) -> TelemetryStatus:
        return TelemetryStatus(
            "simulated", True, details={"gpus": str(len(self.node.capacities))}
        )

    def free_bytes(self, index: int) -> int | None:
        if 0 <= index < len(self.node.capacities):
            return self.node.free(index)
        return None

    def devices(self) -> list[GPUInfo]:
        now = clock.now()
        out = []
        for i, capacity in enumerate(self.node.capacities):
            since = self._last_device.get(i, now - 1.0)
            self._last_device[i] = now
            out.append(
                GPUInfo(
                    index=i,
                    uuid=f"SIM-{i:08d}-0000-0000-0000-000000000000",
                    name=f"{DEVICE_NAME} {i}",
                    memory_total=capacity,
                    memory_used=self.node.used(i),
                    utilization=round(100 * self.node.busy_fraction(None, i, since, now), 1),
                )
            )
        return out

    def processes(self) -> list[ProcessUsage]:
        now = clock.now()
        since = self._last_process if self._last_process is not None else now - 1.0
        self._last_process = now
        out = []
        for pid, per_gpu in self.node.pids().items():
            for gpu, nbytes in per_gpu.items():
                util = 100 * self.node.busy_fraction(pid, gpu, since, now)
                out.append(ProcessUsage(pid, gpu, nbytes, round(util, 1)))
        return out
