"""The jupyter-server extension: its options, its wiring, and the poll loop.

Set options in ``jupyter_server_config.py`` as ``c.GPUShareApp.NAME = value``.

Loading is all or nothing. Everything that can fail (the configuration, the telemetry
source, the release methods, the agent channel's socket) is built first, and closed again
when a step fails; only then does the extension change anything outside itself
(:mod:`.server_hooks`: the websocket class, the default provisioner, the event schema, log
routing), each change with its undo. A failed load leaves the server stock and says why once.
``stop_extension`` is safe in any state and puts everything back.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from contextlib import ExitStack, suppress
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

from ..core import metrics
from ..core.ahead import AheadRestores
from ..core.controller import Controller
from ..core.hostmem import HostRoom
from ..core.tracker import Tracker
from ..events import KERNEL_SCHEMA_ID, KERNEL_SCHEMA_PATH
from ..node import hub_link
from ..node.node_locks import NodeLocks
from ..node.placement import Placer
from ..policy import Policy, PolicyConfig
from ..reclaim import MethodContext, ReclaimMethod
from ..telemetry import SIMULATED_GPUS_DEFAULT, SIMULATED_NODE_ENV, Telemetry, TelemetrySettings
from . import selection, server_hooks
from .agent_ops import AgentOps, check_reply
from .channel import AgentServer, socket_path
from .gate import GATES_KEY, SETTINGS_KEY, Gates
from .handlers import handlers
from .provisioner import LaunchSettings
from .views import kernel_view, status_view

BACKEND_ENV = selection.BACKEND_ENV

_instances = itertools.count(1)  # extensions initialized in this process (socket names)
_active: GPUShareApp | None = None  # the one whose hooks are installed now


class ExtensionOff(RuntimeError):
    """The extension did not load and the server runs without it; the message says why."""


class GPUShareApp(ExtensionApp):
    """Reclaims idle kernels' GPU memory without killing them."""

    name = "jupyter_gpushare"
    load_other_extensions = True

    backend = Unicode(
        help="""Where GPU numbers come from: "nvml" (the real GPUs), "simulated" (a simulated
        node, see simulated_gpus), "auto" (NVML when a GPU answers, else simulated; the log
        says which and why) or the name of a backend another installed package registers
        (entry point group jupyter_gpushare.telemetry_backends). Default: the environment
        variable JUPYTER_GPUSHARE_BACKEND (checked like this option: another value is
        refused), else "auto".""",
    ).tag(config=True)

    @default("backend")
    def _default_backend(self) -> str:
        try:
            return selection.backend_from_environment()
        except selection.SettingError as e:
            raise TraitError(str(e)) from None

    @validate("backend")
    def _check_backend(self, proposal: Any) -> str:
        try:
            return selection.check_backend(proposal["value"])
        except selection.SettingError as e:
            raise TraitError(str(e)) from None

    simulated_gpus = List(
        Int(),
        default_value=list(SIMULATED_GPUS_DEFAULT),
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
        return os.environ.get(SIMULATED_NODE_ENV, "")

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

    release_method = Unicode(
        "auto",
        help="""How GPU memory leaves the GPU: "driver" (CUDA driver checkpoint: any framework,
        frees the CUDA context too; needs driver >= 570, not under MIG), "framework" (the kernel
        agent moves PyTorch/CuPy/JAX objects to host; frees all but the CUDA context), "auto"
        (driver where supported, else framework; "simulated" on the simulated backend), "off"
        (monitor only, never release), or the name of a method another package registers
        (entry point group jupyter_gpushare.release_methods). Default "auto".""",
    ).tag(config=True)

    @validate("release_method")
    def _check_method(self, proposal: Any) -> str:
        try:
            return selection.check_method(proposal["value"])
        except selection.SettingError as e:
            raise TraitError(str(e)) from None

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
        Placement (see placement) also counts a GPU with less room than this as full, on
        either backend. Default 512 MiB. 0 = reserve only the counted bytes.""",
    ).tag(config=True)

    node_lock_dir = Unicode(
        help="""A directory the Jupyter servers of this machine share, where restores take a
        lock file per GPU (named by the GPU's UUID), so that restores on different servers take
        turns on a GPU instead of both filling the same free memory. Used only where no other
        user can take the locks: the directory (not a symbolic link) must belong to this
        server's user and be writable by nobody else, or belong to root and be writable by
        nobody else or sticky; a lock file must be a regular file of this user or root.
        Created (mode 0700) when missing. Default: gpushare-locks in this user's Jupyter
        runtime directory, which serializes this user's own servers. For a node with several
        users' servers, an admin creates a root-owned directory and one root-owned lock file
        per GPU (see the admin guide) and sets it here. A directory or lock file that does not
        qualify is refused with a warning in the log, and restores on that GPU then go on
        without a turn and ask for room for twice their state, read twice 0.5 s apart. The wait
        for a turn another server holds is shown in the cell and status, and is bounded per
        GPU: 60 s per holder, after which restores there go on without a turn while it keeps
        it. "" = restores take turns only within this server. Not used with a private
        simulated node (no other server sees it).""",
    ).tag(config=True)

    @default("node_lock_dir")
    def _default_node_lock_dir(self) -> str:
        return os.path.join(jupyter_runtime_dir(), "gpushare-locks")  # not at import

    kernel_env = Dict(
        default_value={"TF_FORCE_GPU_ALLOW_GROWTH": "true", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
        help="""Environment defaults for kernels the server starts, applied where the user has
        not set them. Default turns off TensorFlow's and JAX's grab-all-memory at start, so
        memory held is memory used. {} = none.""",
    ).tag(config=True)

    history_seconds = Float(
        1800.0,
        help="""Seconds of samples kept per GPU and per kernel for the history API and the
        panel's charts. Default 1800. Memory: about 450 bytes per kernel per poll (a
        release or restore adds a poll, so under load the samples span less time).""",
    ).tag(config=True)

    load_agent = Bool(
        True,
        help="""Load the gpushare agent (and %gpushare magics) into IPython kernels the server
        starts, through the gpushare kernel provisioner. Default True. False = track by NVML
        only: no simulated backend, no framework method, no restore before nbclient cells.""",
    ).tag(config=True)

    telemetry_class = Type(
        klass=Telemetry,
        help="""The Telemetry subclass GPU numbers come from. Default: the class backend names
        (NVMLTelemetry for "nvml" and "auto", SimulatedTelemetry for "simulated"). Set it to
        use another source without registering it (it is then used as it is, whatever
        backend says).""",
    ).tag(config=True)

    @default("telemetry_class")
    def _default_telemetry_class(self) -> type[Telemetry]:
        return selection.telemetry_class(self.backend)

    policy_class = Type(
        default_value=Policy,
        klass=Policy,
        help="""The release rules: a subclass of jupyter_gpushare.policy.Policy whose decide,
        make_room and seconds_until_release say which kernels to release after each poll and
        to make room for a restore (quotas, fair share). It may have options of its own
        (c.MyPolicy.NAME). Default: Policy, the rules docs/how-it-works.md describes.""",
    ).tag(config=True)

    keep_restore_progress = Bool(
        False,
        help="""Keep the restore progress line ("gpushare: restored 1.0 GiB in 0.42 s") in the
        output of the cell that waited for the restore, so that it is saved with the notebook.
        Default False: the line shows while the restore runs and is cleared before the cell's
        code runs (the panel, the status bar and a notification keep the result), so saved
        notebooks carry no gpushare output. Restores asked with %gpushare restore keep their
        line either way.""",
    ).tag(config=True)

    socket_dir = Unicode(
        "",
        help="""Directory of the agent channel's Unix socket (gpushare-<pid>.sock, mode 0600).
        Default "" = Jupyter's runtime directory. Unix sockets cannot be created on some
        network file systems: point this at a local directory then. A directory where the
        socket cannot be created keeps the extension from loading (the log says why).""",
    ).tag(config=True)

    ahead_grace = Float(
        300.0,
        help="""Seconds a kernel restored ahead of its person's next cell (the JupyterLab
        extension asks for that when someone opens or edits a notebook whose kernel is
        released) stays on the GPU without running a cell before it may be released again,
        without waiting for idle_timeout. Taken as an automatic release would be: never a
        pinned kernel, one computing on the GPU, or one whose idle timeout is 0. Default 300.
        0 = a kernel restored ahead is kept like any other (released again by idle_timeout).""",
    ).tag(config=True)

    @validate("ahead_grace")
    def _check_ahead_grace(self, proposal: Any) -> float:
        if proposal["value"] < 0:
            raise TraitError(f"GPUShareApp.ahead_grace must be >= 0, got {proposal['value']}")
        return proposal["value"]

    placement = Enum(
        ["room", "off"],
        default_value="room",
        help="""How a kernel the server starts gets its GPU(s). "room": the gpushare kernel
        provisioner sets the kernel's CUDA_VISIBLE_DEVICES to the GPU(s) with the most room
        (free memory read at launch, less the bytes this server's released kernels will take
        back and its restores have reserved), then the least SM utilization, then the fewest
        kernels this server placed there; its device 0 is the one with the most room. An
        existing CUDA_VISIBLE_DEVICES in the kernel's or the server's environment is the set
        it chooses within. How many GPUs: the kernelspec's metadata.gpushare.gpus, else
        placement_gpus. A GPU has room when that is at least context_bytes; a kernel placed
        where no GPU has room starts anyway and its first cell says so (IPython kernels with
        the agent; the server log for all). "off": the environment decides, as without
        gpushare (for spawners that pin GPUs). Needs the gpushare provisioner (kernels of
        another provisioner are not placed); MIG instances are not placed. Default "room".""",
    ).tag(config=True)

    placement_gpus = Int(
        1,
        help="""How many GPUs a kernel gets with placement = "room" when its kernelspec does not
        say (metadata.gpushare.gpus). Default 1. Capped at the GPUs the kernel may use (a
        kernelspec asking for more than that is refused at start with the reason). 0 = no
        GPU: CUDA_VISIBLE_DEVICES="".""",
    ).tag(config=True)

    @validate("placement_gpus")
    def _check_placement_gpus(self, proposal: Any) -> int:
        if proposal["value"] < 0:
            raise TraitError(f"GPUShareApp.placement_gpus must be >= 0, got {proposal['value']}")
        return proposal["value"]

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


    # -- state (class defaults hold before, during and after a failed load) -----------------
    #: new -> loaded -> starting -> running -> stopped; "off" after a failed load
    _phase = "new"
    _refusal = ""  # why the configuration was refused when the extension was linked
    _teardown: ExitStack | None = None  # closes what was built, undoes what was changed
    _poll_task: asyncio.Task[None] | None = None
    telemetry: Telemetry | None = None
    backend_name = ""
    backend_reason = ""
    method_name = "off"
    methods: dict[str, ReclaimMethod]
    tracker: Tracker
    controller: Controller
    agent_ops: AgentOps
    channel: AgentServer
    socket_path = ""

    @property
    def server(self) -> Any:
        """The ServerApp we are loaded into (always set once the extension is linked)."""
        assert self.serverapp is not None
        return self.serverapp

    @property
    def _source(self) -> Telemetry:
        """The telemetry source, open (set by ``_build`` before anything asks its hooks)."""
        assert self.telemetry is not None
        return self.telemetry

    @property
    def node(self) -> Any:
        """The source's own ledger of its GPUs, when it keeps one (the simulated node), else
        None: for tests and tools; the extension itself asks only the source's hooks."""
        return getattr(self.telemetry, "node", None)

    # -- load: all or nothing ---------------------------------------------------------------
    def _link_jupyter_server_extension(self, serverapp: Any) -> None:
        try:
            super()._link_jupyter_server_extension(serverapp)
        except Exception as e:  # a bad option: refuse to load rather than run half-configured
            self.serverapp = serverapp
            self._refusal = f"its configuration was refused: {e}"

    def initialize(self) -> None:  # type: ignore[override]  # ExtensionApp's takes no argv
        """Build, then hook into the server; on any failure put back what was done and
        raise :class:`ExtensionOff` (jupyter_server logs it once and goes on without us)."""
        if self._phase != "new":
            return  # loaded (or refused) already: a second load changes nothing
        if self._refusal:
            self._phase = "off"
            raise ExtensionOff(_off(self._refusal))
        try:
            super().initialize()  # options, initialize_settings, handlers
        except Exception as e:
            self._unload()
            self._phase = "off"
            if isinstance(e, ExtensionOff):
                raise
            why = str(e) if isinstance(e, TraitError) else f"{type(e).__name__}: {e}"
            raise ExtensionOff(_off(why)) from e

    def initialize_settings(self) -> None:
        self._teardown = ExitStack()
        self._build(self._teardown)  # may fail: nothing outside the extension changed yet
        self._hook_in(self._teardown)

    def initialize_handlers(self) -> None:
        self.handlers.extend(handlers())

    def _build(self, teardown: ExitStack) -> None:
        """Everything that can fail, each piece closed by ``teardown``."""
        self.hub_link: hub_link.HubLink | None = None
        self._started = asyncio.Event()
        self._poll_lock = asyncio.Lock()
        self._next_poll: asyncio.Future[None] | None = None
        self._open_telemetry(teardown)
        assert self.telemetry is not None
        self._choose_method()
        self.tracker = Tracker(
            self.server.kernel_manager, self.telemetry, self.history_seconds, self.poll_interval,
            session_manager=self.server.session_manager,
            agent_reports=lambda kid: self.agent_ops.report_of(kid),
        )
        teardown.callback(self.tracker.close)
        self.tracker.idle_utilization = self.idle_utilization
        self.controller = self._make_controller()
        self.agent_ops = AgentOps(
            self.controller, self.tracker, self.telemetry, poll=self.poll_once,
            kernel_view=lambda kid: kernel_view(self.controller, kid), backend=self.backend_name,
            connections=lambda: self.channel.connections,
            hub_view=lambda: self.hub_link.view() if self.hub_link is not None else None,
        )
        directory = self.socket_dir or jupyter_runtime_dir()
        self.socket_path = socket_path(directory, next(_instances))
        self.channel = AgentServer(
            self.socket_path, self.agent_ops.authorize, self.agent_ops.handlers(),
            on_connect=self.agent_ops.on_connect, on_disconnect=self.agent_ops.on_disconnect,
            hello_reply=self.agent_ops.hello_reply, check_reply=check_reply,
        )
        self.channel.hello_extra = {
            "restore_mode": self.controller.restore_mode,
            **self.telemetry.hello_extra(),
        }
        try:
            os.makedirs(os.path.dirname(self.socket_path), mode=0o700, exist_ok=True)
            self.channel.bind()
        except OSError as e:
            raise ExtensionOff(_off(f"cannot create the agent socket {self.socket_path}: {e}")) from e
        teardown.callback(self.channel.close_now)
        self.hub_link = hub_link.connect(self.config, self.controller, self.refresh)
        self.ahead = AheadRestores(self.controller, self.ahead_grace)

    def _open_telemetry(self, teardown: ExitStack) -> None:
        settings = TelemetrySettings(tuple(self.simulated_gpus), self.simulated_node)
        try:
            chosen = selection.open_telemetry(self.backend, self.telemetry_class, settings,
                                              teardown)
        except Exception as e:
            raise ExtensionOff(_off(f"the telemetry source {self.telemetry_class.__name__} failed "
                                    f"to start: {type(e).__name__}: {e}")) from e
        self.telemetry, self.backend_name, self.backend_reason = chosen
        self.log.info("gpushare: telemetry backend %s (%s)", self.backend_name, self.backend_reason)

    def _choose_method(self) -> None:
        context = MethodContext(free_bytes=self._free_bytes, lock_timeout=self.lock_timeout)
        assert self.telemetry is not None
        choice = selection.choose_method(self.release_method, self.backend_name, context,
                                         simulated=self.telemetry.simulated)
        self.methods, self.method_name = choice.methods, choice.name
        named = self.release_method not in (selection.AUTO, selection.OFF)
        if named and choice.name == selection.OFF:
            self.log.warning("gpushare: %s; nothing is released", choice.reason)
        else:
            self.log.info("gpushare: release method %s (%s)", choice.name, choice.reason)

    def _make_controller(self) -> Controller:
        method = self.methods.get(self.method_name)
        restore_mode = self.restore_mode
        if restore_mode == "lazy" and method is not None and not method.supports_lazy:
            self.log.warning("gpushare: restore_mode = lazy needs a method that supports it "
                             "(%s does not); using eager", method.name)
            restore_mode = "eager"
        config = PolicyConfig(
            idle_timeout=self.idle_timeout,
            idle_utilization=self.idle_utilization,
            min_release_bytes=self.min_release_bytes,
            pressure_free_fraction=self.pressure_free_fraction,
            pressure_idle_timeout=self.pressure_idle_timeout,
        )
        return Controller(
            self.tracker,
            self.methods,
            choose_method=self._method_for,
            config=config,
            rules=self.policy_class(config, parent=self),
            read_free=self._read_free,
            total_bytes=self._total_bytes,
            agent=lambda kid: self.channel.connections.get(kid),
            emit=self._emit,
            restore_mode=restore_mode,
            restore_grace=self.restore_grace,
            kernel_overrides=self._kernelspec_overrides,
            refresh=self.refresh,
            host_room=self._host_room,
            host_memory_reserve=self.host_memory_reserve,
            context_bytes=self._source.context_bytes(self.context_bytes),
            live_state=self._live_state,
            clear_progress=not self.keep_restore_progress,
            node_locks=self._node_locks(),
        )

    def _node_locks(self) -> NodeLocks | None:
        if not self.node_lock_dir or not self._source.shares_node_locks():
            return None
        locks = NodeLocks(self.node_lock_dir)
        why = locks.refusal()  # said once at start; each restore's turn checks again
        if why:
            self.log.warning("gpushare: %s; restores go on without a turn across servers, with a "
                             "stricter room check (see GPUShareApp.node_lock_dir)", why)
        return locks

    def _hook_in(self, teardown: ExitStack) -> None:
        """The changes outside the extension, each undone by ``teardown``."""
        global _active
        server = self.server
        previous = _active
        if previous is not None and previous is not self and previous._phase != "stopped":
            previous._abandon("another Jupyter server was initialized in this process")
        server_hooks.register_schema(server.event_logger, KERNEL_SCHEMA_ID, KERNEL_SCHEMA_PATH,
                                     teardown)
        server_hooks.route_logs(self.log, teardown)
        server_hooks.install_provisioner(LaunchSettings(
            socket_path=self.socket_path,
            kernel_env={str(k): str(v) for k, v in self.kernel_env.items()},
            source_env=self._source.launch_env(),
            load_agent=self.load_agent,  # kernel_env applies either way
            placer=Placer.from_app(self) if self.placement == "room" else None,
        ), self.log, teardown)
        server_hooks.install_gate(server, self.settings, self.log, teardown)
        server_hooks.publish(SETTINGS_KEY, self.controller, self.settings,
                             server.web_app.settings, teardown)
        gates = Gates(self.controller)
        server_hooks.publish(GATES_KEY, gates, self.settings, server.web_app.settings, teardown)
        server_hooks.hook_kernel_manager(server.kernel_manager, gates, self.log, teardown)
        server_hooks.at_exit(self.channel.remove_file, teardown)
        _active = self
        teardown.callback(self._no_longer_active)
        self._phase = "loaded"
        IOLoop.current().add_callback(self._start)

    def _no_longer_active(self) -> None:
        global _active
        if _active is self:
            _active = None

    def _unload(self) -> None:
        """Undo every change and close everything built, newest first. Idempotent."""
        teardown, self._teardown = self._teardown, None
        if teardown is not None:
            teardown.close()

    # -- start / stop -----------------------------------------------------------------------------
    async def _start(self) -> None:
        if self._phase != "loaded":
            return  # starting or running already, stopped, or never loaded
        self._phase = "starting"
        try:
            await self.channel.start()
        except Exception:  # tracking goes on; agents cannot connect
            self.log.exception("gpushare: the agent channel cannot serve on %s", self.socket_path)
        if self._phase != "starting":  # stopped while the channel started: stop it too
            await self.channel.stop()
            return
        self._poll_task = asyncio.ensure_future(self._poll_loop())
        self._phase = "running"
        if self.hub_link is not None:
            self.hub_link.start(self.server.event_logger)

    async def _start_jupyter_server_extension(self, serverapp: Any) -> None:
        await self._start()

    async def ready(self) -> None:
        """Wait until the channel listens and the first poll is done (handlers call this)."""
        await self._start()
        if self._phase in ("starting", "running"):
            await self._started.wait()

    async def _poll_loop(self) -> None:
        while self._phase == "running":
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad poll must not stop tracking
                self.log.exception("gpushare: poll failed")
            self._started.set()  # after the first poll: status never answers with no GPUs yet
            await asyncio.sleep(self.poll_interval)

    async def refresh(self) -> None:
        """A poll that starts after this call: what status shows after an operation is of one
        moment. Operations that end while no such poll has started yet share one (under load
        a poll per operation was most of a release's latency)."""
        pending = self._next_poll
        if pending is None or pending.done():
            pending = self._next_poll = asyncio.ensure_future(self.poll_once())
        await asyncio.shield(pending)

    async def poll_once(self) -> None:
        """One sample and one policy pass; polls never overlap (the loop, an agent's release)."""
        async with self._poll_lock:
            if self._next_poll is not None and self._next_poll is asyncio.current_task():
                self._next_poll = None  # started: later callers need a poll after this one
            await self.channel.heal()  # its socket file removed: listen again
            if self.tracker.foreign_pids:
                await self.agent_ops.refresh_reports()
            await self.tracker.poll()
            metrics.POLL_SECONDS.observe(self.tracker.last_poll_seconds)
            await self.controller.tick()
            self.ahead.tick()
            metrics.export_sample(self.tracker.gpus.values(), self.tracker.kernels)

    async def stop_extension(self) -> None:
        """Restore held kernels that have room, stop polling and listening, put back every
        change. Safe in any state: never loaded, failed to load, never started, stopped."""
        phase, self._phase = self._phase, "stopped"
        if phase in ("new", "off", "stopped"):
            return
        try:
            await self._stop_polling()
            if self.hub_link is not None:
                await self.hub_link.stop()
            await self.controller.shutdown()
        except Exception:
            self.log.exception("gpushare: stopping the extension")
        finally:
            with suppress(Exception):
                await self.channel.stop()
            self._unload()
            metrics.clear()
            self._started.set()  # nobody waits for a first poll that will not come

    async def _stop_polling(self) -> None:
        """Cancel the poll loop and wait until it has ended. A cancel can be lost (Python
        3.11's wait_for returns a result that arrived with it), so cancel until it ends; the
        loop also ends by itself once the phase is no longer "running"."""
        task, self._poll_task = self._poll_task, None
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=1)
        if task is not None and not task.cancelled() and task.exception() is not None:
            self.log.error("gpushare: the poll loop ended with %r", task.exception())

    def _abandon(self, why: str) -> None:
        """Stop at once, without the event loop (its server was left for a new one in this
        process and will never be stopped): socket, poll loop, every change."""
        self.log.warning("gpushare: %s: the extension of the earlier server stops (its agent "
                         "socket %s, its poll loop) and the new server's takes over", why,
                         self.socket_path)
        held = sorted(st.kernel_id for st in self.controller.lifecycles() if st.held is not None)
        if held:
            self.log.error("gpushare: kernels %s of the earlier server stay released: their "
                           "state is held in host memory until they exit", ", ".join(held))
        self._phase = "stopped"
        if self._poll_task is not None:
            self._poll_task.cancel()
            self._poll_task = None
        if self.hub_link is not None:
            self.hub_link.stop_now()
        self.controller.stop_now()
        self.channel.close_now()
        self._unload()
        self._started.set()

    # -- what the parts read from the server and the hardware ----------------------------------
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

    def _method_for(self, kernel_id: str) -> str | None:
        method = self.methods.get(self.method_name)
        if method is None:
            return None
        if method.needs_agent and kernel_id not in self.channel.connections:
            return None
        return method.name

    def _live_state(self, kernel_id: str) -> str:
        try:
            return getattr(self.server.kernel_manager.get_kernel(kernel_id), "execution_state", "unknown")
        except KeyError:
            return "unknown"

    def _total_bytes(self) -> dict[int, int]:
        known = self._source.total_bytes()
        if known is not None:
            return known
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

    def status(self) -> dict[str, Any]:
        assert self.telemetry is not None
        tstatus = self.telemetry.status()
        return status_view(self.controller, self.backend_name, self.method_name,
                           tstatus.available, tstatus.reason if not tstatus.available else "",
                           hub=self.hub_link.view() if self.hub_link is not None else None)


def _off(why: str) -> str:
    return f"gpushare is off and the server runs without it: {why}"


logging.getLogger(__name__).addHandler(logging.NullHandler())
