"""The discrete-event loop: kernels, their cells, releases, restores and culls.

The engine owns the mechanics that are the same under every policy (a cell runs when its
kernel's state is on the GPU; memory is allocated, freed, moved to host and back, taking the
transfer model's time) and asks a :class:`~.policies.Policy` for every decision (where a
kernel goes, whether it fits, what to release, when to restore). Time is the simulation
clock only: ``Simulation.now``.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .meter import Meter
from .node import Node
from .transfer import TransferModel
from .workload import Cell, KernelWork, Workload

if TYPE_CHECKING:
    from .policies import Policy

# kernel states (the product's active/idle are one state here: RESIDENT)
NEW = "new"  # not started, or its start failed for lack of memory
RESIDENT = "resident"
RELEASING = "releasing"
RELEASED = "released"
RESTORING = "restoring"
CULLED = "culled"  # killed by the culler; the next cell starts it again and re-runs its work
ENDED = "ended"  # shut down by its person


def reason_kind(reason: str) -> str:
    """The policy module's reason without its numbers: idle, memory pressure, making room."""
    for kind in ("memory pressure", "making room", "idle"):
        if reason.startswith(kind):
            return kind
    return reason


@dataclass
class Waiting:
    """A cell that has arrived and waits for its kernel."""

    cell: Cell
    arrival: float
    restore_seconds: float = 0.0  # the restore this cell waited for, if any


@dataclass
class Kernel:
    work: KernelWork
    index: int
    user_index: int
    gpu: int = 0
    state: str = NEW
    busy: bool = False
    running_utilization: float = 0.0  # SM % of the cell it runs now
    last_activity: float = 0.0
    last_gpu_end: float = float("-inf")  # when its last cell that used the GPU ended
    last_gpu_utilization: float = 0.0
    compute_since_start: float = 0.0  # s of cells run since it (re)started: what a cull loses
    lost_on_restart: float = 0.0
    session: int = 0
    cell: int = 0  # next cell of ``session``
    pending: Waiting | None = None
    policy_state: dict = field(default_factory=dict)  # a policy's own bookkeeping

    @property
    def id(self) -> str:
        return self.work.kernel_id

    @property
    def nbytes(self) -> int:
        return self.work.gpu_bytes

    @property
    def alive(self) -> bool:
        return self.state not in (NEW, ENDED)


@dataclass
class CellRecord:
    kernel: int
    arrival: float
    start: float
    duration: float  # nominal
    utilization: float
    restore_seconds: float  # the restore it waited for (0: none)
    end: float | None = None  # None: still running at the end of the trace

    @property
    def delay(self) -> float:
        return self.start - self.arrival


# what happened to a kernel, for whoever records it (e.g. an export in the history's shape)
Observer = Callable[[float, "Kernel", str, dict], None]


@dataclass
class Counters:
    oom_failures: int = 0
    releases: int = 0
    restores: int = 0
    culls: int = 0
    restarts: int = 0
    work_lost_seconds: float = 0.0
    release_reasons: dict[str, int] = field(default_factory=dict)
    still_waiting: list[float] = field(default_factory=list)  # arrival of cells never started
    peak_used: dict[int, int] = field(default_factory=dict)


