"""The gate: queues a released kernel's execute_requests until its GPU state is restored.

``handle_incoming_message`` is synchronous and the websocket handler does not await it, so
queued messages wait in a queue per connection and are forwarded, in order, once the restore
is done. Queued: execute_requests, and (in eager mode) the comm messages that run user code
in the kernel (widget callbacks); kernel_info, completions and everything on the control
channel (interrupt, shutdown) pass straight through.

The restore belongs to the controller: when this connection closes, only its waiting
stops. A queued cell is stopped by every way Jupyter stops a cell: an ``interrupt_request``
over the websocket, and (through :class:`Gates`, which the server's kernel manager calls)
the REST interrupt JupyterLab's stop button sends, a restart and a shutdown. The queued cells
get their error reply at once and never run later; a restore that still waits stops. A
restore already moving bytes finishes (it cannot be stopped half-way): after an interrupt
its cells run once the bytes have landed, after a restart or shutdown they are answered at
once. An interrupt never drops the held state.

Message order: the cell whose restore shows progress gets ``status: busy`` first, from here
(the kernel has not seen the cell yet, and the protocol puts a cell's outputs after its
busy); the kernel's own busy follows when the cell reaches it.
When the held state is dropped (the kernel restarted or died), the queued cells are answered
with an error that says so: they never run in the new process in place of the old one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from typing import Any

from jupyter_server.services.kernels.connection.base import deserialize_msg_from_ws_v1
from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection

from ..core.controller import Controller, ControllerError
from ..kernel.lazy import only_gpushare_magics

log = logging.getLogger(__name__)

V1 = "v1.kernel.websocket.jupyter.org"
SETTINGS_KEY = "gpushare_controller"
GATES_KEY = "gpushare_gates"
INTERRUPTED = "interrupted while waiting for the GPU state to be restored"
#: shell messages that run user code in the kernel, besides execute_request (eager mode)
COMM_MESSAGES = ("comm_open", "comm_msg", "comm_close")


class GateConnection(ZMQChannelsWebsocketConnection):
    """ZMQChannelsWebsocketConnection that waits for a restore before an execute_request."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._queued: list[tuple[Any, dict[str, Any]]] = []
        self._drain_task: asyncio.Task[None] | None = None
        self._busy_sent: set[str] = set()  # msg_ids we announced busy for ourselves

    @property
    def controller(self) -> Controller | None:
        handler = getattr(self, "websocket_handler", None)
        return handler.settings.get(SETTINGS_KEY) if handler is not None else None

    @property
    def gates(self) -> Gates | None:
        handler = getattr(self, "websocket_handler", None)
        return handler.settings.get(GATES_KEY) if handler is not None else None

    def connect(self) -> Any:
        # A reply is several small websocket frames; with Nagle's algorithm on, the last one
        # waits for the client's delayed ACK: ~40 ms per cell (benchmarks/gate_latency.py).
        handler = getattr(self, "websocket_handler", None)
        if handler is not None:
            try:
                handler.set_nodelay(True)
            except Exception:  # no stream yet: the stock behaviour, nothing lost
                pass
        return super().connect()

    def _peek(self, ws_msg: Any) -> tuple[str | None, dict[str, Any]]:
        """(channel, header) of a websocket message, without consuming it."""
        try:
            if self.subprotocol == V1:
                channel, msg_list = deserialize_msg_from_ws_v1(ws_msg)
                return channel, self.get_part("header", None, msg_list)
            if isinstance(ws_msg, bytes):
                return None, {}  # legacy binary message: pass through untouched
            msg = json.loads(ws_msg)
            return msg.get("channel"), msg.get("header") or {}
        except Exception:  # a malformed message is the stock code's to reject
            return None, {}

    def handle_incoming_message(self, incoming_msg: Any) -> None:
        controller = self.controller
        if controller is None:
            super().handle_incoming_message(incoming_msg)
            return
        channel, header = self._peek(incoming_msg)
        msg_type = header.get("msg_type")
        on_shell = channel in (None, "shell")
        is_execute = on_shell and msg_type == "execute_request"
        is_comm = on_shell and msg_type in COMM_MESSAGES
        if not (is_execute or is_comm):
            if channel == "control" and msg_type == "interrupt_request" and self._queued:
                self.interrupt_queued(INTERRUPTED)
            super().handle_incoming_message(incoming_msg)
            return
        must_wait = self._must_wait(controller, is_comm)
        if (is_execute and not must_wait and not self._queued
                and controller.rebalancer.moves_before_cells
                and not self._only_gpushare_magics(incoming_msg)):
            # a heavy kernel whose GPU another kernel's cell keeps busy moves first: the cell
            # waits for the move's release and restore like any restore
            must_wait = self._moves_first(controller, header)
        if self._queued or (must_wait and not (is_execute and self._only_gpushare_magics(incoming_msg))):
            if not self._queued and is_execute and controller.restore_mode == "eager":
                self._send_busy(header)  # its restore's progress lines come next
            self._queued.append((incoming_msg, header))
            gates = self.gates
            if gates is not None:
                gates.add(self)
            if self._drain_task is None:
                self._drain_task = asyncio.ensure_future(self._drain(controller))
            return
        super().handle_incoming_message(incoming_msg)

    def _moves_first(self, controller: Controller, header: dict[str, Any]) -> bool:
        """Whether the kernel starts a move before this cell (rebalance_before_cell). A fault
        in that choice never keeps the cell from running: it runs where the kernel is."""
        try:
            return controller.rebalancer.before_cell(self.kernel_id, header)
        except Exception:
            log.exception("gpushare gate: choosing a move before the cell failed")
            return False

    def _only_gpushare_magics(self, ws_msg: Any) -> bool:
        """A cell of `%gpushare ...` lines only (status, restore, pin) runs without a restore."""
        try:
            if self.subprotocol == V1:
                _, msg_list = deserialize_msg_from_ws_v1(ws_msg)
                content = self.get_part("content", None, msg_list)
            else:
                content = json.loads(ws_msg).get("content") or {}
            return only_gpushare_magics(str(content.get("code", "")))
        except Exception:  # unreadable: hold it, a restore is the safe side
            return False

    def _must_wait(self, controller: Controller, is_comm: bool) -> bool:
        st = controller.find(self.kernel_id)
        if st is None or not st.is_held:
            return False
        if controller.restore_mode == "eager":
            return True
        # lazy mode: only a release in flight holds a message; the agent decides for cells
        # (and a comm handler that touches the GPU waits for the watchdog, as CPU cells do)
        return st.op is not None and st.op.kind == "release"

    async def _drain(self, controller: Controller) -> None:
        try:
            while self._queued:
                _, first_header = self._queued[0]
                failure, retryable = None, True
                parent = first_header if first_header.get("msg_type") == "execute_request" else None
                try:
                    if controller.restore_mode == "eager":
                        await controller.ensure_resident(self.kernel_id, trigger="gate", parent=parent)
                    else:
                        await controller.settle(self.kernel_id)
                except ControllerError as e:
                    failure, retryable = e.message, e.retryable
                batch, self._queued = self._queued, []
                for raw, header in batch:
                    if failure is None:
                        self._busy_sent.discard(header.get("msg_id", ""))
                        if self.channels:
                            ZMQChannelsWebsocketConnection.handle_incoming_message(self, raw)
                    elif header.get("msg_type") == "execute_request":
                        hint = (" Your GPU state is still held; run the cell again to retry."
                                if retryable else "")
                        self._reply_error(header, "GPUStateNotRestored", f"gpushare: {failure}.{hint}")
                    else:
                        log.warning("gpushare gate: dropped a queued %s: %s", header.get("msg_type"), failure)
        except asyncio.CancelledError:
            pass  # the connection closed: only our waiting stops, the restore goes on
        except Exception:
            log.exception("gpushare gate: forwarding queued messages failed")
        finally:
            if self._drain_task is asyncio.current_task():
                self._drain_task = None

    def interrupt_queued(self, why: str) -> None:
        """An interrupt (websocket or REST): the queued cells are answered with a
        KeyboardInterrupt now and never run; a restore that waits stops, the state stays
        held. A restore already moving bytes finishes first; its cells then run."""
        if not self._queued:
            return
        controller = self.controller
        st = controller.find(self.kernel_id) if controller is not None else None
        op = st.op if st is not None else None
        if op is not None and op.kind == "restore" and op.phase == "moving":
            return
        if controller is not None:
            controller.stop_waiting(self.kernel_id, why)
        self.answer_queued("KeyboardInterrupt", f"gpushare: {why}")

    def answer_queued(self, ename: str, text: str) -> None:
        """Answer every queued cell with an error now; none of them runs later. Only this
        connection's waiting stops (the restore, if any, is the controller's)."""
        batch, self._queued = self._queued, []
        task, self._drain_task = self._drain_task, None
        if task is not None:
            task.cancel()
        for _, header in batch:
            if header.get("msg_type") == "execute_request":
                self._reply_error(header, ename, text)
            else:
                log.info("gpushare gate: dropped a queued %s: %s", header.get("msg_type"), text)

    def _send_busy(self, parent: dict[str, Any]) -> None:
        """``status: busy`` for a queued cell, as the kernel sends it when a cell starts."""
        if self.channels and parent.get("msg_id"):
            self._send("iopub", self.session.msg("status", {"execution_state": "busy"}, parent=parent))
            self._busy_sent.add(parent["msg_id"])

    def _reply_error(self, parent: dict[str, Any], ename: str, text: str) -> None:
        """Answer an execute_request we will not forward, as the kernel would."""
        if not self.channels:
            return
        session = self.session
        content = {"status": "error", "ename": ename, "evalue": text, "traceback": [text],
                   "execution_count": None}
        if parent.get("msg_id") not in self._busy_sent:
            self._send("iopub", session.msg("status", {"execution_state": "busy"}, parent=parent))
        self._busy_sent.discard(parent.get("msg_id", ""))
        for channel, msg in (
            ("iopub", session.msg("error", {k: content[k] for k in ("ename", "evalue", "traceback")},
                                  parent=parent)),
            ("shell", session.msg("execute_reply", content, parent=parent)),
            ("iopub", session.msg("status", {"execution_state": "idle"}, parent=parent)),
        ):
            self._send(channel, msg)

    def _send(self, channel: str, msg: dict[str, Any]) -> None:
        try:
            self.handle_outgoing_message(channel, self.session.serialize(msg))
        except Exception:
            log.exception("gpushare gate: could not send a %s message", msg["header"]["msg_type"])

    def disconnect(self) -> None:  # type: ignore[override]  # the stock one is sync too
        if self._drain_task is not None:
            self._drain_task.cancel()
        self._queued = []
        gates = self.gates
        if gates is not None:
            gates.discard(self)
        super().disconnect()


