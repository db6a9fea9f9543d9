"""The tracking and restore options of the server (``c.GPUShareApp.NAME``).

Each class owns its options and their checks; the server's app inherits them, so an admin
sets every option in one section while each part of the code reads the ones it owns.
"""

from __future__ import annotations

from typing import Any

from traitlets import Bool, Enum, Float, Int, validate
from traitlets.config import Configurable

from ..policy.options import non_negative, positive


class TrackingOptions(Configurable):
    """How often GPUs are sampled and how much history is kept."""

    poll_interval = Float(
        2.0,
        help="""Seconds between two samples of GPU memory and utilization (and policy
        decisions). Default 2. Must be > 0; below 0.5 s NVML sampling costs noticeable CPU.""",
    ).tag(config=True)

    history_seconds = Float(
        1800.0,
        help="""Seconds of samples kept per GPU and per kernel for the history API and the
        panel's charts. Default 1800. Memory: about 450 bytes per kernel per poll (a
        release or restore adds a poll, so under load the samples span less time).""",
    ).tag(config=True)

    @validate("poll_interval", "history_seconds")
    def _check_tracking_positive(self, proposal: Any) -> float:
        return positive(self, proposal)


class RestoreOptions(Configurable):
    """How releases and restores run: when a restore happens, the room it needs, what the
    cell shows."""

    restore_mode = Enum(
        ["eager", "lazy"],
        default_value="eager",
        help="""When a released kernel is restored: "eager" (before any cell runs) or "lazy"
        (only before cells that may touch the GPU, decided by the agent from the cell's code; a
        watchdog restores a released kernel busy for longer than restore_grace). Lazy works
        with the driver and simulated methods only; with the framework method eager is used.
        Default "eager".""",
    ).tag(config=True)

    restore_grace = Float(
        30.0,
        help="""Lazy mode only: seconds a released kernel may run a cell before the watchdog
        restores it anyway (its GPU calls would wait otherwise). Default 30. Must be > 0.""",
    ).tag(config=True)

    lock_timeout = Float(
        10.0,
        help="""Seconds a release waits for the kernel's running GPU work to finish (the driver
        lock) before giving up and leaving the kernel running. Default 10.""",
    ).tag(config=True)

    host_memory_reserve = Int(
        1 << 30,
        help="""Host memory, in bytes, that a release must leave free, in the kernel's memory
        cgroup and on the machine. A release moves the kernel's GPU state into host memory
        inside the kernel's own process, so a state that does not fit would get the kernel
        OOM-killed: such a release is refused with the reason (API, panel, %gpushare), and
        automatic releases skip the kernel. Default 1 GiB. 0 = only the limits themselves.""",
    ).tag(config=True)

    precopy_after = Float(
        60.0,
        help="""Seconds a kernel must sit idle before its agent copies, in the background, the
        GPU state that changed since its last host copy (framework and simulated methods).
        The next release then copies only what changed after that, so a release someone
        waits for frees the GPU at once. It never blocks a cell: a cell that starts stops
        it, and what the cell changes is copied at release. The host copies count against
        host memory (host_memory_reserve) and are dropped, oldest first, when it is short.
        Default 60 s. 0 = never pre-copy (a restore still keeps its host copy).""",
    ).tag(config=True)

    context_bytes = Int(
        512 * 1024 * 1024,
        help="""GPU memory, in bytes, that one CUDA context takes. A restore reserves it on
        top of a kernel's bytes when those came from the kernel's own count (NVML could not
        see its processes, e.g. in a container), since that count leaves the context out.
        Placement (see placement) also counts a GPU with less room than this as full, on
        either backend. Default 512 MiB. 0 = reserve only the counted bytes.""",
    ).tag(config=True)

    keep_restore_progress = Bool(
        False,
        help="""Keep the restore progress line ("gpushare: restored 1.0 GiB in 0.42 s") in the
        output of the cell that waited for the restore, so that it is saved with the notebook.
        Default False: the line shows while the restore runs and is cleared before the cell's
        code runs (the panel, the status bar and a notification keep the result), so saved
        notebooks carry no gpushare output. Restores asked with %gpushare restore keep their
        line either way.""",
    ).tag(config=True)

    ahead_grace = Float(
        300.0,
        help="""Seconds a kernel restored ahead of its person's next cell (the JupyterLab
        extension asks for that when someone opens or edits a notebook whose kernel is
        released) stays on the GPU without running a cell before it may be released again,
        without waiting for idle_timeout. Taken as an automatic release would be: never a
        pinned kernel, one computing on the GPU, or one whose idle timeout is 0. Default 300.
        0 = a kernel restored ahead is kept like any other (released again by idle_timeout).""",
    ).tag(config=True)

    restore_move_after = Float(
        30.0,
        help="""Seconds a restore waits for room on the GPU(s) its kernel was released from
        (while idle kernels there are released to make it, if policy allows) before it
        restores onto other GPUs that have room (preferring those left above
        pressure_free_fraction free, so the move has no idle kernel released there): the
        kernel then runs there, its device numbering unchanged, and the cell, status
        (restored_onto) and log say where it went.
        Only with methods that can (the driver method on driver 580 or newer, the simulated
        method; never the framework method: the waiting message says why), and only for a
        state wholly off the GPU. Default 30. 0 = never move: restores wait for their own
        GPUs.""",
    ).tag(config=True)

    rebalance = Bool(
        True,
        help="""Move an idle kernel off a GPU whose SMs are contended (two or more kernels
        computed there within the rebalance window - 5 x rebalance_idle, at least
        load_window: 600 s by default - and its SMs were busy at least 90 % of that time)
        onto a quiet GPU with room, between cells, so that its next cell does not share:
        a release, then a restore onto the new GPU (its device numbering unchanged), said in an
        event (action "moved"), status and the panel. Never while a cell runs; only a kernel
        idle for rebalance_idle seconds; only with methods that can restore onto another GPU
        (the driver method on driver 580 or newer, the simulated method). Default True.
        False = kernels stay on the GPU they were placed or restored on.""",
    ).tag(config=True)

    rebalance_idle = Float(
        120.0,
        help="""Seconds a kernel must have been idle (no cell running, no GPU use) before
        rebalance may move it: its person is away. It also sets the rebalance window, over
        which contention is judged (rebalance, status, metrics, the panel): 5 x
        rebalance_idle, at least load_window (600 s by default), so that a kernel idle
        long enough to move still counts among those sharing its GPU. Default 120. 0 = any
        kernel not running a cell may move (the window is then load_window).""",
    ).tag(config=True)

    rebalance_before_cell = Bool(
        False,
        help="""With rebalance: when a cell arrives for a kernel whose last GPU work ran at 50 %
        SM or more, and another kernel's cell keeps its GPU busy (the last reading and its own
        SM add up to more than 110 %), the kernel moves to a quiet GPU with room before the
        cell runs (a release, then a restore there, as rebalance moves it): the cell waits
        seconds for the move instead of both cells running slower for as long as both run.
        The move counts within rebalance_max_per_hour; it happens only for cells that come
        through the server's websocket (JupyterLab, Notebook, VS Code), not for a kernel
        already running a cell, and only with methods that can restore onto another GPU.
        Default False (measured in the simulator: fewer hours of shared SMs, more cells that
        wait or run out of memory, no fewer GPUs on its default workload). False = a kernel moves only between
        cells, once its person is away (rebalance_idle).""",
    ).tag(config=True)

    rebalance_max_per_hour = Int(
        2,
        help="""Moves per kernel per hour at most (rebalance). Default 2. 0 = no moves (as
        rebalance = False).""",
    ).tag(config=True)

    @validate("restore_grace", "lock_timeout")
    def _check_restore_positive(self, proposal: Any) -> float:
        return positive(self, proposal)

    @validate("host_memory_reserve", "context_bytes", "restore_move_after", "ahead_grace",
              "rebalance_idle", "rebalance_max_per_hour", "precopy_after")
    def _check_restore_non_negative(self, proposal: Any) -> Any:
        return non_negative(self, proposal)
