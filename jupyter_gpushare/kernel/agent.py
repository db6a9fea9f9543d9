"""The agent inside a kernel the server started.

It says hello on the channel, moves simulated GPU accounting onto the server's node,
serves the server's requests (the emulated checkpoint, framework offload, trim, progress
lines in a cell), and before each cell makes sure the kernel's GPU state is resident
(restore trigger 2: clients that talk to the kernel directly and bypass the server's
websocket, such as nbclient).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any

from .. import states
from ..protocol import (
    KERNEL_ID_ENV,
    LIST_CAP,
    PLACEMENT_NOTE_ENV,
    SOCKET_ENV,
    RemoteError,
    cap_list,
)
from . import caps as kernel_caps
from . import lazy, oom
from .client import AgentClient, RemoteBackend

log = logging.getLogger(__name__)

GPU_FRAMEWORKS = ("torch", "cupy", "jax", "tensorflow")
_MAX_SHOWN = 32  # display ids remembered (one per restore that showed progress)
RECONNECT_WAIT = 15.0  # s a cell waits for a dropped channel to come back before it restores
SIM_RESUME_WAIT = 0.5  # s a sim_resume waits for the resume before it answers with progress
OOM_ANSWER_WAIT = 5.0  # s a cell that ran out of GPU memory waits for the server's room-making


class KernelBusy(RuntimeError):
    """A release asked while a cell runs (and not by that cell)."""


class BackgroundGPUWork(RuntimeError):
    """An automatic release asked while threads other than the cells' use the GPU."""


