"""The discrete-event loop: kernels, their cells, releases, restores and culls.

The engine owns the mechanics that are the same under every policy (a cell that uses the GPU
runs when its kernel's state is on all of the kernel's GPUs; memory is allocated, grown,
freed, moved to host and back, taking the transfer model's time per GPU, the GPUs of one
kernel in parallel) and asks a :class:`~.policies.Policy` for every decision (where a kernel
goes, whether it fits, what to release, when to restore). Time is the simulation clock only:
``Simulation.now``.

Restore modes: ``eager`` (every cell that arrives at a released kernel restores it first, as
the product's gate does by default) and ``lazy`` (a cell that uses no GPU runs at once, its
kernel's state staying on the host; only cells that use the GPU restore it).
Restores ahead (``ahead_lead`` > 0): the person's first activity (focusing the
notebook, editing a cell) comes ``ahead_lead`` s before a cell; where the kernel is released
then, the policy hears of it (:meth:`~.policies.Policy.on_activity`) and may restore it before
the cell arrives (``ahead_share``: the share of cells the lab sees activity before, drawn per
cell from ``seed``).
Kernels start (are placed) when their first session starts and allocate at their first cell
that uses the GPU: in between they are placed but not yet computing, as in the product from a
kernel's launch to its first GPU cell, and placement counts them (``pending``).
Placement: ``room`` (the product's: at each kernel's start, the GPUs of its user's machine
ranked by :mod:`jupyter_gpushare.policy.placement` unchanged, from :meth:`Simulation.views`)
or ``round-robin`` (a baseline: user ``i``'s kernels on GPU ``i mod G``, and the next ones for
a kernel of several GPUs). The machine a user's server runs on: ``servers`` ``rule`` (at its
first kernel's start, by the same rule's ``rank_groups`` over the machines) or
``round-robin`` (a baseline: the machine of the user's round-robin GPU). A policy may move a
released kernel onto other GPUs of its machine before it restores it
(:meth:`Simulation.move`), or move an idle resident one (:meth:`Simulation.relocate`): the
kernel then lives there.

What a release copies (``release_copies``): ``changed`` (the product's, where the transfer
model's method is incremental): a restore keeps the host copy, a cell that uses the GPU
changes all its kernel holds there (nothing says how much less: the worst case), and a
kernel idle for ``precopy_after`` s copies what changed in the background at the release
bandwidth (a cell that starts stops it), so a release copies only what is left; ``all`` (a
baseline, and always with a method that is not incremental): every release copies the
kernel's whole state. Host memory is not modelled: kept copies are never dropped.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..node.gpu_load import OWED_GRACE, coming_back
from ..policy import placement as rule
from .defaults import LOAD_WINDOW, MIN_ROOM, PRECOPY_AFTER
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

RESTORE_MODES = ("eager", "lazy")
PLACEMENTS = ("room", "round-robin")  # the product's, then the baseline
SERVERS = ("rule", "round-robin")  # where a user's server runs: the cluster rule, the baseline
RELEASE_COPIES = ("changed", "all")  # what a release copies: the product's, the baseline
HELD = (RELEASING, RELEASED, RESTORING)  # its state is off the GPU, or on its way


def reason_kind(reason: str) -> str:
    """The policy module's reason without its numbers: idle, memory pressure, making room."""
    for kind in ("memory pressure", "making room", "idle", "long idle", "ahead grace",
                 "rebalance"):
        if reason.startswith(kind):
            return kind
    return reason


@dataclass
class Waiting:
    """A cell that has arrived and waits for its kernel."""

    cell: Cell
    arrival: float
    restore_seconds: float = 0.0  # the restore this cell waited for, if any
    gpu: int = 0  # its kernel's first GPU when it arrived (a restore may move the kernel)
    room: bool = False  # its restore found no room at once (waited for releases or a move)


