"""Telemetry of the simulated GPU node: what kernels allocated through their agents.

As on a real GPU, a process's memory is held until the process exits: each sample first
drops the pids that no longer run (a kernel shut down or died), whatever their channel did.

The node is also what the kernels' agents allocate on: :meth:`SimulatedTelemetry.agent_handlers`
gives the agent channel its requests (``alloc``, ``free``, ``busy_begin``, ``busy_end``,
``busy_work``, ``sync``), and the other server hooks tell kernels the node's GPUs (hello reply, launch
environment). The server itself never names this backend.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import psutil

from .. import clock
from ..fields import integer, shown
from ..protocol import SIMULATED_GPUS_ENV
from ..sim.node import DEVICE_NAME, FULL, NodeLedger, check_sm
from ..sim.shared import SharedSimNode, open_node
from .base import (
    AgentHandler,
    GPUInfo,
    ProcessUsage,
    Telemetry,
    TelemetrySettings,
    TelemetryStatus,
)


class SimulatedTelemetry(Telemetry):
    name = "simulated"
    label = "the simulated node"
    simulated = True

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

    # -- server hooks -------------------------------------------------------------------------
    def agent_handlers(self) -> Mapping[str, AgentHandler]:
        return AgentRequests(self.node).handlers()

    def agent_gone(self, pid: int) -> None:
        # GPU memory belongs to the process until it exits, not to its channel: keep it (a
        # reconnecting agent syncs it) unless the process is gone already
        self.node.end_busy(pid)
        if not process_alive(pid):
            self.node.drop_pid(pid)

    def hello_extra(self) -> dict[str, Any]:
        return {"simulated_gpus": list(self.node.capacities)}

    def launch_env(self) -> dict[str, str]:
        if not self.node.capacities:
            return {}
        return {SIMULATED_GPUS_ENV: ",".join(str(n) for n in self.node.capacities)}

    def context_bytes(self, configured: int) -> int:
        return 0  # the simulated node has no CUDA context: a kernel holds what it counted

    def total_bytes(self) -> dict[int, int] | None:
        return dict(enumerate(self.node.capacities))

    def shares_node_locks(self) -> bool:
        # a private node (no simulated_node file) is seen by this server alone
        return isinstance(self.node, SharedSimNode)


class AgentRequests:
    """The agent channel's requests on the simulated node: the kernels' simulated GPUs
    allocate, free and run on the server's node. Every field is checked before anything
    changes (``agent_ops``' checks)."""

    def __init__(self, node: NodeLedger):
        self.node = node

    def handlers(self) -> dict[str, AgentHandler]:
        return {
            "alloc": self.alloc,
            "free": self.free,
            "busy_begin": self.busy_begin,
            "busy_end": self.busy_end,
            "busy_work": self.busy_work,
            "sync": self.sync,
        }

    def _gpu(self, msg: Mapping[str, Any], key: str = "gpu") -> int:
        count = len(self.node.capacities)
        value = msg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value < count:
            raise ValueError(f"invalid device {value}: this node has {count} simulated GPUs")
        return integer(msg, key)

    def alloc(self, conn: Any, msg: dict[str, Any]) -> dict[str, Any]:
        gpu, nbytes = self._gpu(msg), integer(msg, "bytes")
        self.node.alloc(conn.pid, gpu, nbytes)
        return {}

    def free(self, conn: Any, msg: dict[str, Any]) -> None:
        gpu, nbytes = self._gpu(msg), integer(msg, "bytes")
        self.node.release(conn.pid, gpu, nbytes)

    def busy_begin(self, conn: Any, msg: dict[str, Any]) -> None:
        # sm: the share of the GPU's time its work asks for (%, default all of it)
        self.node.busy_begin(conn.pid, self._gpu(msg), sm=check_sm(msg.get("sm", FULL)))

    def busy_end(self, conn: Any, msg: dict[str, Any]) -> None:
        self.node.busy_end(conn.pid, self._gpu(msg))

    def busy_work(self, conn: Any, msg: dict[str, Any]) -> dict[str, Any]:
        """Seconds of full-speed work done since busy_begin, and the speed now (the GPU
        shared by others' work)."""
        work, speed = self.node.busy_work(conn.pid, self._gpu(msg))
        return {"work": work, "speed": speed}

    def sync(self, conn: Any, msg: dict[str, Any]) -> dict[str, Any]:
        """After a reconnection: what the agent's process holds, exactly, per GPU
        (``{"gpus": {"0": bytes}, "busy": [gpu, ...]}``); replaces the node's count for it."""
        node = self.node
        gpus = msg.get("gpus")
        if not isinstance(gpus, dict):
            raise ValueError('gpus must be an object {"GPU index": bytes}')
        per_gpu: dict[int, int] = {}
        for key, nbytes in gpus.items():
            if not (isinstance(key, str) and key.isdigit()):
                raise ValueError(f"gpus keys must be GPU indexes, got {shown(key)}")
            per_gpu[self._gpu({"gpu": int(key)})] = integer({"bytes": nbytes}, "bytes")
        busy = msg.get("busy", [])
        if not isinstance(busy, list):
            raise ValueError("busy must be a list of GPU indexes")
        busy_gpus = [self._gpu({"gpu": g}) for g in busy]
        node.set_usage(conn.pid, per_gpu)  # all or nothing
        node.end_busy(conn.pid)
        for gpu in busy_gpus:
            node.busy_begin(conn.pid, gpu)
        return {}


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
