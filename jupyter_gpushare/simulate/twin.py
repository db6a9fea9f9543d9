"""The twin: one workload run by the real product and by the simulator, compared cell by cell.

``benchmarks/twin.py`` plays a trace (docs/trace-format.md) through a real server on the
simulated node and records, from the cell replies and the server's own events, what each cell
and kernel went through (:class:`Run`). This module holds what both sides share: the settings
of a run at a time scale (:class:`TwinSettings`: the product's options scaled, and the
simulator's :class:`~.settings.Settings`), the simulator's side of the same workload
(:func:`simulate`), the transfer model fitted to the product's own releases and restores
(:func:`fit_transfer`), and the comparison (:func:`compare`, :func:`report`).

Every figure is in the trace's units (seconds and bytes of the trace), whatever the scale the
product ran at.

The product runs one server for every session of the trace (one Jupyter server, as on a
shared lab machine): the simulator runs the trace as one user's, so that the same server
makes room from every kernel and places each by the same history.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from ..core.ahead import ROOM_WAIT as AHEAD_ROOM_WAIT
from ..policy import PolicyConfig
from . import defaults
from .engine import CellRecord, Kernel, Simulation
from .figures import quantile
from .settings import POLICIES, Settings
from .transfer import PRESETS, TransferModel
from .workload import GiB, KernelWork, Workload

#: the tolerances the twin holds both sides to
COUNT_TOLERANCE = 0.10  # releases, restores, moves: +/- 10 % (and at least +/- 1)
DELAY_TOLERANCE = 0.20  # delay quantiles: +/- 20 % ...
DELAY_FLOOR = 0.2  # ... or 0.2 s, whichever is more
SAME_GPUS = 0.90  # of kernels, the share placed on the same GPUs by both


@dataclass(frozen=True)
class TwinSettings:
    """One run's settings, in the trace's units, and the scale the product runs at.

    ``scale``: the product runs ``scale`` times faster than the trace (every time option is
    divided by it, every cell's duration and gap too); ``byte_scale``: the product's
    simulated GPUs and every allocation are that fraction of the trace's bytes (a simulated
    GPU's memory is host memory); ``rate``: bytes per trace-second each simulated GPU copies
    at, in the trace's bytes (the device's copy speed is scaled with both)."""

    gpus: int = 2
    gpu_gib: float = 80.0
    scale: float = 20.0
    byte_scale: float = 1 / 256
    rate: float = 4e9  # trace bytes per trace second, per GPU (the ``sim`` preset's, about)
    poll_interval: float = 2.0
    config: PolicyConfig = field(default_factory=lambda: PolicyConfig(
        release_policy=defaults.RELEASE_POLICY))
    long_idle: float = defaults.LONG_IDLE
    move_after: float = defaults.MOVE_AFTER
    ahead_grace: float = defaults.AHEAD_GRACE
    load_window: float = defaults.LOAD_WINDOW
    rebalance: bool = defaults.REBALANCE
    rebalance_idle: float = defaults.REBALANCE_IDLE
    rebalance_before_cell: bool = defaults.REBALANCE_BEFORE_CELL
    precopy_after: float = 60.0
    context_bytes: int = defaults.MIN_ROOM
    seed: int = 0

    @property
    def release_policy(self) -> str:
        return self.config.release_policy

    def wall(self, seconds: float) -> float:
        """Trace seconds as the product's (wall) seconds."""
        return seconds / self.scale

    def device_bytes(self, nbytes: int) -> int:
        """Trace bytes as the product's simulated bytes."""
        return int(nbytes * self.byte_scale)

    def product_options(self) -> dict[str, Any]:
        """``c.GPUShareApp`` traits: the same settings, at the product's scale."""
        c = self.config
        w = self.wall
        gpu = self.device_bytes(int(self.gpu_gib * GiB))
        return {
            "backend": "simulated",
            "simulated_gpus": [gpu] * self.gpus,
            "placement": "room",
            "poll_interval": w(self.poll_interval),
            "history_seconds": max(w(1800.0), 2 * w(max(self.load_window, 600.0))),
            "release_policy": c.release_policy,
            "idle_timeout": w(c.idle_timeout),
            "idle_utilization": c.idle_utilization,
            "min_release_bytes": self.device_bytes(c.min_release_bytes),
            "pressure_free_fraction": c.pressure_free_fraction,
            "pressure_idle_timeout": w(c.pressure_idle_timeout),
            "long_idle": w(self.long_idle),
            "restore_move_after": w(self.move_after),
            "ahead_grace": w(self.ahead_grace),
            "load_window": w(self.load_window),
            "rebalance": self.rebalance,
            "rebalance_idle": w(self.rebalance_idle),
            "rebalance_before_cell": self.rebalance_before_cell,
            "precopy_after": w(self.precopy_after),
            "context_bytes": self.device_bytes(self.context_bytes),
            # a release copies into this process's memory: the machine's own reserve is
            # for real GPUs' states, not for the scaled ones
            "host_memory_reserve": 0,
        }

    def device_rate(self) -> float:
        """Bytes per wall second each simulated GPU copies at
        (``JUPYTER_GPUSHARE_SIM_TRANSFER_RATE``): the trace's rate at both scales."""
        return self.rate * self.byte_scale * self.scale

    def simulator(self, transfer: TransferModel) -> Settings:
        return Settings(
            gpus=self.gpus, gpu_gib=self.gpu_gib, transfer=transfer, config=self.config,
            poll_interval=self.poll_interval, restore_mode="eager", placement="room",
            servers="rule", seed=self.seed, release_policy=self.release_policy,
            long_idle=self.long_idle, move_after=self.move_after, ahead_grace=self.ahead_grace,
            rebalance=self.rebalance, rebalance_idle=self.rebalance_idle,
            rebalance_before_cell=self.rebalance_before_cell,
            load_window=self.load_window, release_copies="changed",
            precopy_after=self.precopy_after)


