"""Statistics of a workload, next to the published figures the generator is calibrated to.

Computed from the workload alone, as if every kernel held its memory from its first cell to
its shutdown (or the end of the trace) and ran its cells back to back at full speed: what
the published traces measure (GPUs reserved, and how much of that time they compute).
"""

from __future__ import annotations

from typing import Any

from .workload import KernelWork, Workload

BARELY = 0.05  # a kernel busy on the GPU less than this share of its life "barely computes"

PUBLISHED = {
    "barely_computing_memory_time_pct": (
        "Alibaba PAI 2020 (NSDI'22): about half of GPU memory-time is held by jobs that barely compute",
        "about 50"),
    "train_session_idle_pct": (
        "Microsoft Philly (ATC'19): jobs sit fully idle 25-51 % of the time", "25-51"),
    "kernel_lifetime_gpu_idle_pct": (
        "NotebookOS / Adobe (ASPLOS'26): notebook sessions leave their GPUs unused most of their lifetime",
        "most (> 50)"),
    "cpu_only_cells_pct": (
        "Production interactive-GPU notebook traces: about a third of cells use no GPU",
        "about 33"),
    "gpu_cell_sm_median_pct": (
        "Production interactive-GPU notebook traces: median SM use under 10 % (here: of GPU "
        "cells' run time)", "< 10"),
}


def peak_bytes(k: KernelWork) -> int:
    """The most a kernel holds on all its GPUs together: its start, or its largest cell."""
    per_gpu = max([k.gpu_bytes] + [c.nbytes for s in k.sessions for c in s.cells
                                   if c.nbytes is not None])
    return per_gpu * k.gpus


def sm_median(cells: list[tuple[float, float]]) -> float | None:
    """The SM % that half of the GPU cells' run time is at or below: ``cells`` are (SM %,
    weight) pairs, weight = duration x GPUs the cell computes on (None: no GPU cell)."""
    total = sum(w for _, w in cells)
    if total <= 0:
        return None
    seen = 0.0
    for sm, w in sorted(cells):
        seen += w
        if seen >= total / 2:
            return sm
    return sorted(cells)[-1][0]  # pragma: no cover - float rounding only


def trace_statistics(w: Workload, marks_cpu_cells: bool = True) -> dict[str, Any]:
    """``marks_cpu_cells`` False: the source cannot see CPU-only cells (a replayed history),
    so their share is unknown (None), not 0."""
    held = barely = life_total = busy_total = 0.0
    cells = cpu_only = 0
    train_span = train_busy = 0.0
    gpu_cells: list[tuple[float, float]] = []  # (SM %, duration x GPUs) of each GPU cell
    for k in w.kernels:
        start = k.first_start
        t = start
        busy = 0.0
        for s in k.sessions:
            t = max(t, s.start)
            session_start, session_busy = t, 0.0
            for c in s.cells:
                t += c.gap + c.duration
                cells += 1
                cpu_only += not c.uses_gpu
                if c.uses_gpu:
                    gpu_cells.append((c.utilization, c.duration * c.n_gpus))
                if c.uses_gpu and c.utilization > 0:
                    session_busy += c.duration
            busy += session_busy
            if s.kind == "train":
                train_span += t - session_start
                train_busy += session_busy
        end = min(w.duration, max(t, k.shutdown_at if k.shutdown_at is not None else w.duration))
        life = max(end - start, 1.0)
        held += peak_bytes(k) * life
        life_total += life
        busy_total += min(busy, life)
        if busy / life < BARELY:
            barely += peak_bytes(k) * life
    return {
        "users": len(w.users),
        "kernels": len(w.kernels),
        "cells": cells,
        "cpu_only_cells_pct": (100.0 * cpu_only / cells if cells else 0.0) if marks_cpu_cells else None,
        "barely_computing_memory_time_pct": 100.0 * barely / held if held else 0.0,
        # a replay does not know which sessions were training: None, not 0
        "train_session_idle_pct": 100.0 * (1 - train_busy / train_span) if train_span else None,
        "gpu_cell_sm_median_pct": sm_median(gpu_cells),
        "kernel_lifetime_gpu_idle_pct": 100.0 * (1 - busy_total / life_total) if life_total else 0.0,
        "mean_kernel_gib": sum(peak_bytes(k) for k in w.kernels) / max(1, len(w.kernels)) / (1 << 30),
    }
