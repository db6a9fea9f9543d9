"""Where a kernel's GPU state goes: one rule for placing a new kernel, choosing a restore's
GPUs and moving idle kernels off contended GPUs, called unchanged by the server's placer,
the restore room, the rebalancer, the hub service's node ranking and the simulator.

A GPU's memory decides whether a kernel fits there; its SM load decides where it goes:

1. a GPU qualifies when its room (free memory less what is promised to others) covers the
   kernel's expected need (:class:`Need`);
2. qualifying GPUs rank by load: SM busy over a window (a mean, not one reading) plus the
   expected load of kernels placed there that have not used the GPU yet (``pending``), in
   steps of :data:`LOAD_STEP` % so that noise does not decide;
3. then by kernels there, then by room, then by index (a stable answer).

GPUs that do not qualify come after every one that does, most room first in steps of
:data:`ROOM_STEP` of the need, then by load (a kernel that fits nowhere starts where about
the most is, the least loaded of those); GPUs whose room is unknown come last; GPUs where the
person is over their share rank after those where they are within it. Exact bytes never
outrank load.

Pure functions: no I/O, no clock of their own; callers build :class:`GpuView` from what they
measure (the tracker's history, the simulated node, the hub service's view).
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import cast

#: % SM: loads closer than this count as equal, and the next keys decide
LOAD_STEP = 10.0
#: of a kernel's need: where it fits nowhere, rooms closer than this count as equal and load
#: decides (a GPU whose SMs are saturated does not win it on a few more bytes that fit no
#: better: the kernel would share SMs with a training from its first cell)
ROOM_STEP = 1 / 8
#: % SM a kernel placed on a GPU but not yet computing there is expected to add
PENDING_LOAD = 50.0
#: % SM (windowed mean) at or above which a GPU shared by two or more computing kernels is
#: contended: their cells slow each other down
CONTENDED_LOAD = 90.0
#: % SM (load + pending) at or below which a GPU is quiet enough to take a kernel moved off a
#: contended one
QUIET_LOAD = 25.0
#: % SM of a kernel's last GPU work at or above which its next cell is expected to be heavy:
#: beside another kernel's cell that keeps the GPU busy, both would slow down
HEAVY_CELL = 50.0
#: % SM: a cell joining a GPU whose busy reading and its own expected SM add up to more than
#: this would run (and slow the cell already there) more than 10 % slower
SHARED_LIMIT = 110.0


@dataclass(frozen=True)
class Need:
    """What a kernel is expected to need on each of its GPUs."""

    bytes: int  # memory per GPU
    load: float = PENDING_LOAD  # % SM it is expected to add while it has not computed yet


@dataclass(frozen=True)
class GpuView:
    """One GPU as the rule sees it."""

    gpu: Hashable  # the caller's name for it (an index on a node, a UUID across nodes)
    room: int | None  # bytes a new state may take there (None: unknown)
    load: float = 0.0  # % SM busy over the window (0-100)
    pending: float = 0.0  # % SM expected from kernels placed there that have not computed yet
    kernels: int = 0  # kernels placed or resident there
    busy: int = 0  # kernels that computed there within the window
    within_share: bool = True  # the person is within their share there
    # room not counting the released states that will come back there (None: as ``room``)
    room_now: int | None = None

    @property
    def expected(self) -> float:
        """% SM expected there soon: measured load plus what placed kernels will add."""
        return self.load + self.pending


def fits(view: GpuView, need: Need | int) -> bool:
    n = need.bytes if isinstance(need, Need) else need
    return view.room is not None and view.room >= n


def fits_now(view: GpuView, need: Need | int) -> bool:
    """Whether ``need`` fits ``view`` beside what is there now, released states that will
    come back left out (they restore by their own room rules when they do)."""
    n = need.bytes if isinstance(need, Need) else need
    room = view.room if view.room_now is None else view.room_now
    return room is not None and room >= n


def key(view: GpuView, need: Need | int) -> tuple:
    """The sort key of ``view`` for a kernel of ``need``: smaller is better."""
    room = view.room or 0
    if fits(view, need):
        tier = 0
    elif fits_now(view, need):  # it allocates now; the states coming back may come in hours
        tier = 1
    else:  # nowhere it fits: the most room first (in steps of the need), then load
        return (view.room is None, 2, not view.within_share, -_room_step(room, need),
                _step(view.expected), -room, view.kernels, _order(view.gpu))
    return (False, tier, not view.within_share, _step(view.expected), view.kernels, -room,
            _order(view.gpu))


def rank(views: Iterable[GpuView], need: Need | int) -> list[GpuView]:
    """``views`` best first for a kernel of ``need``."""
    return sorted(views, key=lambda v: key(v, need))


def choose(views: Iterable[GpuView], need: Need, count: int = 1) -> list[GpuView]:
    """The ``count`` GPUs a new kernel of ``need`` starts on, best first (its device 0 first)."""
    return rank(views, need)[:max(0, count)]


def add(view: GpuView, need: Need) -> GpuView:
    """``view`` once a kernel of ``need`` is placed there (not yet computing)."""
    room = None if view.room is None else view.room - need.bytes
    return replace(view, room=room, pending=view.pending + need.load, kernels=view.kernels + 1)


def contended(view: GpuView, threshold: float = CONTENDED_LOAD) -> bool:
    """Two or more kernels computed on ``view`` within the window and its SMs were busy."""
    return view.busy >= 2 and view.load >= threshold


def restore_target(
    want: Mapping[int, int], views: Mapping[int, GpuView], *, may_move: bool = True,
    lacking: Iterable[int] = (), threshold: float = CONTENDED_LOAD,
    keep: Mapping[int, int] | None = None,
) -> dict[int, int] | None:
    """Where a restore of ``want`` (bytes per home GPU) should go: {home GPU: other GPU} for
    the GPUs that move ({} = all stay home); None when a GPU of ``want`` that cannot stay
    has nowhere to go (the state comes back whole or not at all).

    A GPU stays home when it has room (not in ``lacking``, and ``views`` says it fits) and
    its SMs are not contended; otherwise it goes to the best-ranked GPU that is none of
    ``want``'s, fits its bytes and is expected to be less loaded than home (a busy home with
    nowhere quieter keeps the kernel). ``keep``: bytes per GPU a move should leave free
    there (the pressure threshold: a restore that pushes a GPU below it has that GPU's idle
    kernels released, whose people then wait for their restores): a busy home moves only
    onto a GPU that keeps them; a home without room prefers one that does, and takes one that
    does not only where none does; a home with room for the state but not for it and
    ``keep`` (tight) moves onto a GPU that keeps them and is neither contended nor expected
    to be busier than home, else stays. ``may_move`` False (a method whose states cannot
    change GPU): {} when every GPU can stay, else None. Largest state picks first."""
    short = set(lacking)
    floor = keep or {}
    moves: dict[int, int] = {}
    taken = set(want)
    placed: dict[int, GpuView] = dict(views)
    for g in sorted(want, key=lambda g: (-want[g], g)):
        home = placed.get(g)
        has_room = g not in short and (home is None or home.room is None or fits(home, want[g]))
        busy = home is not None and contended(home, threshold)
        tight = (has_room and not busy and home is not None and home.room is not None
                 and not fits(home, want[g] + floor.get(g, 0)))
        if has_room and not busy and not tight:
            continue
        if not may_move:
            if has_room:
                continue
            return None
        others = [v for t, v in placed.items() if t not in taken and fits(v, want[g])]
        if busy and has_room and home is not None:
            others = [v for v in others if _step(v.expected) < _step(home.expected)]
        if tight and home is not None:
            others = [v for v in others if _step(v.expected) <= _step(home.expected)
                      and not contended(v, threshold)]
        roomy = [v for v in others if fits(v, want[g] + floor.get(cast(int, v.gpu), 0))]
        best = rank(roomy if roomy or has_room else others, want[g])
        if not best:
            if has_room:
                continue
            return None
        target = best[0].gpu
        assert isinstance(target, int)
        moves[g] = target
        taken.add(target)
        placed[target] = add(best[0], Need(want[g], 0.0))
    return moves


@dataclass(frozen=True)
class Resident:
    """A resident kernel the rebalancer may move: its bytes per GPU, and whether it may move
    now (its person is away: not executing, idle past the threshold; the method can move it;
    its moves this hour are within the bound)."""

    kernel: str
    gpus: Mapping[int, int]
    movable: bool
    idle_seconds: float = 0.0


def rebalance(
    residents: Sequence[Resident], views: Mapping[int, GpuView], *,
    threshold: float = CONTENDED_LOAD, quiet: float = QUIET_LOAD, most: int = 1,
    keep: Mapping[int, int] | None = None,
) -> list[tuple[str, dict[int, int]]]:
    """Moves that take idle kernels off contended GPUs: [(kernel, {from GPU: to GPU})], at
    most ``most`` per contended GPU, each kernel's GPUs all or none. A kernel moves only when
    it is ``movable`` and every GPU it leaves for is quiet (load + pending at most ``quiet``
    %) and fits its bytes with ``keep`` (bytes per GPU, the pressure threshold) still free
    there: a move that pushed a GPU below it would have that GPU's idle kernels released; the
    one idle longest goes first. Targets are counted as taken once planned, so two kernels
    do not crowd onto one quiet GPU.

    It runs at every poll over every GPU and resident kernel of the node, so it does the
    work once: the residents are sorted and grouped by GPU once, and the quiet GPUs are kept
    best first (a GPU's key does not depend on the bytes of a kernel that fits there), so a
    move reads the first quiet GPU that fits instead of ranking them all."""
    placed: dict[int, GpuView] = dict(views)
    hot = sorted((g for g, v in placed.items() if contended(v, threshold)),
                 key=lambda g: (-placed[g].load, g))
    targets = _Quiet(placed, quiet, keep or {})
    if not hot or not targets.order:
        return []
    on: dict[int, list[Resident]] = {}
    for r in sorted(residents, key=lambda r: (-r.idle_seconds, r.kernel)):
        if r.movable:
            for g in r.gpus:
                on.setdefault(g, []).append(r)
    out: list[tuple[str, dict[int, int]]] = []
    moved: set[str] = set()
    for g in hot:
        n = 0
        for r in on.get(g, ()):
            if n >= most:
                break
            if r.kernel in moved:
                continue
            plan = targets.plan(r)
            if plan is None:
                continue
            for src, dst in plan.items():
                targets.take(dst, Need(r.gpus[src], 0.0))
            out.append((r.kernel, plan))
            moved.add(r.kernel)
            n += 1
    return out


def before_cell(
    kernel: Resident, expected: float, now: Mapping[int, float], views: Mapping[int, GpuView],
    *, keep: Mapping[int, int] | None = None, heavy: float = HEAVY_CELL,
    limit: float = SHARED_LIMIT, quiet: float = QUIET_LOAD,
) -> dict[int, int] | None:
    """Where a resident kernel whose person just ran a cell should move before the cell runs:
    {its GPU: a quiet GPU} for each of its GPUs, or None (it stays).

    It moves when it may (``movable``), its last GPU work ran at ``expected`` % SM, at least
    ``heavy`` (a training, not a print), and on one of its GPUs the busy reading ``now`` (%
    SM, the last sample, up to 100) and ``expected`` add up to more than ``limit``: another
    kernel's cell keeps that GPU busy, and the two would slow each other for as long as both
    run. Every GPU it goes to must be quiet now (reading at most ``quiet``) and over the
    window as :func:`rebalance` judges targets (not contended, load + pending at most
    ``quiet``) and fit its bytes with ``keep`` free: the cell waits for the move (seconds)
    instead of sharing SMs (minutes to hours). All of its GPUs move or none."""
    if not kernel.movable or expected < heavy:
        return None
    if not any(min(100.0, now.get(g, 0.0)) + expected > limit for g in kernel.gpus):
        return None
    calm = {g: v for g, v in views.items() if now.get(g, 0.0) <= quiet}
    return _Quiet(calm, quiet, keep or {}).plan(kernel)


class _Quiet:
    """The GPUs a moved kernel may go to (quiet, not contended), best first by the rule's
    key for a kernel that fits, kept up as moves are planned onto them."""

    def __init__(self, placed: dict[int, GpuView], quiet: float, keep: Mapping[int, int]):
        self.placed = placed
        self.quiet = quiet
        self.keep = keep
        self.order = sorted((_fitting_key(v), t) for t, v in placed.items() if self._ok(v))

    def _ok(self, v: GpuView) -> bool:
        return v.room is not None and v.expected <= self.quiet and not contended(v)

    def plan(self, r: Resident) -> dict[int, int] | None:
        """{GPU of ``r``: the best quiet GPU that fits it}, all of ``r``'s GPUs or None."""
        plan: dict[int, int] = {}
        taken = set(r.gpus)
        for g in sorted(r.gpus, key=lambda g: (-r.gpus[g], g)):
            n = max(0, r.gpus[g])
            for _, t in self.order:
                if t not in taken and fits(self.placed[t], n + max(0, self.keep.get(t, 0))):
                    plan[g] = t
                    taken.add(t)
                    break
            else:
                return None
        return plan

    def take(self, t: int, need: Need) -> None:
        """A move is planned onto ``t``: it counts there (and may no longer be quiet)."""
        old = self.placed[t]
        self.order.remove((_fitting_key(old), t))
        self.placed[t] = new = add(old, need)
        if self._ok(new):
            bisect.insort(self.order, (_fitting_key(new), t))


def _fitting_key(view: GpuView) -> tuple:
    """:func:`key` of ``view`` for any kernel that fits there (the same for every size)."""
    return (False, False, not view.within_share, _step(view.expected), view.kernels,
            -(view.room or 0), _order(view.gpu))


def pressure_floor(total: Mapping[int, int], fraction: float) -> dict[int, int]:
    """Bytes per GPU below which free memory is under pressure (``pressure_free_fraction``
    of each GPU's ``total``): what a move should leave free there (0: no floor)."""
    return {g: int(max(0.0, fraction) * t) for g, t in total.items()}


def window_mean(samples: Iterable[tuple[float, float | None]], since: float, until: float) -> float:
    """The time-weighted mean of ``samples`` ((t, value or None), oldest first, each value
    holding until the next sample) over [since, until]; unknown values count as 0, and a
    window with no sample in it is 0."""
    total = 0.0
    prev_t: float | None = None
    prev_v = 0.0
    for t, v in samples:
        if prev_t is not None:
            lo, hi = max(prev_t, since), min(t, until)
            if hi > lo:
                total += prev_v * (hi - lo)
        prev_t, prev_v = t, float(v or 0.0)
    if prev_t is not None:
        lo = max(prev_t, since)
        if until > lo:
            total += prev_v * (until - lo)
    span = until - since
    return total / span if span > 0 else prev_v


def expected_need(asked: int | None, cap: int | None, recent: Sequence[int], floor: int,
                  load: float = PENDING_LOAD) -> Need:
    """What a new kernel is expected to need per GPU: its cap where it has one (it can hold no
    more), else what its kernelspec says (``asked``), else the largest its person's recent
    kernels held (``recent``, bytes per GPU), else ``floor``; never less than ``floor``."""
    if cap is not None and cap > 0:
        n = cap
    elif asked is not None and asked > 0:
        n = asked
    elif recent:
        n = max(recent)
    else:
        n = floor
    return Need(max(int(n), int(floor)), load)


def rank_groups(groups: Mapping[str, Sequence[GpuView]], need: Need, count: int = 1) -> list[str]:
    """Groups of GPUs (the nodes of a cluster), best first for a new kernel of ``need`` on
    ``count`` GPUs: groups whose ``count`` best GPUs all have room for it first; for a kernel
    of several GPUs, among those, groups where none of them is contended, and of those the
    group of fewest GPUs first (best fit: a larger group is left to kernels wider than this
    one, which fit nowhere else; a kernel of one GPU fits every group, and this would only
    crowd the smallest); then by those GPUs' keys (a group
    with fewer GPUs than ``count`` ranks last), then by name. The keys leave out each GPU's
    own name: an index or UUID says nothing across groups, and would let a group's first GPU
    outrank another's as good one before their second GPUs were compared."""
    def group_key(name: str) -> tuple:
        best = rank(groups[name], need)[:count]
        if len(best) < count or not best:
            return (True, True, True, 0, (), name)
        fit = all(fits(v, need) for v in best)
        quiet = fit and not any(contended(v) for v in best)
        size = len(groups[name]) if count > 1 and quiet else 0
        return (False, not fit, not quiet and count > 1, size,
                tuple(sorted(key(v, need)[:-1] for v in best)), name)
    return sorted(groups, key=group_key)


def _step(load: float) -> int:
    return int(max(0.0, load) // LOAD_STEP)


def _room_step(room: int, need: Need | int) -> int:
    n = need.bytes if isinstance(need, Need) else need
    return int(max(0, room) // max(1.0, n * ROOM_STEP))


def _order(gpu: Hashable) -> tuple:
    return (0, gpu, "") if isinstance(gpu, int) else (1, 0, str(gpu))
