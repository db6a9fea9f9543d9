"""Which kernel holds what on which GPU: kernels -> local pids -> usage, over time.

Every poll reads the kernel manager (pids, activity), one telemetry sample, and updates
one record per kernel plus ring buffers for the history API. Kernels that appear,
restart or die are picked up and dropped on the next poll.

The sample itself (NVML, the process table, cgroup files) runs on one worker thread with
a time limit, never on the event loop: a stalled NVML call must not freeze every user's
websocket. One kernel whose numbers cannot be read is logged and skipped; the others are
tracked as usual.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple, TypeVar

import psutil

from .. import clock
from ..node.gpu_load import SlidingLoad
from ..policy import ReleaseSettings
from ..policy.placement import window_mean
from ..telemetry import GPUInfo, ProcessUsage, Telemetry
from .hostmem import HostMemory, HostRoom

T = TypeVar("T")
RECENT_PEAKS = 8  # peaks kept per kernelspec name, of its kernels that ended
RECENT_SPECS = 64  # kernelspec names whose peaks are kept (the least recent goes first)
RECENT_ENDED = 256  # ids of kernels that ended, kept (placement forgets them at once)
SAMPLE_TIMEOUT = 30.0  # s a telemetry sample may take before the poll gives up on it

log = logging.getLogger(__name__)


class KernelSample(NamedTuple):
    """One poll's numbers for a kernel (the history API's series are made of these)."""

    t: float  # epoch seconds
    gpu_memory_bytes: int  # all GPUs
    sm_utilization: float | None  # percent, the busiest GPU
    gpu_bytes: dict[int, int]  # GPU index -> bytes
    gpu_utilization: dict[int, float]  # GPU index -> percent SM of the kernel's processes there


@dataclass
class KernelRecord:
    id: str
    name: str = ""  # kernelspec name
    path: str = ""  # the notebook (from the session manager)
    pids: list[int] = field(default_factory=list)
    gpu_bytes: dict[int, int] = field(default_factory=dict)  # GPU index -> bytes held now
    pid_gpu_bytes: dict[int, dict[int, int]] = field(default_factory=dict)  # pid -> GPU -> bytes
    sm_utilization: float | None = None  # percent, last sample, the busiest of its GPUs
    # GPU index -> percent SM of the kernel's processes on that GPU, last sample
    gpu_utilization: dict[int, float] = field(default_factory=dict)
    execution_state: str = "unknown"
    last_activity: float = 0.0  # epoch seconds (server activity or GPU use, the later)
    server_activity: float = 0.0  # epoch seconds of the last message the server saw
    first_seen: float = 0.0
    attributed: bool = True  # bytes measured per process (False: the agent's own count)
    gpu_pids: list[int] = field(default_factory=list)  # pids with a GPU device open (unmeasured)
    host_room: HostRoom | None = None  # host memory the kernel's process may still use
    gpu_work_while_idle: bool = False  # the last sample saw GPU work while no cell ran
    background_threads: list[str] = field(default_factory=list)  # agent: threads using the GPU
    #: agent: GPU bytes whose kept host copy is current, bytes a release would copy now, and
    #: host bytes the kept copies hold (None: the agent did not say)
    host_copy_bytes: int | None = None
    to_copy_bytes: int | None = None
    host_copy_kept_bytes: int | None = None
    #: agent: the part of to_copy_bytes with no kept buffer to be copied into (new host
    #: memory a release takes); None: an older agent, which did not say
    to_copy_new_bytes: int | None = None
    history: deque[KernelSample] = field(default_factory=deque)  # one per poll
    peak_gpu_bytes: dict[int, int] = field(default_factory=dict)  # GPU index -> most bytes seen
    # GPU index -> epoch seconds of the last sample in which its processes computed there
    # (SM above idle_utilization): which kernels share a GPU's SMs
    computed: dict[int, float] = field(default_factory=dict)
    # % SM of its busiest GPU at the peak of its last stretch of samples in which it computed:
    # how heavy its last GPU work was (a move before its next cell weighs it; the stretch's
    # last sample reads only the part of its interval the work still ran)
    computed_sm: float = 0.0
    computing: bool = False  # the last sample saw it compute
    # the samples of history that no later sample's SM % reaches, oldest first, as
    # (serial, t, SM %): SM % falls along it, so the first one at or after a time is the
    # highest SM % since then. Serials count every sample folded in.
    _peaks: deque[tuple[int, float, float]] = field(default_factory=deque, init=False,
                                                    repr=False, compare=False)
    _peaks_upto: Any = field(default=None, init=False, repr=False, compare=False)
    _peaks_folded: int = field(default=0, init=False, repr=False, compare=False)

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
        """Highest SM utilization sampled since ``since`` (0 when none was sampled).

        Asked for every kernel at every poll and every status request: a scan of the whole
        history made each status request cost O(kernels x history), growing with every poll
        until the ring buffers are full (benchmarks/load_cycle.py). Samples are in time order."""
        self._catch_up_peaks()
        for _, t, u in self._peaks:
            if t >= since:
                return u
        return 0.0

    def _catch_up_peaks(self) -> None:
        """Fold in the samples appended since the last call; forget the peaks of samples the
        ring buffer has dropped."""
        history, peaks = self.history, self._peaks
        if history and history[-1] is not self._peaks_upto:
            new = []
            for sample in reversed(history):
                if sample is self._peaks_upto:
                    break
                new.append(sample)
            else:  # the last sample we saw is gone (a new buffer, or it wrapped): start over
                peaks.clear()
                self._peaks_folded = 0
            for sample in reversed(new):
                t, u = sample[0], sample[2]  # KernelSample.t, .sm_utilization
                self._peaks_folded += 1
                if u is None:
                    continue
                while peaks and peaks[-1][2] <= u:
                    peaks.pop()
                peaks.append((self._peaks_folded, t, u))
            self._peaks_upto = history[-1]
        oldest_kept = self._peaks_folded - len(history) + 1  # serial of history[0]
        while peaks and peaks[0][0] < oldest_kept:
            peaks.popleft()


@dataclass
class GPURecord:
    info: GPUInfo
    history: deque[tuple[float, int | None, float | None]] = field(default_factory=deque)
    _windows: dict[float, SlidingLoad] = field(default_factory=dict, init=False, repr=False,
                                               compare=False)

    def recent_load(self, window: float) -> float:
        """:meth:`load` over the last ``window`` seconds of samples (up to the newest one),
        kept up as samples come (a running sum per window asked: placement's and the
        rebalancer's): O(samples since the last call), not O(the window's samples), for
        every GPU at the first decision after each poll."""
        sliding = self._windows.get(window)
        if sliding is None:
            sliding = self._windows[window] = SlidingLoad(window)
        sliding.fold(self.history)
        return sliding.recent_load(window)

    def load(self, since: float, until: float) -> float:
        """Mean SM % busy over [since, until], from this GPU's samples: each sample's
        utilization is the busy fraction since the sample before it, so it counts over that
        interval. The window shrinks to the samples there are; a window with none in it (0 s)
        is the last sample's; 0 with no sample. Reads only the window's samples, newest
        first, not the whole ring."""
        history = self.history
        if not history:
            return 0.0
        last_t, _, last_u = history[-1]
        until = min(until, last_t)
        rows = []
        for row in reversed(history):
            rows.append(row)
            if row[0] <= since:
                break
        rows.reverse()
        start = max(since, rows[0][0])
        if len(rows) < 2 or until <= start:
            return float(last_u or 0.0)
        samples = [(rows[i - 1][0], rows[i][2]) for i in range(1, len(rows))]
        return window_mean(samples, start, until)


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


def process_gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped counts as exited)."""
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:  # cannot tell (access denied): alive, as far as we know
        return False


