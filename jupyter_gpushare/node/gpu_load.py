"""Each GPU of the node as the placement rule judges it (:class:`..policy.placement.GpuView`):
one builder for the placer, the restore room and the rebalancer, so that they weigh the same
numbers.

- ``load``: SM busy over the last ``window`` seconds of the tracker's samples of the GPU
  (the node's own figure: other servers' kernels count); ``window`` 0 = the last sample;
  each GPU's record keeps a running sum per window (:class:`SlidingLoad`), so a decision
  reads it in O(1) after O(new samples) to bring it up to date;
- ``pending``: the expected load of kernels this server placed there that have not used it
  yet (a kernel the tracker has seen hold memory or compute there no longer counts);
- ``kernels``: kernels this server placed there or that hold memory there now;
- ``busy``: kernels that computed there (SM above ``idle_utilization``) within the window
  (at least the last :data:`BUSY_FLOOR` seconds) and hold memory there now;
- ``room``: the caller's (free memory less what is promised, narrowed by the hub service's
  view) less the expected bytes (``Need.bytes``) of kernels this server placed there that
  have not used it yet: they allocate them soon (the simulator counts them alike);
- ``within_share``: the caller's.

The callers' room counts what released kernels will take back once (:func:`coming_back`).

Kernels placed by other servers of the node and not yet allocated are not in this server's
records (the simulated node's ledger and NVML know only allocations): the node daemon, where
there is one, tells them (``others_pending``, and their bytes out of the caller's room); the
hub service's view, where there is one, counts their load (``seen_pending``) and their
expected bytes (its room, which the caller's room is narrowed by); without either their memory
and load count once they use the GPU. A placement is forgotten when its kernel has ended (a kernel not listed yet
may still be starting: forgotten after a grace) and follows its kernel when a restore moves
it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from .. import clock
from ..policy.placement import GpuView, Need
from ..states import RESTORING

#: s: the least window over which kernels count as computing on a GPU (a few polls)
BUSY_FLOOR = 10.0
#: s a placed kernel the tracker has not listed yet is kept (a kernel still starting)
START_GRACE = 120.0
#: s the memory a kernel's failed allocation asked for stays wanted (:meth:`GpuLoad.owe`):
#: its person runs the cell again within minutes, or has moved on
OWED_GRACE = 120.0


class SlidingLoad:
    """One GPU's SM load over its last ``window`` seconds of samples, kept up as the samples
    come: a running sum of SM % x seconds, O(new samples) to bring up to date and O(1) to
    read, so that the first placement decision after a poll does not read every GPU's whole
    window again. The figure ``GPURecord.load`` works out from the samples: each sample's
    utilization is the busy fraction since the sample before it, and the window shrinks to
    the samples there are (those the ring still holds)."""

    def __init__(self, window: float):
        self.window = window
        self.spans: deque[tuple[float, float, float]] = deque()  # (from, to, SM %), oldest first
        self.total = 0.0  # sum of SM % x seconds over spans
        self.history: Any = None  # the ring folded in (another one: start over)
        self.upto: float | None = None  # time of the last sample folded in
        self.last = 0.0  # its SM %

    def fold(self, history: deque[tuple[float, int | None, float | None]]) -> None:
        """Take in the samples of ``history`` newer than the last one folded in; forget the
        spans that ended before the window."""
        if not history:
            self.spans.clear()
            self.total, self.history, self.upto, self.last = 0.0, history, None, 0.0
            return
        if history is not self.history or (self.upto is not None and history[0][0] > self.upto):
            self.spans.clear()  # a new ring, or it wrapped past us: start over
            self.total, self.history, self.upto = 0.0, history, None
        new = []
        for row in reversed(history):
            if self.upto is not None and row[0] <= self.upto:
                break
            new.append(row)
        for t, _, u in reversed(new):
            value = float(u or 0.0)
            if self.upto is not None and t > self.upto:
                self.spans.append((self.upto, t, value))
                self.total += value * (t - self.upto)
            self.upto, self.last = t, value
        if self.upto is not None:
            since = max(self.upto - self.window, history[0][0])  # the ring's oldest, at most
            while self.spans and self.spans[0][1] <= since:
                a, b, v = self.spans.popleft()
                self.total -= v * (b - a)
            if not self.spans:
                self.total = 0.0  # no rounding carried on

    def recent_load(self, window: float) -> float:
        """Mean SM % over the last ``window`` seconds of samples (at most this one's window)."""
        if self.upto is None:
            return 0.0
        if not self.spans:
            return self.last
        since = self.upto - min(window, self.window)
        first, _, v0 = self.spans[0]
        span = self.upto - max(since, first)
        if span <= 0:
            return self.last
        return max(0.0, (self.total - v0 * max(0.0, since - first)) / span)


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


class HeldState(Protocol):
    """What a kernel's lifecycle offers (``core.lifecycle.Lifecycle``)."""

    @property
    def state(self) -> str: ...
    @property
    def released_gpus(self) -> dict[int, int]: ...


def coming_back(states: Iterable[HeldState]) -> dict[int, int]:
    """Per GPU, the bytes this server's released kernels will take back there: each held
    state whole, except while its restore moves (``restoring``): its landed bytes are in the
    GPU's used memory then and the rest in its reservation, so it would count twice (and at
    its home GPU, where a restore that moves it will not land)."""
    out: dict[int, int] = {}
    for st in states:
        if st.state == RESTORING:
            continue
        for g, n in st.released_gpus.items():
            out[g] = out.get(g, 0) + n
    return out


def _used(rec: KernelUse | None, gpu: int) -> bool:
    """The kernel has used ``gpu`` (held memory or computed there) since it was placed;
    bytes on an unknown GPU (-1: the agent's own count where NVML cannot see the kernel's
    processes) are used, wherever they are."""
    if rec is None:
        return False
    used = rec.peak_gpu_bytes
    return bool(used.get(gpu) or used.get(-1) or gpu in rec.computed)


@dataclass
class Owed:
    """What a kernel whose allocation failed wants to hold on each GPU: what it held then
    plus what the allocation asked for."""

    bytes: dict[int, int]
    at: float  # clock.now() when it failed


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
        self.owed: dict[str, Owed] = {}

    # -- placements -------------------------------------------------------------------------
    def place(self, kernel_id: str, gpus: list[int], need: Need) -> None:
        self.placed[kernel_id] = Placed(list(gpus), need, clock.now())

    def moved(self, kernel_id: str, mapping: Mapping[int, int]) -> None:
        """A restore put the kernel's state from GPU ``g`` onto ``mapping[g]``: it counts
        there from now on, not at its old GPU."""
        p = self.placed.get(kernel_id)
        if p is not None and mapping:
            p.gpus = [mapping.get(g, g) for g in p.gpus]

    def owe(self, kernel_id: str, gpus: Iterable[int], nbytes: int) -> None:
        """A cell of ``kernel_id`` failed to allocate ``nbytes`` more on each of ``gpus``:
        until the kernel holds that much more there, for at most :data:`OWED_GRACE` s, the
        difference is wanted memory (:meth:`promised`, :meth:`unused`: what the node daemon
        tells the node's other servers, whose release policies count it as taken), so that
        idle kernels there make way for the cell's next try, whoever's they are."""
        rec = self.kernels().get(kernel_id)
        held = rec.gpu_bytes if rec is not None else {}
        self.owed[kernel_id] = Owed({g: held.get(g, 0) + nbytes for g in gpus}, clock.now())

    def _owed_now(self, records: Mapping[str, KernelUse], now: float,
                  exclude: str | None = None) -> dict[int, int]:
        """Per GPU, the bytes kernels that ran out of memory still want there beyond what they
        hold and what their placement already counts; done ones are forgotten (held, the
        kernel gone, or past the grace)."""
        out: dict[int, int] = {}
        for kid, o in list(self.owed.items()):
            rec = records.get(kid)
            if (rec is None or now - o.at > OWED_GRACE
                    or all(rec.gpu_bytes.get(g, 0) >= n for g, n in o.bytes.items())):
                del self.owed[kid]  # gone, past the grace, or it holds what it asked for
                continue
            if kid == exclude:
                continue
            placed = self.placed.get(kid)
            for g, n in o.bytes.items():
                counted = placed.need.bytes if placed is not None and g in placed.gpus \
                    and not _used(rec, g) else 0
                want = n - rec.gpu_bytes.get(g, 0) - counted
                if want > 0:
                    out[g] = out.get(g, 0) + want
        return out

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

    def promised(self, now: float | None = None) -> dict[int, int]:
        """Per GPU, the bytes this server's placed kernels that have not used it yet are
        expected to allocate there, and what kernels that ran out of memory there still want
        (:meth:`owe`): memory that is wanted, though no one waits for it yet (the release
        policy counts it as taken, so that idle kernels make way before the first allocation
        fails, or before the failed one's next try)."""
        return {g: n for g, (n, _) in self.unused(now).items()}

    def unused(self, now: float | None = None) -> dict[int, tuple[int, int]]:
        """Per GPU, (bytes, kernels) of this server's placed kernels that have not used it
        yet, and the bytes kernels that ran out of memory there still want (not counted as
        kernels: they are not new there): :meth:`promised`, with how many they are (what the
        node daemon is told)."""
        now = clock.now() if now is None else now
        records = self.kernels()
        self.forget(records, now)
        out: dict[int, tuple[int, int]] = {}
        for kid, p in self.placed.items():
            for g in p.gpus:
                if not _used(records.get(kid), g):
                    n, k = out.get(g, (0, 0))
                    out[g] = (n + p.need.bytes, k + 1)
        for g, want in self._owed_now(records, now).items():
            n, k = out.get(g, (0, 0))
            out[g] = (n + want, k)
        return out

    def listed_unused(self, now: float | None = None) -> set[str]:
        """This server's placed kernels that the tracker lists and that have not used a GPU
        they were placed on yet: those the hub service can see in this server's status as
        placed (what :meth:`..hub_link.HubLink.placed` tells it of at once)."""
        now = clock.now() if now is None else now
        records = self.kernels()
        self.forget(records, now)
        return {kid for kid, p in self.placed.items()
                if kid in records and any(not _used(records[kid], g) for g in p.gpus)}

    # -- views ------------------------------------------------------------------------------
    def views(self, room: Mapping[int, int | None], within: Mapping[int, bool] | None = None,
              exclude: str | None = None, now: float | None = None,
              seen_pending: Mapping[int, float] | None = None,
              others_pending: Mapping[int, float] | None = None,
              room_now: Mapping[int, int | None] | None = None) -> dict[int, GpuView]:
        """A view of each GPU of ``room`` (bytes a new state may take there, None: unknown;
        less what placed kernels that have not used the GPU yet are expected to take);
        ``within``: per GPU, whether the person is within their share (default: yes);
        ``exclude``: a kernel left out of every count (the one being restored);
        ``seen_pending``: per GPU, the pending load a node-wide view counts (the hub
        service's, every server's placed kernels, this one's among them): the larger of it
        and this server's own counts; ``others_pending``: per GPU, the pending load of other
        servers' placed kernels alone (the node daemon's), added to this server's own;
        ``room_now``: per GPU, the room without the released states that will come back
        there (what a kernel starting now may allocate; less placed kernels' too)."""
        now = clock.now() if now is None else now
        busy_since = now - max(self.window, BUSY_FLOOR)
        records = self.kernels()
        self.forget(records, now)
        gpus = self.gpus()
        pending: dict[int, float] = {}
        promised: dict[int, int] = {}  # bytes placed kernels are expected to allocate there
        there: dict[int, set[str]] = {}
        busy: dict[int, int] = {}
        for kid, p in self.placed.items():
            if kid == exclude:
                continue
            for g in p.gpus:
                there.setdefault(g, set()).add(kid)
                if not _used(records.get(kid), g):
                    pending[g] = pending.get(g, 0.0) + p.need.load
                    promised[g] = promised.get(g, 0) + p.need.bytes
        for g, want in self._owed_now(records, now, exclude).items():  # a failed cell's retry
            promised[g] = promised.get(g, 0) + want
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
            seen = (seen_pending or {}).get(g, 0.0)
            own = pending.get(g, 0.0) + (others_pending or {}).get(g, 0.0)
            room_left = None if r is None else r - promised.get(g, 0)
            now_r = (room_now or {}).get(g)
            out[g] = GpuView(g, room_left, load=load, pending=max(own, seen),
                             kernels=len(there.get(g, ())), busy=busy.get(g, 0),
                             within_share=(within or {}).get(g, True),
                             room_now=None if now_r is None else now_r - promised.get(g, 0))
        return out
