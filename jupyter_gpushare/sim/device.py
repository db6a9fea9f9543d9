"""The simulated GPU as a kernel process sees it: allocations, busy time and the
emulated CUDA checkpoint state machine, with the driver's rules:

- ``running -> lock -> locked -> checkpoint -> checkpointed -> restore -> locked -> unlock ->
  running``; a step called in any other state raises :class:`SimCheckpointError` and changes
  nothing (the driver's ``CUDA_ERROR_ILLEGAL_STATE``);
- a lock that times out leaves the process running;
- GPU calls block while the process is not running and go on once it is unlocked;
- checkpoint and restore are all or nothing: every array's bytes are copied first, then one
  step that cannot fail moves the accounting and the state. A failure in the copy leaves
  every array, and the node's accounting, exactly as before the call.

A restore may bring the state back onto other GPUs (``resume(gpu_mapping={from: to})``, as the
driver's restore with GPU pairs does): the blocks of GPU ``from`` come back on GPU ``to``, and
the process's device numbering follows, so its device that was ``from`` is ``to`` from then on.

A checkpoint or restore of a process that holds memory on several GPUs moves them in
parallel, as the driver does for one process: one copy per GPU at once, each GPU's time
overlapping the others', and still all or nothing across them (a failure on any GPU, or no
room on one, leaves none moved). Each copy takes at least its bytes over
:attr:`SimDevice.transfer_rate` (bytes per second per GPU, from
``JUPYTER_GPUSHARE_SIM_TRANSFER_RATE``; unset: the time the host copy takes), shows in
:meth:`SimDevice.progress` while it runs and in :meth:`SimDevice.transfer_log` after.
:attr:`SimDevice.parallel` False (``JUPYTER_GPUSHARE_SIM_PARALLEL=0``) moves one GPU after
another instead (the sequential baseline of ``benchmarks/parallel_restore.py``).

For tests and demos the state machine takes injected faults and stalls
(:meth:`SimDevice.inject_fault`, :meth:`SimDevice.stall`), and :meth:`SimDevice.resume`
brings the device back to running from any state.

Memory is accounted on a :class:`~jupyter_gpushare.sim.node.SimNode`: the server's
(through the agent channel) when the kernel was started by an enabled server, else a
private in-process node.

GPU indices are the process's own, as CUDA's are: with ``CUDA_VISIBLE_DEVICES`` set (read
once, when the process's device is made), device ``N`` is the ``N``-th GPU it lists, and an
index past the visible ones raises :class:`SimInvalidDeviceError` (CUDA's "invalid device
ordinal"). The node's accounting, and everything the agent reports, uses the node's indices.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..protocol import SIMULATED_GPUS_ENV
from .node import FULL, SimNode, SimOutOfMemoryError, check_sm, format_bytes, parse_gpus

log = logging.getLogger(__name__)

RUNNING, LOCKED, CHECKPOINTED = "running", "locked", "checkpointed"
#: the driver's terminal state (a restore without room leaves a process there): every step
#: and every GPU call fails until the process is restarted
FAILED = "failed"
STEPS = ("lock", "checkpoint", "restore", "unlock")

#: bytes per second each simulated GPU moves between host and device memory (read when the
#: process's device is made); unset or 0: a move takes the time of its host copy only
TRANSFER_RATE_ENV = "JUPYTER_GPUSHARE_SIM_TRANSFER_RATE"
#: "0": a checkpoint or restore moves one GPU after another instead of all at once
PARALLEL_ENV = "JUPYTER_GPUSHARE_SIM_PARALLEL"
#: "0": drop each array's host copy after a restore (every checkpoint copies everything)
KEEP_ENV = "JUPYTER_GPUSHARE_KEEP_HOST_COPY"
PACE_SLICE = 0.02  # s: the finest step in which a paced copy advances its progress
TRANSFER_LOG = 64  # per-GPU copies remembered by transfer_log()
MAX_WAIT = 30.0  # s the longest wait_resume() holds its caller
COMPUTE_CHECK = 0.1  # s between compute()'s looks at a shared GPU's speed
JOIN_ENDED = 10.0  # s after its end that a resume nobody was told the end of is still joined


def _rate_from_env(value: str | None) -> float | None:
    """``JUPYTER_GPUSHARE_SIM_TRANSFER_RATE`` as bytes per second, None when unset or 0; a
    value that is not a number is said in the log and ignored (the device must still start)."""
    if not value or not value.strip():
        return None
    try:
        rate = float(value)
    except ValueError:
        log.warning("gpushare: %s=%r is not a number of bytes per second; ignored",
                    TRANSFER_RATE_ENV, value)
        return None
    if not rate > 0 or rate == float("inf"):
        return None
    return rate


class Backend(Protocol):
    """Where a kernel's simulated allocations are accounted."""

    def alloc(self, gpu: int, nbytes: int) -> None: ...
    def free(self, gpu: int, nbytes: int) -> None: ...
    def busy_begin(self, gpu: int, sm: float = FULL) -> None: ...
    def busy_end(self, gpu: int) -> None: ...
    def busy_work(self, gpu: int) -> tuple[float, float]: ...
    def device_count(self) -> int: ...


class LocalBackend:
    """A private node in this process (no server reachable)."""

    def __init__(self, node: SimNode | None = None):
        self.node = node or SimNode(parse_gpus(os.environ.get(SIMULATED_GPUS_ENV)))
        self.pid = os.getpid()

    def alloc(self, gpu: int, nbytes: int) -> None:
        self.node.alloc(self.pid, gpu, nbytes)

    def free(self, gpu: int, nbytes: int) -> None:
        self.node.release(self.pid, gpu, nbytes)

    def busy_begin(self, gpu: int, sm: float = FULL) -> None:
        self.node.busy_begin(self.pid, gpu, sm=sm)

    def busy_end(self, gpu: int) -> None:
        self.node.busy_end(self.pid, gpu)

    def busy_work(self, gpu: int) -> tuple[float, float]:
        return self.node.busy_work(self.pid, gpu)

    def device_count(self) -> int:
        return len(self.node.capacities)


VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


class SimInvalidDeviceError(ValueError):
    """A device index this process cannot see (CUDA's "invalid device ordinal")."""


def visible_gpus(value: str | None, count: int) -> list[int] | None:
    """The node's GPUs a process sees, in its own order, from ``CUDA_VISIBLE_DEVICES`` as CUDA
    reads it: comma-separated indices; the list ends at the first entry that is not an index
    of the node (a negative number, a UUID, one past the last GPU) or repeats one; "" = none.
    None when ``value`` is None (every GPU, numbered as the node numbers them)."""
    if value is None:
        return None
    out: list[int] = []
    for part in value.split(","):
        token = part.strip()
        if not token.isdigit() or int(token) >= count or int(token) in out:
            break
        out.append(int(token))
    return out


class SimCheckpointError(RuntimeError):
    """A checkpoint step called in the wrong state, or a GPU call in the ``failed`` state."""


class InjectedFault(RuntimeError):
    """The error :meth:`SimDevice.inject_fault` raises when given a message or nothing."""


@dataclass
class _Block:
    """One allocation: where its bytes are and how big it is."""

    gpu: int
    nbytes: int
    on_device: bool = True


@dataclass
class _Fault:
    error: BaseException
    after: int
    wedge: bool


@dataclass
class Transfer:
    """One GPU's copy in a checkpoint or restore: when it ran and what it moved."""

    step: str  # "checkpoint" or "restore"
    gpu: int  # the node's GPU the bytes left (checkpoint) or landed on (restore)
    bytes: int
    arrays: int
    start: float  # time.monotonic() of this process when the first byte moved
    end: float  # ... when the last one had (or the copy stopped)
    ok: bool  # False: the move failed (on this GPU or another) and was undone

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "gpu": self.gpu, "bytes": self.bytes, "arrays": self.arrays,
                "start": self.start, "end": self.end, "seconds": self.end - self.start,
                "ok": self.ok}


@dataclass
class _Copy:
    """A GPU's part of the move in flight: its progress, and when it began and ended."""

    total: int
    moved: int = 0
    arrays: int = 0
    start: float | None = None
    end: float | None = None


@dataclass
class _ResumeJob:
    """A resume running on its own thread (:meth:`SimDevice.start_resume`)."""

    plan: dict[int, int]  # node GPU -> bytes it brings back
    parallel: bool
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    result: dict[str, Any] | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    told: bool = False  # a wait_resume has answered with its end


class _Aborted(Exception):
    """A GPU's copy stopped because another GPU's failed (the whole move is undone)."""


@dataclass
class Stall:
    """A step held up on purpose (see :meth:`SimDevice.stall`)."""

    step: str
    after: int
    seconds: float | None
    #: set when the step reaches the stall (wait on it instead of sleeping)
    reached: threading.Event = field(default_factory=threading.Event)
    _go: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        """Let the stalled step go on (or never stall, if it has not got there yet)."""
        self._go.set()

    def _hold(self) -> None:
        self.reached.set()
        self._go.wait(self.seconds)