# -- what each side records ---------------------------------------------------------------------
@dataclass
class CellRun:
    """One cell as one side saw it (trace seconds from the trace's start)."""

    kernel: str  # its session's id
    index: int  # its place in the session
    arrival: float
    start: float | None = None  # None: it never started (still waiting at the end)
    end: float | None = None
    nominal: float = 0.0  # s it runs with the GPU to itself
    gpus: int = 0  # GPUs it computes on
    oom: bool = False  # it failed for lack of GPU memory
    ran_on: tuple[int, ...] = ()  # the kernel's GPUs when it ran
    began: float | None = None  # when its code began, where that is not ``start`` (the
    # product's: ``start`` leaves out Jupyter's own path from the browser to the kernel)

    @property
    def delay(self) -> float | None:
        return None if self.start is None else max(0.0, self.start - self.arrival)

    @property
    def slowdown(self) -> float | None:
        began = self.start if self.began is None else self.began
        if began is None or self.end is None or self.nominal <= 0 or not self.gpus:
            return None
        return (self.end - began) / self.nominal


@dataclass
class KernelRun:
    """One kernel as one side saw it."""

    kernel: str
    placed: tuple[int, ...] = ()  # the GPUs it started on
    releases: int = 0
    restores: dict[str, int] = field(default_factory=dict)  # trigger -> count
    moves: int = 0  # times it came back onto other GPUs than it left

    def restored(self, trigger: str) -> None:
        self.restores[trigger] = self.restores.get(trigger, 0) + 1


@dataclass
class Run:
    side: str  # "product" | "simulator"
    cells: list[CellRun] = field(default_factory=list)
    kernels: dict[str, KernelRun] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: (trace s, kernel, what happened): releases, restores, waits, moves, activity
    timeline: list[tuple[float, str, str]] = field(default_factory=list)

    def kernel(self, kid: str) -> KernelRun:
        return self.kernels.setdefault(kid, KernelRun(kid))

    def cell(self, kid: str, index: int) -> CellRun | None:
        for c in self.cells:
            if c.kernel == kid and c.index == index:
                return c
        return None

    def figures(self) -> dict[str, Any]:
        delays = [c.delay for c in self.cells if c.delay is not None]
        slow = [s for c in self.cells if (s := c.slowdown) is not None]
        ks = self.kernels.values()
        restores: dict[str, int] = {}
        for k in ks:
            for trigger, n in k.restores.items():
                restores[trigger] = restores.get(trigger, 0) + n
        return {
            "cells": len(self.cells),
            "started": len(delays),
            "releases": sum(k.releases for k in ks),
            "restores": sum(restores.values()),
            "restores_by_trigger": dict(sorted(restores.items())),
            "moves": sum(k.moves for k in ks),
            "oom_cells": sum(c.oom for c in self.cells),
            "delay_p50": quantile(delays, 0.50) if delays else 0.0,
            "delay_p95": quantile(delays, 0.95) if delays else 0.0,
            "delay_p99": quantile(delays, 0.99) if delays else 0.0,
            "delay_max": max(delays, default=0.0),
            "slowdown_p99": quantile(slow, 0.99) if slow else 1.0,
        }