class Gates:
    """The gate connections that hold cells, per kernel: a stop that does not come over the
    websocket (JupyterLab's stop, restart and shutdown buttons are REST calls) reaches them
    through the server's kernel manager, which calls :meth:`interrupted` and
    :meth:`ending` (:func:`.server_hooks.hook_kernel_manager`)."""

    def __init__(self, controller: Controller):
        self.controller = controller
        self._conns: dict[str, weakref.WeakSet[GateConnection]] = {}

    def add(self, conn: GateConnection) -> None:
        self._conns.setdefault(conn.kernel_id, weakref.WeakSet()).add(conn)

    def discard(self, conn: GateConnection) -> None:
        conns = self._conns.get(conn.kernel_id)
        if conns is not None:
            conns.discard(conn)
            if not conns:
                del self._conns[conn.kernel_id]

    def _of(self, kernel_id: str) -> list[GateConnection]:
        return list(self._conns.get(kernel_id, ()))

    def interrupted(self, kernel_id: str) -> None:
        """The kernel is interrupted (REST): as an ``interrupt_request`` on each websocket."""
        for conn in self._of(kernel_id):
            conn.interrupt_queued(INTERRUPTED)

    def ending(self, kernel_id: str, why: str) -> None:
        """The kernel restarts or shuts down: its queued cells are answered now, whatever the
        restore is doing, and never run (not in the old process, not in a new one)."""
        self.controller.stop_waiting(kernel_id, why)
        for conn in self._of(kernel_id):
            conn.answer_queued("GPUStateNotRestored", f"gpushare: {why}; this cell did not run")
