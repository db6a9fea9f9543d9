"""Moves between cells: an idle kernel leaves a GPU whose SMs are contended for a quiet one.

Placement decides where a kernel starts; two trainings that land on one GPU would otherwise
share it for as long as both live, while other GPUs idle. At each poll this module looks at
every GPU's SM load over :func:`window_of` (5 x ``rebalance_idle``, at least ``load_window``:
600 s by default; the tracker's history, not one reading) and at
the kernels that computed there; where a GPU is contended (the rule's
:func:`..policy.placement.contended`) and another with room is quiet, a resident kernel whose
person is away (no cell running, idle for ``rebalance_idle`` seconds) moves there, so that its
next training does not share (:func:`..policy.placement.rebalance` picks which and where,
over the views :mod:`..node.gpu_load` builds, as for placement).

A move is a release and then a restore onto the new GPU(s) with a GPU mapping, the
controller's own steps: never mid-cell (the agent refuses a release while a cell runs), a
cell that arrives meanwhile waits at the gate as for any restore, and the move is all or
nothing: a release that fails leaves the kernel where it was; a target that filled up
meanwhile, or a restore onto it that fails, brings the state back home. Only methods that
can restore onto another GPU (``move_refusal()`` None) move; at most
``rebalance_max_per_hour`` moves per kernel per hour.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from .. import clock
from ..node.gpu_load import GpuLoad, coming_back
from ..policy.placement import (
    GpuView,
    Resident,
    before_cell,
    contended,
    pressure_floor,
    rebalance,
)
from ..states import ACTIVE, IDLE
from . import metrics
from .errors import ControllerError
from .operations import wait_for

if TYPE_CHECKING:
    from .controller import Controller
    from .lifecycle import Held, Lifecycle
    from .operations import Operation
    from .progress import CellProgress
    from .reservations import Grant
    from .tracker import Tracker

log = logging.getLogger(__name__)

#: the rebalancer's window, in rebalance_idle: a GPU's SM load and the kernels computing there
#: are judged over this many times rebalance_idle (at least load_window), so that a kernel
#: whose person left (idle rebalance_idle, movable) still counts among those sharing the GPU
#: (its next training would share it), and a GPU is contended only when busy that long
WINDOW_PER_IDLE = 5.0


def window_of(rebalance_idle: float, load_window: float) -> float:
    """Seconds over which the rebalancer (and status, metrics, the panel) judge contention:
    ``WINDOW_PER_IDLE`` x ``rebalance_idle``, at least ``load_window`` (600 s by default)."""
    return max(float(load_window), WINDOW_PER_IDLE * float(rebalance_idle))


LOAD_WINDOW = window_of(120.0, 120.0)  # the defaults' window (600 s)
HOUR = 3600.0
REBALANCE = "rebalance"  # the trigger of a move's restore


@dataclass(frozen=True)
class Contention:
    """One GPU's compute over the window, as status, metrics and the rebalancer see it."""

    load: float  # % SM busy, mean over the window (all processes on the GPU)
    computing: tuple[str, ...]  # this server's kernels that computed there within the window
    contended: bool


def contention(tracker: Tracker, now: float, window: float = LOAD_WINDOW) -> dict[int, Contention]:
    """Per GPU: its SM load over the window (the tracker's records keep it up as samples
    come), this server's kernels that computed there within the window, and whether it is
    contended. O(GPUs + kernels x their GPUs)."""
    since = now - window
    who: dict[int, list[str]] = {}
    for kid, rec in tracker.kernels.items():
        for g, t in rec.computed.items():
            if t > since:
                who.setdefault(g, []).append(kid)
    out = {}
    for g in sorted(tracker.gpus):
        load = round(tracker.gpus[g].recent_load(window), 1)
        names = tuple(sorted(who.get(g, ())))
        out[g] = Contention(load, names, contended(GpuView(g, None, load, busy=len(names))))
    return out


def room(controller: Controller) -> dict[int, int | None]:
    """Bytes a moved state may take on each GPU: free at the last sample, less restores'
    reservations not landed yet and what this server's released kernels will take back
    (a restoring kernel's bytes once: :func:`..node.gpu_load.coming_back`)."""
    held = coming_back(controller.lifecycles())
    free = controller.seen_free()
    return {g: (free[g] - held.get(g, 0)) if g in free else None
            for g in sorted(controller.tracker.gpus)}


