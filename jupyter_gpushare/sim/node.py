"""The simulated GPU node's device side: memory accounting and busy time per process.

The server owns one ``SimNode``; kernels allocate on it through the agent channel, so
several kernels share (and can exhaust) the same simulated memory exactly as on a real
GPU. A kernel with no server (plain IPython) gets a private in-process node.

Compute is shared as on a real GPU, whose processes' kernels take turns on the SMs
(time-slicing): a busy process asks for a share of the GPU's time (``sm``, the % that
NVML would read were it alone; 100 by default), and while the shares asked on one GPU add up
to more than 100 % each runs slower in proportion (``speed`` = 100 / the sum). The GPU's
utilization reads as NVML's does: the share of the sample period in which any kernel ran,
min(100 %, the sum); a process's, its share of that (:func:`shared_time`).
"""

from __future__ import annotations

import bisect
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .. import clock
from ..units import GiB, format_bytes

DEFAULT_GPUS = (16 * GiB, 16 * GiB)
DEVICE_NAME = "Simulated GPU"


class SimOutOfMemoryError(MemoryError):
    """Raised like CUDA's out-of-memory error when an allocation does not fit."""


def parse_gpus(text: str | None) -> tuple[int, ...]:
    """``"17179869184,17179869184"`` -> capacities; empty/None -> the default two 16 GiB GPUs."""
    if not text:
        return DEFAULT_GPUS
    sizes = tuple(int(float(part)) for part in text.split(",") if part.strip())
    if not sizes or any(s <= 0 for s in sizes):
        raise ValueError(f"simulated GPU sizes must be positive byte counts, got {text!r}")
    return sizes


#: % of the GPU's time a busy process asks for when it does not say (a kernel that runs
#: alone keeps the GPU busy all along)
FULL = 100.0


@dataclass
class _Busy:
    intervals: list[tuple[float, float, float]]  # (start, end, sm %), in order of their ends
    open_since: float | None = None
    open_sm: float = FULL

    def close(self, end: float) -> None:
        assert self.open_since is not None
        bisect.insort(self.intervals, (self.open_since, end, self.open_sm), key=_end)
        self.open_since = None

    def since(self, since: float) -> list[tuple[float, float, float]]:
        """The closed spans that end after ``since`` (a poll reads only the latest few)."""
        return self.intervals[bisect.bisect_right(self.intervals, since, key=_end):]


def _end(span: tuple[float, float, float]) -> float:
    return span[1]


class NodeLedger(Protocol):
    """What a simulated node is to its users (the agent channel, the telemetry): a private
    :class:`SimNode` or the machine's :class:`~jupyter_gpushare.sim.shared.SharedSimNode`."""

    capacities: tuple[int, ...]
    node_id: str

    def uuid(self, gpu: int) -> str: ...
    def used(self, gpu: int) -> int: ...
    def free(self, gpu: int) -> int: ...
    def alloc(self, pid: int, gpu: int, nbytes: int) -> None: ...
    def release(self, pid: int, gpu: int, nbytes: int) -> None: ...
    def held_by(self, pid: int) -> dict[int, int]: ...
    def take_all(self, pid: int) -> dict[int, int]: ...
    def reserve(self, pid: int, per_gpu: dict[int, int]) -> None: ...
    def set_usage(self, pid: int, per_gpu: dict[int, int]) -> None: ...
    def end_busy(self, pid: int) -> None: ...
    def drop_pid(self, pid: int) -> None: ...
    def drop_gone(self, alive: Callable[[int], bool]) -> list[int]: ...
    def pids(self) -> dict[int, dict[int, int]]: ...
    def busy_begin(self, pid: int, gpu: int, at: float | None = None, sm: float = FULL) -> None: ...
    def busy_end(self, pid: int, gpu: int, at: float | None = None) -> None: ...
    def busy_fraction(self, pid: int | None, gpu: int, since: float, until: float) -> float: ...
    def busy_work(self, pid: int, gpu: int, until: float | None = None) -> tuple[float, float]: ...


