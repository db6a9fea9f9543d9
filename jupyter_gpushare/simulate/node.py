"""The GPUs: memory that must never be over-committed, and SMs shared by running cells.

Memory: ``allocate`` refuses (raises) rather than go over a GPU's capacity; policies check
``free`` first, so a refusal is a simulator bug, and the invariant tests look for it.

SMs: cells running on one GPU share it the way time-slicing does: when the SM percentages
they ask for add up to more than 100, each runs slower in proportion (processor sharing), so
packing more people onto a GPU costs run time, and that cost is measured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .meter import Meter, Recent


class OverCapacity(AssertionError):
    """The simulator tried to put more bytes on a GPU than it has."""


@dataclass
class Running:
    remaining: float  # s of work left at full speed
    utilization: float
    done: Callable[[float, float], None]  # called with the finish time and its peak share
    best: float = 0.0  # the highest speed it ran at (1: alone, or the GPU not oversubscribed)

    @property
    def peak_share(self) -> float:
        """The highest SM % its process got while it ran, as NVML's per-process samples
        read it: its own % at the best speed it had (a cell slowed all along reads less than
        it asks)."""
        return self.utilization * self.best


@dataclass
class GPU:
    index: int
    capacity: int
    used: int = 0
    running: dict[int, Running] = field(default_factory=dict)
    updated: float = 0.0  # when ``remaining`` of the running cells was last brought up to date
    version: int = 0  # bumps when the next finish time changes; older finish events are stale

    def free(self) -> int:
        return self.capacity - self.used

    def demand(self) -> float:
        return sum(r.utilization for r in self.running.values())

    def speed(self) -> float:
        """Fraction of full speed each running cell gets."""
        return min(1.0, 100.0 / max(self.demand(), 1e-9))


class Node:
    """One or more machines' GPUs, indexed 0..n-1 across machines."""

    def __init__(self, capacities: list[int], duration: float, bin_seconds: float,
                 schedule: Callable[[float, Callable[[], None]], None],
                 load_window: float = 120.0, keep: float | None = None):
        self.gpus = [GPU(i, c) for i, c in enumerate(capacities)]
        self.schedule = schedule
        self.memory = [Meter(bin_seconds, duration) for _ in self.gpus]
        self.sm = [Meter(bin_seconds, duration) for _ in self.gpus]
        self.load_window = load_window
        # SM %, capped at 100, kept for the longest window asked (``keep``)
        self.recent = [Recent(max(load_window, keep or 0.0)) for _ in self.gpus]
        self.demand = 0.0  # SM % asked by every running cell on every GPU, uncapped
        self.peak_demand = 0.0  # its highest: the compute a workload needs at once
        self._next_token = 0

    # -- memory -------------------------------------------------------------------------------
    def allocate(self, now: float, gpu: int, nbytes: int) -> None:
        g = self.gpus[gpu]
        if nbytes > g.free():
            raise OverCapacity(f"GPU {gpu}: {nbytes} bytes asked, {g.free()} free at t={now:.1f}")
        g.used += nbytes
        self.memory[gpu].set(now, g.used)

    def release(self, now: float, gpu: int, nbytes: int) -> None:
        g = self.gpus[gpu]
        g.used -= nbytes
        assert g.used >= 0, f"GPU {gpu} freed more than it held"
        self.memory[gpu].set(now, g.used)

    def free(self, gpu: int) -> int:
        return self.gpus[gpu].free()

    # -- SMs ----------------------------------------------------------------------------------
    def load(self, gpu: int, now: float, window: float | None = None) -> float:
        """SM % of ``gpu`` over the last ``window`` s (``load_window`` where None): the mean
        of min(100, demand)."""
        return self.recent[gpu].mean(now, self.load_window if window is None else window)

    def run(self, now: float, gpu: int, duration: float, utilization: float,
            done: Callable[[float, float], None]) -> None:
        """Run ``duration`` s of work at ``utilization`` SM %; ``done(t, peak share)`` when it
        finishes (:attr:`Running.peak_share`)."""
        if utilization <= 0:  # a cell that does not use the GPU is not slowed by it
            self.schedule(now + duration, lambda: done(now + duration, 0.0))
            return
        g = self.gpus[gpu]
        self._catch_up(now, g)
        self._next_token += 1
        was = g.demand()
        g.running[self._next_token] = Running(duration, utilization, done)
        self._reschedule(now, g, was)

    def _catch_up(self, now: float, g: GPU) -> None:
        elapsed = (now - g.updated) * g.speed()
        for r in g.running.values():
            r.remaining -= elapsed
        g.updated = now

    def _reschedule(self, now: float, g: GPU, was: float = 0.0) -> None:
        demand = g.demand()
        self.sm[g.index].set(now, min(100.0, demand))
        self.recent[g.index].set(now, min(100.0, demand))
        self.demand += demand - was
        self.peak_demand = max(self.peak_demand, self.demand)
        g.version += 1
        if not g.running:
            return
        speed = g.speed()
        for r in g.running.values():
            r.best = max(r.best, speed)
        token, first = min(g.running.items(), key=lambda kv: (kv[1].remaining, kv[0]))
        at = now + max(0.0, first.remaining) / speed
        version = g.version
        self.schedule(at, lambda: self._finish(at, g, token, version))

    def _finish(self, now: float, g: GPU, token: int, version: int) -> None:
        if version != g.version:
            return  # the set of running cells changed since: a newer event took over
        self._catch_up(now, g)
        was = g.demand()
        ended = g.running.pop(token)
        self._reschedule(now, g, was)
        ended.done(now, ended.peak_share)

    def close(self, now: float) -> None:
        for meter in self.memory + self.sm:
            meter.close(now)