@dataclass(frozen=True)
class RebalanceSettings:
    enabled: bool
    idle: float
    per_hour: int
    window: float = LOAD_WINDOW  # s contention is judged over (window_of)
    before_cell: bool = False  # a heavy kernel's cell that would share a busy GPU moves first

    @classmethod
    def of(cls, config: Any) -> RebalanceSettings:
        """The app's options (``rebalance``, ``rebalance_idle``, ``rebalance_max_per_hour``,
        ``load_window``); settings without them (a bare policy config) do not move kernels."""
        idle = float(getattr(config, "rebalance_idle", 120.0))
        return cls(bool(getattr(config, "rebalance", False)), idle,
                   int(getattr(config, "rebalance_max_per_hour", 2)),
                   window_of(idle, float(getattr(config, "load_window", 120.0))),
                   bool(getattr(config, "rebalance_before_cell", False)))


def said(plan: dict[int, int], why: str) -> str:
    """The move for a person: "GPU 0 -> 3: GPU 0 busy"."""
    came = ", ".join(str(g) for g in sorted(plan))
    went = ", ".join(str(plan[g]) for g in sorted(plan))
    return f"GPU {came} -> {went}: {why}"


class Rebalancer:
    """The controller's moves between cells (see the module's docstring)."""

    def __init__(self, controller: Controller):
        self.c = controller
        self.moves: dict[str, deque[float]] = {}  # kernel -> when its moves started, last hour
        self.planned: dict[str, tuple[dict[int, int], str]] = {}  # kernel -> (mapping, why)
        self.granted: dict[str, Grant] = {}  # kernel -> the restore grant onto its new GPUs
        self.last: dict[str, tuple[str, int]] = {}  # kernel -> (its last move, restores then)
        self.seen: dict[int, Contention] = {}
        # the placement rule's views, built as the placer and the restores build them and
        # with their placements (kernels placed, not computing yet, count), over this window
        self.load = GpuLoad(lambda: controller.tracker.gpus, lambda: controller.tracker.kernels,
                            self.window)
        self.load.placed = controller.room.load.placed  # one record of placements, shared

    @property
    def settings(self) -> RebalanceSettings:
        return RebalanceSettings.of(self.c.config)

    @property
    def window(self) -> float:
        """Seconds contention is judged over, from the options now (:func:`window_of`)."""
        return self.settings.window

    # -- each poll ---------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Judge every GPU (the metrics show it) and start the moves the rule plans."""
        tracker = self.c.tracker
        self.load.window = window = self.window
        self.seen = contention(tracker, now, window)
        metrics.set_contention({g: (c.load, c.contended) for g, c in self.seen.items()})
        for kid in set(self.moves) - set(tracker.kernels):
            self.moves.pop(kid, None)
            self.last.pop(kid, None)
        cfg = self.settings
        if not cfg.enabled or cfg.per_hour <= 0 or self.c.closing:
            return
        if not any(c.contended for c in self.seen.values()):
            return
        views = self.load.views(room(self.c), now=now)
        residents = [r for r in (self._resident(kid, now, cfg) for kid in list(tracker.kernels)) if r]
        keep = pressure_floor(self.c.node_room.total_bytes(),
                              self.c.config.pressure_free_fraction)
        for kid, plan in rebalance(residents, views, keep=keep):
            why = ", ".join(f"GPU {g} busy" for g in sorted(plan))
            self._start(kid, plan, why, now)

    @property
    def moves_before_cells(self) -> bool:
        """rebalance_before_cell is on (with rebalance): the gate asks :meth:`before_cell`."""
        cfg = self.settings
        return cfg.enabled and cfg.before_cell and cfg.per_hour > 0

    def before_cell(self, kid: str, parent: dict | None = None) -> bool:
        """A cell of ``kid`` arrives (the gate holds it): True when the kernel starts moving
        first, because its last GPU work was heavy and another kernel's cell keeps its GPU
        busy while a quiet GPU has room (:func:`..policy.placement.before_cell`); the cell
        then waits for the move as for any restore, and the move's restore shows its
        progress in the cell (``parent``: the cell's request header). False: it runs where
        it is."""
        cfg = self.settings
        c = self.c
        if not self.moves_before_cells or c.closing:
            return False
        rec = c.tracker.kernels.get(kid)
        if rec is None or rec.computed_sm <= 0:
            return False
        now = clock.now()
        # the kernel is between cells (the gate saw no reply yet): not idle for long, though
        resident = self._resident(kid, now, replace(cfg, idle=0.0))
        if resident is None or not resident.movable:
            return False
        reading = {g: r.load(now, now) for g, r in c.tracker.gpus.items()}  # the last sample
        self.load.window = cfg.window
        plan = before_cell(resident, rec.computed_sm, reading,
                           self.load.views(room(c), now=now, exclude=kid),
                           keep=pressure_floor(c.node_room.total_bytes(),
                                               c.config.pressure_free_fraction))
        if not plan:
            return False
        why = ", ".join(f"GPU {g} busy with another kernel's cell" for g in sorted(plan))
        return self._start(kid, plan, why, now, parent)

    def _start(self, kid: str, plan: dict[int, int], why: str, now: float,
               parent: dict | None = None) -> bool:
        """Start a move: its release at once (cells that arrive from now wait at the gate),
        the restore onto ``plan`` when it is done (for the cell of ``parent``, whose output
        shows it, where a cell waits). False: the release could not start."""
        try:
            op = self.c.release_automatically(kid, f"moving {said(plan, why)}")
        except ControllerError as e:
            log.info("gpushare: kernel %s not moved: %s", kid, e.message)
            return False
        self.moves.setdefault(kid, deque()).append(now)
        self.planned[kid] = (plan, why)
        self.c._spawn(self.move(kid, plan, why, op, parent))
        return True

    def _resident(self, kid: str, now: float, cfg: RebalanceSettings) -> Resident | None:
        st = self.c.states.get(kid)
        rec = self.c.tracker.kernels.get(kid)
        if st is None or rec is None or st.held is not None or st.op is not None:
            return None
        if st.resident not in (ACTIVE, IDLE) or kid in self.planned:
            return None
        gpus = {g: n for g, n in rec.gpu_bytes.items() if n}
        if not gpus or min(gpus) < 0:
            return None
        idle = rec.idle_seconds(now)
        recent = self.moves.get(kid, deque())
        while recent and now - recent[0] >= HOUR:
            recent.popleft()
        movable = (not st.pinned and not rec.busy and idle >= cfg.idle
                   and len(recent) < cfg.per_hour and st.release_blocked is None
                   and not self.c.failed_recently(st, now)
                   and self.c.kernels.live_state(kid) != "busy"
                   and self._refusal(kid) is None)
        return Resident(kid, gpus, movable, idle)

    def _refusal(self, kid: str) -> str | None:
        name = self.c.method_for(kid)
        method = self.c.methods.get(name) if name else None
        return "no method" if method is None else method.move_refusal()

    # -- one move ----------------------------------------------------------------------------
    async def move(self, kid: str, plan: dict[int, int], why: str, op: Operation,
                   parent: dict | None = None) -> None:
        """After the release ``op`` (started by :meth:`_start`), restore onto ``plan``'s
        GPUs (home again if that cannot be); for a cell waiting at the gate (``parent``), as
        the gate's own restore, its progress in the cell."""
        c = self.c
        text = said(plan, why)
        try:
            outcome = await wait_for(op)
            if not outcome.ok:  # nothing moved (a cell started, the agent refused): it stays
                log.info("gpushare: kernel %s not moved: %s", kid, outcome.message)
                return
            for _ in range(2):  # onto the new GPUs; once more (home) if that restore failed
                try:
                    await c.ensure_resident(kid, trigger=REBALANCE if parent is None else "gate",
                                            parent=parent)
                    break
                except ControllerError as e:
                    log.warning("gpushare: kernel %s: the restore of its move failed: %s", kid,
                                e.message)
                    self.planned.pop(kid, None)
            grant = self.granted.pop(kid, None)
            st = c.states.get(kid)
            if grant is None or st is None or st.held is not None:
                return  # it came back home, or is held still (a cell's restore brings it back)
            self.last[kid] = (text, st.restores)
            c.announce(kid, "moved", method=st.method, reason=why,
                       from_gpus=sorted(plan), to_gpus=[plan[g] for g in sorted(plan)])
            log.info("gpushare: moved kernel %s %s", kid, text)
        finally:
            self.planned.pop(kid, None)
            self.granted.pop(kid, None)

    async def grant(self, st: Lifecycle, op: Operation, held: Held, need: dict[int, int],
                    shown: CellProgress) -> Grant | None:
        """The restore of a kernel being moved: its turns and room on the new GPUs, with the
        mapping (the restore room's :meth:`~.restore_room.RestoreRoom.onto`). None (the
        restore goes home, as any restore): no move planned, or the new GPUs lack the room
        now."""
        planned = self.planned.pop(st.kernel_id, None)
        if planned is None:
            return None
        plan, why = planned
        if set(need) - set(plan) or self._refusal(st.kernel_id) is not None:
            return None
        grant = await self.c.room.onto(st, op, held, need, {g: plan[g] for g in need}, why, shown)
        if grant is not None:
            self.granted[st.kernel_id] = grant
        return grant

    def contention(self, gpu: int) -> Contention:
        """The GPU's compute as judged at the last poll."""
        return self.seen.get(gpu) or Contention(0.0, (), False)

    def moved(self, kid: str) -> str | None:
        """The kernel's last move ("GPU 0 -> 3: GPU 0 busy") while it stays where it went
        (None once it was restored again, or never moved)."""
        last = self.last.get(kid)
        st = self.c.states.get(kid)
        if last is None or st is None or st.restores != last[1] or st.held is not None:
            return None
        return last[0]


__all__ = ["Contention", "Rebalancer", "contention", "room", "window_of"]
