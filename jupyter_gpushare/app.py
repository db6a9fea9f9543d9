"""The jupyter-server extension: configuration, wiring, and the poll loop.

Set options in ``jupyter_server_config.py`` as ``c.GPUShareApp.NAME = value``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from jupyter_core.paths import jupyter_runtime_dir
from jupyter_server.extension.application import ExtensionApp
from tornado.ioloop import IOLoop
from traitlets import (
    Bool,
    Dict,
    Enum,
    Float,
    Int,
    List,
    TraitError,
    Type,
    Unicode,
    default,
    validate,
)

from . import hub_link, metrics, provisioner
from .agent_ops import AgentOps, check_reply
from .channel import AgentServer, socket_path
from .controller import Controller
from .events import KERNEL_SCHEMA_ID, KERNEL_SCHEMA_PATH
from .gate import SETTINGS_KEY, GateConnection
from .handlers import handlers
from .hostmem import HostRoom
from .policy import PolicyConfig
from .reclaim import ReclaimMethod
from .reclaim.framework import FrameworkMethod
from .reclaim.simulated import SimulatedMethod
from .sim.node import GiB, NodeLedger
from .sim.shared import NODE_ENV, open_node
from .telemetry import Telemetry
from .telemetry.simulated import SimulatedTelemetry
from .views import kernel_view, status_view

BACKEND_ENV = "JUPYTER_GPUSHARE_BACKEND"


class GPUShareApp(ExtensionApp):
    """Reclaims idle kernels' GPU memory without killing them."""

    name = "jupyter_gpushare"
    load_other_extensions = True

    backend = Unicode(
        help="""Where GPU numbers come from: "nvml" (the real GPUs), "simulated" (a simulated
        node, see simulated_gpus) or "auto" (NVML when a GPU answers, else simulated; the log
        says which and why). Default: the environment variable JUPYTER_GPUSHARE_BACKEND, else
        "auto".""",
    ).tag(config=True)

    @default("backend")
    def _default_backend(self) -> str:
        return os.environ.get(BACKEND_ENV, "auto") or "auto"

    @validate("backend")
    def _check_backend(self, proposal: Any) -> str:
        value = proposal["value"]
        if value not in ("auto", "nvml", "simulated"):
            raise TraitError(
                f'GPUShareApp.backend must be "auto", "nvml" or "simulated", not {value!r}'
            )
        return value

    simulated_gpus = List(
        Int(),
        default_value=[16 * GiB, 16 * GiB],
        help="""Memory of each GPU of the simulated node, in bytes, one entry per GPU.
        Default: two GPUs of 16 GiB. Used only by the simulated backend. An empty list is a
        node with no GPU.""",
    ).tag(config=True)

    @validate("simulated_gpus")
    def _check_sim(self, proposal: Any) -> list[int]:
        value = proposal["value"]
        if any(v <= 0 for v in value):
            raise TraitError("GPUShareApp.simulated_gpus: each GPU's memory must be > 0 bytes")
        return value

    simulated_node = Unicode(
        help="""A file that holds the simulated node's state, shared by every Jupyter server on
        this machine that names the same file (a JupyterHub of several users), so they see the
        same simulated GPUs as they would see the same real ones. The first server creates it
        with simulated_gpus; the others use the sizes in it. Default: the environment variable
        JUPYTER_GPUSHARE_SIMULATED_NODE, else "" = a node private to this server. Used only by
        the simulated backend.""",
    ).tag(config=True)

    @default("simulated_node")
    def _default_simulated_node(self) -> str:
        return os.environ.get(NODE_ENV, "")

    poll_interval = Float(
        2.0,
        help="""Seconds between two samples of GPU memory and utilization (and policy
        decisions). Default 2. Must be > 0; below 0.5 s NVML sampling costs noticeable CPU.""",
    ).tag(config=True)

    idle_timeout = Float(
        600.0,
        help="""Seconds a kernel must sit idle (not executing, SM utilization at or below
        idle_utilization) before its GPU memory is released. Default 600. 0 = never release
        automatically (REST, the panel and %gpushare release still work). A kernelspec can
        override it in metadata.gpushare.idle_timeout.""",
    ).tag(config=True)

    idle_utilization = Float(
        5.0,
        help="""SM utilization (percent, 0-100) at or below which a kernel counts as idle, over
        the idle window. Default 5. 0 = any GPU activity keeps a kernel resident.""",
    ).tag(config=True)

    min_release_bytes = Int(
        256 * 1024 * 1024,
        help="""Kernels holding less GPU memory than this (bytes) are never released
        automatically: moving them is not worth the pause. Default 256 MiB. 0 = release any
        kernel that holds GPU memory.""",
    ).tag(config=True)

    release_method = Enum(
        ["auto", "driver", "framework", "off"],
        default_value="auto",
        help="""How GPU memory leaves the GPU: "driver" (CUDA driver checkpoint: any framework,
        frees the CUDA context too; needs driver >= 570, not under MIG), "framework" (the kernel
        agent moves PyTorch/CuPy/JAX objects to host; frees all but the CUDA context), "auto"
        (driver where supported, else framework; "simulated" on the simulated backend) or "off"
        (monitor only, never release). Default "auto".""",
    ).tag(config=True)

    restore_mode = Enum(
        ["eager", "lazy"],
        default_value="eager",
        help="""When a released kernel is restored: "eager" (before any cell runs) or "lazy"
        (only before cells that may touch the GPU, decided by the agent from the cell's code; a
        watchdog restores a released kernel busy for longer than restore_grace). Lazy works
        with the driver and simulated methods only; with the framework method eager is used.
        Default "eager".""",
    ).tag(config=True)

    restore_grace = Float(
        30.0,
        help="""Lazy mode only: seconds a released kernel may run a cell before the watchdog
        restores it anyway (its GPU calls would wait otherwise). Default 30. Must be > 0.""",
    ).tag(config=True)

    pressure_free_fraction = Float(
        0.1,
        help="""When a GPU's free memory falls below this fraction (0-1) of its total, idle
        kernels on it are released after pressure_idle_timeout instead of idle_timeout,
        longest idle first, until it is above again. Default 0.1. 0 = no pressure releases.""",
    ).tag(config=True)

    pressure_idle_timeout = Float(
        120.0,
        help="""Seconds idle after which a kernel may be released under memory pressure or to
        make room for another kernel's restore. Default 120. 0 = any idle kernel may be taken
        at once.""",
    ).tag(config=True)

    lock_timeout = Float(
        10.0,
        help="""Seconds a release waits for the kernel's running GPU work to finish (the driver
        lock) before giving up and leaving the kernel running. Default 10.""",
    ).tag(config=True)

    host_memory_reserve = Int(
        1 << 30,
        help="""Host memory, in bytes, that a release must leave free, in the kernel's memory
        cgroup and on the machine. A release moves the kernel's GPU state into host memory
        inside the kernel's own process, so a state that does not fit would get the kernel
        OOM-killed: such a release is refused with the reason (API, panel, %gpushare), and
        automatic releases skip the kernel. Default 1 GiB. 0 = only the limits themselves.""",
    ).tag(config=True)

    context_bytes = Int(
        512 * 1024 * 1024,
        help="""GPU memory, in bytes, that one CUDA context takes. A restore reserves it on
        top of a kernel's bytes when those came from the kernel's own count (NVML could not
        see its processes, e.g. in a container), since that count leaves the context out.
        Default 512 MiB. 0 = reserve only the counted bytes.""",
    ).tag(config=True)

    kernel_env = Dict(
        default_value={"TF_FORCE_GPU_ALLOW_GROWTH": "true", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
        help="""Environment defaults for kernels the server starts, applied where the user has
        not set them. Default turns off TensorFlow's and JAX's grab-all-memory at start, so
        memory held is memory used. {} = none.""",
    ).tag(config=True)

    history_seconds = Float(
        1800.0,
        help="""Seconds of samples kept per GPU and per kernel for the history API and the
        panel's charts. Default 1800. Memory: about 100 bytes per kernel per poll.""",
    ).tag(config=True)

    load_agent = Bool(
        True,
        help="""Load the gpushare agent (and %gpushare magics) into IPython kernels the server
        starts, through the gpushare kernel provisioner. Default True. False = track by NVML
        only: no simulated backend, no framework method, no restore before nbclient cells.""",
    ).tag(config=True)

    telemetry_class = Type(
        default_value=Telemetry,
        klass=Telemetry,
        help="""A Telemetry subclass to use instead of the one backend picks (tests, other
        hardware). Default: the abstract base class itself, which means "as backend says".""",
    ).tag(config=True)

    @validate("poll_interval", "restore_grace", "history_seconds", "lock_timeout")
    def _check_positive(self, proposal: Any) -> float:
        if proposal["value"] <= 0:
            raise TraitError(f"GPUShareApp.{proposal['trait'].name} must be > 0, got {proposal['value']}")
        return proposal["value"]

    @validate("idle_timeout", "pressure_idle_timeout", "min_release_bytes", "host_memory_reserve",
              "context_bytes")
    def _check_non_negative(self, proposal: Any) -> Any:
        if proposal["value"] < 0:
            raise TraitError(f"GPUShareApp.{proposal['trait'].name} must be >= 0, got {proposal['value']}")
        return proposal["value"]

    @validate("idle_utilization")
    def _check_percent(self, proposal: Any) -> float:
        if not 0 <= proposal["value"] <= 100:
            raise TraitError(f"GPUShareApp.idle_utilization is a percentage (0-100), got {proposal['value']}")
        return proposal["value"]

    @validate("pressure_free_fraction")
    def _check_fraction(self, proposal: Any) -> float:
        if not 0 <= proposal["value"] < 1:
            raise TraitError(f"GPUShareApp.pressure_free_fraction must be in [0, 1), got {proposal['value']}")
        return proposal["value"]

    # -- wiring ---------------------------------------------------------------------------------
    @property
    def server(self) -> Any:
        """The ServerApp we are loaded into (always set once the extension is linked)."""
        assert self.serverapp is not None
        return self.serverapp

    def _route_logs(self) -> None:
        """The package's module loggers write through the server's log (its format, its level),
        not Python's bare last-resort handler."""
        pkg = logging.getLogger("jupyter_gpushare")
        self._saved_log = (pkg.handlers, pkg.propagate, pkg.level)
        pkg.handlers = list(self.log.handlers)
        # still propagate: a root handler (pytest's, an admin's logging config) sees them too;
        # the server's own loggers do not sit under the root's handlers, so nothing doubles
        pkg.propagate = True
        pkg.setLevel(self.log.getEffectiveLevel())

    def _unroute_logs(self) -> None:
        saved = getattr(self, "_saved_log", None)
        if saved is not None:
            pkg = logging.getLogger("jupyter_gpushare")
            pkg.handlers, pkg.propagate, _ = saved
            pkg.setLevel(saved[2])

    def initialize_settings(self) -> None:
        self._route_logs()
        self.node: NodeLedger | None = None
        self.telemetry: Telemetry | None = None
        self.backend_name = ""
        self.backend_reason = ""
        self.method_name = "off"
        self._started = asyncio.Event()
        self._poll_lock = asyncio.Lock()
        self._start_task: Any = None
        self._poll_task: asyncio.Task[None] | None = None
        self.socket_path = socket_path(jupyter_runtime_dir())
        os.makedirs(os.path.dirname(self.socket_path), exist_ok=True)
        self.methods: dict[str, ReclaimMethod] = {}
        self._choose_backend()
        self._wire_core()
        self._wire_channel()
        self.hub_link = hub_link.connect(self.config, self.controller, self.poll_once)
        self._install_gate()
        self._install_provisioner()
        self.server.event_logger.register_event_schema(KERNEL_SCHEMA_PATH)
        self.settings[SETTINGS_KEY] = self.controller
        IOLoop.current().add_callback(self._start)

    def initialize_handlers(self) -> None:
        self.handlers.extend(handlers())

    def _choose_backend(self) -> None:
        choice = self.backend
        if self.telemetry_class is not Telemetry:
            self.telemetry = self.telemetry_class()  # type: ignore[abstract]
            self.backend_name = self.telemetry.name or "custom"
            self.backend_reason = f"telemetry_class = {self.telemetry_class.__name__}"
        elif choice in ("auto", "nvml"):
            from .telemetry.nvml import NVMLTelemetry

            nvml = NVMLTelemetry()
            status = nvml.open()
            gpus = nvml.devices() if status.available else []
            if choice == "nvml" or gpus:
                self.telemetry, self.backend_name = nvml, "nvml"
                self.backend_reason = (f"NVML sees {len(gpus)} GPU(s)" if gpus
                                       else f"backend = nvml, but NVML is unavailable: {status.reason}")
            else:
                nvml.close()
                why = status.reason or "NVML found no GPU"
                self.backend_reason = f"no GPU answered NVML ({why}): using the simulated node"
        if self.telemetry is None:
            self.node = open_node(self.simulated_node, tuple(self.simulated_gpus))
            self.telemetry = SimulatedTelemetry(self.node)
            self.backend_name = "simulated"
            self.backend_reason = self.backend_reason or "backend = simulated"
            self.telemetry.open()
        self.log.info("gpushare: telemetry backend %s (%s)", self.backend_name, self.backend_reason)

    def _wire_core(self) -> None:
        from .tracker import Tracker

        assert self.telemetry is not None
        self.tracker = Tracker(
            self.server.kernel_manager, self.telemetry, self.history_seconds, self.poll_interval,
            session_manager=self.server.session_manager,
            agent_reports=lambda kid: self.agent_ops.report_of(kid),
        )
        self.tracker.idle_utilization = self.idle_utilization
        if self.backend_name == "simulated":
            self.methods["simulated"] = SimulatedMethod(lock_timeout=self.lock_timeout)
        else:
            self.methods["framework"] = FrameworkMethod()
            try:
                from .reclaim.driver import DriverMethod

                driver = DriverMethod(free_bytes=self._free_bytes,
                                      lock_timeout_ms=int(self.lock_timeout * 1000))
                support = driver.support()
                if support.ok:
                    self.methods["driver"] = driver
                elif self.release_method == "driver":
                    self.log.warning("gpushare: release_method = driver, but %s", support.reason)
                self.driver_reason = support.reason
            except ImportError as e:  # pragma: no cover - the module ships with the package
                self.driver_reason = str(e)
        self.method_name = self._default_method()
        restore_mode = self.restore_mode
        if restore_mode == "lazy" and self.method_name == "framework":
            self.log.warning("gpushare: restore_mode = lazy needs the driver or simulated method; using eager")
            restore_mode = "eager"
        self.controller = Controller(
            self.tracker,
            self.methods,
            choose_method=self._method_for,
            config=PolicyConfig(
                idle_timeout=self.idle_timeout,
                idle_utilization=self.idle_utilization,
                min_release_bytes=self.min_release_bytes,
                pressure_free_fraction=self.pressure_free_fraction,
                pressure_idle_timeout=self.pressure_idle_timeout,
            ),
            read_free=self._read_free,
            total_bytes=self._total_bytes,
            agent=lambda kid: self.channel.connections.get(kid),
            emit=self._emit,
            restore_mode=restore_mode,
            restore_grace=self.restore_grace,
            kernel_overrides=self._kernelspec_overrides,
            refresh=self.poll_once,
            host_room=self._host_room,
            host_memory_reserve=self.host_memory_reserve,
            context_bytes=0 if self.backend_name == "simulated" else self.context_bytes,
            live_state=self._live_state,
        )

    def _wire_channel(self) -> None:
        self.agent_ops: AgentOps = AgentOps(
            self.controller, self.tracker, self.node, poll=self.poll_once,
            kernel_view=lambda kid: kernel_view(self.controller, kid), backend=self.backend_name,
            connections=lambda: self.channel.connections,
            hub_view=lambda: self.hub_link.view() if self.hub_link is not None else None,
        )
        self.channel: AgentServer = AgentServer(
            self.socket_path, self.agent_ops.authorize, self.agent_ops.handlers(),
            on_connect=self.agent_ops.on_connect, on_disconnect=self.agent_ops.on_disconnect,
            hello_reply=self.agent_ops.hello_reply, check_reply=check_reply,
        )
        self.channel.hello_extra = {
            "restore_mode": self.controller.restore_mode,
            "simulated_gpus": list(self.node.capacities) if self.node else None,
        }

    def _default_method(self) -> str:
        if self.release_method == "off":
            return "off"
        if self.backend_name == "simulated":
            return "simulated"
        if self.release_method in ("driver", "framework"):
            return self.release_method if self.release_method in self.methods else "off"
        return "driver" if "driver" in self.methods else "framework"

    def _method_for(self, kernel_id: str) -> str | None:
        name = self.method_name
        if name == "off" or name not in self.methods:
            return None
        if name in ("simulated", "framework") and kernel_id not in self.channel.connections:
            return None  # both need the kernel's agent
        return name

    def _install_gate(self) -> None:
        from jupyter_server.services.kernels.connection.channels import (
            ZMQChannelsWebsocketConnection,
        )

        current = self.server.kernel_websocket_connection_class
        if current is ZMQChannelsWebsocketConnection:
            self.server.kernel_websocket_connection_class = GateConnection
            # ExtensionApp merges self.settings into the web app's after this method: set both
            self.server.web_app.settings["kernel_websocket_connection_class"] = GateConnection
            self.settings["kernel_websocket_connection_class"] = GateConnection
        elif not (isinstance(current, type) and issubclass(current, GateConnection)):
            self.log.warning(
                "gpushare: ServerApp.kernel_websocket_connection_class is %s; the gate is off, so "
                "cells restore through the kernel agent only", current,
            )

    def _install_provisioner(self) -> None:
        from jupyter_client.provisioning.factory import KernelProvisionerFactory

        provisioner.settings = provisioner.LaunchSettings(
            socket_path=self.socket_path,
            kernel_env={str(k): str(v) for k, v in self.kernel_env.items()},
            simulated_gpus=list(self.node.capacities) if self.node else None,
            load_agent=self.load_agent,  # kernel_env applies either way
        )
        factory = KernelProvisionerFactory.instance()
        if factory.default_provisioner_name in ("local-provisioner", provisioner.NAME):
            factory.default_provisioner_name = provisioner.NAME
        else:
            self.log.warning(
                "gpushare: kernels use provisioner %s, so they start without the gpushare agent "
                "(tracking by NVML only). Subclass jupyter_gpushare.provisioner.GPUShareProvisioner "
                "in yours to keep both.", factory.default_provisioner_name)

    # -- start / stop -----------------------------------------------------------------------------
    async def _start(self) -> None:
        if self._start_task is not None:
            return
        self._start_task = True
        await self.channel.start()
        self._poll_task = asyncio.ensure_future(self._poll_loop())
        if self.hub_link is not None:
            self.hub_link.start(self.server.event_logger)

    async def _start_jupyter_server_extension(self, serverapp: Any) -> None:
        await self._start()

    async def ready(self) -> None:
        """Wait until the channel listens and the first poll is done (handlers call this)."""
        if not self._started.is_set():
            await self._start()
        await self._started.wait()

    async def _poll_loop(self) -> None:
        while True:
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad poll must not stop tracking
                self.log.exception("gpushare: poll failed")
            self._started.set()  # after the first poll: status never answers with no GPUs yet
            await asyncio.sleep(self.poll_interval)

    async def poll_once(self) -> None:
        """One sample and one policy pass; polls never overlap (the loop, an agent's release)."""
        async with self._poll_lock:
            await self.channel.heal()  # its socket file removed: listen again
            if self.tracker.foreign_pids:
                await self.agent_ops.refresh_reports()
            await self.tracker.poll()
            metrics.POLL_SECONDS.observe(self.tracker.last_poll_seconds)
            await self.controller.tick()
            self._export_metrics()

    async def stop_extension(self) -> None:
        if self._poll_task is not None:
            self._poll_task.cancel()
        if self.hub_link is not None:
            await self.hub_link.stop()
        try:
            await self.controller.shutdown()
        finally:
            await self.channel.stop()
            self.tracker.close()
            if self.telemetry is not None:
                self.telemetry.close()
            provisioner.settings = None
            self._unroute_logs()

    # -- helpers ------------------------------------------------------------------------------------
    def _free_bytes(self, gpu: int) -> int | None:
        """Free memory of one GPU read now (blocking: call it off the event loop)."""
        return self.telemetry.free_bytes(gpu) if self.telemetry is not None else None

    async def _read_free(self, gpus: list[int]) -> dict[int, int | None]:
        """Free memory of ``gpus`` read now, on the sampling thread; None where unknown."""
        try:
            return await self.tracker.off_loop(lambda: {g: self._free_bytes(g) for g in gpus}, 10)
        except asyncio.TimeoutError:
            self.log.warning("gpushare: reading free GPU memory took longer than 10 s")
            return {g: None for g in gpus}

    async def _host_room(self, pid: int | None) -> HostRoom:
        return await self.tracker.off_loop(lambda: self.tracker.hostmem.room(pid), 10)

    def _live_state(self, kernel_id: str) -> str:
        try:
            return getattr(self.server.kernel_manager.get_kernel(kernel_id), "execution_state", "unknown")
        except KeyError:
            return "unknown"

    def _total_bytes(self) -> dict[int, int]:
        if self.node is not None:
            return dict(enumerate(self.node.capacities))
        return {g.info.index: g.info.memory_total for g in self.tracker.gpus.values()
                if g.info.memory_total}

    def _kernelspec_overrides(self, kernel_id: str) -> dict[str, Any]:
        try:
            spec = self.server.kernel_manager.get_kernel(kernel_id).kernel_spec
            meta = (getattr(spec, "metadata", None) or {}).get("gpushare") or {}
        except Exception:  # no spec (remote kernels): no overrides
            return {}
        out: dict[str, Any] = {}
        if isinstance(meta.get("idle_timeout"), (int, float)) and meta["idle_timeout"] >= 0:
            out["idle_timeout"] = float(meta["idle_timeout"])
        return out

    def _emit(self, data: dict[str, Any]) -> None:
        self.server.event_logger.emit(schema_id=KERNEL_SCHEMA_ID, data=data)

    def _export_metrics(self) -> None:
        for g in self.tracker.gpus.values():
            label = str(g.info.index)
            if g.info.memory_total is not None:
                metrics.GPU_MEMORY_TOTAL.labels(label).set(g.info.memory_total)
            if g.info.memory_used is not None:
                metrics.GPU_MEMORY_USED.labels(label).set(g.info.memory_used)
            if g.info.utilization is not None:
                metrics.GPU_UTILIZATION.labels(label).set(g.info.utilization)
        metrics.set_kernel_memory({
            (kid, str(gpu)): n
            for kid, rec in self.tracker.kernels.items() for gpu, n in rec.gpu_bytes.items()
        })
        metrics.set_kernel_host_room({
            kid: rec.host_room.available for kid, rec in self.tracker.kernels.items()
            if rec.host_room is not None and rec.host_room.available is not None
        })

    def status(self) -> dict[str, Any]:
        assert self.telemetry is not None
        tstatus = self.telemetry.status()
        return status_view(self.controller, self.backend_name, self.method_name,
                           tstatus.available, tstatus.reason if not tstatus.available else "",
                           hub=self.hub_link.view() if self.hub_link is not None else None)


logging.getLogger(__name__).addHandler(logging.NullHandler())
