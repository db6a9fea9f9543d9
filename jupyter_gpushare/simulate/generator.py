"""A seeded synthetic workload of notebook users, calibrated to published figures.

What the published traces say, and how this generator is tuned to them (the statistics of
a generated workload are printed next to these by ``calibration.trace_statistics``):

- **Alibaba PAI 2020** (Weng et al., "MLaaS in the Wild", NSDI'22): about half of the GPU
  memory-time is held by jobs that barely compute. Here: the share of kernel memory-time
  held by kernels busy on the GPU less than 5 % of their life; ``trainer_share`` and the
  kernel sizes are set so that it comes out near one half.
- **Microsoft Philly** (Jeon et al., "Analysis of Large-Scale Multi-Tenant GPU Clusters for
  DNN Training Workloads", ATC'19): jobs sit fully idle 25-51 % of the time. Here: the idle
  share of "train" sessions (long busy stretches with idle gaps), set by the train cell and
  gap lengths.
- **NotebookOS / Adobe** (Carver et al., ASPLOS'26, production notebook workload): notebook
  sessions leave their reserved GPUs unused during most of their lifetime. Here: "build"
  sessions (GPU cells of about a minute between long think times) and kernels that live overnight.

- **Production interactive-GPU notebook traces**: about a third of cells use no GPU at all;
  kernels grow as their cells allocate; the median SM use is under 10 %; cells last minutes,
  not seconds. Here: CPU-only cells are marked (``Cell.gpus`` 0) at about that share; a
  kernel starts at ``start_fraction`` of its size and grows to it over its first
  ``grow_cells`` GPU cells (the framework's cache keeps what it grew to); each GPU cell
  draws its SM % from a lognormal (build cells median 3 %, light training runs median 5 %,
  a tail of heavy cells), and only ``heavy_train_share`` of train sessions run at 60-98 %,
  so that the median SM % of GPU cells' run time (``gpu_cell_sm_median_pct``) is about 5;
  build GPU cells last about a minute, between think times of about 4 minutes (so that
  build kernels still compute less than 5 % of their life, the Alibaba figure).

Everything else is an assumption, stated here and in the parameters of :class:`Profile`:
office hours (arrival about 9:00, a working day of about 8.5 h, lunch, two or so breaks),
weekdays only, a mix of "builders" and "trainers", 1-40 GiB per kernel, kernels left running
overnight unless their person shuts them down. The same seed gives the same workload, and
user ``i`` is the same person whatever the number of users, so adding users only adds load.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from .workload import DAY, HOUR, Cell, GiB, KernelWork, Session, Workload

MINUTE = 60.0


@dataclass(frozen=True)
class Profile:
    """Every knob of the synthetic users (times in seconds, sizes in GiB)."""

    trainer_share: float = 0.6  # users who also train models in their notebooks
    train_block_share: float = 0.6  # of a trainer's work blocks, those spent training
    arrive_mean: float = 9 * HOUR
    arrive_sd: float = 45 * MINUTE
    day_mean: float = 8.5 * HOUR
    day_sd: float = 45 * MINUTE
    lunch_at: float = 12.25 * HOUR
    lunch_minutes: tuple[float, float] = (30, 75)
    breaks_per_day: float = 2.0  # meetings, coffee: Poisson mean
    break_minutes: tuple[float, float] = (15, 60)
    # build sessions: cells of about a minute between think times of a few minutes
    think_median: float = 4 * MINUTE
    think_sigma: float = 1.0
    cpu_cell_share: float = 0.34  # build cells that do not touch the GPU (pandas, plots)
    gpu_cell_median: float = 1 * MINUTE  # cells last minutes, not seconds
    gpu_cell_sigma: float = 1.0
    cpu_cell_median: float = 10.0
    cpu_cell_sigma: float = 1.0
    build_sm_median: float = 3.0  # SM % of a build GPU cell: lognormal, most a few %, a tail
    build_sm_sigma: float = 1.0
    sm_range: tuple[float, float] = (0.5, 100.0)
    # train sessions: long busy cells with idle gaps and a few short cells between them
    train_cell_median: float = 20 * MINUTE
    train_cell_sigma: float = 0.8
    train_cell_range: tuple[float, float] = (3 * MINUTE, 3 * HOUR)
    train_gap_median: float = 4 * MINUTE
    train_gap_sigma: float = 0.8
    train_sm_median: float = 5.0  # SM % of a light session's runs (small models, input-bound)
    train_sm_sigma: float = 0.8
    heavy_train_share: float = 0.3  # train sessions whose runs fill the GPU
    train_utilization: tuple[float, float] = (60, 98)  # SM % of a heavy session's runs
    overnight_share: float = 0.25  # trainers who start a long run before they leave
    overnight_hours: tuple[float, float] = (1, 6)
    # kernels
    build_gib_median: float = 6.0
    build_gib_sigma: float = 0.9
    train_gib_median: float = 16.0
    train_gib_sigma: float = 0.6
    gib_range: tuple[float, float] = (1.0, 40.0)
    new_notebook_per_day: float = 0.3  # a fresh kernel for the day's work
    shutdown_at_night: float = 0.3  # kernels their person shuts down on leaving
    kernels_alive_max: int = 3
    start_fraction: float = 0.5  # of its size a kernel holds at its start
    grow_cells: int = 3  # GPU cells over which it grows to its size
    user_gib_max: float = 72.0  # a person's kernels fit one 80 GiB GPU (exclusive never OOMs)


class _Person:
    """One synthetic user: their kernels, day after day."""

    def __init__(self, index: int, seed: int, profile: Profile):
        self.p = profile
        self.rng = random.Random(f"{seed}:user:{index}")
        self.name = f"user{index:03d}"
        self.index = index
        self.trainer = self.rng.random() < profile.trainer_share
        self.kernels: list[dict] = []  # all kernels ever: id, kind, gib, sessions, shutdown_at
        self.alive: dict[str, dict] = {}  # kind -> the kernel used for that kind now

    # -- distributions -----------------------------------------------------------------------
    def lognormal(self, median: float, sigma: float) -> float:
        return median * math.exp(self.rng.gauss(0.0, sigma))

    def uniform(self, lo_hi: tuple[float, float]) -> float:
        return self.rng.uniform(*lo_hi)

    def sm(self, median: float, sigma: float) -> float:
        """SM % of a GPU cell while it runs: lognormal, clipped to ``sm_range``."""
        lo, hi = self.p.sm_range
        return min(max(self.lognormal(median, sigma), lo), hi)

    def run_sm(self, heavy: bool) -> float:
        """SM % of a training run: a heavy session's fill the GPU, a light one's do not."""
        p = self.p
        return self.uniform(p.train_utilization) if heavy else self.sm(p.train_sm_median,
                                                                        p.train_sm_sigma)

    # -- kernels -----------------------------------------------------------------------------
    def kernel_for(self, kind: str, at: float, fresh_today: set[str]) -> dict:
        k = self.alive.get(kind)
        if k is not None and k["shutdown_at"] is None and kind not in fresh_today:
            return k
        p = self.p
        median, sigma = ((p.train_gib_median, p.train_gib_sigma) if kind == "train"
                         else (p.build_gib_median, p.build_gib_sigma))
        gib = min(max(self.lognormal(median, sigma), p.gib_range[0]), p.gib_range[1])
        live = [o for o in self.kernels if o["shutdown_at"] is None]
        # too many notebooks open, or they would not fit one GPU: the oldest are shut down now
        while live and (len(live) >= p.kernels_alive_max
                        or sum(o["gib"] for o in live) + gib > p.user_gib_max):
            live.pop(0)["shutdown_at"] = at - 1.0  # just before the new one starts
        k = {"id": f"{self.name}-k{len(self.kernels) + 1}", "kind": kind, "gib": gib,
             "sessions": [], "shutdown_at": None}
        self.kernels.append(k)
        self.alive[kind] = k
        fresh_today.discard(kind)
        return k

    # -- a day -------------------------------------------------------------------------------
    def day(self, start: float) -> None:
        p, rng = self.p, self.rng
        arrive = start + min(max(rng.gauss(p.arrive_mean, p.arrive_sd), 7 * HOUR), 11 * HOUR)
        leave = arrive + max(rng.gauss(p.day_mean, p.day_sd), 4 * HOUR)
        lunch = start + p.lunch_at + rng.gauss(0, 20 * MINUTE)
        pauses = [(lunch, lunch + self.uniform(p.lunch_minutes) * MINUTE)]
        for _ in range(self._poisson(p.breaks_per_day)):
            at = rng.uniform(arrive, leave)
            pauses.append((at, at + self.uniform(p.break_minutes) * MINUTE))
        fresh_today = {kind for kind in ("build", "train") if rng.random() < p.new_notebook_per_day}
        blocks = self._blocks(arrive, leave, pauses)
        for i, (b0, b1) in enumerate(blocks):
            kind = "train" if self.trainer and rng.random() < p.train_block_share else "build"
            kernel = self.kernel_for(kind, b0, fresh_today)
            last = i == len(blocks) - 1
            overnight = last and kind == "train" and rng.random() < p.overnight_share
            if kind == "train":
                heavy = rng.random() < p.heavy_train_share
                cells = self.train_cells(b1 - b0, overnight, heavy)
            else:
                cells = self.build_cells(b1 - b0)
            if cells:
                kernel["sessions"].append(Session(b0, tuple(cells), kind))
        for k in self.alive.values():
            if k["shutdown_at"] is None and rng.random() < p.shutdown_at_night:
                k["shutdown_at"] = leave

    def _poisson(self, mean: float) -> int:
        n, t = 0, self.rng.expovariate(1.0)
        while t < mean:
            n, t = n + 1, t + self.rng.expovariate(1.0)
        return n

    @staticmethod
    def _blocks(arrive: float, leave: float, pauses: list[tuple[float, float]]) -> list[tuple[float, float]]:
        """The stretches of work between arriving, the pauses, and leaving (at least 5 min)."""
        blocks, t = [], arrive
        for p0, p1 in sorted(pauses):
            if p0 > t:
                blocks.append((t, min(p0, leave)))
            t = max(t, p1)
        if t < leave:
            blocks.append((t, leave))
        return [(a, b) for a, b in blocks if b - a >= 5 * MINUTE]

    def build_cells(self, length: float) -> list[Cell]:
        p, rng = self.p, self.rng
        cells: list[Cell] = []
        t, gap = 0.0, 0.0
        while True:
            if rng.random() < p.cpu_cell_share:
                cell = Cell(gap, self.lognormal(p.cpu_cell_median, p.cpu_cell_sigma), 0.0, gpus=0)
            else:
                cell = Cell(gap, self.lognormal(p.gpu_cell_median, p.gpu_cell_sigma),
                            self.sm(p.build_sm_median, p.build_sm_sigma), gpus=1)
            t += cell.gap + cell.duration
            if t > length:
                return cells
            cells.append(cell)
            gap = self.lognormal(p.think_median, p.think_sigma)

    def train_cells(self, length: float, overnight: bool, heavy: bool = True) -> list[Cell]:
        p = self.p
        cells: list[Cell] = []
        t, gap = 0.0, 0.0
        while True:
            duration = min(max(self.lognormal(p.train_cell_median, p.train_cell_sigma),
                               p.train_cell_range[0]), p.train_cell_range[1])
            if t + gap + duration > length:
                break
            cells.append(Cell(gap, duration, self.run_sm(heavy), gpus=1))
            t += gap + duration
            # between two runs: read the results, then a few short cells to change things
            gap = self.lognormal(p.train_gap_median, p.train_gap_sigma)
            for short in self.build_cells(4 * p.think_median * math.exp(p.think_sigma ** 2 / 2)):
                cells.append(replace(short, gap=gap + short.gap))
                t += gap + short.gap + short.duration
                gap = 0.0
            gap += self.lognormal(p.think_median, p.think_sigma)
        if overnight:  # a long run started before leaving
            cells.append(Cell(min(gap, 5 * MINUTE), self.uniform(p.overnight_hours) * HOUR,
                              self.run_sm(heavy), gpus=1))
        return cells

    def works(self) -> list[KernelWork]:
        return [self._grown(k) for k in self.kernels if k["sessions"]]

    def _grown(self, k: dict) -> KernelWork:
        """The kernel starts at ``start_fraction`` of its size; its first GPU cells allocate
        the rest in equal steps (``Cell.nbytes``), and it keeps it (its cache holds it)."""
        p = self.p
        size = int(k["gib"] * GiB)
        start = int(size * p.start_fraction)
        steps = max(1, p.grow_cells)
        n = 0
        sessions = []
        for s in k["sessions"]:
            cells = []
            for c in s.cells:
                if c.uses_gpu and n < steps:
                    n += 1
                    c = replace(c, nbytes=start + (size - start) * n // steps)
                cells.append(c)
            sessions.append(replace(s, cells=tuple(cells)))
        return KernelWork(k["id"], self.name, start, tuple(sessions), k["shutdown_at"])


def generate(users: int, days: int = 5, seed: int = 0, profile: Profile | None = None,
             gpu_gib: float = 80.0) -> Workload:
    """``users`` synthetic people over ``days`` days from a Monday 00:00, weekdays only.

    ``gpu_gib`` bounds what one person's kernels hold together (90 % of a GPU), so that under
    ``exclusive`` nobody runs out of memory on their own GPU."""
    profile = profile or Profile()
    profile = replace(profile, user_gib_max=min(profile.user_gib_max, 0.9 * gpu_gib),
                      gib_range=(profile.gib_range[0], min(profile.gib_range[1], 0.9 * gpu_gib)))
    kernels: list[KernelWork] = []
    names = []
    for u in range(users):
        person = _Person(u, seed, profile)
        for d in range(days):
            if d % 7 < 5:
                person.day(d * DAY)
        kernels += person.works()
        names.append(person.name)
    return Workload(days * DAY, tuple(kernels),
                    f"synthetic: {users} users, {days} days, seed {seed}", tuple(names))
