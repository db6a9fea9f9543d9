"""The agent inside a kernel the server started.

It says hello on the channel, moves simulated GPU accounting onto the server's node,
serves the server's requests (the emulated checkpoint, framework offload, trim, progress
lines in a cell), and before each cell makes sure the kernel's GPU state is resident
(restore trigger 2 in DESIGN.md: clients that bypass the server's websocket).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any

from ..protocol import KERNEL_ID_ENV, SOCKET_ENV, RemoteError
from . import lazy
from .client import AgentClient, RemoteBackend

log = logging.getLogger(__name__)

GPU_FRAMEWORKS = ("torch", "cupy", "jax", "tensorflow")


class Agent:
    def __init__(self, shell: Any):
        self.shell = shell
        self.client: AgentClient | None = None
        self.kernel_id = os.environ.get(KERNEL_ID_ENV, "")
        self.why_offline = ""  # why there is no server connection, for %gpushare
        self.released = False
        self.restore_mode = "eager"
        self.gpu_names: set[str] = set()  # names bound to GPU objects at release (lazy mode)
        self._offloaded: list[Any] = []  # framework adapters holding offloaded state
        self._last_shown: dict[str, Any] = {}

    # -- connection -------------------------------------------------------------------
    def start(self) -> None:
        path = os.environ.get(SOCKET_ENV)
        if not path or not self.kernel_id:
            self.why_offline = "this kernel was not started by a gpushare-enabled Jupyter server"
            return
        client = AgentClient(path, self._handlers())
        try:
            reply = client.connect(
                {"kernel_id": self.kernel_id, "pid": os.getpid(), "frameworks": self.frameworks()}
            )
        except (OSError, RemoteError) as e:
            self.why_offline = f"the gpushare server is not reachable ({e})"
            log.warning("gpushare agent: %s", self.why_offline)
            return
        self.client = client
        client.on_disconnect = self._on_disconnect
        self.restore_mode = reply.get("restore_mode", "eager")
        sim = reply.get("simulated_gpus")
        if sim:
            from ..sim import device

            dev = device.set_backend(RemoteBackend(client, len(sim)))
            dev.on_blocked = self._on_blocked
        self.shell.events.register("pre_run_cell", self.pre_run_cell)

    def _on_disconnect(self) -> None:
        self.why_offline = "the gpushare server closed the channel"

    def frameworks(self) -> list[str]:
        return [name for name in GPU_FRAMEWORKS if name in sys.modules]

    def _handlers(self) -> dict[str, Any]:
        return {
            "sim_lock": self._sim_lock,
            "sim_checkpoint": lambda msg: _sim().checkpoint(),
            "sim_restore": lambda msg: _sim().restore(),
            "sim_unlock": lambda msg: (_sim().unlock(), {})[1],
            "state": self._on_state,
            "show": self._show,
            "trim": self._trim,
            "offload": self._offload,
            "reload": self._reload,
            "report": lambda msg: self.report(),
        }

    # -- server requests -----------------------------------------------------------------
    def _sim_lock(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.gpu_names = lazy.gpu_names(self.shell.user_ns)
        _sim().lock(timeout=float(msg.get("lock_timeout", 10.0)))
        return {}

    def _on_state(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.released = msg.get("state") in ("releasing", "released")
        if msg.get("restore_mode"):
            self.restore_mode = msg["restore_mode"]
        return {}

    def _trim(self, msg: dict[str, Any]) -> dict[str, Any]:
        from .offload import present_adapters

        freed = 0
        for adapter in present_adapters():
            freed += adapter.trim()
        return {"freed": freed}

    def _offload(self, msg: dict[str, Any]) -> dict[str, Any]:
        from .offload import present_adapters

        self.gpu_names = lazy.gpu_names(self.shell.user_ns)
        reports = []
        adapters = present_adapters()
        if not adapters:
            raise RuntimeError("no supported framework (PyTorch, CuPy, JAX) is imported in this kernel")
        for adapter in adapters:
            reports.append(adapter.offload(self.shell.user_ns))
            self._offloaded.append(adapter)
        return {
            "bytes": sum(r.bytes for r in reports),
            "freed": sum(r.freed_bytes for r in reports),
            "skipped": [s for r in reports for s in r.skipped],
        }

    def _reload(self, msg: dict[str, Any]) -> dict[str, Any]:
        reports = [adapter.reload() for adapter in self._offloaded]
        self._offloaded.clear()
        return {"bytes": sum(r.bytes for r in reports)}

    def report(self) -> dict[str, Any]:
        """What this kernel holds by its own count (used when NVML cannot see our pids)."""
        out: dict[str, Any] = {"frameworks": self.frameworks(), "framework_bytes": 0}
        try:
            from .offload import present_adapters

            out["framework_bytes"] = sum(a.device_bytes() for a in present_adapters())
        except Exception as e:  # a framework in a bad state must not break reporting
            out["error"] = str(e)
        return out

    def _show(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Show (or replace) a one-line message in the output of the cell ``parent``."""
        kernel = getattr(self.shell, "kernel", None)
        parent = msg.get("parent")
        if kernel is None or not isinstance(parent, dict):
            return {}
        display_id = str(msg.get("display_id") or "gpushare")
        text = str(msg.get("text", ""))
        content = {
            "data": {"text/plain": text, "text/html": f"<pre class='gpushare-progress'>{_esc(text)}</pre>"},
            "metadata": {},
            "transient": {"display_id": display_id},
        }
        msg_type = "update_display_data" if display_id in self._last_shown else "display_data"
        self._last_shown[display_id] = text
        kernel.session.send(kernel.iopub_socket, msg_type, content, parent=parent)
        return {}

    # -- restore before a cell (trigger 2) -------------------------------------------------
    def _on_blocked(self) -> None:
        """A simulated GPU call found the kernel released: ask for a restore (lazy mode)."""
        if self.client is not None:
            try:
                self.client.request("restore", timeout=None, trigger="gpu-call")
            except Exception as e:
                log.warning("gpushare: restore after a blocked GPU call failed: %s", e)

    def pre_run_cell(self, info: Any = None) -> None:
        if not self.released or self.client is None:
            return  # the fast path: one attribute check per cell
        code = getattr(info, "raw_cell", "") or ""
        if self.restore_mode == "lazy" and not lazy.may_touch_gpu(code, self.shell, self.gpu_names):
            return
        parent = getattr(self.shell, "parent_header", None) or {}
        started = time.monotonic()
        try:
            self.client.request("restore", timeout=None, trigger="agent", parent=parent)
        except RemoteError as e:
            # the state is still held; the cell runs and its GPU calls wait for a restore
            print(f"gpushare: restore failed: {e}", file=sys.stderr)
            return
        log.debug("gpushare: restored before the cell in %.2f s", time.monotonic() - started)


def _sim():
    from ..sim.device import get_device

    return get_device()


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


_agent: Agent | None = None
_agent_lock = threading.Lock()


def get_agent(shell: Any = None) -> Agent | None:
    return _agent


def load(shell: Any) -> Agent:
    """Start the agent once per kernel (idempotent: %load_ext twice is harmless)."""
    global _agent
    with _agent_lock:
        if _agent is None:
            _agent = Agent(shell)
            _agent.start()
        return _agent
