"""What a kernel's agent may ask of the server over the agent channel, and who may ask.

The channel's counterpart of ``handlers.py``: thin operations over the controller, plus the
requests the telemetry source adds (``Telemetry.agent_handlers``: the simulated node's
allocations). Every field is checked before anything changes (integers are integers and not
booleans, byte counts >= 0, a GPU is a valid index, ``pinned`` is a boolean, seconds are
finite and >= 0), so an agent's bad request gets an error reply that says why and changes
nothing. The agent's answers to the server's own requests are checked here too
(``check_reply``), and its self-report is checked when it arrives: a bad one is refused and
the previous one kept, so the tracker never sees garbage and one bad agent affects only
its own kernel.

Everything it needs is passed in; it never imports the app.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ..core import metrics, oom_room
from ..core.controller import ControllerError
from ..fields import boolean, integer, optional_integer, seconds_or_none, shown, strings
from ..node.placement import placed_gpus
from ..policy.caps import parse_cap
from ..telemetry import Telemetry
from .channel import AgentConnection, Handler, Refused

log = logging.getLogger(__name__)

RESTORE_TRIGGERS = ("agent", "magic", "background")  # triggers an agent may name (others: the server's)
REPORT_TIMEOUT = 2.0
MAX_FRAMEWORKS = 16


def check_report(report: Mapping[str, Any]) -> dict[str, Any]:
    """An agent's self-report (``Agent.report``), checked and reduced to its known fields."""
    clean: dict[str, Any] = {"framework_bytes": integer(report, "framework_bytes")}
    frameworks = strings(report, "frameworks", MAX_FRAMEWORKS)
    clean["frameworks"] = [f[:64] for f in frameworks or []]
    simulated = optional_integer(report, "simulated_bytes")
    if simulated is not None:
        clean["simulated_bytes"] = simulated
    for name in ("host_copy_bytes", "to_copy_bytes", "to_copy_new_bytes", "host_copy_kept_bytes",
                 "framework_pool_bytes"):
        value = optional_integer(report, name)
        if value is not None:
            clean[name] = value
    threads = strings(report, "background_gpu_threads", 100)
    if threads:
        clean["background_gpu_threads"] = [t[:100] for t in threads]
    if report.get("error") is not None:
        if not isinstance(report["error"], str):
            raise ValueError("error must be a string")
        clean["error"] = report["error"][:500]
    return clean


def _moved(reply: Mapping[str, Any]) -> None:
    integer(reply, "bytes")
    optional_integer(reply, "arrays")


#: shapes of the agent's replies to the server's requests (fields the server reads)
REPLY_CHECKS: dict[str, Callable[[Mapping[str, Any]], Any]] = {
    "sim_checkpoint": _moved,
    "sim_resume": _moved,
    "offload": lambda r: (integer(r, "bytes"), optional_integer(r, "freed"), strings(r, "skipped", 1000),
                          optional_integer(r, "device_before"), optional_integer(r, "device_after")),
    "reload": lambda r: integer(r, "bytes"),
    "trim": lambda r: integer(r, "freed"),
    "drop_host_copies": lambda r: integer(r, "freed"),
    "report": check_report,
}


def check_reply(op: str, reply: dict[str, Any]) -> None:
    """Raise ValueError when the agent's reply to ``op`` lacks a field or has a wrong type."""
    check = REPLY_CHECKS.get(op)
    if check is not None:
        check(reply)