@dataclass
class Kernel:
    work: KernelWork
    index: int
    user_index: int
    gpus: list[int] = field(default_factory=lambda: [0])  # where it runs: all on one machine
    held: int = 0  # bytes per GPU of its state (on the GPUs or, released, on the host)
    changed: int = 0  # of which: changed since its host copy, as of ``last_activity``
    state: str = NEW
    busy: bool = False
    running_utilization: float = 0.0  # SM % of the cell it runs now
    last_activity: float = 0.0
    last_gpu_end: float = float("-inf")  # when its last cell that used the GPU ended
    last_gpu_utilization: float = 0.0
    #: the highest SM % its processes got on one of its GPUs during its last GPU cell (what
    #: the product's tracker keeps as the peak of its last GPU work: less than it asked where
    #: the cell was slowed all along)
    last_gpu_share: float = 0.0
    compute_since_start: float = 0.0  # s of cells run since it (re)started: what a cull loses
    lost_on_restart: float = 0.0
    session: int = 0
    cell: int = 0  # next cell of ``session``
    pending: Waiting | None = None
    ahead_since: float | None = None  # its person's activity no cell has followed yet
    ahead_restore: bool = False  # its restore (in flight or done) was asked by activity, unused
    restore_end: float = 0.0  # when its restore in flight ends
    allocated: bool = False  # it has allocated on its GPUs since it started (placed, else)
    need: rule.Need | None = None  # what its placement expected it to need
    #: bytes per GPU it is to hold once its failed allocation's next try fits, and when that
    #: allocation failed (the product's ``GpuLoad.owe``): wanted memory until it holds them
    owed: int = 0
    owed_at: float = 0.0
    moved_at: list[float] = field(default_factory=list)  # when rebalance moved it
    policy_state: dict = field(default_factory=dict)  # a policy's own bookkeeping

    @property
    def id(self) -> str:
        return self.work.kernel_id

    @property
    def gpu(self) -> int:
        """Its first GPU (the machine it is on is this GPU's)."""
        return self.gpus[0]

    @property
    def nbytes(self) -> int:
        """Bytes per GPU: a release or restore moves this much on each GPU, in parallel."""
        return self.held

    @property
    def total_bytes(self) -> int:
        return self.held * len(self.gpus)

    @property
    def released_gpus(self) -> dict[int, int]:
        """Bytes per GPU of its state while it is held off the GPU or on its way (releasing,
        released, restoring), as the product's lifecycle says them (``held.gpus``): the
        product's count of what comes back (:func:`~jupyter_gpushare.node.gpu_load.coming_back`)
        reads it, and the states' names are the product's."""
        if self.state in HELD:
            return {g: self.held for g in self.gpus}
        return {}

    def owed_more(self, now: float) -> int:
        """Bytes per GPU its failed allocation still wants beyond what it holds (0 once it
        holds them, ended, or :data:`OWED_GRACE` s after it failed)."""
        if not self.owed or now - self.owed_at > OWED_GRACE or self.state in (CULLED, ENDED):
            return 0
        return max(0, self.owed - (self.held if self.state == RESIDENT else 0))

    def holds(self, gpu: int) -> bool:
        """Whether it holds memory on ``gpu`` now (what the product's tracker measures)."""
        on = self.state in (RELEASING, RESTORING) or (self.state == RESIDENT and self.allocated)
        return on and self.held > 0 and gpu in self.gpus

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
    gpus: int = 1  # GPUs it computed on (0: a CPU-only cell)
    end: float | None = None  # None: still running at the end of the trace
    waited_on: int = 0  # its kernel's first GPU when it arrived
    ran_on: int = 0  # and when it started (another where its restore moved the kernel)
    waited_for_room: bool = False  # its restore found no room at once

    @property
    def delay(self) -> float:
        return self.start - self.arrival


# what happened to a kernel, for whoever records it (e.g. an export in the history's shape)
Observer = Callable[[float, "Kernel", str, dict], None]


@dataclass
class Counters:
    oom_failures: int = 0  # cells failed for lack of memory: at a kernel's start or growth
    oom_growth: int = 0  # of which: a cell that allocated more than its GPUs had free
    releases: int = 0
    restores: int = 0
    culls: int = 0
    restarts: int = 0
    work_lost_seconds: float = 0.0
    release_reasons: dict[str, int] = field(default_factory=dict)
    still_waiting: list[float] = field(default_factory=list)  # arrival of cells never started
    peak_used: dict[int, int] = field(default_factory=dict)
    ahead_requests: int = 0  # activity on a released kernel: a restore asked ahead of a cell
    ahead_restores: int = 0  # of which restored (started) before their cell arrived
    ahead_used: int = 0  # restores ahead that a cell then used
    ahead_released_again: int = 0  # no cell within ahead_grace: released again
    ahead_cancelled: int = 0  # no room found within ahead_grace: never restored ahead
    moves: int = 0  # restores onto other GPUs than those the kernel was released from
    rebalances: int = 0  # of which: idle resident kernels moved off contended GPUs
    release_bytes: int = 0  # bytes releases copied to host (all GPUs)


