"""Prometheus metrics (created once at import, as prometheus_client wants; no hardware touched).

They appear on the server's ``/metrics``. Names start with ``gpushare_``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

GPU_MEMORY_TOTAL = Gauge("gpushare_gpu_memory_total_bytes", "GPU memory in total", ["gpu"])
GPU_MEMORY_USED = Gauge("gpushare_gpu_memory_used_bytes", "GPU memory in use", ["gpu"])
GPU_UTILIZATION = Gauge("gpushare_gpu_utilization_percent", "GPU SM utilization", ["gpu"])
KERNEL_MEMORY = Gauge(
    "gpushare_kernel_gpu_memory_bytes", "GPU memory held by a kernel", ["kernel_id", "gpu"]
)
KERNEL_HOST_BYTES = Gauge(
    "gpushare_kernel_released_bytes", "GPU state a released kernel holds in host memory", ["kernel_id"]
)
HOST_BYTES = Gauge("gpushare_released_bytes", "GPU state held in host memory by released kernels")
KERNELS = Gauge("gpushare_kernels", "Kernels by state", ["state"])
RELEASES = Counter("gpushare_releases", "Releases of kernels' GPU memory", ["method", "outcome"])
RESTORES = Counter("gpushare_restores", "Restores of kernels' GPU memory", ["method", "outcome"])
AHEAD_RESTORES = Counter(
    "gpushare_ahead_restores",
    "Restores ahead of a person's next cell (trigger activity), by outcome: restored, joined "
    "(one was on its way), resident (nothing to do), no_room (stopped by the server), failed, "
    "superseded (a cell's restore took over), used (a cell ran after it), released_unused "
    "(released again after ahead_grace)",
    ["outcome"],
)
OUT_OF_MEMORY = Counter(
    "gpushare_out_of_memory",
    "Cells that ran out of GPU memory and asked for room for their next try, by what was done: "
    "released (this server's idle kernels, or the hub service's), releasing (the hub service's "
    "releases still going), room (there was room already), none (nothing could make it), cap "
    "(the kernel's own memory cap), unknown_gpu, failed (the releases failed), busy (one was "
    "being made)",
    ["cause"],
)
RESTORE_SECONDS = Histogram(
    "gpushare_restore_seconds",
    "Time to restore a kernel's GPU state",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
)
RELEASE_SECONDS = Histogram(
    "gpushare_release_seconds",
    "Time to release a kernel's GPU state",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
)
POLL_SECONDS = Histogram(
    "gpushare_poll_seconds", "Time of one tracker poll", buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1)
)
# a count that only grows under steady load is a leak of tasks (benchmarks/load_cycle.py)
ASYNCIO_TASKS = Gauge("gpushare_asyncio_tasks", "asyncio tasks alive in the server's event loop, at the last poll")

KERNEL_HOST_ROOM = Gauge(
    "gpushare_kernel_host_room_bytes",
    "Host memory a kernel's process may still use (its memory cgroup or the machine), the room a "
    "release has",
    ["kernel_id"],
)

GPU_LOAD = Gauge(
    "gpushare_gpu_load_percent",
    "GPU SM busy %, mean over the rebalance window (5 x rebalance_idle, at least load_window; "
    "600 s by default), every process on the GPU", ["gpu"])
GPU_CONTENDED = Gauge(
    "gpushare_gpu_contended",
    "1 when two or more of this server's kernels computed on the GPU within the window and its "
    "SMs were busy at least 90 % of it, else 0", ["gpu"])
KERNEL_MOVES = Counter(
    "gpushare_kernel_moves",
    "Idle kernels moved off a contended GPU onto a quiet one (rebalance)", ["method", "outcome"])
KERNEL_CAP = Gauge(
    "gpushare_kernel_memory_cap_bytes",
    "A capped kernel's memory cap, bytes per GPU (uncapped kernels have no series)", ["kernel_id"])
KERNEL_OVER_CAP = Gauge(
    "gpushare_kernel_over_cap",
    "1 when the node sees a capped kernel hold more than its cap on a GPU, else 0", ["kernel_id"])

_known_kernel_series: set[tuple[str, str]] = set()
_known_host_room: set[tuple[str, ...]] = set()
_known_caps: set[tuple[str, ...]] = set()
_known_over_cap: set[tuple[str, ...]] = set()


def _replace_series(gauge: Gauge, known: set[Any], values: dict[Any, int]) -> None:
    """Set these series and remove those no longer there (kernels gone: no leak of label sets)."""
    for key in known - set(values):
        gauge.remove(*key)
    for key, v in values.items():
        gauge.labels(*key).set(v)
    known.clear()
    known.update(values)


def set_kernel_memory(values: dict[tuple[str, str], int]) -> None:
    _replace_series(KERNEL_MEMORY, _known_kernel_series, values)


def set_kernel_host_room(values: dict[str, int]) -> None:
    _replace_series(KERNEL_HOST_ROOM, _known_host_room, {(k,): v for k, v in values.items()})


def set_caps(values: dict[str, tuple[int, bool]]) -> None:
    """Per capped kernel: its cap and whether it holds more."""
    _replace_series(KERNEL_CAP, _known_caps, {(k,): cap for k, (cap, _) in values.items()})
    _replace_series(KERNEL_OVER_CAP, _known_over_cap,
                    {(k,): int(over) for k, (_, over) in values.items()})


def set_contention(values: dict[int, tuple[float, bool]]) -> None:
    """Per GPU: its SM load over the window and whether it is contended."""
    for gpu, (load, contended) in values.items():
        GPU_LOAD.labels(str(gpu)).set(load)
        GPU_CONTENDED.labels(str(gpu)).set(1 if contended else 0)


def forget_kernel(kernel_id: str) -> None:
    try:
        KERNEL_HOST_BYTES.remove(kernel_id)
    except KeyError:
        pass


def export_sample(gpus: Iterable[Any], kernels: Mapping[str, Any]) -> None:
    """One poll's numbers: per GPU (``tracker.gpus`` values) and per kernel (``tracker.kernels``)."""
    ASYNCIO_TASKS.set(len(asyncio.all_tasks()))
    for g in gpus:
        label = str(g.info.index)
        if g.info.memory_total is not None:
            GPU_MEMORY_TOTAL.labels(label).set(g.info.memory_total)
        if g.info.memory_used is not None:
            GPU_MEMORY_USED.labels(label).set(g.info.memory_used)
        if g.info.utilization is not None:
            GPU_UTILIZATION.labels(label).set(g.info.utilization)
    set_kernel_memory({
        (kid, str(gpu)): n for kid, rec in kernels.items() for gpu, n in rec.gpu_bytes.items()
    })
    set_kernel_host_room({
        kid: rec.host_room.available for kid, rec in kernels.items()
        if rec.host_room is not None and rec.host_room.available is not None
    })


def clear() -> None:
    """Drop every series the extension set (it stopped: nothing it showed holds any more).
    Counters and histograms keep their totals, as Prometheus expects."""
    for gauge in (GPU_MEMORY_TOTAL, GPU_MEMORY_USED, GPU_UTILIZATION, KERNEL_MEMORY,
                  KERNEL_HOST_BYTES, KERNELS, KERNEL_HOST_ROOM, GPU_LOAD, GPU_CONTENDED,
                  KERNEL_CAP, KERNEL_OVER_CAP):
        gauge.clear()
    HOST_BYTES.set(0)
    _known_kernel_series.clear()
    _known_host_room.clear()
    _known_caps.clear()
    _known_over_cap.clear()