class SimDevice:
    """Process-wide simulated GPU state (one per kernel process)."""

    def __init__(self, backend: Backend | None = None, visible: str | None = None):
        self.backend: Backend = backend or LocalBackend()
        #: CUDA_VISIBLE_DEVICES as the process started with it (None: every GPU)
        self.visible_env = os.environ.get(VISIBLE_ENV) if visible is None else visible
        #: called as ``on_blocked(thread_name)`` when a thread other than the main thread
        #: makes a GPU call while the device is not running, once per call that waits, on
        #: that thread and without any lock held: the agent asks the server for a restore
        self.on_blocked: Callable[[str], None] | None = None
        self._cond = threading.Condition()  # guards state, _inflight, the blocks' flags
        self._step_lock = threading.Lock()  # one checkpoint step at a time
        self.state = RUNNING  # written only under _cond, by the steps
        self._inflight = 0  # GPU calls running now
        self._waiting = 0  # GPU calls blocked until the device runs again
        self._blocks: weakref.WeakKeyDictionary[Any, _Block] = weakref.WeakKeyDictionary()
        self._users: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
        #: (step, node GPU or None for any) -> what strikes there next
        self._faults: dict[tuple[str, int | None], _Fault] = {}
        self._stalls: dict[tuple[str, int | None], Stall] = {}
        #: bytes per second each GPU's copy moves at most (None: as fast as the host copies)
        self.transfer_rate: float | None = _rate_from_env(os.environ.get(TRANSFER_RATE_ENV))
        #: a process's GPUs move at once, as the driver moves them (False: one after another)
        self.parallel = os.environ.get(PARALLEL_ENV, "1").strip() not in ("0", "false", "no")
        self._progress_lock = threading.Lock()  # guards _moving, _transfers
        self._moving: dict[int, _Copy] = {}  # node GPU -> its copy, while a move runs
        self._moving_step: str | None = None
        self._transfers: deque[Transfer] = deque(maxlen=TRANSFER_LOG)
        self._job_lock = threading.Lock()
        self._job: _ResumeJob | None = None
        #: how many times wait_resume() answered that the resume still runs
        self.progress_reads = 0
        #: keep each array's host copy after a restore (``JUPYTER_GPUSHARE_KEEP_HOST_COPY=0``:
        #: never), so the next checkpoint copies only the arrays written since
        self.keep_host_copy = os.environ.get(KEEP_ENV, "1").strip() not in ("0", "false", "no")
        #: held while a pre-copy commits one array's copy, and through a checkpoint, so the
        #: checkpoint reads every kept copy and its version at one moment
        self._precopy_lock = threading.Lock()
        self._precopy_stats = {"runs": 0, "bytes": 0, "arrays": 0}
        #: node GPU a process device started on -> node GPU it is on now, after restores onto
        #: other GPUs (as CUDA's numbering follows a restore with a GPU mapping)
        self.remap: dict[int, int] = {}
        #: bytes this process may hold per GPU (its gpushare memory cap; None: uncapped): an
        #: allocation or a restore past it raises the out-of-memory error, as a framework's
        #: own limit does (PyTorch's memory fraction)
        self.cap: int | None = None

    # -- the process's device numbering ------------------------------------------
    def visible(self) -> list[int]:
        """The node's indices of the GPUs this process sees, in its own order."""
        count = self.backend.device_count()
        seen = visible_gpus(self.visible_env, count)
        return [self.remap.get(g, g) for g in (range(count) if seen is None else seen)]

    def physical(self, gpu: int) -> int:
        """The node's index of this process's device ``gpu``."""
        if self.visible_env is None:
            # every GPU, numbered as the node numbers them (the node checks it)
            return self.remap.get(gpu, gpu) if isinstance(gpu, int) else gpu
        seen = self.visible()
        if isinstance(gpu, bool) or not isinstance(gpu, int) or not 0 <= gpu < len(seen):
            raise SimInvalidDeviceError(
                f"invalid device ordinal {gpu!r}: this process sees {len(seen)} simulated "
                f"GPU(s) (CUDA_VISIBLE_DEVICES={self.visible_env!r})")
        return seen[gpu]

    # -- allocation ---------------------------------------------------------------
    def register(self, array: Any, gpu: int, nbytes: int) -> None:
        """Account ``nbytes`` for ``array`` on the process's device ``gpu``; freed when the
        array is collected."""
        gpu = self.physical(gpu)
        with self.op():
            self._check_cap(gpu, nbytes)
            self.backend.alloc(gpu, nbytes)
            block = _Block(gpu, nbytes)
            self._blocks[array] = block
            weakref.finalize(array, self._release_block, block)

    def _check_cap(self, gpu: int, nbytes: int, held: int | None = None) -> None:
        """Refuse an allocation that would take this process past its cap on ``gpu``."""
        cap = self.cap
        if cap is None:
            return
        held = self.allocated(gpu) if held is None else held
        if held + nbytes > cap:
            raise SimOutOfMemoryError(
                f"simulated GPU {gpu} out of memory: tried to allocate {format_bytes(nbytes)} with "
                f"{format_bytes(held)} in use; this kernel's gpushare memory cap is "
                f"{format_bytes(cap)} per GPU (%gpushare cap)")

    def _release_block(self, block: _Block) -> None:
        with self._cond:
            was_on_device, block.on_device = block.on_device, False
        if was_on_device:
            try:
                self.backend.free(block.gpu, block.nbytes)
            except Exception:  # interpreter shutdown, server gone: nothing left to free
                pass

    def allocated(self, gpu: int | None = None) -> int:
        """Bytes on the device now (all GPUs, or ``gpu``)."""
        return sum(
            b.nbytes
            for b in list(self._blocks.values())
            if b.on_device and (gpu is None or b.gpu == gpu)
        )

    def on_host(self, gpu: int | None = None) -> int:
        """Bytes of device arrays held in host memory now (checkpointed)."""
        return sum(
            b.nbytes
            for b in list(self._blocks.values())
            if not b.on_device and (gpu is None or b.gpu == gpu)
        )

    def held(self) -> dict[int, int]:
        """Bytes per GPU of every live array, wherever its bytes are now."""
        out: dict[int, int] = {}
        for b in list(self._blocks.values()):
            out[b.gpu] = out.get(b.gpu, 0) + b.nbytes
        return out

    def placement(self) -> dict[str, Any]:
        """The state, where the bytes are (per GPU) and how many GPU calls wait, read at one
        moment (JSON-ready)."""
        with self._cond:
            blocks = list(self._blocks.values())
            return {
                "state": self.state,
                "device": _per_gpu(b for b in blocks if b.on_device),
                "host": _per_gpu(b for b in blocks if not b.on_device),
                "waiting_calls": self._waiting,
            }

    # -- GPU calls ----------------------------------------------------------------
    @contextmanager
    def op(self) -> Iterator[None]:
        """Wrap every simulated GPU call: blocks while the process is locked or released."""
        me = threading.current_thread()
        background = me is not threading.main_thread()
        with self._cond:
            if background:
                self._users.add(me)
            if self.state != RUNNING:
                self._waiting += 1
                try:
                    # the main thread's cells are restored by the server before they run
                    self._wait_running(me, ask=background)
                finally:
                    self._waiting -= 1
            self._inflight += 1
        try:
            yield
        finally:
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

    def _wait_running(self, me: threading.Thread, ask: bool) -> None:
        """Wait (``_cond`` held) until the device runs, like CUDA under the checkpoint lock;
        if ``ask``, call ``on_blocked`` once first."""
        while self.state != RUNNING:
            if self.state == FAILED:
                raise SimCheckpointError(
                    "the simulated GPU is in the failed checkpoint state; restart the kernel"
                )
            hook = self.on_blocked
            if ask and hook is not None:
                ask = False
                self._cond.release()  # the hook talks to the server: never under the lock
                try:
                    hook(me.name)
                except Exception as e:
                    log.warning("gpushare: the simulated GPU's on_blocked hook failed: %s", e)
                finally:
                    self._cond.acquire()
                continue  # the state may have changed meanwhile
            self._cond.wait()

    def waiting_calls(self) -> int:
        """GPU calls blocked now because the device is not running."""
        with self._cond:
            return self._waiting

    @contextmanager
    def busy(self, gpu: int, sm: float = FULL) -> Iterator[None]:
        """The process's device ``gpu`` computes while this runs, asking ``sm`` % of its time."""
        gpu = self.physical(gpu)
        with self.op():
            self.backend.busy_begin(gpu, sm)
            try:
                yield
            finally:
                self.backend.busy_end(gpu)

    def compute(self, seconds: float, sm: float = FULL, gpus: Sequence[int] = (0,),
                check: float = COMPUTE_CHECK) -> None:
        """Run ``seconds`` of work, as long as it takes alone on a GPU, at ``sm`` % of each
        of the process's devices ``gpus``: slower while other processes' work on a GPU asks
        more than 100 % of it in all, as on a real GPU (the node's speed); each GPU's share
        ends when its work is done, the call when all have. ``check``: s between two looks
        at the node's speed while it is below full (it rises when others' work ends)."""
        sm = check_sm(sm)
        if seconds <= 0:
            return
        todo = [self.physical(g) for g in dict.fromkeys(gpus)]
        with self.op():
            for g in todo:
                self.backend.busy_begin(g, sm)
            left = list(todo)
            try:
                while left:
                    waits = []
                    for g in list(left):
                        work, speed = self.backend.busy_work(g)
                        if work >= seconds - 1e-3:
                            self.backend.busy_end(g)
                            left.remove(g)
                        else:  # at full speed nothing can make it sooner: sleep to its end
                            end = (seconds - work) / max(speed, 1e-6)
                            waits.append(end if speed >= 1.0 else min(end, check))
                    if waits:
                        time.sleep(max(1e-3, min(waits)))
            finally:
                for g in left:
                    self.backend.busy_end(g)

    def background_users(self) -> list[str]:
        """Names of the live threads other than the main thread that used the GPU."""
        with self._cond:
            return sorted({t.name for t in list(self._users) if t.is_alive()})

    # -- fault injection (tests, demos) ----------------------------------------------
    def inject_fault(
        self,
        step: str,
        error: BaseException | str | None = None,
        *,
        after: int = 0,
        wedge: bool = False,
        gpu: int | None = None,
    ) -> None:
        """Make the next ``step`` ("lock", "checkpoint", "restore", "unlock") fail once.

        ``error``: the exception to raise (a message becomes an :class:`InjectedFault`).
        ``after``: for checkpoint and restore, how many arrays are copied before it strikes
        (a restore has allocated its device memory by then); it strikes before the commit
        even when there are fewer arrays. Counted across GPUs in the order the arrays were
        made, which moves the GPUs one after another for that step; with ``gpu`` (the
        node's index of a GPU: where a restore's bytes land, where a checkpoint's leave),
        only that GPU's copy fails, after ``after`` of its arrays, while the others move in
        parallel (a GPU the move does not touch: no strike). The failed step changes
        nothing, as the driver's do, on any GPU, unless ``wedge``: then the device goes to
        the driver's ``failed`` state, where every step and GPU call fails. A later fault
        for the same step and ``gpu`` replaces this one.
        """
        self._check_step(step, after, gpu)
        if error is None:
            error = InjectedFault(f"injected fault in {step}")
        elif isinstance(error, str):
            error = InjectedFault(error)
        elif not isinstance(error, BaseException):
            raise TypeError(f"error must be an exception or a message, got {error!r}")
        with self._cond:
            self._faults[(step, gpu)] = _Fault(error, after, wedge)

    def stall(self, step: str, *, seconds: float | None = None, after: int = 0,
              gpu: int | None = None) -> Stall:
        """Hold up the next ``step`` until ``Stall.release()`` or for ``seconds`` (once).

        The step has checked its state and (checkpoint, restore) copied ``after`` arrays; a
        stalled lock has not locked yet, a stalled restore holds its device memory.
        ``gpu``: only that GPU's copy stalls, after ``after`` of its arrays (see
        :meth:`inject_fault`), while the other GPUs' copies go on.
        ``Stall.reached`` is set when the step gets there. Then the step goes on (an injected
        fault for it still strikes). A later stall for the same step and ``gpu`` replaces
        this one.
        """
        self._check_step(step, after, gpu)
        if seconds is not None and seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds!r}")
        stall = Stall(step, after, seconds)
        with self._cond:
            self._stalls[(step, gpu)] = stall
        return stall

    def clear_faults(self) -> None:
        """Drop every fault and stall not yet consumed (a stalled step goes on)."""
        with self._cond:
            stalls = list(self._stalls.values())
            self._faults.clear()
            self._stalls.clear()
        for stall in stalls:
            stall.release()

    @staticmethod
    def _check_step(step: str, after: int, gpu: int | None = None) -> None:
        if step not in STEPS:
            raise ValueError(f"step must be one of {', '.join(STEPS)}, got {step!r}")
        if not isinstance(after, int) or isinstance(after, bool) or after < 0:
            raise ValueError(f"after must be a count of arrays >= 0, got {after!r}")
        if after and step in ("lock", "unlock"):
            raise ValueError(f"after applies to checkpoint and restore only, not {step}")
        if gpu is not None:
            if isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0:
                raise ValueError(f"gpu must be a GPU index >= 0 or None, got {gpu!r}")
            if step in ("lock", "unlock"):
                raise ValueError(f"gpu applies to checkpoint and restore only, not {step}")

    def _counts_in_order(self, step: str) -> bool:
        """A fault or stall for ``step`` on any GPU waits for a count of arrays: it counts
        them in the order they were made, so the move runs in that order."""
        with self._cond:
            pending = [self._faults.get((step, None)), self._stalls.get((step, None))]
        return any(p is not None and p.after > 0 for p in pending)

    def _strike(self, step: str, copied: int, last: bool = False, gpu: int | None = None) -> None:
        """Where a step may be stalled or fail: once ``copied`` arrays were copied (``last``:
        the copy is complete and nothing is committed yet); ``gpu``: those of that GPU's copy."""
        key = (step, gpu)
        with self._cond:
            stall = self._stalls.get(key)
            if stall is not None and (copied >= stall.after or last):
                del self._stalls[key]
            else:
                stall = None
            fault = self._faults.get(key)
            if fault is not None and (copied >= fault.after or last):
                del self._faults[key]
            else:
                fault = None
        if stall is not None:
            stall._hold()
        if fault is not None:
            if fault.wedge:
                with self._cond:
                    self.state = FAILED
                    self._cond.notify_all()
            raise fault.error

    # -- checkpoint state machine (driven by the server's simulated method) -------
    def _expect(self, step: str, needed: str) -> None:
        if self.state != needed:
            raise SimCheckpointError(f"cannot {step}: process is {self.state}, not {needed}")

    def lock(self, timeout: float | None = 10.0) -> None:
        """Stop new GPU calls and wait for running ones, like ``cuCheckpointProcessLock``.

        On timeout the process is running again and :class:`TimeoutError` is raised."""
        with self._step_lock:
            self._lock(timeout)

    def _lock(self, timeout: float | None) -> None:
        self._expect("lock", RUNNING)
        self._strike("lock", 0)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self.state = LOCKED
            while self._inflight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self.state = RUNNING
                    self._cond.notify_all()
                    raise TimeoutError(
                        f"GPU work still running after the lock timeout ({timeout:g} s)"
                    )
                self._cond.wait(left)

    def checkpoint(self) -> dict[str, Any]:
        """Copy every array's bytes to host memory, then free the device memory.

        All or nothing: if a copy fails, the device stays locked with every array on it and
        the node's accounting unchanged."""
        with self._step_lock:
            return self._checkpoint()

    def _checkpoint(self) -> dict[str, Any]:
        with self._precopy_lock:
            return self._checkpoint_locked()

    def _checkpoint_locked(self) -> dict[str, Any]:
        self._expect("checkpoint", LOCKED)
        with self._cond:  # strong references: no array dies between copy and commit
            arrays = [(a, b) for a, b in list(self._blocks.items()) if b.on_device]
        copied = sum(_to_copy(a, b, True) for a, b in arrays)
        self._move(arrays, "checkpoint", to_host=True)
        # commit: the accounting and the state, in one step nothing can interrupt halfway
        with self._cond:
            for _, block in arrays:
                block.on_device = False
            self.state = CHECKPOINTED
        moved = _per_gpu(b for _, b in arrays)
        for key, nbytes in moved.items():
            self._free_quietly(int(key), nbytes)
        return {**_summary(arrays, moved), "copied": copied}

    def restore(self, gpu_mapping: Mapping[int, int] | None = None) -> dict[str, Any]:
        """Allocate everything again, copy the bytes back, then account them on the device.

        ``gpu_mapping`` ({from: to}, node GPUs): the blocks of GPU ``from`` come back on GPU
        ``to``, and the process's device that was ``from`` is ``to`` from then on.
        All or nothing: if the allocation or a copy fails, what was allocated is freed and the
        process stays checkpointed, every array in host memory, accounted exactly as before."""
        with self._step_lock:
            return self._restore(gpu_mapping)

    def _check_mapping(self, gpu_mapping: Mapping[int, int] | None) -> dict[int, int]:
        """``gpu_mapping`` as {from: to} without pairs that stay; ValueError when it names a
        GPU that is not the node's or names one twice on either side."""
        if gpu_mapping is None:
            return {}
        count = self.backend.device_count()
        targets: set[int] = set()
        for src, dst in gpu_mapping.items():
            for gpu in (src, dst):
                if isinstance(gpu, bool) or not isinstance(gpu, int) or not 0 <= gpu < count:
                    raise ValueError(f"gpu_mapping: {gpu!r} is not a GPU of this node "
                                     f"(it has {count} simulated GPUs)")
            if dst in targets:
                raise ValueError(f"gpu_mapping: GPU {dst} is named twice as a target")
            targets.add(dst)
        return {src: dst for src, dst in gpu_mapping.items() if src != dst}

    # -- host copies kept while running: pre-copy, budget ------------------------------
    def precopy(self, stop: threading.Event | None = None,
                after_copy: Callable[[Any], None] | None = None) -> dict[str, Any]:
        """Copy to host, while the process runs, every array written since its host copy was
        made (or that has none), one array at a time, each at ``transfer_rate``.

        Makes no GPU call: the cells' calls never wait for it, and it never counts as a
        background thread. It ends at once when ``stop`` is set or the device is locked; a
        copy whose array was written meanwhile stays stale (its version says so) and is
        copied again by the next pre-copy or checkpoint. Returns what it copied and whether
        it stopped early. ``after_copy(array)`` (tests) runs once each copy exists, before
        it is recorded: a cell's write at the worst moment."""
        stop = stop or threading.Event()
        with self._cond:
            arrays = [a for a, b in list(self._blocks.items()) if b.on_device]
        arrays.sort(key=lambda a: getattr(a, "_kept_at", 0.0))
        copied = count = 0
        stopped = False
        for array in arrays:
            if stop.is_set() or self.state != RUNNING:
                stopped = True
                break
            if array._current_copy() is not None or array._dev is None:
                continue
            version = array._version
            dev = array._dev
            copy = dev.copy()
            if after_copy is not None:
                after_copy(array)
            if not self._pace(copy.nbytes, stop):
                stopped = True
                break
            with self._precopy_lock:
                if self.state != RUNNING or array._dev is not dev:
                    stopped = True  # a checkpoint ran meanwhile: its own copy counts
                    break
                array._kept, array._kept_version, array._kept_at = copy, version, time.monotonic()
            copied += int(copy.nbytes)
            count += 1
        with self._precopy_lock:
            self._precopy_stats["runs"] += 1
            self._precopy_stats["bytes"] += copied
            self._precopy_stats["arrays"] += count
        return {"bytes": copied, "arrays": count, "stopped": stopped}

    def _pace(self, nbytes: int, stop: threading.Event) -> bool:
        """Take ``nbytes / transfer_rate`` seconds (none without a rate); False if ``stop``
        was set meanwhile or the device stopped running."""
        rate = self.transfer_rate
        if not rate or not nbytes:
            return True
        deadline = time.monotonic() + nbytes / rate
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            if stop.wait(min(PACE_SLICE, left)) or self.state != RUNNING:
                return False

    def host_copies(self) -> dict[str, int]:
        """Bytes on the device whose kept host copy is current (a release moves none of
        them), bytes a release would copy now, and host bytes every kept copy holds."""
        current = to_copy = kept = 0
        with self._precopy_lock:
            with self._cond:
                items = [(a, b) for a, b in list(self._blocks.items()) if b.on_device]
            for array, block in items:
                held = array._kept
                kept += int(held.nbytes) if held is not None else 0
                if array._current_copy() is not None:
                    current += block.nbytes
                else:
                    to_copy += block.nbytes
        return {"current": current, "to_copy": to_copy, "kept": kept}

    def drop_host_copies(self, wanted: int | None = None) -> int:
        """Free kept host copies, oldest first, until ``wanted`` bytes are freed (None:
        all); returns the bytes freed. The arrays stay on the device: only the next
        release copies them again."""
        with self._cond:
            arrays = [a for a, b in list(self._blocks.items()) if b.on_device]
        freed = 0
        with self._precopy_lock:
            for array in sorted(arrays, key=lambda a: a._kept_at):
                if wanted is not None and freed >= wanted:
                    break
                freed += array._drop_kept()
        return freed

    def precopy_stats(self) -> dict[str, int]:
        with self._precopy_lock:
            return dict(self._precopy_stats)

    def _restore(self, gpu_mapping: Mapping[int, int] | None = None) -> dict[str, Any]:
        self._expect("restore", CHECKPOINTED)
        moves = self._check_mapping(gpu_mapping)
        with self._cond:
            arrays = [(a, b) for a, b in list(self._blocks.items()) if not b.on_device]
        onto = [moves.get(b.gpu, b.gpu) for _, b in arrays]  # where each block comes back
        needed = _per_gpu(_Block(gpu, b.nbytes) for gpu, (_, b) in zip(onto, arrays, strict=True))
        for key, nbytes in needed.items():  # a restore never brings back more than the cap
            self._check_cap(int(key), nbytes)
        allocated: list[tuple[int, int]] = []
        try:
            for key, nbytes in needed.items():  # per GPU: one request each, freed on failure
                self.backend.alloc(int(key), nbytes)
                allocated.append((int(key), nbytes))
            self._move(arrays, "restore", to_host=False, onto=onto)
        except BaseException:
            for gpu, nbytes in allocated:
                self._free_quietly(gpu, nbytes)
            raise
        with self._cond:  # commit
            for gpu, (_, block) in zip(onto, arrays, strict=True):
                block.on_device = True
                block.gpu = gpu
            if moves:  # the process's devices follow their memory
                count = self.backend.device_count()
                seen = visible_gpus(self.visible_env, count)
                now = {g: self.remap.get(g, g) for g in (range(count) if seen is None else seen)}
                self.remap = {g: moves.get(at, at) for g, at in now.items() if moves.get(at, at) != g}
            self.state = LOCKED
        return _summary(arrays, needed)

    def _move(self, arrays: list[tuple[Any, _Block]], step: str, *, to_host: bool,
              onto: list[int] | None = None) -> None:
        """Copy every array's bytes to the other side, or leave every array where it was.

        ``onto``: the node GPU each array's bytes land on (a restore), else its block's GPU.
        One copy per GPU, all at once (one after another when not :attr:`parallel`, or when
        a fault or stall counts arrays across GPUs); the move is whole only once every GPU's
        copy is: any failure stops the others and undoes them all.

        A simulated GPU's device memory is host RAM too, so each array hands its old buffer
        over as soon as its copy exists (holding the whole state twice would double the
        kernel's memory during a move). Handing it back is an assignment, which cannot fail:
        on any error every array already moved goes back, with the same bytes."""
        gpus = onto if onto is not None else [b.gpu for _, b in arrays]
        groups: dict[int, list[int]] = {}  # node GPU -> indices of its arrays, in order
        for index, gpu in enumerate(gpus):
            groups.setdefault(gpu, []).append(index)
        sizes = [_to_copy(a, b, to_host) for a, b in arrays]
        with self._progress_lock:
            self._moving_step = step
            self._moving = {g: _Copy(sum(sizes[i] for i in idx))
                            for g, idx in sorted(groups.items())}
        moved: list[Any] = []
        ok = False
        try:
            in_order = self._counts_in_order(step)
            if self.parallel and len(groups) > 1 and not in_order:
                self._strike(step, 0)  # a fault for any GPU, after no array: before any copy
                self._move_parallel(arrays, groups, step, to_host, moved)
            else:  # one GPU after another, unless a count of arrays needs the arrays' order
                order = (list(range(len(arrays))) if in_order
                         else [i for _, idx in sorted(groups.items()) for i in idx])
                self._move_in_order(arrays, gpus, order, step, to_host, moved)
            self._strike(step, len(arrays), last=True)
            ok = True
        except BaseException:
            for array in reversed(moved):  # the copy it holds has the very same bytes
                if to_host:
                    array._undo_host()
                else:
                    array._commit_host(array._dev)
            raise
        finally:
            self._end_move(step, ok)

    def _move_in_order(self, arrays: list[tuple[Any, _Block]], gpus: list[int], order: list[int],
                       step: str, to_host: bool, moved: list[Any]) -> None:
        counts: dict[int, int] = {}
        for copied, index in enumerate(order):
            array, block = arrays[index]
            gpu = gpus[index]
            self._strike(step, copied)
            self._strike(step, counts.get(gpu, 0), gpu=gpu)
            self._copy(array, _to_copy(array, block, to_host), gpu, to_host, moved)
            counts[gpu] = counts.get(gpu, 0) + 1
        for gpu, count in sorted(counts.items()):
            self._strike(step, count, last=True, gpu=gpu)

    def _move_parallel(self, arrays: list[tuple[Any, _Block]], groups: dict[int, list[int]],
                       step: str, to_host: bool, moved: list[Any]) -> None:
        """One thread per GPU; the first failure stops the others and is raised here."""
        abort = threading.Event()
        errors: list[BaseException] = []

        def copy_gpu(gpu: int, indices: list[int]) -> None:
            try:
                for count, index in enumerate(indices):
                    if abort.is_set():
                        return
                    self._strike(step, count, gpu=gpu)
                    array, block = arrays[index]
                    self._copy(array, _to_copy(array, block, to_host), gpu, to_host, moved, abort)
                self._strike(step, len(indices), last=True, gpu=gpu)
            except _Aborted:
                pass
            except BaseException as e:  # the move's caller raises it: no thread dies noisily
                errors.append(e)
                abort.set()

        threads = [threading.Thread(target=copy_gpu, args=(gpu, indices), daemon=True,
                                    name=f"gpushare-sim-{step}-gpu{gpu}")
                   for gpu, indices in sorted(groups.items())]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]

    def _copy(self, array: Any, nbytes: int, gpu: int, to_host: bool, moved: list[Any],
              abort: threading.Event | None = None) -> None:
        """Move one array (and take ``nbytes`` / ``transfer_rate`` seconds at least, its
        progress advancing as it goes); ``nbytes`` is what moves: 0 for an array whose kept
        host copy is current."""
        started = time.monotonic()
        with self._progress_lock:
            copy = self._moving[gpu]
            if copy.start is None:
                copy.start = started
            before = copy.moved
        if to_host:
            array._commit_host(array._copy_to_host())
        else:
            array._commit_device(array._copy_to_device(), keep=self.keep_host_copy)
        moved.append(array)  # list.append is atomic: GPUs' threads share this list
        rate = self.transfer_rate
        if rate and nbytes:
            due = nbytes / rate
            while True:
                elapsed = time.monotonic() - started
                with self._progress_lock:
                    copy.moved = before + min(nbytes, int(nbytes * elapsed / due))
                if elapsed >= due:
                    break
                if abort is not None and abort.is_set():
                    raise _Aborted
                time.sleep(min(PACE_SLICE, due - elapsed))
        with self._progress_lock:
            copy.moved = before + nbytes
            copy.arrays += 1
            copy.end = time.monotonic()

    def _end_move(self, step: str, ok: bool) -> None:
        with self._progress_lock:
            for gpu, copy in sorted(self._moving.items()):
                if copy.start is not None:
                    self._transfers.append(Transfer(
                        step, gpu, copy.moved, copy.arrays, copy.start,
                        copy.end if copy.end is not None else time.monotonic(), ok))
            self._moving = {}
            self._moving_step = None

    def progress(self) -> dict[str, Any]:
        """The checkpoint or restore moving now, per node GPU (JSON-ready): ``{"step":
        "restore", "gpus": {"0": [moved, total], ...}}``; step None and no GPUs when none."""
        with self._progress_lock:
            return {"step": self._moving_step,
                    "gpus": {str(g): [c.moved, c.total] for g, c in sorted(self._moving.items())}}

    def transfer_log(self, step: str | None = None) -> list[dict[str, Any]]:
        """The last per-GPU copies (of ``step`` only, if given), oldest first: when each ran
        (``time.monotonic()`` of this process), what it moved, whether its move held."""
        with self._progress_lock:
            return [t.as_dict() for t in self._transfers if step is None or t.step == step]

    def unlock(self) -> None:
        with self._step_lock:
            self._unlock()

    def _unlock(self) -> None:
        self._expect("unlock", LOCKED)
        self._strike("unlock", 0)
        with self._cond:
            self.state = RUNNING
            self._cond.notify_all()

    def resume(self, gpu_mapping: Mapping[int, int] | None = None) -> dict[str, Any]:
        """Bring the device back to running from whatever state it is in: locked -> unlock,
        checkpointed -> restore then unlock, running -> nothing.

        For a server that lost track (a lock that ran after its timeout, an interrupted
        operation). Returns what was moved back and the state it started from; raises like
        the steps it runs (no room to restore: still checkpointed; ``failed``: stays).
        ``gpu_mapping``: restore onto other GPUs (see :meth:`restore`); only from
        checkpointed, else :class:`SimCheckpointError` and nothing changes (the memory never
        left, so it cannot come back elsewhere)."""
        with self._step_lock:
            start = self.state
            moved: dict[str, Any] = {"bytes": 0, "arrays": 0, "gpus": {}}
            if start == FAILED:
                raise SimCheckpointError("cannot resume: process is failed; restart the kernel")
            if self._check_mapping(gpu_mapping) and start != CHECKPOINTED:
                raise SimCheckpointError(f"cannot restore onto other GPUs: process is {start}, "
                                         f"not {CHECKPOINTED}")
            if start == CHECKPOINTED:
                moved = self._restore(gpu_mapping)
            if self.state == LOCKED:
                self._unlock()
            return {"from": start, **moved}

    def start_resume(self, gpu_mapping: Mapping[int, int] | None = None) -> dict[str, Any]:
        """Run :meth:`resume` on a thread of its own, so that its progress can be read while
        it moves (:meth:`wait_resume`). Returns the plan: bytes per node GPU that come back
        (none when the device is not checkpointed), and whether they move in parallel. While
        an earlier one still runs, returns that one's plan (one resume at a time); so does
        one that ended within ``JOIN_ENDED`` s and whose end no caller was told yet (the
        caller's next ask came just after the end: a new resume would answer for itself, a
        move that landed as a failure, a failure as a success), unless it ended well and the
        device is no longer running."""
        with self._job_lock:
            job = self._job
            joins = job is not None and not job.told and (
                not job.done.is_set()
                or (time.monotonic() - (job.ended or 0.0) < JOIN_ENDED
                and (job.error is not None or self.state == RUNNING)))
            if job is None or not joins:
                moves = self._check_mapping(gpu_mapping)
                plan: dict[int, int] = {}
                with self._cond:
                    if self.state == CHECKPOINTED:
                        for b in list(self._blocks.values()):
                            if not b.on_device:
                                gpu = moves.get(b.gpu, b.gpu)
                                plan[gpu] = plan.get(gpu, 0) + b.nbytes
                job = _ResumeJob(plan, self.parallel and len(plan) > 1)
                self._job = job
                threading.Thread(target=self._run_job, args=(job, gpu_mapping), daemon=True,
                                 name="gpushare-sim-resume").start()
        return {"plan": {str(g): n for g, n in sorted(job.plan.items())},
                "parallel": job.parallel}

    def _run_job(self, job: _ResumeJob, gpu_mapping: Mapping[int, int] | None) -> None:
        try:
            job.result = self.resume(gpu_mapping=gpu_mapping)
        except BaseException as e:  # handed to wait_resume's caller
            job.error = e
        finally:
            job.ended = time.monotonic()
            job.done.set()

    def wait_resume(self, wait: float = 0.0) -> dict[str, Any]:
        """Wait up to ``wait`` seconds (at most 30) for the resume :meth:`start_resume` began.

        ``done`` False: it still runs; ``plan`` is what it brings back per GPU, ``progress``
        how far each GPU's copy is (``bytes`` 0: nothing is back until all of it is).
        ``done`` True: what :meth:`resume` returned (``from``, ``bytes``, ``arrays``,
        ``gpus``), with ``seconds`` it took and ``transfers``, its per-GPU copies (see
        :meth:`transfer_log`). A resume that failed raises its error here, as :meth:`resume`
        does (nothing came back)."""
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait >= 0:
            raise ValueError(f"wait must be seconds >= 0, got {wait!r}")
        job = self._job
        if job is None:
            raise SimCheckpointError("no resume was started (start_resume)")
        if not job.done.wait(min(float(wait), MAX_WAIT)):
            with self._job_lock:
                self.progress_reads += 1
            return {"done": False, "bytes": 0, "arrays": 0, "parallel": job.parallel,
                    "plan": {str(g): n for g, n in sorted(job.plan.items())},
                    "progress": self.progress()}
        job.told = True
        if job.error is not None:
            raise job.error
        return {**(job.result or {}), "done": True, "parallel": job.parallel,
                "seconds": (job.ended or job.started) - job.started,
                "transfers": [t for t in self.transfer_log("restore") if t["start"] >= job.started]}

    def resume_step(self, gpu_mapping: Mapping[int, int] | None = None,
                    wait: float = 0.5) -> dict[str, Any]:
        """:meth:`start_resume` (or join the one that runs), then :meth:`wait_resume` for
        ``wait`` seconds: what the agent's ``sim_resume`` answers, asked until ``done``."""
        self.start_resume(gpu_mapping)
        return self.wait_resume(wait)

    def _free_quietly(self, gpu: int, nbytes: int) -> None:
        try:
            self.backend.free(gpu, nbytes)
        except Exception as e:  # the bytes are off the device either way; say so and go on
            log.warning("gpushare: could not account %d freed bytes on simulated GPU %d: %s",
                        nbytes, gpu, e)


