"""Each GPU of the node as the placement rule judges it (:class:`..policy.placement.GpuView`):
one builder for the placer, the restore room and the rebalancer, so that they weigh the same
numbers.

- ``load``: SM busy over the last ``window`` seconds of the tracker's samples of the GPU
  (the node's own figure: other servers' kernels count); ``window`` 0 = the last sample;
- ``pending``: the expected load of kernels this server placed there that have not used it
  yet (a kernel the tracker has seen hold memory or compute there no longer counts);
- ``kernels``: kernels this server placed there or that hold memory there now;
- ``busy``: kernels that computed there (SM above ``idle_utilization``) within the window
  (at least the last :data:`BUSY_FLOOR` seconds) and hold memory there now;
- ``room`` and ``within_share``: the caller's (free memory less what is promised, narrowed
  by the hub service's view).

Kernels placed by other servers of the node and not yet allocated are not seen here (the
simulated node's ledger and NVML know only allocations): their memory and load count once
they use the GPU. A placement is forgotten when its kernel has ended (a kernel not listed yet
may still be starting: forgotten after a grace) and follows its kernel when a restore moves
it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from .. import clock
from ..policy.placement import GpuView, Need

#: s: the least window over which kernels count as computing on a GPU (a few polls)
BUSY_FLOOR = 10.0
#: s a placed kernel the tracker has not listed yet is kept (a kernel still starting)
START_GRACE = 120.0


class GpuSamples(Protocol):
    """What a GPU's record offers (``core.tracker.GPURecord``)."""

    def recent_load(self, window: float) -> float: ...


class KernelUse(Protocol):
    """What a kernel's record offers (``core.tracker.KernelRecord``)."""

    @property
    def gpu_bytes(self) -> dict[int, int]: ...
    @property
    def peak_gpu_bytes(self) -> dict[int, int]: ...
    @property
    def computed(self) -> dict[int, float]: ...


@dataclass
class Placed:
    """Where this server placed a kernel, and what it was expected to need there."""

    gpus: list[int]
    need: Need
    at: float  # clock.now() when placed


class GpuLoad:
    """The placements of this server's kernels and the views built from them and the
    tracker's records (see the module's docstring)."""

    def __init__(self, gpus: Callable[[], Mapping[int, GpuSamples]],
                 kernels: Callable[[], Mapping[str, KernelUse]], window: float = 120.0,
                 ended: Callable[[], Iterable[str]] | None = None):
        """gpus, kernels: the tracker's records now (GPU index -> record, kernel id -> record);
        window: seconds of SM samples a GPU's load is the mean of (0: the last sample);
        ended: ids of kernels known to have ended (forgotten at once, not after a grace)."""
        self.gpus = gpus
        self.kernels = kernels
        self.window = window
        self.ended = ended or (lambda: ())
        self.placed: dict[str, Placed] = {}

    # -- placements -------------------------------------------------------------------------
    def place(self, kernel_id: str, gpus: list[int], need: Need) -> None:
        self.placed[kernel_id] = Placed(list(gpus), need, clock.now())

    def moved(self, kernel_id: str, mapping: Mapping[int, int]) -> None:
        """A restore put the kernel's state from GPU ``g`` onto ``mapping[g]``: it counts
        there from now on, not at its old GPU."""
        p = self.placed.get(kernel_id)
        if p is not None and mapping:
            p.gpus = [mapping.get(g, g) for g in p.gpus]

    def forget(self, alive: Iterable[str], now: float | None = None) -> None:
        """Drop the placements of kernels not ``alive`` that ended, or that were placed longer
        ago than a start takes (a kernel not listed yet may still be starting)."""
        now = clock.now() if now is None else now
        live = set(alive)
        gone = [k for k, p in self.placed.items() if k not in live]
        if not gone:
            return
        ended = set(self.ended())
        for kid in gone:
            if kid in ended or now - self.placed[kid].at > START_GRACE:
                del self.placed[kid]

    # -- views ------------------------------------------------------------------------------
    def views(self, room: Mapping[int, int | None], within: Mapping[int, bool] | None = None,
              exclude: str | None = None, now: float | None = None) -> dict[int, GpuView]:
        """A view of each GPU of ``room`` (bytes a new state may take there, None: unknown);
        ``within``: per GPU, whether the person is within their share (default: yes);
        ``exclude``: a kernel left out of every count (the one being restored)."""
        now = clock.now() if now is None else now
        busy_since = now - max(self.window, BUSY_FLOOR)
        records = self.kernels()
        self.forget(records, now)
        gpus = self.gpus()
        pending: dict[int, float] = {}
        there: dict[int, set[str]] = {}
        busy: dict[int, int] = {}
        for kid, p in self.placed.items():
            if kid == exclude:
                continue
            rec = records.get(kid)
            used = rec.peak_gpu_bytes if rec is not None else {}
            computed = rec.computed if rec is not None else {}
            for g in p.gpus:
                there.setdefault(g, set()).add(kid)
                # placed, not yet used there (bytes on an unknown GPU, -1, are the agent's own
                # count where NVML cannot see the kernel's processes: used, wherever it is)
                if not used.get(g) and not used.get(-1) and g not in computed:
                    pending[g] = pending.get(g, 0.0) + p.need.load
        for kid, rec in records.items():
            if kid == exclude:
                continue
            for g, n in rec.gpu_bytes.items():
                if n <= 0:
                    continue
                there.setdefault(g, set()).add(kid)
                if rec.computed.get(g, float("-inf")) >= busy_since:
                    busy[g] = busy.get(g, 0) + 1
        out: dict[int, GpuView] = {}
        for g, r in room.items():
            record = gpus.get(g)
            load = record.recent_load(self.window) if record is not None else 0.0
            out[g] = GpuView(g, r, load=load, pending=pending.get(g, 0.0),
                             kernels=len(there.get(g, ())), busy=busy.get(g, 0),
                             within_share=(within or {}).get(g, True))
        return out