# -- the operations ---------------------------------------------------------------------------
class AgentOps:
    """The agent channel's operation table, authorization and connection hooks."""

    def __init__(
        self,
        controller: Any,
        tracker: Any,
        telemetry: Telemetry,
        poll: Callable[[], Awaitable[None]],
        kernel_view: Callable[[str], dict[str, Any]],
        backend: str,
        connections: Callable[[], Mapping[str, AgentConnection]],
        hub_view: Callable[[], dict[str, Any] | None] = lambda: None,
        oom_across: Callable[[], oom_room.Across | None] = lambda: None,
    ):
        self.controller = controller
        self.tracker = tracker
        self.telemetry = telemetry  # its agent_handlers() and agent_gone() hooks
        self.poll = poll
        self.kernel_view = kernel_view
        self.backend = backend
        self.connections = connections
        self.hub_view = hub_view
        self.oom_across = oom_across  # the hub service's make-room after an OOM (None: no service)
        self._making_room: set[str] = set()  # kernels whose out_of_memory request runs

    def handlers(self) -> dict[str, Handler]:
        """The server's own requests, and those the telemetry source adds (its names that
        clash with the server's are not used)."""
        return {
            **self.telemetry.agent_handlers(),
            "report": self.report,
            "status": self.status,
            "restore": self.restore,
            "release": self.release,
            "pin": self.pin,
            "idle_timeout": self.idle_timeout,
            "allow_background": self.allow_background,
            "cap": self.cap,
            "out_of_memory": self.out_of_memory,
        }

    # -- who may connect, and what a connection changes -----------------------------------------
    async def authorize(self, kernel_id: str, pid: int) -> None:
        """The peer must be (a child of) the process of the kernel it claims to be."""
        km = self.tracker.km
        for _ in range(100):  # a kernel that is still starting appears within a few seconds
            if kernel_id in km and self.tracker.kernel_pid(kernel_id) is not None:
                break
            await asyncio.sleep(0.05)
        else:
            raise Refused(f"no kernel {kernel_id} on this server")
        if not self.tracker.owns_pid(kernel_id, pid):
            raise Refused(f"pid {pid} is not a process of kernel {kernel_id}")

    def hello_reply(self, kernel_id: str) -> dict[str, Any]:
        """The kernel's gpushare state, so a reconnecting agent knows where it stands."""
        out: dict[str, Any] = {}
        st = self.controller.find(kernel_id)
        if st is not None:
            out["state"] = st.state
        with contextlib.suppress(ControllerError):  # a kernel the server does not know (yet)
            out.update(self.cap_fields(kernel_id))
        return out

    def cap_fields(self, kernel_id: str) -> dict[str, Any]:
        """What the kernel's agent needs to apply its memory cap: the cap in effect (bytes per
        GPU, None: uncapped) and the memory of its largest GPU (so a fraction of it is never
        more than the cap)."""
        cap = self.controller.memory_cap(self.controller.get(kernel_id))
        totals = {g.info.index: g.info.memory_total for g in self.tracker.gpus.values()
                  if g.info.memory_total}
        mine = [totals[g] for g in placed_gpus(self.tracker.km, kernel_id) if g in totals]
        total = max(mine or totals.values(), default=None)
        return {"memory_cap": cap, "gpu_memory_total": total}

    def on_connect(self, conn: AgentConnection) -> None:
        st = self.controller.find(conn.kernel_id)
        held = st.held if st is not None else None
        if held is not None and held.kernel_pid not in (None, conn.pid):
            self.controller.drop_held(conn.kernel_id, "the kernel restarted")
        log.info("gpushare: agent of kernel %s connected (pid %s)", conn.kernel_id, conn.pid)

    def on_disconnect(self, conn: AgentConnection) -> None:
        if conn.replaced:
            return  # a newer connection of the same kernel took over; nothing was lost
        log.info("gpushare: agent of kernel %s disconnected", conn.kernel_id)
        self.telemetry.agent_gone(conn.pid)

    # -- self-reports (NVML cannot see our pids) -------------------------------------------------
    async def refresh_reports(self) -> None:
        """Ask each agent what its frameworks hold; a bad or missing answer keeps the last."""
        async def one(conn: AgentConnection) -> None:
            try:
                conn.report = check_report(await conn.request("report", timeout=REPORT_TIMEOUT))
            except Exception as e:  # busy, gone or wrong: this kernel keeps its last report
                log.debug("gpushare: no report from kernel %s: %s", conn.kernel_id, e)

        await asyncio.gather(*(one(c) for c in list(self.connections().values())))

    def report_of(self, kernel_id: str) -> dict[str, Any] | None:
        conn = self.connections().get(kernel_id)
        return conn.report if conn else None

    # -- the kernel's own requests (magics, pre_run_cell) -------------------------------------------
    def report(self, conn: AgentConnection, msg: dict[str, Any]) -> None:
        conn.report = check_report(msg)  # a bad report raises: the previous one stays

    def status(self, conn: AgentConnection, msg: dict[str, Any]) -> dict[str, Any]:
        """The kernel's view, asked from one of its cells (``%gpushare``). That cell is use
        too: the idle clock starts again when it ends, so the next automatic release is
        counted from there (``release_in_after_cell``), not from the idle time shown."""
        after = self._controller_call(self.controller.release_in, conn.kernel_id, 0.0)
        return {"kernel": self._view(conn.kernel_id), "backend": self.backend, "hub": self.hub_view(),
                "release_in_after_cell": None if after is None else round(after, 1)}

    async def restore(self, conn: AgentConnection, msg: dict[str, Any]) -> dict[str, Any]:
        trigger = msg.get("trigger", "agent")
        if trigger not in RESTORE_TRIGGERS:
            raise ValueError(f"trigger must be one of {', '.join(RESTORE_TRIGGERS)}, got {shown(trigger)}")
        parent = msg.get("parent")
        if parent is not None and not isinstance(parent, dict):
            raise ValueError("parent must be a message header (an object)")
        try:
            await self.controller.ensure_resident(conn.kernel_id, trigger=trigger, parent=parent or None)
        except ControllerError as e:
            raise RuntimeError(e.message) from None
        return {"kernel": self._view(conn.kernel_id)}

    async def release(self, conn: AgentConnection, msg: dict[str, Any]) -> dict[str, Any]:
        await self.poll()  # see what the cell just allocated
        try:
            await self.controller.release(conn.kernel_id, reason="requested from the kernel",
                                          by_kernel=True)
        except ControllerError as e:
            raise RuntimeError(e.message) from None
        return {"kernel": self._view(conn.kernel_id)}

    def pin(self, conn: AgentConnection, msg: dict[str, Any]) -> dict[str, Any]:
        pinned = boolean(msg, "pinned")
        self._controller_call(self.controller.set_pinned, conn.kernel_id, pinned)
        return {"kernel": self._view(conn.kernel_id)}

    def idle_timeout(self, conn: AgentConnection, msg: dict[str, Any]) -> dict[str, Any]:
        seconds = seconds_or_none(msg, "seconds")
        self._controller_call(self.controller.set_idle_timeout, conn.kernel_id, seconds)
        return {"kernel": self._view(conn.kernel_id)}

    def cap(self, conn: AgentConnection, msg: dict[str, Any]) -> dict[str, Any]:
        """``%gpushare cap``: the kernel's own cap (``bytes`` None: back to its ceiling)."""
        value = msg.get("bytes")
        cap = None if value is None else parse_cap(value, "bytes")  # CapError: changes nothing
        self._controller_call(self.controller.set_memory_cap, conn.kernel_id, cap)
        return {"kernel": self._view(conn.kernel_id), **self.cap_fields(conn.kernel_id)}

    async def out_of_memory(self, conn: AgentConnection, msg: dict[str, Any]) -> dict[str, Any]:
        """A cell of the kernel ran out of GPU memory: release idle kernels on that GPU so
        that its next try fits (``core/oom_room.py``). ``bytes``: what the failed allocation
        asked for; ``gpu``: the node's GPU it failed on; either None when the error did not
        say. One request at a time per kernel: a second one while the first runs is told so."""
        nbytes = optional_integer(msg, "bytes")
        gpu = optional_integer(msg, "gpu")
        if conn.kernel_id in self._making_room:
            metrics.OUT_OF_MEMORY.labels("busy").inc()
            return {"gpus": [], "released": [], "bytes": 0, "cause": "busy",
                    "text": "gpushare: room is being made for this kernel already: run the cell "
                            "again in a moment"}
        self._making_room.add(conn.kernel_id)
        try:
            done = await oom_room.after_oom(self.controller, conn.kernel_id, gpu, nbytes,
                                            across=self.oom_across())
            metrics.OUT_OF_MEMORY.labels(done["cause"]).inc()  # admins: how often, what helped
            return done
        except ControllerError as e:
            raise LookupError(e.message) from None
        finally:
            self._making_room.discard(conn.kernel_id)

    def allow_background(self, conn: AgentConnection, msg: dict[str, Any]) -> dict[str, Any]:
        allow = boolean(msg, "allow")
        self._controller_call(self.controller.set_allow_background, conn.kernel_id, allow)
        return {"kernel": self._view(conn.kernel_id)}

    def _view(self, kernel_id: str) -> dict[str, Any]:
        return self._controller_call(self.kernel_view, kernel_id)

    @staticmethod
    def _controller_call(fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except ControllerError as e:  # e.g. a kernel the server no longer knows
            raise LookupError(e.message) from None
