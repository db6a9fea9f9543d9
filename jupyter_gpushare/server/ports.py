"""The controller's ports (:mod:`..core.ports`) as the server supplies them: the node read
through the telemetry source and the tracker, the kernels through jupyter_server's kernel
manager and the agent channel."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from ..core.hostmem import HostRoom
from ..core.tracker import Tracker
from ..node.placement import ServiceRoom
from ..policy import caps
from ..policy.caps import CapError
from ..reclaim import ReclaimMethod
from ..telemetry import Telemetry
from .selection import FRAMEWORK, method_for_kernel

log = logging.getLogger(__name__)

READ_TIMEOUT = 10.0  # s a read on the sampling thread may take before it counts as unknown
DAEMON_TIMEOUT = 1.0  # s the node daemon's reading of free memory may take before our own is used


class ServerNodeRoom:
    """GPU and host memory of this server's node (a :class:`..core.ports.NodeRoom`)."""

    def __init__(self, tracker: Tracker, source: Telemetry,
                 refresh: Callable[[], Awaitable[None]],
                 service_room: ServiceRoom | None = None,
                 daemon_free: Callable[[list[str]], Awaitable[dict[str, int | None]]] | None = None) -> None:
        """service_room(uuids): the hub service's view of those GPUs (None: no service, or no
        answer); daemon_free(uuids): the node daemon's reading of their free bytes (None: no
        daemon)."""
        self.tracker = tracker
        self.source = source
        self._refresh = refresh
        self._service_room = service_room
        self._daemon_free = daemon_free
        self._daemon_error: str | None = None

    async def read_free(self, gpus: list[int]) -> dict[int, int | None]:
        """Free bytes per GPU: the node daemon's reading where it runs (a party the server's
        user cannot change), else this server's own."""
        try:
            own = await self.tracker.off_loop(
                lambda: {g: self.source.free_bytes(g) for g in gpus}, READ_TIMEOUT)
        except asyncio.TimeoutError:
            log.warning("gpushare: reading free GPU memory took longer than %g s", READ_TIMEOUT)
            own = {g: None for g in gpus}
        theirs = await self._read_daemon(gpus)
        return {g: theirs[g] if theirs.get(g) is not None else own[g] for g in gpus}

    async def _read_daemon(self, gpus: list[int]) -> dict[int, int | None]:
        if self._daemon_free is None:
            return {}
        uuids = {rec.info.uuid: rec.info.index for rec in self.tracker.gpus.values()
                 if rec.info.uuid and rec.info.index in gpus}
        if not uuids:
            return {}
        try:
            free = await asyncio.wait_for(self._daemon_free(list(uuids)), DAEMON_TIMEOUT)
        except (OSError, ValueError, asyncio.TimeoutError) as e:
            why = str(e) or type(e).__name__
            if self._daemon_error is None:
                log.warning("gpushare: the node daemon's reading of free GPU memory: %s; this "
                            "server's own is used until it answers", why)
            self._daemon_error = why
            return {}
        if self._daemon_error is not None:
            log.info("gpushare: free GPU memory is the node daemon's reading again")
            self._daemon_error = None
        return {uuids[u]: n for u, n in free.items() if u in uuids}

    def total_bytes(self) -> dict[int, int]:
        known = self.source.total_bytes()
        if known is not None:
            return known
        return {g.info.index: g.info.memory_total for g in self.tracker.gpus.values()
                if g.info.memory_total}

    async def host_room(self, pid: int | None) -> HostRoom | None:
        return await self.tracker.off_loop(lambda: self.tracker.hostmem.room(pid), READ_TIMEOUT)

    async def refresh(self) -> None:
        await self._refresh()

    async def node_view(self, gpus: list[int]) -> dict[int, tuple[int | None, bool]] | None:
        if self._service_room is None:
            return None
        uuids = {rec.info.uuid: rec.info.index for rec in self.tracker.gpus.values()
                 if rec.info.uuid and rec.info.index in gpus}
        if not uuids:
            return None
        seen = await self._service_room(list(uuids))
        return None if seen is None else {uuids[u]: v for u, v in seen.items() if u in uuids}