# -- the simulator's side ---------------------------------------------------------------------------
def with_first_arrivals(w: Workload, arrivals: dict[str, float]) -> Workload:
    """``w`` with each kernel's first cell arriving when it did in the product, where that was
    later than the trace says: a real kernel takes seconds to start (Jupyter's, not
    gpushare's), and the simulator's starts at once. Later cells keep their gaps."""
    out = []
    for k in w.kernels:
        at = arrivals.get(k.kernel_id)
        s = k.sessions[0] if k.sessions else None
        if at is None or s is None or at <= s.start + s.cells[0].gap:
            out.append(k)
            continue
        first = replace(s.cells[0], gap=at - s.start)
        out.append(replace(k, sessions=(replace(s, cells=(first, *s.cells[1:])),
                                         *k.sessions[1:])))
    return Workload(w.duration, tuple(out), w.source, w.users)


def one_user(w: Workload, user: str = "twin") -> Workload:
    """``w`` as one user's: the product runs one server for every session."""
    return Workload(w.duration, tuple(replace(k, user=user) for k in w.kernels), w.source,
                    (user,))


class _Recorded(Simulation):
    """The simulator, unchanged, with what the twin needs to know of each cell: which cell of
    its session a record is, which cell failed for lack of memory, and the person's activity
    ``active_before`` each cell (``leads``: (kernel id, cell index) -> s)."""

    def __init__(self, *args: Any, leads: dict[tuple[str, int], float], **kw: Any):
        self.leads = leads
        self.index_of: dict[int, tuple[int, int]] = {}  # id(CellRecord) -> (kernel, cell)
        self.failed: list[tuple[int, int, float]] = []  # (kernel, cell, arrival)
        super().__init__(*args, **kw)

    def _cell_index(self, k: Kernel) -> int:
        return sum(len(s.cells) for s in k.work.sessions[:k.session]) + k.cell

    def _start_cell(self, k: Kernel) -> None:
        w = k.pending
        assert w is not None
        before, index = len(self.cells), self._cell_index(k)
        super()._start_cell(k)
        if len(self.cells) == before:  # it failed: out of memory
            self.failed.append((k.index, index, w.arrival))
        else:
            self.index_of[id(self.cells[-1])] = (k.index, index)

    def _plan_activity(self, k: Kernel, t: float, at: float) -> None:
        lead = self.leads.get((k.id, self._cell_index(k)))
        if lead is None:
            return
        when = max(at - lead, t)
        if when <= t and k.state == "resident":
            return  # the person never left: nothing to restore
        self.schedule(when, lambda: self._activity(k))


def simulate(workload: Workload, s: TwinSettings, transfer: TransferModel,
             leads: dict[tuple[str, int], float] | None = None) -> Run:
    """The simulator's run of ``workload`` (as one user's) under ``s``: what it records."""
    w = one_user(workload)
    settings = s.simulator(transfer)
    run = Run("simulator")
    by_index: dict[int, KernelWork] = dict(enumerate(w.kernels))

    def observe(now: float, k: Kernel, what: str, data: dict) -> None:
        kr = run.kernel(k.id)
        if what not in ("memory", "cell"):
            said = ", ".join(str(v) for key, v in data.items()
                             if key in ("reason", "trigger", "gpus_to"))
            run.timeline.append((now, k.id, f"{what}" + (f" ({said})" if said else "")))
        if what == "released":
            kr.releases += 1
        elif what == "restored":
            kr.restored(str(data.get("trigger", "cell")))
        elif what == "moved":
            kr.moves += 1
        elif what == "placed" and not kr.placed:
            kr.placed = tuple(data.get("gpus", ()))

    sim = _Recorded(w, POLICIES["gpushare"](settings), int(s.gpu_gib * GiB), s.gpus, transfer,
                    observer=observe, restore_mode="eager", placement="room", seed=s.seed,
                    load_window=s.load_window, release_copies="changed",
                    precopy_after=s.precopy_after, leads=leads or {})
    # the server's 5 s for a restore ahead to find room is wall time, not an option: at the
    # product's scale it is that many times longer in the trace's time
    sim.policy.ahead_room_wait = AHEAD_ROOM_WAIT * s.scale  # type: ignore[attr-defined]
    sim.run()
    for rec in sim.cells:
        ki, index = sim.index_of[id(rec)]
        run.cells.append(_cell_run(by_index[ki], index, rec, sim.kernels[ki]))
    for ki, index, arrival in sim.failed:
        cell = _cell_at(by_index[ki], index)
        run.cells.append(CellRun(by_index[ki].kernel_id, index, arrival, nominal=cell.duration,
                                 gpus=cell.n_gpus, oom=True))
    for k in w.kernels:
        run.kernel(k.kernel_id)
    run.cells.sort(key=lambda c: (c.kernel, c.index))
    run.notes.append(transfer.describe())
    return run


