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

import itertools
import logging
import os
from contextlib import ExitStack, suppress
from typing import Any

from jupyter_core.paths import jupyter_runtime_dir
from jupyter_server.extension.application import ExtensionApp
from tornado.ioloop import IOLoop
from traitlets import TraitError

from ..core import metrics
from ..core.ahead import AheadRestores
from ..core.capwatch import CapWatch
from ..core.controller import Controller
from ..core.options import RestoreOptions, TrackingOptions
from ..core.precopy import Precopies
from ..core.tracker import Tracker
from ..events import KERNEL_SCHEMA_ID, KERNEL_SCHEMA_PATH
from ..node import hub_link
from ..node.daemon_client import NodeDaemonTurns
from ..node.gpu_load import coming_back
from ..node.node_locks import NodeLocks, ServerTurnsOnly
from ..node.node_placed import NodePlaced
from ..node.options import NodeOptions
from ..node.placement import Placer
from ..policy.caps import ceiling, parse_cap
from ..policy.options import ReleaseOptions
from ..reclaim import MethodContext, ReclaimMethod
from ..telemetry import Telemetry, TelemetrySettings
from . import selection, server_hooks
from .agent_ops import AgentOps, check_reply
from .channel import AgentServer, socket_path
from .gate import GATES_KEY, SETTINGS_KEY, Gates
from .handlers import handlers
from .options import KernelOptions, SourceOptions
from .poller import Poller
from .ports import AutoPick, ServerKernels, ServerNodeRoom
from .provisioner import LaunchSettings
from .views import kernel_view, status_view

BACKEND_ENV = selection.BACKEND_ENV

#: polls the node daemon's word on other servers' placements counts unrenewed
PLACED_KEPT_POLLS = 3
_instances = itertools.count(1)  # extensions initialized in this process (socket names)
_active: GPUShareApp | None = None  # the one whose hooks are installed now


class ExtensionOff(RuntimeError):
    """The extension did not load and the server runs without it; the message says why."""


