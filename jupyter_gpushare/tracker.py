"""Which kernel holds what on which GPU: kernels -> local pids -> usage, over time.

Every poll reads the kernel manager (pids, activity), one telemetry sample, and updates
one record per kernel plus ring buffers for the history API. Kernels that appear,
restart or die are picked up and dropped on the next poll.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psutil

from . import clock
from .telemetry import GPUInfo, ProcessUsage, Telemetry

log = logging.getLogger(__name__)


@dataclass
class KernelRecord:
    id: str
    name: str = ""  # kernelspec name
    path: str = ""  # the notebook (from the session manager)
    pids: list[int] = field(default_factory=list)
    gpu_bytes: dict[int, int] = field(default_factory=dict)  # GPU index -> bytes held now
    pid_gpu_bytes: dict[int, dict[int, int]] = field(default_factory=dict)  # pid -> GPU -> bytes
    sm_utilization: float | None = None  # percent, last sample
    execution_state: str = "unknown"
    last_activity: float = 0.0  # epoch seconds (server activity or GPU use, the later)
    first_seen: float = 0.0
    # (t, bytes held, SM %, {gpu: bytes}) per poll
    history: deque[tuple[float, int, float | None, dict[int, int]]] = field(default_factory=deque)

    @property
    def gpu_memory_bytes(self) -> int:
        return sum(self.gpu_bytes.values())

    @property
    def busy(self) -> bool:
        return self.execution_state == "busy"

    def idle_seconds(self, now: float) -> float:
        if self.busy:
            return 0.0
        return max(0.0, now - self.last_activity)

    def max_utilization_since(self, since: float) -> float:
        """Highest SM utilization sampled since ``since`` (0 when none was sampled)."""
        values = [u for t, _, u, _ in self.history if t >= since and u is not None]
        return max(values, default=0.0)


@dataclass
class GPURecord:
    info: GPUInfo
    history: deque[tuple[float, int | None, float | None]] = field(default_factory=deque)


def _children_by_parent() -> dict[int, list[int]]:
    """parent pid -> child pids of every process we can see, in one pass over /proc."""
    ppid_map = getattr(psutil, "_ppid_map", None)  # 3x cheaper than process_iter (psutil's own)
    try:
        pairs = ppid_map().items() if ppid_map is not None else None
    except Exception:  # a private helper that changed: the public way
        pairs = None
    if pairs is None:
        pairs = ((p.pid, p.info.get("ppid")) for p in psutil.process_iter(["ppid"]))
    children: dict[int, list[int]] = {}
    for pid, ppid in pairs:
        if ppid:
            children.setdefault(ppid, []).append(pid)
    return children


def _epoch(value: Any) -> float:
    if isinstance(value, datetime):
        return value.timestamp()
    return float(value or 0.0)


class Tracker:
    """Owns the per-kernel records; driven by the app's poll loop."""

    def __init__(
        self,
        kernel_manager: Any,
        telemetry: Telemetry,
        history_seconds: float,
        poll_interval: float,
        session_manager: Any = None,
        agent_reports: Any = None,
    ):
        self.km = kernel_manager
        self.telemetry = telemetry
        self.session_manager = session_manager
        self.history_len = max(2, int(history_seconds / max(poll_interval, 0.05)) + 1)
        self.kernels: dict[str, KernelRecord] = {}
        self.gpus: dict[int, GPURecord] = {}
        self.foreign_pids: set[int] = set()  # NVML pids this pid namespace cannot see
        self.agent_reports = agent_reports  # callable kernel_id -> agent report dict, or None
        self.idle_utilization = 0.0  # SM % above which a kernel counts as using the GPU
        # parent pid -> child pids, from one scan of the process table per poll (50 kernels:
        # one scan costs what one psutil children() call costs, i.e. 50x less than one each)
        self._children: dict[int, list[int]] | None = None
        self.last_poll_seconds = 0.0

    # -- pids ------------------------------------------------------------------------
    def kernel_pid(self, kernel_id: str) -> int | None:
        try:
            km = self.km.get_kernel(kernel_id)
        except KeyError:
            return None
        provisioner = getattr(km, "provisioner", None)
        pid = getattr(provisioner, "pid", None) if provisioner is not None else None
        if pid is None and provisioner is not None:
            process = getattr(provisioner, "process", None)
            pid = getattr(process, "pid", None)
        return pid

    def kernel_pids(self, kernel_id: str) -> list[int]:
        """The kernel process and all its descendants (e.g. DataLoader workers)."""
        pid = self.kernel_pid(kernel_id)
        if pid is None:
            return []
        children = self._children if self._children is not None else _children_by_parent()
        if pid not in children and not psutil.pid_exists(pid):
            return []
        out, todo = [pid], [pid]
        while todo:
            for child in children.get(todo.pop(), ()):
                out.append(child)
                todo.append(child)
        return out

    def owns_pid(self, kernel_id: str, pid: int) -> bool:
        return pid in self.kernel_pids(kernel_id)

    # -- polling -------------------------------------------------------------------------
    async def poll(self) -> None:
        started = clock.monotonic()
        now = clock.now()
        kernel_ids = list(self.km.list_kernel_ids())
        self._children = _children_by_parent()
        paths = await self._paths()
        usage = self.telemetry.processes()
        devices = self.telemetry.devices()
        self._note_foreign(usage)

        by_pid: dict[int, list[ProcessUsage]] = {}
        for u in usage:
            by_pid.setdefault(u.pid, []).append(u)

        for kid in kernel_ids:
            rec = self.kernels.get(kid)
            if rec is None:
                rec = self.kernels[kid] = KernelRecord(id=kid, first_seen=now, last_activity=now)
                rec.history = deque(maxlen=self.history_len)
            self._update_kernel(rec, by_pid, paths.get(kid, ""), now)

        self._children = None  # between polls, pid checks (the agent channel) read it fresh
        for kid in set(self.kernels) - set(kernel_ids):
            del self.kernels[kid]  # shut down or culled: no history kept for the dead

        for info in devices:
            rec_gpu = self.gpus.get(info.index)
            if rec_gpu is None:
                rec_gpu = self.gpus[info.index] = GPURecord(info, deque(maxlen=self.history_len))
            rec_gpu.info = info
            rec_gpu.history.append((now, info.memory_used, info.utilization))
        for index in set(self.gpus) - {d.index for d in devices}:
            del self.gpus[index]
        self.last_poll_seconds = clock.monotonic() - started

    def _update_kernel(self, rec: KernelRecord, by_pid: dict[int, list[ProcessUsage]], path: str, now: float) -> None:
        try:
            km = self.km.get_kernel(rec.id)
        except KeyError:
            return
        rec.name = getattr(km, "kernel_name", "") or rec.name
        rec.path = path or rec.path
        rec.execution_state = getattr(km, "execution_state", "unknown") or "unknown"
        activity = _epoch(getattr(km, "last_activity", None))
        rec.pids = self.kernel_pids(rec.id)

        gpu_bytes: dict[int, int] = {}
        pid_gpu_bytes: dict[int, dict[int, int]] = {}
        utils: list[float] = []
        for pid in rec.pids:
            for u in by_pid.get(pid, ()):
                gpu_bytes[u.gpu] = gpu_bytes.get(u.gpu, 0) + u.memory_bytes
                per_pid = pid_gpu_bytes.setdefault(pid, {})
                per_pid[u.gpu] = per_pid.get(u.gpu, 0) + u.memory_bytes
                if u.sm_utilization is not None:
                    utils.append(u.sm_utilization)
        if not gpu_bytes and self.foreign_pids and self.agent_reports is not None:
            report = self.agent_reports(rec.id) or {}
            framework_bytes = int(report.get("framework_bytes") or 0)
            if framework_bytes:  # the agent's own count; which GPU is known only on a 1-GPU node
                gpu_bytes[0 if len(self.gpus) == 1 else -1] = framework_bytes
        rec.gpu_bytes = gpu_bytes
        rec.pid_gpu_bytes = pid_gpu_bytes
        rec.sm_utilization = max(utils) if utils else (0.0 if gpu_bytes else None)
        if rec.sm_utilization and rec.sm_utilization > self.idle_utilization:
            activity = max(activity, now)  # GPU work counts as activity
        if rec.busy:
            activity = now
        rec.last_activity = max(rec.last_activity, activity)
        rec.history.append((now, rec.gpu_memory_bytes, rec.sm_utilization, dict(gpu_bytes)))

    def _note_foreign(self, usage: Iterable[ProcessUsage]) -> None:
        if self.telemetry.name != "nvml":
            return
        pids = {u.pid for u in usage}
        foreign = {p for p in pids if not psutil.pid_exists(p)}
        if foreign and not self.foreign_pids:
            log.warning(
                "gpushare: NVML reports pids %s that this pid namespace cannot see (a container?); "
                "attributing GPU memory from the kernel agents' own reports instead",
                sorted(foreign)[:5],
            )
        self.foreign_pids = foreign

    async def _paths(self) -> dict[str, str]:
        if self.session_manager is None:
            return {}
        try:
            sessions = await self.session_manager.list_sessions()
        except Exception:  # the session DB is not ours to break
            return {}
        out = {}
        for s in sessions:
            kernel = s.get("kernel") or {}
            if kernel.get("id"):
                out[kernel["id"]] = s.get("path") or s.get("name") or ""
        return out

    def touch(self, kernel_id: str) -> None:
        """Count now as activity (a restore, a cell)."""
        rec = self.kernels.get(kernel_id)
        if rec is not None:
            rec.last_activity = clock.now()