class Agent:
    def __init__(self, shell: Any):
        self.shell = shell
        self.client: AgentClient | None = None
        self.kernel_id = os.environ.get(KERNEL_ID_ENV, "")
        self.why_offline = ""  # why there is no server connection, for %gpushare
        self.placement_note = ""  # said before the first cell (the server placed it without room)
        self.released = False  # the server holds (or is taking) this kernel's GPU state
        self.executing = False  # a cell runs now (between pre_run_cell and post_run_cell)
        # releases and cells decide under this lock, so a release never starts while a
        # cell runs and a cell that starts during a release always restores first
        self._cell_lock = threading.Lock()
        self.restore_mode = "eager"
        #: names that may reach the GPU, computed at release (lazy mode); None while resident
        self.gpu_names: set[str] | None = None
        self._offloaded: list[Any] = []  # framework adapters holding offloaded state
        self._remote: RemoteBackend | None = None  # simulated GPU accounted on the server
        self._hooked = False  # pre_run_cell registered
        self._last_shown: dict[str, tuple[str, str]] = {}  # display id -> (cell's msg_id, text)
        # the pre-copy of an idle kernel's changed state, on a thread of its own; a cell
        # that starts sets the event (it never waits), a release waits for the thread
        self._precopy_thread: threading.Thread | None = None
        self._precopy_stop = threading.Event()
        self._cap_note = ""  # "holds 9.1 GiB of its 8 GiB cap", said in the next cell

    # -- connection -------------------------------------------------------------------
    def start(self) -> None:
        # Take the channel's address out of the environment: processes this kernel starts
        # (`!jupyter nbconvert --execute`, subprocesses that load the extension) must not
        # connect in its name. The server would accept them (they are its descendants) and
        # drop this kernel's own connection. The client keeps the path to reconnect.
        path = os.environ.pop(SOCKET_ENV, None)
        os.environ.pop(KERNEL_ID_ENV, None)
        # the epoch of requests that may run code: a release trusts a kept host copy made
        # current at the epoch that still holds, without reading it (offload/quiet.py)
        from .offload import quiet

        quiet.watch_kernel(self.shell)
        self.placement_note = os.environ.pop(PLACEMENT_NOTE_ENV, "")
        if self.placement_note:  # the server placed this kernel where no GPU had room
            self.shell.events.register("pre_run_cell", self._say_placement)
        if not path or not self.kernel_id:
            self.why_offline = "this kernel was not started by a gpushare-enabled Jupyter server"
            return
        client = AgentClient(path, self._handlers(), hello=self._hello)
        client.on_hello = self._on_hello
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        self.client = client
        if not client.open():  # it keeps trying in the background
            self.why_offline = f"the gpushare server is not reachable ({client.last_error}); retrying"
            log.warning("gpushare agent: %s", self.why_offline)

    def _say_placement(self, info: Any = None) -> None:
        """Before the first cell only: why this kernel's GPU may run out of memory."""
        self.shell.events.unregister("pre_run_cell", self._say_placement)
        print(self.placement_note, file=sys.stderr)

    def _hello(self) -> dict[str, Any]:
        return {"kernel_id": self.kernel_id, "pid": os.getpid(), "frameworks": self.frameworks()}

    def _on_hello(self, reply: dict[str, Any]) -> None:
        """The server's settings and its word on our state, before any later notification."""
        self.why_offline = ""
        if reply.get("restore_mode") in ("eager", "lazy"):
            self.restore_mode = reply["restore_mode"]
        if isinstance(reply.get("state"), str):
            self.note_state(reply["state"])
        if "memory_cap" in reply:  # before any cell: frameworks imported later are capped too
            self.apply_cap(reply)

    def _on_connect(self, reply: dict[str, Any]) -> None:
        """After every (re)connection: our simulated GPU memory, so that the server's
        accounting is exactly what this process holds."""
        sim = reply.get("simulated_gpus")
        if sim and isinstance(sim, list) and self._remote is None:
            self._remote = self._use_server_gpus(len(sim))
        if not self._hooked:
            self._hooked = True
            self.shell.events.register("pre_run_cell", self.pre_run_cell)
            self.shell.events.register("post_run_cell", self.post_run_cell)
        if self._remote is not None:
            self._remote.sync()

    def _use_server_gpus(self, count: int) -> RemoteBackend | None:
        from ..sim import device

        assert self.client is not None
        backend = RemoteBackend(self.client, count)
        try:
            # A cell's GPU call on a released kernel blocks until a restore, exactly as CUDA
            # calls do under the driver's checkpoint lock (so lazy mode's wrong "CPU-only"
            # decisions show, as on a real GPU). Only threads other than the cells' ask for
            # a restore when they block (on_blocked is never called for the main thread):
            # nothing else would ever bring the state back for them.
            dev = device.set_backend(backend)
            dev.on_blocked = self._restore_for_thread
        except RuntimeError as e:  # used locally before the server answered: stays local
            log.warning("gpushare agent: the simulated GPU stays private to this kernel: %s", e)
            return None
        return backend

    def _on_disconnect(self) -> None:
        self.why_offline = "the gpushare server closed the channel; reconnecting"
        if self._remote is not None:
            self._remote.channel_lost()

    def frameworks(self) -> list[str]:
        return [name for name in GPU_FRAMEWORKS if name in sys.modules]

    def _handlers(self) -> dict[str, Any]:
        return {
            "begin_release": self._begin_release,
            "sim_lock": self._sim_lock,
            "sim_checkpoint": lambda msg: _sim().checkpoint(),
            "sim_resume": lambda msg: _sim_resume(_gpu_mapping(msg.get("gpu_mapping")),
                                                  msg.get("wait", SIM_RESUME_WAIT)),
            "state": self._on_state,
            "show": self._show,
            "clear": self._clear,
            "trim": self._trim,
            "offload": self._offload,
            "reload": self._reload,
            "report": lambda msg: self.report(),
            "precopy": self._precopy,
            "drop_host_copies": self._drop_host_copies,
            "cap": lambda msg: {"applied": self.apply_cap(msg)},
            "cap_note": self._on_cap_note,
        }

    # -- the memory cap ----------------------------------------------------------------------
    def apply_cap(self, fields: dict[str, Any]) -> list[str]:
        """Apply the server's word on this kernel's cap (``memory_cap`` bytes per GPU or None,
        ``gpu_memory_total``) to every framework; one line per framework, as said."""
        cap, total = fields.get("memory_cap"), fields.get("gpu_memory_total")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
            raise ValueError(f"memory_cap must be bytes > 0 or null, got {cap!r:.60}")
        if total is not None and (isinstance(total, bool) or not isinstance(total, int)):
            raise ValueError(f"gpu_memory_total must be bytes or null, got {total!r:.60}")
        lines = kernel_caps.get().set(cap, total or None)
        for line in lines:
            log.info("gpushare: %s", line)
        return lines

    def _on_cap_note(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The server saw this kernel hold more than its cap: say so in the cell that runs
        now, else in the next one."""
        text = (f"gpushare: this kernel {str(msg.get('text', ''))[:200]}: what holds it was "
                "not limited by the cap (a framework started before it, or raw CUDA); it is "
                "released first when others need room\n")
        kernel = getattr(self.shell, "kernel", None)
        parent = getattr(self.shell, "parent_header", None)
        if self.executing and kernel is not None and parent:
            kernel.session.send(kernel.iopub_socket, "stream", {"name": "stderr", "text": text},
                                parent=parent)
        else:
            self._cap_note = text
        return {}

    # -- server requests -----------------------------------------------------------------
    def _begin_release(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The server asks before any release: is this a moment to take the GPU state?"""
        with self._cell_lock:
            if self.executing and not msg.get("by_kernel"):
                raise KernelBusy("kernel is busy running a cell; release it when idle")
            if msg.get("automatic") and not msg.get("background_ok"):
                threads = self.background_gpu_threads()
                if threads:
                    raise BackgroundGPUWork(
                        f"background threads use the GPU ({', '.join(threads[:3])}); release "
                        "by hand or allow it with %gpushare allow-background")
            self.released = True  # from here a cell that starts restores first
            kernel_caps.get().hold()  # a cap that comes now makes no GPU call: it would block
        self._note_gpu_names()
        return {}

    def background_gpu_threads(self) -> list[str]:
        """Threads other than the cells' that used the GPU and still run (simulated GPU)."""
        device_module = sys.modules.get("jupyter_gpushare.sim.device")
        device = getattr(device_module, "_device", None) if device_module else None
        users = getattr(device, "background_users", None)
        return list(users()) if users is not None else []

    def _restore_for_thread(self, thread_name: str) -> None:
        """A background thread's GPU call found the kernel released: bring it back."""
        if self.client is None or not self.client.connected:
            return
        try:
            self.client.request("restore", timeout=None, trigger="background")
        except (RemoteError, OSError) as e:
            log.warning("gpushare: restore for thread %s failed: %s", thread_name, e)

    def _sim_lock(self, msg: dict[str, Any]) -> dict[str, Any]:
        self._note_gpu_names()
        self.stop_precopy(wait=True)
        _sim().lock(timeout=float(msg.get("lock_timeout", 10.0)))
        return {}

    # -- host copies: pre-copy while idle, the host memory budget --------------------------
    def _precopy(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The server saw this kernel idle: copy what changed since its host copy, in the
        background. Answers at once; never while a cell runs or the state is released."""
        with self._cell_lock:
            if self.executing or self.released:
                return {"started": False, "why": "a cell runs" if self.executing else "released"}
            if self._precopy_thread is not None and self._precopy_thread.is_alive():
                return {"started": False, "why": "a pre-copy runs"}
            stop = self._precopy_stop = threading.Event()
            thread = threading.Thread(target=self._run_precopy, args=(stop,), daemon=True,
                                      name="gpushare-precopy")
            self._precopy_thread = thread
        thread.start()
        return {"started": True}

    def _run_precopy(self, stop: threading.Event) -> None:
        copied = 0
        try:
            device = _sim_device_in_use()
            if device is not None:
                copied += int(device.precopy(stop)["bytes"])
            from .offload import present_adapters

            for adapter in present_adapters():
                if stop.is_set():
                    break
                copied += adapter.precopy(self.shell.user_ns, stop).copied
        except Exception as e:  # a cell changed the namespace under the walk: next time
            log.debug("gpushare: pre-copy stopped: %s", e)
        log.debug("gpushare: pre-copied %d bytes", copied)

    def stop_precopy(self, wait: bool = False) -> None:
        """Stop the pre-copy (a cell starts: at once, without waiting; a release: wait for
        the copy in flight, so the release reads every kept copy as it stands)."""
        self._precopy_stop.set()
        thread = self._precopy_thread
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()

    def host_copies(self) -> dict[str, int]:
        """Bytes whose kept host copy is current, bytes a release would copy now (of them,
        those with no kept buffer to go into: new host memory), and host bytes the kept
        copies hold (simulated GPU and frameworks together)."""
        out = {"current": 0, "to_copy": 0, "kept": 0, "to_copy_new": 0}
        parts = []
        device = _sim_device_in_use()
        if device is not None:
            parts.append(device.host_copies())
        from .offload import present_adapters

        parts.extend(adapter.host_copies() for adapter in present_adapters())
        for part in parts:
            part = {"to_copy_new": part.get("to_copy", 0), **part}  # not said: all of it new
            for key in out:
                out[key] += int(part.get(key, 0))
        return out

    def _drop_host_copies(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Host memory is short: free kept copies, oldest first, until ``bytes`` are freed
        (absent: all of them). The next release copies those bytes again."""
        wanted = msg.get("bytes")
        if wanted is not None and (isinstance(wanted, bool) or not isinstance(wanted, int)
                                   or wanted < 0):
            raise ValueError(f"bytes must be an integer >= 0, got {wanted!r}")
        self.stop_precopy(wait=True)
        freed = 0
        device = _sim_device_in_use()
        if device is not None:
            freed += device.drop_host_copies(wanted)
        from .offload import present_adapters

        for adapter in present_adapters():
            if wanted is not None and freed >= wanted:
                break
            freed += adapter.drop_host_copies(None if wanted is None else wanted - freed)
        return {"freed": freed}

    def _on_state(self, msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("restore_mode") in ("eager", "lazy"):
            self.restore_mode = msg["restore_mode"]
        self.note_state(str(msg.get("state", "")))
        return {}

    def note_state(self, state: str) -> None:
        """The server's word on this kernel's state (notifications, replies to the magics)."""
        released, caps = state in states.HELD, kernel_caps.get()
        if not released and caps.held:
            # the state is back on the GPU: the caps that came meanwhile apply now, before
            # the flag says so (a cell that starts meanwhile asks, and waits for them here)
            for line in caps.resume():
                log.info("gpushare: %s", line)
        with self._cell_lock:
            self.released = released
            if released:
                caps.hold()
        if released:
            self._note_gpu_names()
        else:
            self.gpu_names = None

    def _note_gpu_names(self) -> None:
        """What may reach the GPU, as of the release (lazy mode decides cells against it).

        Computed once per release, on the handler thread while the kernel is idle; reading
        objects' types and attributes makes no GPU call."""
        if self.gpu_names is None and self.restore_mode == "lazy":
            try:
                self.gpu_names = lazy.gpu_names(self.shell.user_ns)
            except Exception as e:  # never break a release over the lazy bookkeeping
                log.warning("gpushare: could not scan the namespace for GPU objects: %s", e)
                self.gpu_names = None

    def _trim(self, msg: dict[str, Any]) -> dict[str, Any]:
        from .offload import present_adapters

        self.stop_precopy(wait=True)
        freed = 0
        for adapter in present_adapters():
            freed += adapter.trim()
        return {"freed": freed}

    def _offload(self, msg: dict[str, Any]) -> dict[str, Any]:
        from .offload import present_adapters

        self._note_gpu_names()
        self.stop_precopy(wait=True)
        reports = []
        adapters = present_adapters()
        if not adapters:
            raise RuntimeError("no supported framework (PyTorch, CuPy, JAX) is imported in this kernel")
        before = _device_bytes(adapters)
        for adapter in adapters:
            self._offloaded.append(adapter)  # before: a failure half-way is reloaded too
            reports.append(adapter.offload(self.shell.user_ns))
        after = _device_bytes(adapters)
        # one bounded list for every adapter, with the true count of what was left alone
        entries = [e for r in reports for e in (r.skipped[:-1] if r.left_out else r.skipped)]
        total = len(entries) + sum(r.left_out for r in reports)
        shown = cap_list(entries[:LIST_CAP])
        if total > len(shown):
            shown.append(f"... and {total - len(shown)} more")
        return {
            "bytes": sum(r.bytes for r in reports),
            "copied": sum(r.copied for r in reports),
            "freed": sum(r.freed_bytes for r in reports),
            "skipped": shown,
            "skipped_count": total,
            # the frameworks' own count of their GPU memory around the move: what it freed
            # (the server fails a release that freed too little of it)
            **({"device_before": before, "device_after": after}
               if before is not None and after is not None else {}),
        }

    def _reload(self, msg: dict[str, Any]) -> dict[str, Any]:
        from .reload import reload_all

        # all or nothing across frameworks: on a failure those already back are offloaded
        # again and the list stays, so a later reload finds the state exactly as released
        reports = reload_all(self._offloaded, self.shell.user_ns)
        self._offloaded.clear()
        return {"bytes": sum(r.bytes for r in reports)}

    def report(self) -> dict[str, Any]:
        """What this kernel holds by its own count (used when NVML cannot see our pids)."""
        out: dict[str, Any] = {"frameworks": self.frameworks(), "framework_bytes": 0}
        try:
            from .offload import present_adapters

            adapters = present_adapters()
            out["framework_bytes"] = sum(a.device_bytes() for a in adapters)
            # what no offload frees (an allocator's pool): auto leaves such kernels to the driver
            out["framework_pool_bytes"] = sum(a.pool_bytes() for a in adapters)
        except Exception as e:  # a framework in a bad state must not break reporting
            out["error"] = str(e)
        # read without touching the module's names directly: this runs on the channel's
        # thread while a cell may still be importing the module (partially initialized)
        device = _sim_device_in_use()
        if device is not None:
            out["simulated_bytes"] = device.allocated()
        out["background_gpu_threads"] = self.background_gpu_threads()
        try:
            copies = self.host_copies()
            out["host_copy_bytes"], out["to_copy_bytes"] = copies["current"], copies["to_copy"]
            out["host_copy_kept_bytes"] = copies["kept"]
            out["to_copy_new_bytes"] = copies["to_copy_new"]
        except Exception as e:  # never break reporting over the kept copies' bookkeeping
            log.debug("gpushare: could not count the kept host copies: %s", e)
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
        self._last_shown[display_id] = (_msg_id(parent), text)
        while len(self._last_shown) > _MAX_SHOWN:
            self._last_shown.pop(next(iter(self._last_shown)))
        kernel.session.send(kernel.iopub_socket, msg_type, content, parent=parent)
        return {}

    def shown_in(self, parent: dict[str, Any]) -> dict[str, str]:
        """The progress lines shown in the output of the cell ``parent`` (as they read now),
        by display id: what the server said there, so a magic need not say it again."""
        cell = _msg_id(parent)
        return {d: text for d, (p, text) in list(self._last_shown.items()) if cell and p == cell}

    def _clear(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Take the progress line ``display_id`` out of the cell ``parent`` again: the cell's
        code has not run yet, so clearing the cell's output removes only that line."""
        kernel = getattr(self.shell, "kernel", None)
        parent = msg.get("parent")
        display_id = str(msg.get("display_id") or "")
        if kernel is None or not isinstance(parent, dict) or display_id not in self._last_shown:
            return {}
        del self._last_shown[display_id]
        kernel.session.send(kernel.iopub_socket, "clear_output", {"wait": False}, parent=parent)
        return {}

    # -- restore before a cell (trigger 2) -------------------------------------------------
    def post_run_cell(self, result: Any = None) -> None:
        self.executing = False
        error = getattr(result, "error_in_exec", None)
        if error is None or not kernel_caps.is_oom(error) or "gpushare memory cap" in str(error):
            return
        line = kernel_caps.get().oom_line()
        if line:
            print(line, file=sys.stderr)  # under the framework's own out-of-memory error
        self.ask_for_room(error)

    #: one out_of_memory request at a time (the server answers a second one that it runs)
    _asking_room = threading.Lock()

    def ask_for_room(self, error: BaseException) -> None:
        """The cell ran out of GPU memory: ask the server to release idle kernels on that GPU
        so that its next try fits, and say what it did under the error. Bounded: the next
        cell waits for this."""
        client = self.client
        if client is None or not client.connected or not self._asking_room.acquire(blocking=False):
            return
        try:
            reply = client.request("out_of_memory", timeout=OOM_ANSWER_WAIT, **oom.parse(error))
        except (RemoteError, OSError) as e:
            print(f"gpushare: could not ask the server to make room: {e}", file=sys.stderr)
            return
        finally:
            self._asking_room.release()
        text = reply.get("text")
        if isinstance(text, str) and text:
            print(text[:1000], file=sys.stderr)

    def pre_run_cell(self, info: Any = None) -> None:
        self._precopy_stop.set()  # the cell runs at once; what it changes is copied again
        with self._cell_lock:
            self.executing = True
            released = self.released
        if self._cap_note:
            note, self._cap_note = self._cap_note, ""
            print(note, end="", file=sys.stderr)
        if not released or self.client is None:
            return  # the fast path: one flag check per cell
        code = getattr(info, "raw_cell", "") or ""
        if lazy.only_gpushare_magics(code):
            return  # %gpushare shows the state as it is; `%gpushare restore` restores itself
        if self.restore_mode == "lazy":
            self._note_gpu_names()  # no-op when the release computed it already
            known = self.gpu_names  # None: the scan failed, so every cell restores
            if known is not None and not lazy.may_touch_gpu(code, self.shell, known):
                return
        parent = getattr(self.shell, "parent_header", None) or {}
        started = time.monotonic()
        if not self.client.connected:  # a channel that dropped comes back by itself: wait a bit
            self.client.wait_connected(RECONNECT_WAIT)
        try:
            reply = self.client.request("restore", timeout=None, trigger="agent", parent=parent)
        except (RemoteError, OSError) as e:
            # the state is still held; the cell runs and its GPU calls wait for a restore
            print(f"gpushare: restore failed: {e}", file=sys.stderr)
            return
        self.note_state(str((reply.get("kernel") or {}).get("state", states.ACTIVE)))
        log.debug("gpushare: restored before the cell in %.2f s", time.monotonic() - started)


def _sim():
    from ..sim.device import get_device

    return get_device()


def _sim_device_in_use() -> Any:
    """The process's simulated GPU if something made it (never makes one); None too while a
    cell's thread is still importing the module (its names are not all there yet)."""
    module = sys.modules.get("jupyter_gpushare.sim.device")
    return getattr(module, "_device", None) if module is not None else None


def _device_bytes(adapters: list[Any]) -> int | None:
    """What the frameworks hold on the GPUs by their own count (None: one could not say)."""
    try:
        return sum(int(a.device_bytes()) for a in adapters)
    except Exception as e:  # a count is a check of the release, never the reason it fails
        log.warning("gpushare: could not count the frameworks' GPU memory: %s", e)
        return None


def _gpu_mapping(value: Any) -> dict[int, int] | None:
    """The server's ``gpu_mapping`` ([[from, to], ...], node GPU indices) as {from: to}; a
    ValueError that says what is wrong with it otherwise (the device checks the indices)."""
    if value is None:
        return None
    shape = "gpu_mapping must be a list of [from, to] pairs of GPU indices"
    if not isinstance(value, list):
        raise ValueError(f"{shape}, got {value!r:.100}")
    out: dict[int, int] = {}
    for pair in value:
        if (not isinstance(pair, list) or len(pair) != 2
                or any(isinstance(g, bool) or not isinstance(g, int) for g in pair)):
            raise ValueError(f"{shape}, got {pair!r:.100} in it")
        if pair[0] in out:
            raise ValueError(f"gpu_mapping: GPU {pair[0]} is named twice as a source")
        out[pair[0]] = pair[1]
    return out


def _sim_resume(gpu_mapping: dict[int, int] | None = None,
                wait: float = SIM_RESUME_WAIT) -> dict[str, Any]:
    """Back to running from any state: the restore (onto ``gpu_mapping``'s GPUs, if given),
    and the undo of a failed release.

    The resume runs on a thread of its own; the answer comes once it is done or after
    ``wait`` seconds, whichever is first: ``done`` False says how far each GPU's copy is, and
    the server asks again (the same request joins the resume that runs) until ``done``. A
    failed resume is an error answer, as it always was."""
    from ..sim import device as sim_device

    dev = _sim()
    step = getattr(dev, "resume_step", None)
    if step is not None:
        return step(gpu_mapping, wait)
    if gpu_mapping is not None:
        return dev.resume(gpu_mapping=gpu_mapping)
    resume = getattr(dev, "resume", None)
    if resume is not None:
        return resume()
    out: dict[str, Any] = {"bytes": 0, "arrays": 0}
    if dev.state == sim_device.CHECKPOINTED:
        out = dev.restore()
    if dev.state == sim_device.LOCKED:
        dev.unlock()
    return out


def _msg_id(parent: dict[str, Any]) -> str:
    """The msg_id of a cell's parent message (the message, or its header alone)."""
    header = parent.get("header")
    if not isinstance(header, dict):
        header = parent
    return str(header.get("msg_id") or "")


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