class GPUShareApp(SourceOptions, KernelOptions, TrackingOptions, ReleaseOptions, RestoreOptions,
                  NodeOptions, ExtensionApp):
    """Reclaims idle kernels' GPU memory without killing them.

    Its options are those of the classes it inherits (each owned by the part that reads it);
    all of them are set here, as ``c.GPUShareApp.NAME``."""

    name = "jupyter_gpushare"
    load_other_extensions = True

    # -- state (class defaults hold before, during and after a failed load) -----------------
    #: new -> loaded -> starting -> running -> stopped; "off" after a failed load
    _phase = "new"
    _refusal = ""  # why the configuration was refused when the extension was linked
    _teardown: ExitStack | None = None  # closes what was built, undoes what was changed
    poller: Poller | None = None
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
        self.node_placed: NodePlaced | None = None
        self.auto_pick: AutoPick | None = None  # release_method "auto" per kernel (_auto_pick)
        self.poller = Poller(self._poll_step, self.poll_interval)
        self._open_telemetry(teardown)
        assert self.telemetry is not None
        self._choose_method()
        self.tracker = Tracker(
            self.server.kernel_manager, self.telemetry, self.history_seconds, self.poll_interval,
            session_manager=self.server.session_manager,
            agent_reports=lambda kid: self.agent_ops.report_of(kid), settings=self,
        )
        teardown.callback(self.tracker.close)
        daemon = self.node_daemon_socket and self._source.shares_node_locks()  # its free memory
        self.node_room = ServerNodeRoom(self.tracker, self.telemetry, self.poller.refresh,
                                        service_room=self.service_room,
                                        daemon_free=NodeDaemonTurns(self.node_daemon_socket).free
                                        if daemon else None)
        self.controller = self._make_controller()
        self.agent_ops = AgentOps(
            self.controller, self.tracker, self.telemetry, poll=self.poll_once,
            kernel_view=lambda kid: kernel_view(self.controller, kid), backend=self.backend_name,
            connections=lambda: self.channel.connections,
            hub_view=lambda: self.hub_link.view() if self.hub_link is not None else None,
            oom_across=lambda: self.hub_link.out_of_memory if self.hub_link is not None else None,
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
        if daemon:  # the node daemon tells other servers' placements at once
            self.node_placed = NodePlaced(
                NodeDaemonTurns(self.node_daemon_socket).placed,
                gpus=lambda: [rec.info for rec in list(self.tracker.gpus.values())],
                mine=self._node_claim,
                keep=lambda: PLACED_KEPT_POLLS * self.poll_interval,
                where=f"the node daemon at {self.node_daemon_socket}", log=self.log)
        # other servers' placed kernels count as wanted memory, and in restores' targets
        self.controller.placed_elsewhere = self._placed_elsewhere
        if self.node_placed is not None:
            self.controller.pending_elsewhere = self.node_placed.pending
            self.controller.tell_wanted = self.node_placed.tell_soon
        self.controller.default_cap = self.default_cap
        self.capwatch = CapWatch(self.controller, self._tell_over_cap, self.tell_cap)
        self.ahead = AheadRestores(self.controller, self.ahead_grace)
        self.precopies = Precopies(self.controller, lambda: self.precopy_after,
                                   lambda: self.host_memory_reserve)

    def _node_claim(self) -> dict[int, tuple[int, int, int]]:
        """Per GPU, what this server tells the node daemon: its placed kernels' expected bytes,
        how many they are, and what its released kernels' states will take back."""
        out = {g: (n, k, 0) for g, (n, k) in self.controller.room.load.unused().items()}
        for g, back in coming_back(self.controller.lifecycles()).items():
            n, k, _ = out.get(g, (0, 0, 0))
            out[g] = (n, k, back)
        return out

    def _placed_elsewhere(self) -> dict[int, int]:
        """Per GPU, what other servers' placed kernels are expected to take: the larger of the
        node daemon's word and the hub service's (both count the same kernels)."""
        out = self.node_placed.placed_elsewhere() if self.node_placed is not None else {}
        for g, n in (self.hub_link.placed_elsewhere() if self.hub_link is not None else {}).items():
            out[g] = max(out.get(g, 0), n)
        return out

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
        context = MethodContext(
            free_bytes=self._source.free_bytes, lock_timeout=self.lock_timeout,
            # the last poll's GPUs: read without a hardware call (a restore asks on the loop)
            gpu_uuids=lambda: {rec.info.index: rec.info.uuid for rec in self.tracker.gpus.values()
                               if not rec.info.mig},
        )
        assert self.telemetry is not None
        choice = selection.choose_method(self.release_method, self.backend_name, context,
                                         simulated=self.telemetry.simulated)
        self.methods, self.method_name = choice.methods, choice.name
        named = self.release_method not in (selection.AUTO, selection.OFF)
        if named and choice.name == selection.OFF:
            self.log.warning("gpushare: %s; nothing is released", choice.reason)
        else:
            self.log.info("gpushare: release method %s (%s)", choice.name, choice.reason)

    def default_cap(self) -> int | None:
        """The admin's cap for a new kernel of this server, bytes per GPU: the smaller of
        ``memory_limit`` and the hub service's cap for this user (None: neither)."""
        own = parse_cap(self.memory_limit) if self.memory_limit else None
        return ceiling(own, self.hub_link.cap() if self.hub_link is not None else None)

    def tell_cap(self, kernel_id: str) -> None:
        """The kernel's cap changed from outside it (REST): its agent applies it."""
        conn = self.channel.connections.get(kernel_id)
        if conn is not None:
            conn.notify("cap", **self.agent_ops.cap_fields(kernel_id))

    def _tell_over_cap(self, kernel_id: str, text: str) -> None:
        conn = self.channel.connections.get(kernel_id)
        if conn is not None:
            conn.notify("cap_note", text=text)

    async def service_room(self, uuids: list[str]) -> dict[str, tuple[int | None, bool]] | None:
        """The hub service's view of the room on those GPUs (placement and restores that
        move ask it); None without a service or an answer."""
        return None if self.hub_link is None else await self.hub_link.rooms(uuids)

    def _auto_pick(self, restore_mode: str) -> AutoPick | None:
        """With ``release_method = "auto"``, the framework method for the kernels whose GPU
        memory is all PyTorch, CuPy or JAX state (its copies run at the bus's speed), the
        node's choice for the others. Eager restores only: the framework method has no lazy
        mode, and the mode is the node's."""
        if self.release_method != selection.AUTO or restore_mode != "eager" \
                or selection.FRAMEWORK not in self.methods or self.method_name == selection.FRAMEWORK:
            return None

        def gpu_bytes(kernel_id: str) -> int | None:
            rec = self.tracker.kernels.get(kernel_id)
            return sum(rec.gpu_bytes.values()) if rec is not None and rec.attributed else None

        return AutoPick(self.methods, gpu_bytes, self._source.context_bytes(self.context_bytes))

    def _make_controller(self) -> Controller:
        method = self.methods.get(self.method_name)
        restore_mode = self.restore_mode
        if restore_mode == "lazy" and method is not None and not method.supports_lazy:
            self.log.warning("gpushare: restore_mode = lazy needs a method that supports it "
                             "(%s does not); using eager", method.name)
            restore_mode = "eager"
        self.auto_pick = self._auto_pick(restore_mode)
        kernels = ServerKernels(self.server.kernel_manager, method,
                                connections=lambda: self.channel.connections,
                                auto=self.auto_pick)
        return Controller(
            self.tracker, self.methods, config=self, node_room=self.node_room, kernels=kernels,
            emit=self._emit,
            rules=self.policy_class(self, parent=self),
            restore_mode=restore_mode,
            restore_grace=self.restore_grace,
            move_after=self.restore_move_after,
            host_memory_reserve=self.host_memory_reserve,
            context_bytes=self._source.context_bytes(self.context_bytes),
            clear_progress=not self.keep_restore_progress,
            node_locks=self._node_locks(),
        )

    def _node_locks(self) -> NodeLocks | None:
        if self.node_daemon_socket and self._source.shares_node_locks():
            turns = NodeDaemonTurns(self.node_daemon_socket)
            why = turns.refusal()  # said at start; each restore's turn tries again
            if why:
                self.log.warning("gpushare: %s; restores go on without a turn across servers, "
                                 "with a stricter room check (see GPUShareApp.node_daemon_socket)",
                                 why)
            else:
                self.log.info("gpushare: restore turns from the node daemon at %s",
                              self.node_daemon_socket)
            return turns
        if not self._source.shares_node_locks():
            return None
        if not self.node_lock_dir:  # turns within this server: its reservations, no files
            return ServerTurnsOnly()
        # the default directory (this user's runtime dir) serves this user's servers only
        default = str(self.trait_defaults("node_lock_dir"))
        locks = NodeLocks(self.node_lock_dir, shared=os.path.abspath(self.node_lock_dir)
                          != os.path.abspath(default))
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
        assert self.poller is not None
        self.poller.start()
        self._phase = "running"
        if self.hub_link is not None:
            self.hub_link.start(self.server.event_logger)

    async def _start_jupyter_server_extension(self, serverapp: Any) -> None:
        await self._start()

    async def ready(self) -> None:
        """Wait until the channel listens and the first poll is done (handlers call this)."""
        await self._start()
        if self._phase in ("starting", "running") and self.poller is not None:
            await self.poller.started.wait()

    async def refresh(self) -> None:
        """A poll that starts after this call (see :meth:`.Poller.refresh`)."""
        assert self.poller is not None
        await self.poller.refresh()

    async def poll_once(self) -> None:
        """One sample and one policy pass; polls never overlap (the loop, an agent's release)."""
        assert self.poller is not None
        await self.poller.poll_once()

    async def _poll_step(self) -> None:
        await self.channel.heal()  # its socket file removed: listen again
        # their own counts: attribution, auto's pick, host copies and what is left to copy
        await self.agent_ops.refresh_reports()
        await self.tracker.poll()
        metrics.POLL_SECONDS.observe(self.tracker.last_poll_seconds)
        if self.node_placed is not None:  # before the policy weighs wanted memory
            await self.node_placed.exchange()
        if self.hub_link is not None:  # a kernel placed since: the service reads us now
            self.hub_link.placed(self.controller.room.load.listed_unused())
        await self.controller.tick()
        self.capwatch.tick()
        self.ahead.tick()
        await self.precopies.tick()
        metrics.export_sample(self.tracker.gpus.values(), self.tracker.kernels)

    async def stop_extension(self) -> None:
        """Restore held kernels that have room, stop polling and listening, put back every
        change. Safe in any state: never loaded, failed to load, never started, stopped."""
        phase, self._phase = self._phase, "stopped"
        if phase in ("new", "off", "stopped"):
            return
        try:
            if self.poller is not None:
                await self.poller.stop()
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
            if self.poller is not None:
                self.poller.stop_now()  # nobody waits for a first poll that will not come

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
        if self.poller is not None:
            self.poller.stop_now()
        if self.hub_link is not None:
            self.hub_link.stop_now()
        self.controller.stop_now()
        self.channel.close_now()
        self._unload()

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