class Simulation:
    def __init__(self, workload: Workload, policy: Policy, gpu_bytes: int, gpus_per_node: int,
                 transfer: TransferModel, nodes: int = 1, bin_seconds: float = 600.0,
                 observer: Observer | None = None, restore_mode: str = "eager",
                 placement: str = "room", total_gpus: int | None = None,
                 ahead_lead: float = 0.0, ahead_share: float = 1.0, seed: int = 0,
                 servers: str = "rule", load_window: float = LOAD_WINDOW,
                 release_copies: str = "changed", precopy_after: float = PRECOPY_AFTER):
        """``total_gpus``: that many GPUs in machines of ``gpus_per_node`` (the last one
        partly filled), instead of ``nodes`` full machines. ``ahead_lead``: s between a
        person's first activity and their cell (0: no activity is seen, cells alone restore).
        ``load_window``: s of SM history a GPU's load and busy kernels are judged over.
        ``release_copies``: ``changed`` (copy what changed since the host copy, where the
        transfer model is incremental) or ``all``; ``precopy_after``: s idle before a kernel
        pre-copies what changed (0: never)."""
        if restore_mode not in RESTORE_MODES:
            raise ValueError(f"restore mode {restore_mode!r}: one of {', '.join(RESTORE_MODES)}")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement {placement!r}: one of {', '.join(PLACEMENTS)}")
        if servers not in SERVERS:
            raise ValueError(f"servers {servers!r}: one of {', '.join(SERVERS)}")
        if release_copies not in RELEASE_COPIES:
            raise ValueError(f"release copies {release_copies!r}: one of "
                             f"{', '.join(RELEASE_COPIES)}")
        if not precopy_after >= 0:  # NaN too
            raise ValueError(f"precopy_after {precopy_after!r}: seconds, 0 (never) or more")
        #: a release copies only what changed (else all the kernel holds)
        self.incremental = release_copies == "changed" and transfer.incremental
        self.precopy_after = precopy_after
        self.servers = servers
        self.load_window = load_window
        self.restore_mode = restore_mode
        self.placement = placement
        self.ahead_lead = ahead_lead
        self.ahead_share = ahead_share
        self.seed = seed
        self.workload = workload
        self.observer = observer
        self.policy = policy
        self.transfer = transfer
        self.duration = workload.duration
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        user_index = {u: i for i, u in enumerate(workload.users)}
        width = workload.user_gpus()
        # the GPUs before each user's, were every user given their widest kernel's in turn
        self.user_offset = list(itertools.accumulate((width[u] for u in workload.users), initial=0))
        self.kernels = [Kernel(w, i, user_index[w.user]) for i, w in enumerate(workload.kernels)]
        self.by_user: dict[int, list[Kernel]] = {}
        for k in self.kernels:
            self.by_user.setdefault(k.user_index, []).append(k)
        n_gpus = policy.gpu_count(workload, gpus_per_node * nodes if total_gpus is None else total_gpus)
        self.gpus_per_node = gpus_per_node
        wide = max((k.gpus for k in workload.kernels), default=1)
        if wide > min(gpus_per_node, n_gpus) and policy.name != "exclusive":
            raise ValueError(f"a kernel of {wide} GPUs cannot run on machines of "
                             f"{min(gpus_per_node, n_gpus)} GPUs")
        self.node = Node([gpu_bytes] * n_gpus, self.duration, bin_seconds, self.schedule,
                         load_window, keep=policy.history_seconds(load_window))
        self.machine_of: dict[int, range] = {}  # user -> the machine their server runs on
        self.placed: list[set[int]] = [set() for _ in range(n_gpus)]  # placed, not allocated
        self.owing: set[int] = set()  # kernels whose failed allocation may still be owed room
        self.computed: list[dict[int, float]] = [{} for _ in range(n_gpus)]  # kernel -> last
        self._keep = policy.history_seconds(load_window)  # s of that kept
        self.peaks: dict[int, dict[int, int]] = {}  # user -> kernel -> most bytes per GPU held
        self.reclaimed = Meter(bin_seconds, self.duration)  # bytes off the GPU of live kernels
        self._reclaimed_bytes = 0
        self.cells: list[CellRecord] = []
        self.counters = Counters()
        policy.setup(self)
        for k in self.kernels:
            k.gpus = policy.place(self, k)
            k.held = k.work.gpu_bytes
            if k.work.sessions:
                s = k.work.sessions[0]
                self.schedule(s.start, functools.partial(self._launch, k))
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
        k.pending = Waiting(s.cells[k.cell], self.now, gpu=k.gpu)
        k.ahead_since = None  # the cell the activity announced is here
        if k.ahead_restore:
            k.ahead_restore = False
            self.counters.ahead_used += 1
        if k.state == RESTORING:  # it waits for what is left of a restore in flight
            k.pending.restore_seconds = k.restore_end - self.now
        self._dispatch(k)

    def _plan_activity(self, k: Kernel, t: float, at: float) -> None:
        """The person's first activity before the cell due at ``at``: ``ahead_lead`` s before
        it, not before ``t``, when the previous cell ended (a session's first cell too: the
        person comes back before it, whatever the session's nominal start)."""
        if self.ahead_lead <= 0:
            return
        when = max(at - self.ahead_lead, t)
        if when <= t and k.state == RESIDENT:
            return  # the person never left: nothing to restore
        if self.ahead_share < 1.0:
            draw = random.Random(f"{self.seed}:ahead:{k.id}:{k.session}:{k.cell}").random()
            if draw >= self.ahead_share:
                return
        self.schedule(when, lambda: self._activity(k))

    def _activity(self, k: Kernel) -> None:
        """The person works in the notebook from now until their cell: the lab asks for a
        restore while the kernel is released (now, or when a release under way or one that
        comes before the cell is done: the person's edits keep asking)."""
        if k.pending is not None or k.state in (NEW, CULLED, ENDED):
            return
        k.ahead_since = self.now
        if k.state == RELEASED:
            self._ask_ahead(k)

    def _ask_ahead(self, k: Kernel) -> None:
        self.counters.ahead_requests += 1
        self.note(k, "activity")
        self.policy.on_activity(self, k)

    def _dispatch(self, k: Kernel) -> None:
        assert k.pending is not None
        if k.state == RESIDENT:
            if not self.policy.before_cell(self, k):  # else it moves first, then starts
                self._start_cell(k)
        elif (self.restore_mode == "lazy" and not k.pending.cell.uses_gpu
              and k.state in (RELEASED, RELEASING)):
            self._start_cell(k)  # its process runs; its CUDA state stays where it is
        elif k.state in (NEW, CULLED):
            self._start_kernel(k)
        elif k.state != RESTORING:  # RESTORING: the cell starts when the restore is done
            self.policy.on_needs_gpu(self, k)

    def _launch(self, k: Kernel) -> None:
        """Its first session starts: the kernel is launched (placed) before its first cell."""
        if k.state == NEW:
            self._start_kernel(k)

    def _start_kernel(self, k: Kernel) -> None:
        """Launch (or, after a cull, restart) ``k``: placed on its GPUs, nothing allocated
        until its first cell that uses the GPU."""
        if k.state == CULLED:
            self._reclaim(-k.total_bytes)
            self.counters.restarts += 1
            self.counters.work_lost_seconds += k.lost_on_restart  # re-run on this next use
            k.lost_on_restart = 0.0
        k.need = self.expected_need(k)
        k.gpus = self.policy.place_at_start(self, k)
        k.held, k.allocated = 0, False
        for g in k.gpus:
            self.placed[g].add(k.index)
        k.state = RESIDENT
        k.compute_since_start = 0.0
        self.note(k, "placed", gpus=list(k.gpus))
        if k.pending is not None:
            self._start_cell(k)

    def _first_allocation(self, k: Kernel, nbytes: int) -> bool:
        """A placed kernel's first GPU cell: it allocates ``nbytes`` per GPU (a (re)started
        process holds what it allocates at start); False: not there (out of memory)."""
        k.held = nbytes
        if not self.policy.fits(self, k):
            k.held = 0
            self._unplace(k)  # its process made a context there: the product's tracker saw it
            return False
        self._allocate(k)
        k.allocated = True
        k.changed = k.held  # no host copy yet
        self._unplace(k)
        return True

    def _unplace(self, k: Kernel) -> None:
        for g in k.gpus:
            self.placed[g].discard(k.index)

    def _start_cell(self, k: Kernel) -> None:
        w = k.pending
        assert w is not None
        cell = w.cell
        if k.state == RESIDENT and not k.allocated and cell.uses_gpu:
            wanted = max(k.work.gpu_bytes, cell.nbytes or 0)
            if not self._first_allocation(k, wanted):
                self.counters.oom_failures += 1  # the cell fails; the person tries the next one
                self.policy.on_out_of_memory(self, k, wanted)
                k.pending = None
                k.last_activity = self.now
                self._next_cell(k, self.now)
                self.policy.on_idle(self, k)
                return
        if k.state == RESIDENT and cell.nbytes is not None and cell.nbytes > k.held:
            if not self._grow(k, cell.nbytes):  # CUDA out of memory: the cell fails
                self.counters.oom_failures += 1
                self.counters.oom_growth += 1
                self.policy.on_out_of_memory(self, k, cell.nbytes - k.held)
                k.pending = None
                k.changed = self.left_to_copy(k)  # as of now, the new last activity
                k.last_activity = self.now
                self._next_cell(k, self.now)
                self.policy.on_idle(self, k)
                return
        k.pending = None
        on = k.gpus[:min(cell.n_gpus, len(k.gpus))] if k.state == RESIDENT else []
        rec = CellRecord(k.index, w.arrival, self.now, cell.duration, cell.utilization,
                         w.restore_seconds, len(on), waited_on=w.gpu, ran_on=k.gpu,
                         waited_for_room=w.room)
        self.cells.append(rec)
        if k.state == RESIDENT:  # a cell stops a pre-copy: what it copied stays copied
            k.changed = k.held if on else self.left_to_copy(k)
        k.busy, k.running_utilization = True, cell.utilization if on else 0.0
        k.last_activity = self.now
        if not on:
            end = self.now + cell.duration
            self.schedule(end, lambda: self._end_cell(k, rec, end))
            return
        left = [len(on)]  # a cell of several GPUs ends when its slowest GPU's share ends
        # computing there, as the product's tracker counts it: SM above idle_utilization
        computing = cell.utilization > self.policy.idle_utilization
        if computing:
            for g in on:
                self.computed[g][k.index] = float("inf")
            self.policy.on_compute(self, on)

        peak = [0.0]  # the highest share its processes got on one of its GPUs

        def part_done(t: float, share: float) -> None:
            left[0] -= 1
            peak[0] = max(peak[0], share)
            if not left[0]:
                if peak[0] > self.policy.idle_utilization:  # it computed, as the tracker counts
                    k.last_gpu_share = peak[0]
                for g in on:
                    if computing:
                        self.computed[g][k.index] = t
                self._end_cell(k, rec, t)

        for g in on:
            self.node.run(self.now, g, cell.duration, cell.utilization, part_done)

    def _grow(self, k: Kernel, nbytes: int) -> bool:
        """The kernel allocates up to ``nbytes`` per GPU; False if a GPU has not the room."""
        delta = nbytes - k.held
        if any(self.node.free(g) < delta for g in k.gpus):
            return False
        for g in k.gpus:
            self.node.allocate(self.now, g, delta)
            self._peak(g)
        k.held = nbytes
        k.changed = nbytes  # the cell that grows it uses the GPU: all of it may change
        self._user_peak(k)
        self.note(k, "memory", nbytes=k.total_bytes)
        for g in k.gpus:
            self.policy.on_allocated(self, g)
        return True

    def note(self, k: Kernel, what: str, **data: object) -> None:
        if self.observer is not None:
            self.observer(self.now, k, what, data)

    def _end_cell(self, k: Kernel, rec: CellRecord, t: float) -> None:
        rec.end = t
        self.note(k, "cell", start=rec.start, end=t, utilization=rec.utilization)
        k.busy = False
        k.last_activity = t
        k.compute_since_start += rec.duration * rec.gpus  # GPU-s: what a cull makes re-run
        if rec.gpus and rec.utilization > 0:
            k.last_gpu_end, k.last_gpu_utilization = t, rec.utilization
        cell = k.work.sessions[k.session].cells[k.cell]
        if cell.keeps is not None and k.state == RESIDENT and cell.keeps < k.held:
            self._shrink(k, cell.keeps)
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
        self._plan_activity(k, t, at)

    def _shut_down(self, k: Kernel) -> None:
        if k.state == RELEASING:  # let the release finish, then shut down
            self.schedule(self.now + 1.0, lambda: self._shut_down(k))
            return
        if k.state == RESIDENT:
            self._free(k)
        elif k.state in (RELEASED, CULLED):
            self._reclaim(-k.total_bytes)
        self._unplace(k)
        k.state = ENDED
        self.note(k, "ended")
        self._freed(k)

    # -- memory -----------------------------------------------------------------------------------
    def _allocate(self, k: Kernel) -> None:
        for g in k.gpus:
            self.node.allocate(self.now, g, k.held)
            self._peak(g)
        self._user_peak(k)
        self.note(k, "memory", nbytes=k.total_bytes)
        for g in k.gpus:
            self.policy.on_allocated(self, g)

    def _peak(self, g: int) -> None:
        used = self.node.gpus[g].used
        if used > self.counters.peak_used.get(g, 0):
            self.counters.peak_used[g] = used

    def _user_peak(self, k: Kernel) -> None:
        peaks = self.peaks.setdefault(k.user_index, {})
        peaks[k.index] = max(peaks.get(k.index, 0), k.held)

    def _free(self, k: Kernel) -> None:
        for g in k.gpus:
            self.node.release(self.now, g, k.held)
        self.note(k, "memory", nbytes=0)

    def _shrink(self, k: Kernel, nbytes: int) -> None:
        """A cell freed memory (``Cell.keeps``): the kernel holds ``nbytes`` per GPU after it."""
        for g in k.gpus:
            self.node.release(self.now, g, k.held - nbytes)
        k.held = nbytes
        k.changed = min(k.changed, nbytes)
        self.note(k, "memory", nbytes=k.total_bytes)
        self._freed(k)

    def _freed(self, k: Kernel) -> None:
        for g in k.gpus:
            self.policy.on_memory_freed(self, g)

    def reserved(self, gpu: int) -> int:
        """Bytes that released kernels placed on ``gpu`` will take back when restored."""
        return sum(k.held for k in self.kernels if k.state == RELEASED and gpu in k.gpus)

    def _reclaim(self, delta: int) -> None:
        self._reclaimed_bytes += delta
        self.reclaimed.set(self.now, self._reclaimed_bytes)

    # -- what policies may do -------------------------------------------------------------------
    def release(self, k: Kernel, reason: str, then: Callable[[], None] | None = None) -> bool:
        """Move a resident, idle kernel's GPU state to host memory; False if it cannot now."""
        if k.state != RESIDENT or k.busy or not k.allocated:
            return False
        k.state = RELEASING
        if k.ahead_restore:  # restored ahead and released before its cell: asked no more
            k.ahead_restore, k.ahead_since = False, None
        started = self.now
        key = reason_kind(reason)
        self.counters.release_reasons[key] = self.counters.release_reasons.get(key, 0) + 1

        copies = self.left_to_copy(k)

        def released() -> None:
            self._free(k)
            self._reclaim(k.total_bytes)
            k.state = RELEASED
            self.counters.releases += 1
            self.counters.release_bytes += copies * len(k.gpus)
            self.note(k, "released", seconds=self.now - started, reason=reason, copied=copies)
            self._freed(k)
            if then is not None:
                then()
            if k.pending is not None and k.state == RELEASED:
                self.policy.on_needs_gpu(self, k)
            elif k.ahead_since is not None and k.state == RELEASED:
                self._ask_ahead(k)

        # each GPU's share moves over its own link, all at once: the time of one GPU's bytes
        self.schedule(self.now + self.transfer.release_seconds(copies), released)
        return True

    def left_to_copy(self, k: Kernel) -> int:
        """Bytes per GPU a release of ``k`` copies now: all it holds, or (incremental) what
        changed since its host copy less what a pre-copy has copied since it became idle
        ``precopy_after`` s ago, at the release bandwidth."""
        if not self.incremental:
            return k.held
        since = k.last_activity + self.precopy_after
        if k.busy or self.precopy_after <= 0 or self.now <= since:
            return k.changed
        return max(0, k.changed - int((self.now - since) * self.transfer.release_bandwidth))

    def move(self, k: Kernel, gpus: list[int]) -> None:
        """Put a released kernel's state back onto ``gpus`` (as many as it had, on its machine)
        instead of its own: its restore, later cells, growth and releases are there."""
        assert k.state == RELEASED and len(gpus) == len(k.gpus) == len(set(gpus))
        assert all(g in self.node_gpus(k.gpu) for g in gpus)
        was, k.gpus = k.gpus, list(gpus)
        self.counters.moves += 1
        self.note(k, "moved", gpus_from=was, gpus_to=list(gpus))

    def restore(self, k: Kernel, rebalance: bool = False) -> None:
        """Bring a released kernel back onto all its GPUs at once (in parallel, one copy per
        GPU), for the cell that waits or, ahead of it, for its person's activity, or (``rebalance``)
        onto the GPUs it was moved to; the caller has checked that it fits on every one of them."""
        assert k.state == RELEASED and (k.pending is not None or k.ahead_since is not None
                                        or rebalance)
        self._allocate(k)
        self._reclaim(-k.total_bytes)
        k.state = RESTORING
        seconds = self.transfer.restore_seconds(k.held)
        k.restore_end = self.now + seconds
        trigger = "cell" if k.pending is not None else "rebalance" if rebalance else "activity"
        if k.pending is not None:
            k.pending.restore_seconds = seconds
        elif not rebalance:
            k.ahead_restore = True
            self.counters.ahead_restores += 1

        def restored() -> None:
            k.state = RESIDENT
            k.last_activity = self.now  # the controller counts a restore as activity
            k.changed = 0  # its host copy is kept: nothing changed since
            self.counters.restores += 1
            self.note(k, "restored", seconds=seconds, trigger=trigger)
            if k.pending is not None:
                self._start_cell(k)
            else:  # restored ahead (or moved): resident and idle until the cell comes
                self.policy.on_idle(self, k)
                if trigger == "activity":
                    self.policy.on_ahead_restored(self, k)

        self.schedule(self.now + seconds, restored)

    def relocate(self, k: Kernel, gpus: list[int], reason: str) -> bool:
        """Move an idle resident kernel onto ``gpus`` (of its machine): released, moved, and
        restored there at once where it fits (else it stays released, and its next cell
        restores it there as any); False if it cannot be released now."""
        def land() -> None:
            if k.state != RELEASED:
                return
            self.move(k, gpus)
            self.counters.rebalances += 1
            if k.pending is None and all(self.node.free(g) >= k.held for g in k.gpus):
                self.restore(k, rebalance=True)

        return self.release(k, reason, then=land)

    def cull(self, k: Kernel) -> None:
        """Kill an idle kernel: its memory is freed and its work since it started is lost."""
        assert k.state == RESIDENT and not k.busy
        self._free(k)
        self._unplace(k)
        self._reclaim(k.total_bytes)
        k.state = CULLED
        k.lost_on_restart = k.compute_since_start
        k.compute_since_start = 0.0
        self.counters.culls += 1
        self._freed(k)

    def owe(self, k: Kernel, nbytes: int) -> None:
        """A cell of ``k`` failed to allocate ``nbytes`` more per GPU: wanted memory until it
        holds them (the product's ``GpuLoad.owe``, which :meth:`views` and the servers'
        release policies count)."""
        k.owed, k.owed_at = k.held + nbytes, self.now
        self.owing.add(k.index)

    def owed_on(self, gpus: Iterable[int], counts: Callable[[Kernel], bool]) -> dict[int, int]:
        """Per GPU of ``gpus``, the bytes failed allocations of the kernels ``counts`` accepts
        still want (:meth:`owe`); those owed nothing any more are forgotten."""
        on = set(gpus)
        out: dict[int, int] = {}
        for i in list(self.owing):
            o = self.kernels[i]
            more = o.owed_more(self.now)
            if not more:
                self.owing.discard(i)
            elif counts(o):
                for g in on.intersection(o.gpus):
                    out[g] = out.get(g, 0) + more
        return out

    def fits_now(self, k: Kernel) -> bool:
        """Whether ``k``'s state fits on every one of its GPUs now."""
        return all(self.node.free(g) >= k.held for g in k.gpus)

    # -- what placement sees -----------------------------------------------------------------
    def machines(self) -> list[range]:
        return [self.node_gpus(first) for first in range(0, len(self.node.gpus), self.gpus_per_node)]

    def expected_need(self, k: Kernel) -> rule.Need:
        """What the product could expect ``k`` to need per GPU: the most its person's kernels
        held before (not what the workload will make it allocate), else the floor."""
        recent = list(self.peaks.get(k.user_index, {}).values())
        return rule.expected_need(None, None, recent, MIN_ROOM)

    def busy(self, gpu: int, window: float | None = None, holding: bool = False,
             exclude: Kernel | None = None) -> int:
        """Kernels that computed on ``gpu`` within ``window`` s (the load window where None),
        or compute there now; ``holding``: only those that hold memory there now (the
        product's views count those: a kernel moved or released off the GPU no longer
        shares it); ``exclude``: a kernel left out."""
        last = self.computed[gpu]
        since = self.now - (self.load_window if window is None else window)
        n = 0
        old = []
        for i, t in last.items():
            if t >= since:
                o = self.kernels[i]
                if o is not exclude and (not holding or o.holds(gpu)):
                    n += 1
            elif t < self.now - self._keep:
                old.append(i)
        for i in old:  # out of every window: forgotten
            del last[i]
        return n

    def coming_back(self, exclude: Kernel | None = None) -> dict[int, int]:
        """Per GPU, the bytes released kernels will take back, counted by the product's own
        rule (:func:`jupyter_gpushare.node.gpu_load.coming_back`, what the placer and the
        rebalancer subtract): each held state whole, while it is released and while its
        release runs (its bytes are on the GPU until the release ends: the product counts
        them twice then), and not while its restore runs (its bytes are allocated here)."""
        return coming_back(o for o in self.kernels if o.state in HELD and o is not exclude)

    def releases_in_flight(self) -> dict[int, int]:
        """Per GPU, the bytes of releases under way: what a restore's room leaves out there
        (the product's ``RestoreRoom.releases_may_take_back``: an undo would put them back)."""
        return coming_back(o for o in self.kernels if o.state == RELEASING)

    def restore_room(self, k: Kernel) -> dict[int, int | None]:
        """Room a restore of ``k`` has on each of its GPUs, as the product's restore check
        counts it: free memory less the releases in flight there."""
        flight = self.releases_in_flight()
        return {g: self.node.free(g) - flight.get(g, 0) for g in k.gpus}

    def views(self, gpus: Iterable[int], exclude: Kernel | None = None,
              window: float | None = None,
              taken_back: dict[int, int] | None = None,
              seen_by: Kernel | None = None) -> dict[int, rule.GpuView]:
        """The placement rule's view of ``gpus``, built as the product builds it
        (:class:`jupyter_gpushare.node.gpu_load.GpuLoad`): room = free memory less
        ``taken_back`` (default :meth:`coming_back`: the placer's and the rebalancer's; a
        restore's targets pass :meth:`releases_in_flight`) and what placed kernels that have
        not allocated yet are expected to allocate; load = SM % over the load window;
        pending = the expected SM load of those placed kernels; kernels placed there (in any
        state, released too) or resident; kernels that computed there within the window and
        hold memory there now. ``exclude``: a kernel left out of every count (the one being
        placed or restored). ``window``: s (the load window where None; rebalance judges over
        its own). ``seen_by``: the view of that kernel's server, which knows other servers'
        placed kernels and released states only as the policy says
        (:meth:`Policy.sees_placed`, :meth:`Policy.sees_returning`; the product's server knows
        its own, and others' through the node daemon or the hub service)."""
        gpus = list(gpus)
        if taken_back is not None:
            back = taken_back
        elif seen_by is None:
            back = self.coming_back(exclude)
        else:  # the released states its server knows of
            back = coming_back(o for o in self.kernels if o.state in HELD and o is not exclude
                               and self.policy.sees_returning(self, seen_by, o))
        placed = dict.fromkeys(gpus, 0)  # placed kernels' expected bytes
        pending = dict.fromkeys(gpus, 0.0)
        count = dict.fromkeys(gpus, 0)
        for g in gpus:
            for i in self.placed[g]:
                o = self.kernels[i]
                if o is exclude or o.need is None:
                    continue
                if seen_by is not None and not self.policy.sees_placed(self, seen_by, o):
                    continue
                placed[g] += o.need.bytes
                pending[g] += o.need.load
        owed = self.owed_on(gpus, lambda o: o is not exclude and (
            seen_by is None or self.policy.sees_owed(self, seen_by, o)))
        for g, more in owed.items():  # what failed allocations' next tries want
            placed[g] += more
        for o in self.kernels:
            if o is exclude or o.state in (NEW, CULLED, ENDED):
                continue
            for g in o.gpus:
                if g in count and not (seen_by is not None and o.index in self.placed[g]
                                       and not self.policy.sees_placed(self, seen_by, o)):
                    count[g] += 1
        now = {g: self.node.free(g) - placed[g] for g in gpus}  # room, states coming back left out
        return {g: rule.GpuView(g, now[g] - back.get(g, 0),
                                self.node.load(g, self.now, window), pending[g], count[g],
                                self.busy(g, window, holding=True, exclude=exclude),
                                room_now=now[g])
                for g in gpus}

    def node_gpus(self, gpu: int) -> range:
        """The GPUs of the machine ``gpu`` is on (a server sees its own machine's GPUs)."""
        first = gpu // self.gpus_per_node * self.gpus_per_node
        return range(first, min(first + self.gpus_per_node, len(self.node.gpus)))
