"""The figures of one finished run: what the report prints, the JSON holds and the PNG draws."""

from __future__ import annotations

from typing import Any

from .engine import Simulation
from .workload import HOUR, GiB

DELAYED = 1e-6  # s: a cell that started later than it arrived by more than rounding
TAIL_SECONDS = (10, 60, 600, 3600)  # s: waits counted in ``cells_waited_over_s``


def quantile(values: list[float], q: float) -> float:
    """The q-quantile (0-1) by linear interpolation; 0 for no values."""
    if not values:
        return 0.0
    data = sorted(values)
    pos = q * (len(data) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def figures(sim: Simulation, series: bool = False) -> dict[str, Any]:
    """Every figure of the run; ``series`` adds allocation and utilization per time bin."""
    c = sim.counters
    gpus = sim.node.gpus
    capacity = gpus[0].capacity
    duration = sim.duration
    # a cell still waiting at the end has waited at least this long: count it, do not hide it
    delays = [r.delay for r in sim.cells] + [duration - a for a in c.still_waiting]
    delayed = [d for d in delays if d > DELAYED]
    # cells whose restore found no room at once: the ones a release elsewhere holds up
    room = [r.delay for r in sim.cells if r.waited_for_room] + [
        duration - k.pending.arrival for k in sim.kernels
        if k.pending is not None and k.pending.room]
    worst = _worst_cell(sim)
    # cells that would have finished by the end at full speed but were still running: slowed
    # by sharing SMs; counted, and in the slowdown figure with their stretch so far (at least)
    unfinished = [r for r in sim.cells if r.end is None and r.gpus and r.utilization > 0
                  and r.start + r.duration <= duration]
    stretch = [((duration if r.end is None else r.end) - r.start) / r.duration for r in sim.cells
               if r.gpus and r.utilization > 0 and r.duration > 0
               and (r.end is not None or r.start + r.duration <= duration)]
    extra = sum((r.end - r.start - r.duration) * r.gpus for r in sim.cells
                if r.end is not None and r.gpus and r.utilization > 0)
    gpu_seconds = len(gpus) * duration
    held = sum(m.total for m in sim.node.memory)
    busy = sum(m.total for m in sim.node.sm)
    out: dict[str, Any] = {
        "policy": sim.policy.name,
        "policy_settings": sim.policy.describe(),
        "users": len(sim.workload.users),
        "kernels": len(sim.kernels),
        "gpus": len(gpus),
        "gpu_gib": capacity / GiB,
        "hours": duration / HOUR,
        "users_per_gpu": len(sim.workload.users) / len(gpus),
        "cells": len(delays),
        "cells_failed_oom": c.oom_failures,
        "oom_failures": c.oom_failures,
        "oom_on_growth": c.oom_growth,
        "cpu_only_cells": sum(1 for r in sim.cells if not r.gpus),
        "restore_mode": sim.restore_mode,
        "placement": sim.placement,
        "servers": sim.servers,
        # SM % asked by the cells running at once, summed over GPUs: the compute needed
        "peak_sm_demand_pct": sim.node.peak_demand,
        "cells_delayed": len(delayed),
        "cells_delayed_pct": 100.0 * len(delayed) / max(1, len(delays)),
        "cells_still_waiting_at_end": len(c.still_waiting),
        "delay_p50_s": quantile(delayed, 0.50),
        "delay_p95_s": quantile(delayed, 0.95),
        "delay_p99_s": quantile(delayed, 0.99),
        "delay_max_s": max(delayed, default=0.0),
        "cell_delay_p99_s": quantile(delays, 0.99),  # over all cells: the bound's figure
        # the tail the p99 does not show: how many cells waited longer than each of these
        "cells_waited_over_s": {str(t): sum(1 for d in delays if d > t) for t in TAIL_SECONDS},
        "worst_cell": worst,
        "room_waits": len(room),
        "room_wait_p99_s": quantile(room, 0.99),
        "room_wait_max_s": max(room, default=0.0),
        "releases": c.releases,
        "release_copies": "changed" if sim.incremental else "all",
        "release_gib_copied": c.release_bytes / GiB,
        "release_reasons": dict(sorted(c.release_reasons.items())),
        "restores": c.restores,
        "ahead_lead_s": sim.ahead_lead,
        "release_policy": getattr(sim.policy, "release_policy", None),
        "ahead_requests": c.ahead_requests,
        "ahead_restores": c.ahead_restores,
        "ahead_used": c.ahead_used,
        "ahead_released_again": c.ahead_released_again,
        "ahead_cancelled": c.ahead_cancelled,
        "move_after_s": getattr(sim.policy, "move_after", None),
        "moves": c.moves,  # restores onto other GPUs than the kernel's own
        "rebalances": c.rebalances,  # of which: idle kernels moved off contended GPUs
        "culls": c.culls,
        "restarts": c.restarts,
        "work_lost_gpu_hours": c.work_lost_seconds / HOUR,  # GPU cells' time x their GPUs
        "reclaimed_gpu_hours": sim.reclaimed.total / capacity / HOUR,
        "mean_allocation_pct": 100.0 * held / (gpu_seconds * capacity),
        "mean_sm_utilization_pct": busy / gpu_seconds,
        # GPU-h paid: the GPUs for the trace; exclusive: each user's GPUs while a kernel of
        # theirs is alive (a scheduler's reservation per session), not the whole trace
        "gpu_hours": (sim.workload.reserved_gpu_seconds() if sim.policy.name == "exclusive"
                      else gpu_seconds) / HOUR,
        "reserved_gpu_hours": sim.workload.reserved_gpu_seconds() / HOUR,
        "sm_sharing_stretch_p99": quantile(stretch, 0.99) if stretch else 1.0,
        "gpu_cell_slowdown_p99": quantile(stretch, 0.99) if stretch else 1.0,
        "cells_unfinished_contention": len(unfinished),
        "sm_sharing_extra_hours": extra / HOUR,
        "peak_used_pct": 100.0 * max(c.peak_used.values(), default=0) / capacity,
    }
    if series:
        bins = sim.node.memory[0].bin_seconds
        n = len(gpus)
        mem = [sum(col) / n / capacity * 100.0 for col in zip(*(m.bin_means() for m in sim.node.memory), strict=True)]
        sm = [sum(col) / n for col in zip(*(m.bin_means() for m in sim.node.sm), strict=True)]
        out["series"] = {"bin_seconds": bins, "allocation_pct": [round(v, 3) for v in mem],
                         "sm_utilization_pct": [round(v, 3) for v in sm]}
    return out


def _worst_cell(sim: Simulation) -> dict[str, Any] | None:
    """The cell that waited longest (started, or still waiting at the end): whose, where, how
    (``gpu``: where it waited; ``moved_to``: where its restore moved the kernel, or None)."""
    # delay, kernel, arrival, restore, still waiting, GPU it waited on, GPU it ran on
    best: tuple[float, int, float, float, bool, int, int] | None = None
    for r in sim.cells:
        if r.delay > DELAYED and (best is None or r.delay > best[0]):
            best = (r.delay, r.kernel, r.arrival, r.restore_seconds, False, r.waited_on, r.ran_on)
    for k in sim.kernels:  # a cell still waiting at the end has waited at least this long
        if k.pending is not None:
            delay = sim.duration - k.pending.arrival
            if delay > DELAYED and (best is None or delay > best[0]):
                best = (delay, k.index, k.pending.arrival, 0.0, True, k.pending.gpu, k.gpu)
    if best is None:
        return None
    delay, index, arrival, restore, waiting, waited_on, ran_on = best
    k = sim.kernels[index]
    return {"kernel": k.id, "user": k.work.user, "gpu": waited_on, "arrival_h": arrival / HOUR,
            "delay_s": delay, "restore_s": restore, "still_waiting_at_end": waiting,
            "moved_to": None if ran_on == waited_on else ran_on}