def _cell_at(k: KernelWork, index: int) -> Any:
    for s in k.sessions:
        if index < len(s.cells):
            return s.cells[index]
        index -= len(s.cells)
    raise IndexError(index)


def _cell_run(k: KernelWork, index: int, rec: CellRecord, kernel: Kernel) -> CellRun:
    return CellRun(k.kernel_id, index, rec.arrival, rec.start, rec.end, rec.duration, rec.gpus,
                   ran_on=(rec.ran_on,))


# -- the transfer model, fitted to the product's own moves ---------------------------------------------
def fit_transfer(releases: Iterable[tuple[int, float]], restores: Iterable[tuple[int, float]],
                 s: TwinSettings) -> TransferModel:
    """The product's releases and restores ((trace bytes per GPU its copy moved, trace
    seconds) each, from its events) as overhead + bytes / the device's rate: the copy's speed
    is the simulated device's (set, known), the overhead is the median of what each took
    beyond it (the agent's round trips, the server's steps: on a busy machine a few take far
    longer, and a slope fitted through them would say the copy is slow). A release copies
    only what changed since its host copy, as the simulated method does: its points are the
    bytes it copied (the event's detail), not the state it freed, and the model is
    incremental, so the simulator's releases copy what changed too."""
    def overhead(points: list[tuple[int, float]]) -> float:
        extra = sorted(t - b / s.rate for b, t in points)
        return max(0.0, extra[len(extra) // 2]) if extra else 0.0

    return TransferModel("fitted", overhead(list(releases)), s.rate, overhead(list(restores)),
                         s.rate, incremental=True)


def fit_with_make_room(releases: list[tuple[int, float]], restores: list[tuple[int, float]],
                       make_room: list[tuple[int, float]], s: TwinSettings) -> TransferModel:
    """:func:`fit_transfer`, the release line fitted to the releases made to make room as the
    waiting restore saw them (from its wait to its bytes' move: the server's steps around
    the release), where there were any: what a cell waits for."""
    model = fit_transfer(releases, restores, s)
    if not make_room:
        return model
    return replace(model, release_overhead=fit_transfer(make_room, [], s).release_overhead)


def device_transfer(s: TwinSettings) -> TransferModel:
    """The simulated device's copy alone, with no overhead (before any run to fit to)."""
    return replace(PRESETS["sim"], name="device", release_overhead=0.0, restore_overhead=0.0,
                   release_bandwidth=s.rate, restore_bandwidth=s.rate)


# -- the comparison --------------------------------------------------------------------------------------
@dataclass
class Line:
    what: str
    product: Any
    simulator: Any
    tolerance: str
    ok: bool
    explained: str = ""


@dataclass
class Comparison:
    lines: list[Line]
    differing_cells: list[tuple[CellRun | None, CellRun | None]]
    kernels: list[tuple[str, KernelRun, KernelRun]]
    same_gpus: float

    @property
    def ok(self) -> bool:
        return all(line.ok for line in self.lines)

    def failures(self) -> list[str]:
        return [f"{x.what}: product {_fmt(x.product)}, simulator {_fmt(x.simulator)} "
                f"(tolerance {x.tolerance})" for x in self.lines if not x.ok]


def _count_ok(a: float, b: float) -> bool:
    return abs(a - b) <= max(1.0, COUNT_TOLERANCE * max(a, b))


def _delay_ok(a: float, b: float) -> bool:
    return abs(a - b) <= max(DELAY_FLOOR, DELAY_TOLERANCE * max(a, b))


def _cell_differs(a: CellRun | None, b: CellRun | None) -> bool:
    if a is None or b is None:
        return True
    if a.oom != b.oom:
        return True
    da, db = a.delay, b.delay
    if (da is None) != (db is None):
        return True
    if da is not None and db is not None and not _delay_ok(da, db):
        return True
    return bool(a.ran_on and b.ran_on and a.ran_on[0] != b.ran_on[0])


def compare(product: Run, simulator: Run) -> Comparison:
    fp, fs = product.figures(), simulator.figures()
    lines = []
    for key in ("releases", "restores", "moves"):
        lines.append(Line(key, fp[key], fs[key], "+/-10 % or 1",
                          _count_ok(fp[key], fs[key])))
    triggers = sorted(set(fp["restores_by_trigger"]) | set(fs["restores_by_trigger"]))
    for t in triggers:
        a, b = fp["restores_by_trigger"].get(t, 0), fs["restores_by_trigger"].get(t, 0)
        lines.append(Line(f"restores ({t})", a, b, "+/-10 % or 1", _count_ok(a, b)))
    for key in ("delay_p50", "delay_p95", "delay_p99", "delay_max"):
        lines.append(Line(key + " s", fp[key], fs[key], "+/-20 % or 0.2 s",
                          _delay_ok(fp[key], fs[key])))
    oom_p = {(c.kernel, c.index) for c in product.cells if c.oom}
    oom_s = {(c.kernel, c.index) for c in simulator.cells if c.oom}
    lines.append(Line("OOM cells", len(oom_p), len(oom_s), "the same cells", oom_p == oom_s))
    kernels = []
    same = 0
    for kid in sorted(set(product.kernels) | set(simulator.kernels)):
        a, b = product.kernel(kid), simulator.kernel(kid)
        kernels.append((kid, a, b))
        same += a.placed == b.placed
    share = same / len(kernels) if kernels else 1.0
    lines.append(Line("kernels on the same GPUs", f"{same}/{len(kernels)}", f"{share:.0%}",
                      f">= {SAME_GPUS:.0%}", share >= SAME_GPUS))
    lines.append(Line("slowdown p99", fp["slowdown_p99"], fs["slowdown_p99"], "(shown)", True))
    keys = sorted({(c.kernel, c.index) for c in product.cells + simulator.cells})
    differing = [(product.cell(*key), simulator.cell(*key)) for key in keys]
    differing = [(a, b) for a, b in differing if _cell_differs(a, b)]
    differing.sort(key=lambda ab: min(c.arrival for c in ab if c is not None))
    return Comparison(lines, differing, kernels, share)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def _cell_text(c: CellRun | None) -> str:
    if c is None:
        return "-"
    if c.oom:
        return f"at {c.arrival:.1f}: OOM"
    if c.start is None:
        return f"at {c.arrival:.1f}: never started"
    gpus = ",".join(str(g) for g in c.ran_on)
    return f"at {c.arrival:.1f}: delay {c.delay:.2f} s" + (f" on GPU {gpus}" if gpus else "")


def report(product: Run, simulator: Run, comparison: Comparison, first: int = 10) -> str:
    """The comparison as text: the figures side by side, then the first cells that differ."""
    from .report import table

    rows = [[x.what, _fmt(x.product), _fmt(x.simulator), x.tolerance,
             "ok" if x.ok else "DIFFERS"] for x in comparison.lines]
    out = [table(["", "product", "simulator", "tolerance", ""], rows)]
    moved = [kid for kid, a, b in comparison.kernels if a.placed != b.placed]
    if moved:
        out.append("placed on other GPUs: " + "; ".join(
            f"{kid}: product {list(a.placed)}, simulator {list(b.placed)}"
            for kid, a, b in comparison.kernels if kid in moved))
    if comparison.differing_cells:
        out.append(f"first cells that differ ({len(comparison.differing_cells)} in all):")
        rows = [[f"{(a or b).kernel}#{(a or b).index}", _cell_text(a), _cell_text(b)]  # type: ignore[union-attr]
                for a, b in comparison.differing_cells[:first]]
        out.append(table(["cell", "product", "simulator"], rows))
        for a, b in comparison.differing_cells[:first]:
            c = a or b
            assert c is not None
            span = [x for x in (a, b) if x is not None]
            lo = min(x.arrival for x in span) - 1.0
            hi = max((x.start if x.start is not None else x.arrival) for x in span) + 1.0
            for side in (product, simulator):
                said = [f"{t:.1f} {what}" for t, kid, what in side.timeline
                        if kid == c.kernel and lo <= t <= hi]
                if said:
                    out.append(f"  {c.kernel}#{c.index} {side.side}: " + "; ".join(said))
    for n in product.notes + simulator.notes:
        out.append(n)
    return "\n".join(out)


def leads_of(trace: dict[str, Any]) -> dict[tuple[str, int], float]:
    """(session id, cell index) -> s its person was active before it (``active_before``)."""
    out = {}
    for s in trace.get("sessions", []):
        for i, c in enumerate(s.get("cells", [])):
            lead = c.get("active_before")
            if isinstance(lead, (int, float)) and not isinstance(lead, bool) and lead > 0 \
                    and math.isfinite(lead):
                out[(str(s["id"]), i)] = float(lead)
    return out