@dataclass(frozen=True)
class AutoPick:
    """``release_method = "auto"`` per kernel (:func:`.selection.method_for_kernel`): every
    usable method, what telemetry sees a kernel's processes hold (None: unknown) and the CUDA
    context's share of that."""

    methods: Mapping[str, ReclaimMethod]
    gpu_bytes: Callable[[str], int | None]
    context_bytes: int


class ServerKernels:
    """What the server knows of its kernels (a :class:`..core.ports.KernelFacts`)."""

    def __init__(self, kernel_manager: Any, method: ReclaimMethod | None,
                 connections: Callable[[], dict[str, Any]], auto: AutoPick | None = None) -> None:
        """method: the release method in use (None: off); connections(): the agents connected
        now, by kernel id (the channel is built after the controller); auto: pick per kernel
        (``release_method = "auto"``), else every kernel gets ``method``."""
        self.kernel_manager = kernel_manager
        self.method = method
        self.connections = connections
        self.auto = auto
        self.picks: dict[str, str] = {}  # kernel id -> "method: why", as auto last picked
        #: kernel id -> (the kernel's agent pid, why): the framework method could not free
        #: that process's memory, so auto uses the node's choice for it (a restart forgets)
        self.framework_failed: dict[str, tuple[int | None, str]] = {}

    def live_state(self, kernel_id: str) -> str:
        try:
            kernel = self.kernel_manager.get_kernel(kernel_id)
        except KeyError:
            return "unknown"
        return getattr(kernel, "execution_state", "unknown")

    def overrides(self, kernel_id: str) -> dict[str, Any]:
        try:
            spec = self.kernel_manager.get_kernel(kernel_id).kernel_spec
            meta = (getattr(spec, "metadata", None) or {}).get("gpushare") or {}
        except Exception:  # no spec (remote kernels): no overrides
            return {}
        out: dict[str, Any] = {}
        if isinstance(meta.get("idle_timeout"), (int, float)) and meta["idle_timeout"] >= 0:
            out["idle_timeout"] = float(meta["idle_timeout"])
        with suppress(CapError):  # a bad one never starts: the provisioner refuses it
            out["memory_limit"] = caps.of_kernelspec({"gpushare": meta})
        return out

    def method_for(self, kernel_id: str) -> str | None:
        """The method for the kernel now; with ``auto_methods``, the framework method where
        the frameworks hold the kernel's memory (why: ``picks[kernel_id]``)."""
        if self.method is None:
            return None
        connections = self.connections()
        if self.method.needs_agent and kernel_id not in connections:
            return None
        if self.auto is None or kernel_id not in connections:
            return self.method.name
        conn = connections[kernel_id]
        report = getattr(conn, "report", None)
        failed = self.framework_failed.get(kernel_id)
        if failed is not None and failed[0] != getattr(conn, "pid", None):
            del self.framework_failed[kernel_id]  # the kernel restarted: another process now
            failed = None
        name, why = method_for_kernel(self.method.name, self.auto.methods, report,
                                      self.auto.gpu_bytes(kernel_id), self.auto.context_bytes,
                                      failed=failed[1] if failed else None)
        pick = f"{name}: {why}"
        if self.picks.get(kernel_id) != pick:
            log.info("gpushare: kernel %s: release method %s", kernel_id, pick)
            self.picks[kernel_id] = pick
        return name

    def method_failed(self, kernel_id: str, method: str, why: str) -> None:
        """A release by ``method`` left the kernel's memory on the GPU (the method undid it):
        with ``auto``, the framework method is not picked for this kernel's process again."""
        if method == FRAMEWORK and self.auto is not None:
            conn = self.connections().get(kernel_id)
            self.framework_failed[kernel_id] = (getattr(conn, "pid", None), why)

    def agent(self, kernel_id: str) -> Any:
        return self.connections().get(kernel_id)