def gpu_uuid(node_id: str, index: int) -> str:
    """The UUID of simulated GPU ``index`` of node ``node_id``: unique per node, as real GPU
    UUIDs are unique per device (a service that covers several nodes keys GPUs by it)."""
    return f"SIM-{node_id[:8]}-{index:04x}-{node_id[8:12]}-{node_id[12:16]}-{node_id[16:28]}"


class SimNode:
    """Memory and busy-time ledger of a node of simulated GPUs, private to one process.
    Thread-safe. (:class:`~jupyter_gpushare.sim.shared.SharedSimNode` is the same ledger
    shared by every server on a machine.)"""

    def __init__(self, capacities: tuple[int, ...] = DEFAULT_GPUS, node_id: str | None = None):
        self.capacities = tuple(capacities)
        self.node_id = node_id or uuid.uuid4().hex
        self._lock = threading.Lock()
        self._used: dict[int, dict[int, int]] = defaultdict(dict)  # gpu -> pid -> bytes
        self._busy: dict[tuple[int, int], _Busy] = {}
        self._changes = 0  # busy spans begun, ended or dropped: the spans cache's key
        #: gpu -> ((since, until, changes), its shares): a poll reads every kernel over one
        #: period, so the GPU's spans are swept once per poll, not once per kernel
        self._cached: dict[int, tuple[tuple[float, float, int], Shares]] = {}

    def uuid(self, gpu: int) -> str:
        return gpu_uuid(self.node_id, gpu)

    # -- memory -------------------------------------------------------------------
    def _check_gpu(self, gpu: int) -> None:
        if not isinstance(gpu, int) or not 0 <= gpu < len(self.capacities):
            raise ValueError(
                f"invalid device {gpu!r}: this node has {len(self.capacities)} simulated GPUs"
            )

    def used(self, gpu: int) -> int:
        with self._lock:
            return sum(self._used[gpu].values())

    def free(self, gpu: int) -> int:
        return self.capacities[gpu] - self.used(gpu)

    def alloc(self, pid: int, gpu: int, nbytes: int) -> None:
        self._check_gpu(gpu)
        if nbytes < 0:
            raise ValueError("negative allocation")
        with self._lock:
            in_use = sum(self._used[gpu].values())
            if in_use + nbytes > self.capacities[gpu]:
                raise SimOutOfMemoryError(
                    f"out of memory on simulated GPU {gpu}: tried to allocate "
                    f"{format_bytes(nbytes)}; {format_bytes(self.capacities[gpu] - in_use)} free of "
                    f"{format_bytes(self.capacities[gpu])}"
                )
            self._used[gpu][pid] = self._used[gpu].get(pid, 0) + nbytes

    def release(self, pid: int, gpu: int, nbytes: int) -> None:
        self._check_gpu(gpu)
        with self._lock:
            left = self._used[gpu].get(pid, 0) - nbytes
            if left > 0:
                self._used[gpu][pid] = left
            else:
                self._used[gpu].pop(pid, None)

    def held_by(self, pid: int) -> dict[int, int]:
        """Bytes per GPU that ``pid`` holds."""
        with self._lock:
            return {g: by_pid[pid] for g, by_pid in self._used.items() if by_pid.get(pid)}

    def take_all(self, pid: int) -> dict[int, int]:
        """Free everything ``pid`` holds (process exit, checkpoint); return what it held."""
        with self._lock:
            held = {}
            for gpu, by_pid in self._used.items():
                n = by_pid.pop(pid, 0)
                if n:
                    held[gpu] = n
            return held

    def reserve(self, pid: int, per_gpu: dict[int, int]) -> None:
        """Allocate several GPUs at once, all or nothing (a restore)."""
        with self._lock:
            for gpu, n in per_gpu.items():
                self._check_gpu(gpu)
                free = self.capacities[gpu] - sum(self._used[gpu].values())
                if n > free:
                    raise SimOutOfMemoryError(
                        f"simulated GPU {gpu} has {format_bytes(free)} free, "
                        f"{format_bytes(n)} needed"
                    )
            for gpu, n in per_gpu.items():
                self._used[gpu][pid] = self._used[gpu].get(pid, 0) + n

    def set_usage(self, pid: int, per_gpu: dict[int, int]) -> None:
        """Set what ``pid`` holds to exactly ``per_gpu`` (an agent's count after it
        reconnected); all or nothing: refused if a GPU is invalid or would be over capacity."""
        with self._lock:
            for gpu, n in per_gpu.items():
                self._check_gpu(gpu)
                if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                    raise ValueError(f"bytes on GPU {gpu} must be an integer >= 0, got {n!r}")
                others = sum(b for p, b in self._used[gpu].items() if p != pid)
                if others + n > self.capacities[gpu]:
                    raise SimOutOfMemoryError(
                        f"simulated GPU {gpu} cannot hold {format_bytes(n)} for pid {pid}: "
                        f"{format_bytes(self.capacities[gpu] - others)} free"
                    )
            for gpu in range(len(self.capacities)):
                n = per_gpu.get(gpu, 0)
                if n:
                    self._used[gpu][pid] = n
                else:
                    self._used[gpu].pop(pid, None)

    def end_busy(self, pid: int) -> None:
        """Close ``pid``'s open busy intervals (its channel dropped: their ends may be lost)."""
        now = clock.now()
        with self._lock:
            self._changes += 1
            for (p, _), b in self._busy.items():
                if p == pid and b.open_since is not None:
                    b.close(now)

    def drop_pid(self, pid: int) -> None:
        self.take_all(pid)
        with self._lock:
            self._changes += 1
            for key in [k for k in self._busy if k[0] == pid]:
                del self._busy[key]

    def drop_gone(self, alive: Callable[[int], bool]) -> list[int]:
        """Drop every pid for which ``alive(pid)`` is false: a process's memory is freed when
        the process exits, as on a real GPU (not when its channel closes). Returns them."""
        with self._lock:
            known = {p for by_pid in self._used.values() for p in by_pid} | {p for p, _ in self._busy}
        gone = [p for p in known if not alive(p)]
        for pid in gone:
            self.drop_pid(pid)
        return gone

    def pids(self) -> dict[int, dict[int, int]]:
        """pid -> gpu -> bytes, for every pid holding memory."""
        with self._lock:
            out: dict[int, dict[int, int]] = defaultdict(dict)
            for gpu, by_pid in self._used.items():
                for pid, n in by_pid.items():
                    if n:
                        out[pid][gpu] = n
            return dict(out)

    # -- busy time ----------------------------------------------------------------
    def busy_begin(self, pid: int, gpu: int, at: float | None = None, sm: float = FULL) -> None:
        """``pid`` computes on ``gpu``, asking ``sm`` % of its time (0 < sm <= 100)."""
        self._check_gpu(gpu)
        sm = check_sm(sm)
        with self._lock:
            b = self._busy.setdefault((pid, gpu), _Busy([]))
            self._changes += 1
            if b.open_since is None:
                b.open_since = clock.now() if at is None else at
                b.open_sm = sm

    def busy_end(self, pid: int, gpu: int, at: float | None = None) -> None:
        with self._lock:
            b = self._busy.get((pid, gpu))
            if b is None or b.open_since is None:
                return
            self._changes += 1
            b.close(clock.now() if at is None else at)
            # keep the ledger bounded: one hour of intervals is more than any window
            horizon = clock.now() - 3600
            b.intervals = [iv for iv in b.intervals if iv[1] >= horizon][-10000:]

    def _spans(self, gpu: int, since: float, until: float) -> list[Span]:
        """Every process's busy spans on ``gpu`` that overlap [since, until] (lock held)."""
        out: list[Span] = []
        for (p, g), b in self._busy.items():
            if g != gpu:
                continue
            out.extend((s, e, sm, p) for s, e, sm in b.since(since) if s < until)
            if b.open_since is not None and b.open_since < until:
                out.append((b.open_since, until, b.open_sm, p))
        return out

    def _shares(self, gpu: int, since: float, until: float) -> Shares:
        """:func:`shares` of ``gpu`` over [since, until] (lock held), swept once per period."""
        key = (since, until, self._changes)
        hit = self._cached.get(gpu)
        if hit is None or hit[0] != key:
            hit = key, shares(self._spans(gpu, since, until), since, until)
            self._cached[gpu] = hit
        return hit[1]

    def busy_fraction(self, pid: int | None, gpu: int, since: float, until: float) -> float:
        """Share of [since, until] in which a kernel ran on ``gpu`` (NVML's utilization):
        any process's (None), or ``pid``'s (its share of the GPU's time)."""
        if until <= since:
            return 0.0
        with self._lock:
            if pid is not None:  # a poll asks this of every kernel: most are not busy
                one = self._busy.get((pid, gpu))
                if one is None or (one.open_since is None and not any(
                        s < until for s, _, _ in one.since(since))):
                    return 0.0
            ran, mine, _ = self._shares(gpu, since, until)
        return min(1.0, (ran if pid is None else mine.get(pid, 0.0)) / (until - since))

    def busy_work(self, pid: int, gpu: int, until: float | None = None) -> tuple[float, float]:
        """(seconds of full-speed work ``pid`` has done on ``gpu`` since its busy_begin, the
        speed it runs at now): (0, 1) when it is not busy there."""
        until = clock.now() if until is None else until
        with self._lock:
            b = self._busy.get((pid, gpu))
            if b is None or b.open_since is None:
                return 0.0, 1.0
            since = b.open_since
            spans = self._spans(gpu, since, until)
        return work_and_speed(spans, since, until, pid)


