"""What users do, as a simulation input: kernels, their sessions and cells.

A workload is closed-loop: a cell's ``gap`` is the think time after the previous cell of the
same session ended, so a cell that waits for its GPU state pushes the person's later cells
back, as it would in front of a notebook. Sessions start at fixed times of the trace (a
morning, after lunch) or when the kernel's previous session has finished, whichever is later.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

GiB = 1 << 30
HOUR = 3600.0
DAY = 24 * HOUR


@dataclass(frozen=True)
class Cell:
    """One cell. Which GPUs it uses is said, not guessed: ``gpus`` 0 is a CPU-only cell
    (pandas, plots), which in lazy restore mode runs without bringing the kernel's state back;
    ``None`` (hand-made and older workloads) means 1 if ``utilization`` > 0 else 0."""

    gap: float  # s of think time before it (after the previous cell of the session ended)
    duration: float  # s it runs when it has the GPU to itself
    utilization: float  # SM % while it runs on each of its GPUs
    gpus: int | None = None  # of its kernel's GPUs, how many it computes on; 0 = CPU-only
    nbytes: int | None = None  # bytes per GPU the kernel holds while it runs (None: unchanged)
    keeps: int | None = None  # bytes per GPU the kernel holds after it (None: all it held)

    @property
    def n_gpus(self) -> int:
        return (1 if self.utilization > 0 else 0) if self.gpus is None else self.gpus

    @property
    def uses_gpu(self) -> bool:
        return self.n_gpus > 0


@dataclass(frozen=True)
class Session:
    start: float  # s from the trace's start; the first cell's gap counts from here
    cells: tuple[Cell, ...]
    kind: str = "build"  # "build" | "train" | "replay": for the trace's statistics only


@dataclass(frozen=True)
class KernelWork:
    """One kernel's life: it allocates ``gpu_bytes`` on each of its ``gpus`` GPUs at its first
    cell; a cell that needs more (``Cell.nbytes``) grows it, and the framework's cache keeps
    what it grew to unless the cell frees (``Cell.keeps``)."""

    kernel_id: str
    user: str
    gpu_bytes: int  # per GPU, at its start
    sessions: tuple[Session, ...]
    shutdown_at: float | None = None  # s from the start; never before its last cell ends
    gpus: int = 1  # GPUs it runs on (all on one machine); released and restored together

    @property
    def first_start(self) -> float:
        return self.sessions[0].start if self.sessions else 0.0


@dataclass(frozen=True)
class Workload:
    """Everything the simulator needs about the people; the node is given separately."""

    duration: float  # s simulated
    kernels: tuple[KernelWork, ...]
    source: str  # where it came from, for the report
    users: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.users:
            ordered = dict.fromkeys(k.user for k in self.kernels)
            object.__setattr__(self, "users", tuple(ordered))

    def user_gpus(self) -> dict[str, int]:
        """GPUs each user needs at once: their widest kernel's (what ``exclusive`` gives them)."""
        width = dict.fromkeys(self.users, 1)
        for k in self.kernels:
            width[k.user] = max(width.get(k.user, 1), k.gpus)
        return width

    def reserved_gpu_seconds(self) -> float:
        """GPU-s of reserving each user's GPUs while any of their kernels is alive (from its
        first session's start to its shutdown, or the trace's end): what ``exclusive`` costs
        when GPUs are handed out per session, as a scheduler does."""
        width = self.user_gpus()
        spans: dict[str, list[tuple[float, float]]] = {}
        for k in self.kernels:
            if not k.sessions:
                continue
            end = self.duration if k.shutdown_at is None else min(k.shutdown_at, self.duration)
            spans.setdefault(k.user, []).append((k.first_start, max(end, k.first_start)))
        total = 0.0
        for user, intervals in spans.items():
            covered, reach = 0.0, float("-inf")
            for a, b in sorted(intervals):
                a = max(a, reach)
                if b > a:
                    covered += b - a
                reach = max(reach, b)
            total += covered * width[user]
        return total

    def first_users(self, n: int) -> Workload:
        """The same workload for its first ``n`` users only."""
        keep = set(self.users[:n])
        return Workload(self.duration, tuple(k for k in self.kernels if k.user in keep),
                        self.source, self.users[:n])


def with_users(w: Workload, n: int, seed: int = 0, shift: float = 1800.0) -> Workload:
    """``w`` for ``n`` users: its first ``n``, or, past the ones it has, copies of them.

    Copy ``c`` of user ``u`` is named ``u~c`` and starts a seeded random 0-``shift`` s later
    (its tail past the trace's end is cut), so copies do not act in lockstep.
    """
    if n <= len(w.users):
        return w.first_users(n)
    kernels = list(w.kernels)
    names = list(w.users)
    by_user: dict[str, list[KernelWork]] = {}
    for k in w.kernels:
        by_user.setdefault(k.user, []).append(k)
    for i in range(len(w.users), n):
        user = w.users[i % len(w.users)]
        copy = f"{user}~{i // len(w.users)}"
        delay = random.Random(f"{seed}:copy:{copy}").uniform(0, shift)
        names.append(copy)
        for k in by_user.get(user, []):
            sessions = tuple(replace(s, start=s.start + delay) for s in k.sessions)
            end = None if k.shutdown_at is None else k.shutdown_at + delay
            kernels.append(replace(k, kernel_id=f"{k.kernel_id}~{i // len(w.users)}", user=copy,
                                   sessions=sessions, shutdown_at=end))
    return Workload(w.duration, tuple(kernels), w.source, tuple(names))
