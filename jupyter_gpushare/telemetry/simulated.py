"""Telemetry of the simulated GPU node: what kernels allocated through their agents.

As on a real GPU, a process's memory is held until the process exits: each sample first
drops the pids that no longer run (a kernel shut down or died), whatever their channel did.
"""

from __future__ import annotations

import os

import psutil

from .. import clock
from ..sim.node import DEVICE_NAME, NodeLedger
from ..sim.shared import open_node
from .base import GPUInfo, ProcessUsage, Telemetry, TelemetrySettings, TelemetryStatus


class SimulatedTelemetry(Telemetry):
    name = "simulated"
    label = "the simulated node"

    def __init__(self, node: NodeLedger):
        self.node = node
        self._last_device: dict[int, float] = {}
        self._last_process: float | None = None

    @classmethod
    def create(cls, settings: TelemetrySettings) -> SimulatedTelemetry:
        return cls(open_node(settings.simulated_node, settings.simulated_gpus))

    def open(self) -> TelemetryStatus:
        return self.status()

    def close(self) -> None:
        close = getattr(self.node, "close", None)  # a shared node's file handle
        if close is not None:
            close()

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
                    uuid=self.node.uuid(i),
                    name=f"{DEVICE_NAME} {i}",
                    memory_total=capacity,
                    memory_used=self.node.used(i),
                    utilization=round(100 * self.node.busy_fraction(None, i, since, now), 1),
                )
            )
        return out

    def processes(self) -> list[ProcessUsage]:
        self.node.drop_gone(process_alive)  # the tracker samples processes before devices
        now = clock.now()
        since = self._last_process if self._last_process is not None else now - 1.0
        self._last_process = now
        out = []
        for pid, per_gpu in self.node.pids().items():
            for gpu, nbytes in per_gpu.items():
                util = 100 * self.node.busy_fraction(pid, gpu, since, now)
                out.append(ProcessUsage(pid, gpu, nbytes, round(util, 1)))
        return out


def process_alive(pid: int) -> bool:
    """True while ``pid`` exists (about 1 us on POSIX). A zombie still counts until its
    parent reaps it, which jupyter_client does for the kernels it started."""
    if pid <= 0:
        return False
    if os.name != "posix":
        return psutil.pid_exists(pid)
    try:
        os.kill(pid, 0)  # signal 0: existence check, nothing is sent
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