Span = tuple[float, float, float, int]  # (start, end, sm %, pid)
Shares = tuple[float, dict[int, float], dict[int, float]]  # what shares() answers


def check_sm(sm: object) -> float:
    """``sm`` as a share of a GPU's time in %: a number > 0 and <= 100, else ValueError."""
    if isinstance(sm, bool) or not isinstance(sm, (int, float)) or not 0 < sm <= 100:
        raise ValueError(f"sm must be a number of % > 0 and <= 100, got {sm!r}")
    return float(sm)


def shared_time(spans: list[Span], since: float, until: float,
                pid: int | None = None) -> tuple[float, float, float]:
    """Over [since, until], with ``spans`` the GPU's busy processes and the share each asks:
    (seconds in which a kernel ran, seconds of it that were ``pid``'s, seconds of full-speed
    work ``pid`` did). While the shares asked add up to D > 100 %, the GPU runs all the time
    and each process at speed 100 / D (time-slicing): a process asking d % gets d / D of it."""
    ran, mine, work = shares(spans, since, until)
    if pid is None:
        return ran, 0.0, 0.0
    return ran, mine.get(pid, 0.0), work.get(pid, 0.0)


def shares(spans: list[Span], since: float, until: float
           ) -> tuple[float, dict[int, float], dict[int, float]]:
    """:func:`shared_time` for every process at once: (seconds in which a kernel ran,
    pid -> seconds of it that were its, pid -> seconds of full-speed work it did)."""
    edges: list[tuple[float, float, int]] = []  # (time, change of the pid's share, pid)
    for s, e, sm, p in spans:
        s, e = max(s, since), min(e, until)
        if e > s:
            edges += [(s, sm, p), (e, -sm, p)]
    edges.sort()
    ran = 0.0
    mine: dict[int, float] = {}
    work: dict[int, float] = {}
    asked: dict[int, float] = {}  # pid -> share it asks now
    demand = 0.0
    last = since
    for t, change, p in edges:
        if t > last and demand > 1e-9:
            span = t - last
            speed = min(1.0, FULL / demand)
            ran += span * min(1.0, demand / FULL)
            for q, sm in asked.items():
                mine[q] = mine.get(q, 0.0) + span * sm / FULL * speed
                work[q] = work.get(q, 0.0) + span * speed
        last = max(last, t)
        demand += change
        left = asked.get(p, 0.0) + change
        if left > 1e-9:
            asked[p] = left
        else:
            asked.pop(p, None)
    return ran, mine, work


def work_and_speed(spans: list[Span], since: float, until: float, pid: int) -> tuple[float, float]:
    """(seconds of full-speed work ``pid`` did over [since, until], its speed at ``until``)."""
    _, _, work = shared_time(spans, since, until, pid)
    demand = sum(sm for s, e, sm, _ in spans if s <= until and e >= until)
    return work, min(1.0, FULL / demand) if demand > 0 else 1.0