def _gpu_device_pids(pids: Iterable[int]) -> list[int]:
    """Pids with an NVIDIA device file open: those with a CUDA context (when NVML cannot
    tell us, e.g. in a container, this is how we know which processes to checkpoint)."""
    out = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/dev/nvidia") and target[len("/dev/nvidia"):].isdigit():
                out.append(pid)
                break
    return out


class SamplingThread(Executor):
    """Runs calls one at a time on one daemon thread, started here.

    Not a ThreadPoolExecutor: the interpreter joins those workers at exit, so a hung NVML
    call, or an interrupt that lands while a worker is being started (the worker is then
    never told to stop), would keep the server process from exiting on Ctrl-C."""

    def __init__(self, name: str):
        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self.thread = threading.Thread(target=self._work, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            future: Future[T] = Future()
            self._calls.put((future, fn, args, kwargs))
            return future

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args, kwargs = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # the caller's to see, as with any executor
                future.set_exception(e)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                while cancel_futures:
                    try:
                        call = self._calls.get_nowait()
                    except queue.Empty:
                        break
                    if call is not None:
                        call[0].cancel()
                self._calls.put(None)
        if wait:
            self.thread.join()


@dataclass
class _Sample:
    """What one poll read off the event loop."""

    children: dict[int, list[int]]
    usage: list[ProcessUsage]
    devices: list[GPUInfo]
    pids: dict[str, list[int]]
    host: dict[str, HostRoom]
    gpu_pids: dict[str, list[int]]


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
        settings: ReleaseSettings | None = None,
    ):
        """settings: the release settings; their idle_utilization is the SM % above which a
        kernel counts as using the GPU (none: any use counts)."""
        self.km = kernel_manager
        self.settings = settings
        self.telemetry = telemetry
        self.session_manager = session_manager
        self.history_len = max(2, int(history_seconds / max(poll_interval, 0.05)) + 1)
        self.kernels: dict[str, KernelRecord] = {}
        self.gpus: dict[int, GPURecord] = {}
        self.foreign_pids: set[int] = set()  # NVML pids this pid namespace cannot see
        self.agent_reports = agent_reports  # callable kernel_id -> agent report dict, or None
        self.last_poll_seconds = 0.0
        self.hostmem = HostMemory()
        #: kernelspec name -> the most bytes per GPU its last kernels held (newest last):
        #: what a new kernel of that spec is expected to need (bounded: RECENT_PEAKS each,
        #: RECENT_SPECS names)
        self.recent_peaks: dict[str, deque[int]] = {}
        #: ids of the kernels whose records were dropped (shut down, culled, died), newest last
        self.ended: deque[str] = deque(maxlen=RECENT_ENDED)
        # one thread for every hardware read: NVML calls stay ordered, and a stalled one
        # cannot take the event loop's default pool with it
        self._executor = SamplingThread("gpushare-sample")

    @property
    def idle_utilization(self) -> float:
        """SM % above which a kernel counts as using the GPU."""
        return self.settings.idle_utilization if self.settings is not None else 0.0

    async def off_loop(self, fn: Callable[[], T], timeout: float = SAMPLE_TIMEOUT) -> T:
        """Run a blocking read on the sampling thread, within ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        return await asyncio.wait_for(loop.run_in_executor(self._executor, fn), timeout)

    def close(self, timeout: float = 2.0) -> None:
        """Stop the sampling thread: queued reads are dropped, a read in progress gets
        ``timeout`` seconds to return (a hung NVML call is left behind: the thread is a
        daemon, so it never holds up the process's exit)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._executor.thread.join(timeout)

    # -- pids ------------------------------------------------------------------------
    def kernel_pid(self, kernel_id: str) -> int | None:
        try:
            km = self.km.get_kernel(kernel_id)
        except KeyError:
            return None
        except Exception as e:  # jupyter_server's manager answers its 404 for a kernel shut down
            if getattr(e, "status_code", None) == 404:
                return None
            raise
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
        return self._descendants(pid, _children_by_parent())

    def process_ended(self, kernel_id: str, pid: int) -> str | None:
        """Why the kernel's process ``pid`` is no longer its process (None: it still is)."""
        now = self.kernel_pid(kernel_id)
        if now is not None and now != pid:
            return "the kernel restarted"
        return "the kernel died" if process_gone(pid) else None

    def owns_pid(self, kernel_id: str, pid: int) -> bool:
        return pid in self.kernel_pids(kernel_id)

    # -- polling -------------------------------------------------------------------------
    async def poll(self) -> None:
        started = clock.monotonic()
        now = clock.now()
        kernel_ids = list(self.km.list_kernel_ids())
        roots = {kid: self.kernel_pid(kid) for kid in kernel_ids}
        paths = await self._paths()
        try:
            sample = await self.off_loop(lambda: self._sample(roots))
        except asyncio.TimeoutError:
            log.error("gpushare: a GPU telemetry sample took longer than %.0f s; skipping this poll",
                      SAMPLE_TIMEOUT)
            return
        self._note_foreign(sample.usage)

        by_pid: dict[int, list[ProcessUsage]] = {}
        for u in sample.usage:
            by_pid.setdefault(u.pid, []).append(u)

        for kid in kernel_ids:
            rec = self.kernels.get(kid)
            if rec is None:
                rec = self.kernels[kid] = KernelRecord(id=kid, first_seen=now, last_activity=now)
                rec.history = deque(maxlen=self.history_len)
            try:
                self._update_kernel(rec, sample, by_pid, paths.get(kid, ""), now)
            except Exception:  # one kernel's bad numbers must not stop tracking the others
                log.exception("gpushare: kernel %s: could not update its record", kid)

        for kid in set(self.kernels) - set(kernel_ids):
            self._remember_peak(self.kernels.pop(kid))  # shut down or culled: no history kept
            self.ended.append(kid)

        for info in sample.devices:
            rec_gpu = self.gpus.get(info.index)
            if rec_gpu is None:
                rec_gpu = self.gpus[info.index] = GPURecord(info, deque(maxlen=self.history_len))
            rec_gpu.info = info
            rec_gpu.history.append((now, info.memory_used, info.utilization))
        for index in set(self.gpus) - {d.index for d in sample.devices}:
            del self.gpus[index]
        self.last_poll_seconds = clock.monotonic() - started

    def _sample(self, roots: dict[str, int | None]) -> _Sample:
        """Everything a poll reads from the machine (runs on the sampling thread).

        One scan of the process table serves every kernel (50 kernels: one scan costs what
        one psutil children() call costs, i.e. 50x less than one call each)."""
        children = _children_by_parent()
        usage = self.telemetry.processes()
        devices = self.telemetry.devices()
        seen = {u.pid for u in usage}
        pids, host, gpu_pids = {}, {}, {}
        with self.hostmem.one_moment():
            for kid, root in roots.items():
                tree = self._descendants(root, children)
                pids[kid] = tree
                if tree:
                    host[kid] = self.hostmem.room(tree[0])
                if tree and not seen.intersection(tree):
                    gpu_pids[kid] = _gpu_device_pids(tree)
        return _Sample(children, usage, devices, pids, host, gpu_pids)

    @staticmethod
    def _descendants(pid: int | None, children: dict[int, list[int]]) -> list[int]:
        if pid is None or (pid not in children and not psutil.pid_exists(pid)):
            return []
        out, todo = [pid], [pid]
        while todo:
            for child in children.get(todo.pop(), ()):
                out.append(child)
                todo.append(child)
        return out

    def _update_kernel(self, rec: KernelRecord, sample: _Sample, by_pid: dict[int, list[ProcessUsage]],
                       path: str, now: float) -> None:
        try:
            km = self.km.get_kernel(rec.id)
        except KeyError:
            return
        except Exception as e:  # jupyter_server's manager raises its 404 for a kernel shut since listed
            if getattr(e, "status_code", None) == 404:
                return
            raise
        previous_poll = rec.history[-1][0] if rec.history else None
        was_idle = rec.execution_state == "idle"
        rec.name = getattr(km, "kernel_name", "") or rec.name
        rec.path = path or rec.path
        rec.execution_state = getattr(km, "execution_state", "unknown") or "unknown"
        activity = _epoch(getattr(km, "last_activity", None))
        rec.server_activity = activity
        rec.pids = sample.pids.get(rec.id, [])
        rec.host_room = sample.host.get(rec.id)
        rec.gpu_pids = sample.gpu_pids.get(rec.id, [])

        gpu_bytes: dict[int, int] = {}
        pid_gpu_bytes: dict[int, dict[int, int]] = {}
        gpu_util: dict[int, float] = {}  # the busiest of the kernel's processes, per GPU
        for pid in rec.pids:
            for u in by_pid.get(pid, ()):
                gpu_bytes[u.gpu] = gpu_bytes.get(u.gpu, 0) + u.memory_bytes
                per_pid = pid_gpu_bytes.setdefault(pid, {})
                per_pid[u.gpu] = per_pid.get(u.gpu, 0) + u.memory_bytes
                if u.sm_utilization is not None:
                    gpu_util[u.gpu] = max(gpu_util.get(u.gpu, 0.0), u.sm_utilization)
        rec.attributed = True
        report = self.agent_reports(rec.id) if self.agent_reports is not None else None
        report = report or {}
        threads = report.get("background_gpu_threads")
        rec.background_threads = [str(t) for t in threads][:10] if isinstance(threads, list) else []
        rec.host_copy_bytes = report.get("host_copy_bytes")
        rec.to_copy_bytes = report.get("to_copy_bytes")
        rec.host_copy_kept_bytes = report.get("host_copy_kept_bytes")
        rec.to_copy_new_bytes = report.get("to_copy_new_bytes")
        if not gpu_bytes and self.foreign_pids:
            framework_bytes = report.get("framework_bytes")
            if isinstance(framework_bytes, int) and not isinstance(framework_bytes, bool) \
                    and framework_bytes > 0:
                # the agent's own count; which GPU is known only on a 1-GPU node
                gpu_bytes[0 if len(self.gpus) == 1 else -1] = framework_bytes
                rec.attributed = False
        rec.gpu_bytes = gpu_bytes
        rec.pid_gpu_bytes = pid_gpu_bytes
        # a GPU it holds memory on without a utilization sample (none since the last poll,
        # MIG, the agent's own count) shows 0, as the kernel's overall figure always has
        rec.gpu_utilization = {g: gpu_util.get(g, 0.0) for g in sorted(gpu_bytes)}
        for g, nbytes in gpu_bytes.items():
            if nbytes > rec.peak_gpu_bytes.get(g, 0):
                rec.peak_gpu_bytes[g] = nbytes
        computing = []
        for g, sm in gpu_util.items():
            if sm > self.idle_utilization:
                rec.computed[g] = now
                computing.append(sm)
        if computing:
            rec.computed_sm = max(max(computing), rec.computed_sm if rec.computing else 0.0)
        rec.computing = bool(computing)
        rec.sm_utilization = max(rec.gpu_utilization.values()) if gpu_bytes else None
        gpu_working = bool(rec.sm_utilization and rec.sm_utilization > self.idle_utilization)
        # the whole sample interval was quiet for the server (no message since the previous
        # poll, idle then and now), yet the GPU worked: a thread of the kernel uses it
        rec.gpu_work_while_idle = (gpu_working and previous_poll is not None and was_idle
                                   and rec.execution_state == "idle" and activity < previous_poll)
        if gpu_working:
            activity = max(activity, now)  # GPU work counts as activity
        if rec.busy:
            activity = now
        rec.last_activity = max(rec.last_activity, activity)
        rec.history.append(KernelSample(now, rec.gpu_memory_bytes, rec.sm_utilization,
                                        dict(gpu_bytes), dict(rec.gpu_utilization)))

    def _note_foreign(self, usage: Iterable[ProcessUsage]) -> None:
        foreign = self.telemetry.foreign_pids({u.pid for u in usage})
        if foreign and not self.foreign_pids:
            log.warning(
                "gpushare: %s reports pids %s that this pid namespace cannot see (a container?); "
                "attributing GPU memory from the kernel agents' own reports instead",
                self.telemetry.label or self.telemetry.name, sorted(foreign)[:5],
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

    def _remember_peak(self, rec: KernelRecord) -> None:
        peak = max((n for g, n in rec.peak_gpu_bytes.items() if g >= 0), default=0)
        if not rec.name or peak <= 0:
            return
        peaks = self.recent_peaks.pop(rec.name, None) or deque(maxlen=RECENT_PEAKS)
        peaks.append(peak)
        self.recent_peaks[rec.name] = peaks  # the newest name last
        while len(self.recent_peaks) > RECENT_SPECS:
            del self.recent_peaks[next(iter(self.recent_peaks))]

    def recent_peaks_of(self, name: str) -> list[int]:
        """The most bytes per GPU recent kernels of kernelspec ``name`` held: those that
        ended, and those running now."""
        out = list(self.recent_peaks.get(name, ()))
        out += [max(v for g, v in rec.peak_gpu_bytes.items() if g >= 0)
                for rec in self.kernels.values()
                if rec.name == name and any(g >= 0 for g in rec.peak_gpu_bytes)]
        return out

    def touch(self, kernel_id: str) -> None:
        """Count now as activity (a restore, a cell)."""
        rec = self.kernels.get(kernel_id)
        if rec is not None:
            rec.last_activity = clock.now()