class Simulation:
    def __init__(self, workload: Workload, policy: Policy, gpu_bytes: int, gpus_per_node: int,
                 transfer: TransferModel, nodes: int = 1, bin_seconds: float = 600.0,
                 observer: Observer | None = None):
        self.workload = workload
        self.observer = observer
        self.policy = policy
        self.transfer = transfer
        self.duration = workload.duration
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        user_index = {u: i for i, u in enumerate(workload.users)}
        self.kernels = [Kernel(w, i, user_index[w.user]) for i, w in enumerate(workload.kernels)]
        self.by_user: dict[int, list[Kernel]] = {}
        for k in self.kernels:
            self.by_user.setdefault(k.user_index, []).append(k)
        n_gpus = policy.gpu_count(len(workload.users), gpus_per_node * nodes)
        self.gpus_per_node = gpus_per_node
        self.node = Node([gpu_bytes] * n_gpus, self.duration, bin_seconds, self.schedule)
        self.reclaimed = Meter(bin_seconds, self.duration)  # bytes off the GPU of live kernels
        self._reclaimed_bytes = 0
        self.cells: list[CellRecord] = []
        self.counters = Counters()
        policy.setup(self)
        for k in self.kernels:
            k.gpu = policy.place(self, k)
            if k.work.sessions:
                s = k.work.sessions[0]
                self.schedule(s.start + s.cells[0].gap, functools.partial(self._arrive, k))

    # -- the loop -----------------------------------------------------------------------------
    def schedule(self, at: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(at, self.now), next(self._seq), fn))

    def run(self) -> Simulation:
        while self._heap:
            at, _, fn = heapq.heappop(self._heap)
            if at > self.duration:
                break
            self.now = at
            fn()
        self.now = self.duration
        self.node.close(self.duration)
        self.reclaimed.close(self.duration)
        for k in self.kernels:
            if k.pending is not None:
                self.counters.still_waiting.append(k.pending.arrival)
        return self

    # -- cells ----------------------------------------------------------------------------------
    def _arrive(self, k: Kernel) -> None:
        s = k.work.sessions[k.session]
        k.pending = Waiting(s.cells[k.cell], self.now)
        self._dispatch(k)

    def _dispatch(self, k: Kernel) -> None:
        if k.state == RESIDENT:
            self._start_cell(k)
        elif k.state in (NEW, CULLED):
            self._start_kernel(k)
        elif k.state != RESTORING:  # RESTORING: the cell starts when the restore is done
            self.policy.on_needs_gpu(self, k)

    def _start_kernel(self, k: Kernel) -> None:
        if not self.policy.fits(self, k):
            self.counters.oom_failures += 1  # the cell fails; the person tries the next one
            pending, k.pending = k.pending, None
            assert pending is not None
            self._next_cell(k, self.now)
            return
        self._allocate(k)
        if k.state == CULLED:
            self._reclaim(-k.nbytes)
            self.counters.restarts += 1
            self.counters.work_lost_seconds += k.lost_on_restart  # re-run on this next use
            k.lost_on_restart = 0.0
        k.state = RESIDENT
        k.compute_since_start = 0.0
        self._start_cell(k)

    def _start_cell(self, k: Kernel) -> None:
        w, k.pending = k.pending, None
        assert w is not None
        rec = CellRecord(k.index, w.arrival, self.now, w.cell.duration, w.cell.utilization,
                         w.restore_seconds)
        self.cells.append(rec)
        k.busy, k.running_utilization = True, w.cell.utilization
        k.last_activity = self.now
        self.node.run(self.now, k.gpu, w.cell.duration, w.cell.utilization,
                      lambda t: self._end_cell(k, rec, t))

    def note(self, k: Kernel, what: str, **data: object) -> None:
        if self.observer is not None:
            self.observer(self.now, k, what, data)

    def _end_cell(self, k: Kernel, rec: CellRecord, t: float) -> None:
        rec.end = t
        self.note(k, "cell", start=rec.start, end=t, utilization=rec.utilization)
        k.busy = False
        k.last_activity = t
        k.compute_since_start += rec.duration
        if rec.utilization > 0:
            k.last_gpu_end, k.last_gpu_utilization = t, rec.utilization
        self._next_cell(k, t)
        self.policy.on_idle(self, k)

    def _next_cell(self, k: Kernel, t: float) -> None:
        sessions = k.work.sessions
        k.cell += 1
        if k.cell < len(sessions[k.session].cells):
            at = t + sessions[k.session].cells[k.cell].gap
        else:
            k.session, k.cell = k.session + 1, 0
            if k.session >= len(sessions):
                if k.work.shutdown_at is not None:
                    self.schedule(max(t, k.work.shutdown_at), lambda: self._shut_down(k))
                return
            s = sessions[k.session]
            at = max(s.start, t) + s.cells[0].gap
        self.schedule(at, lambda: self._arrive(k))

    def _shut_down(self, k: Kernel) -> None:
        if k.state == RELEASING:  # let the release finish, then shut down
            self.schedule(self.now + 1.0, lambda: self._shut_down(k))
            return
        if k.state == RESIDENT:
            self._free(k)
        elif k.state in (RELEASED, CULLED):
            self._reclaim(-k.nbytes)
        k.state = ENDED
        self.note(k, "ended")
        self.policy.on_memory_freed(self, k.gpu)

    # -- memory -----------------------------------------------------------------------------------
    def _allocate(self, k: Kernel) -> None:
        self.node.allocate(self.now, k.gpu, k.nbytes)
        self.note(k, "memory", nbytes=k.nbytes)
        used = self.node.gpus[k.gpu].used
        if used > self.counters.peak_used.get(k.gpu, 0):
            self.counters.peak_used[k.gpu] = used
        self.policy.on_allocated(self, k.gpu)

    def _free(self, k: Kernel) -> None:
        self.node.release(self.now, k.gpu, k.nbytes)
        self.note(k, "memory", nbytes=0)

    def _reclaim(self, delta: int) -> None:
        self._reclaimed_bytes += delta
        self.reclaimed.set(self.now, self._reclaimed_bytes)

    # -- what policies may do -------------------------------------------------------------------
    def release(self, k: Kernel, reason: str, then: Callable[[], None] | None = None) -> bool:
        """Move a resident, idle kernel's GPU state to host memory; False if it cannot now."""
        if k.state != RESIDENT or k.busy:
            return False
        k.state = RELEASING
        started = self.now
        key = reason_kind(reason)
        self.counters.release_reasons[key] = self.counters.release_reasons.get(key, 0) + 1

        def released() -> None:
            self._free(k)
            self._reclaim(k.nbytes)
            k.state = RELEASED
            self.counters.releases += 1
            self.note(k, "released", seconds=self.now - started, reason=reason)
            self.policy.on_memory_freed(self, k.gpu)
            if then is not None:
                then()
            if k.pending is not None and k.state == RELEASED:
                self.policy.on_needs_gpu(self, k)

        self.schedule(self.now + self.transfer.release_seconds(k.nbytes), released)
        return True

    def restore(self, k: Kernel) -> None:
        """Bring a released kernel back; the caller has checked that it fits."""
        assert k.state == RELEASED and k.pending is not None
        self._allocate(k)
        self._reclaim(-k.nbytes)
        k.state = RESTORING
        seconds = self.transfer.restore_seconds(k.nbytes)
        k.pending.restore_seconds = seconds  # eager mode: only a cell triggers a restore

        def restored() -> None:
            k.state = RESIDENT
            k.last_activity = self.now  # the controller counts a restore as activity
            self.counters.restores += 1
            self.note(k, "restored", seconds=seconds)
            self._start_cell(k)

        self.schedule(self.now + seconds, restored)

    def cull(self, k: Kernel) -> None:
        """Kill an idle kernel: its memory is freed and its work since it started is lost."""
        assert k.state == RESIDENT and not k.busy
        self._free(k)
        self._reclaim(k.nbytes)
        k.state = CULLED
        k.lost_on_restart = k.compute_since_start
        k.compute_since_start = 0.0
        self.counters.culls += 1
        self.policy.on_memory_freed(self, k.gpu)

    def node_gpus(self, gpu: int) -> range:
        """The GPUs of the machine ``gpu`` is on (a server sees its own machine's GPUs)."""
        first = gpu // self.gpus_per_node * self.gpus_per_node
        return range(first, min(first + self.gpus_per_node, len(self.node.gpus)))