def _to_copy(array: Any, block: _Block, to_host: bool) -> int:
    """Bytes a move copies for ``array``: none to host when its kept copy is current."""
    if to_host and array._current_copy() is not None:
        return 0
    return block.nbytes


def _per_gpu(blocks: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for b in blocks:
        out[str(b.gpu)] = out.get(str(b.gpu), 0) + b.nbytes
    return out


def _summary(arrays: list[tuple[Any, _Block]], per_gpu: dict[str, int]) -> dict[str, Any]:
    return {"bytes": sum(per_gpu.values()), "arrays": len(arrays), "gpus": per_gpu}


_device: SimDevice | None = None
_device_lock = threading.Lock()


def get_device() -> SimDevice:
    """The process's simulated GPU (created on first use with a local backend)."""
    global _device
    with _device_lock:
        if _device is None:
            _device = SimDevice()
        return _device


def set_backend(backend: Backend) -> SimDevice:
    """Account this process's allocations on ``backend`` (the agent does this on connect)."""
    device = get_device()
    if device.allocated():
        raise RuntimeError("cannot change the simulated GPU backend while arrays are allocated")
    device.backend = backend
    return device


__all__ = [
    "CHECKPOINTED",
    "FAILED",
    "LOCKED",
    "RUNNING",
    "STEPS",
    "InjectedFault",
    "LocalBackend",
    "SimCheckpointError",
    "SimDevice",
    "SimInvalidDeviceError",
    "SimOutOfMemoryError",
    "Stall",
    "Transfer",
    "format_bytes",
    "get_device",
    "set_backend",
    "visible_gpus",
]
