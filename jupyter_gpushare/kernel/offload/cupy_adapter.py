"""CuPy: move device arrays reachable from the namespace to pinned host memory, in place.

CuPy has no Python API to swap an array's memory, but ``ndarray.__init__`` accepts a
``memptr`` and ``strides``; calling it again on the existing object (after clearing its shape
vector, which ``__init__`` appends to) re-points the very same object at new memory. Whether
this works is checked once per process on a scratch array (:func:`_probe`); if the installed
CuPy behaves differently, nothing is moved and the report says why.

Arrays sharing one allocation (views) move together: one pinned copy per allocation, every
array re-pointed at its offset inside it. While offloaded, arrays point at the pinned host
copy, which CUDA maps into the device address space (UVA), so an accidental access is slow
but correct rather than a read of freed memory. An allocation that something outside the
namespace also points to is left alone and reported (moving it would split the aliases).

All or nothing (:mod:`.txn`): every allocation is copied first; then every array is
re-pointed, and if one refuses, those already re-pointed go back to the memory they had, so
a failed offload or reload leaves every array exactly as it was and raises.

Speed, as for PyTorch: the pinned host copies come from a pool kept across cycles
(:class:`.pinned.PinnedPool`, bounded by ``$JUPYTER_GPUSHARE_PINNED_KEEP``; ``trim`` frees
it), every copy is issued on one non-blocking stream per GPU that first waits for the
device's current stream, and each move ends with one synchronize per GPU.

Incremental releases: after a restore the host copy of each allocation is kept (``_kept``,
by GPU and address; ``$JUPYTER_GPUSHARE_KEEP_HOST_COPY=0`` turns it off), and so is a
pre-copy's (:meth:`CupyAdapter.precopy`, a thread of the agent while the kernel is idle).
CuPy has no version counters, so the next release takes a kept copy as it is only when it is
provably current: made current at the agent's epoch that still holds (no code can have run
since, :mod:`.quiet`), or, under ``$JUPYTER_GPUSHARE_KEPT_CHECK`` "full" (the default) or
"sampled", when the allocation's fingerprint, read on its GPU, is the one taken with the
copy (:func:`fingerprint`). Under "counters" no fingerprint is read: a copy the epoch does
not vouch for is copied again (nothing is lost; only the epoch saves a copy). A written
allocation is copied into its kept copy's own buffer: no new pinned host memory.

Covered on CPU by tests/test_incremental_cupy.py through a CuPy faked at its device
(tests/fakes/fake_cupy.py: "GPU memory" made of host memory); on a GPU by
tests/gpu/test_offload_cuda.py and tests/gpu/test_incremental_cupy_gpu.py.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..walk import Child, Ref, walk_namespace
from . import quiet
from .base import OffloadAdapter, OffloadReport, drop_oldest, keep_host_copies, kept_check
from .pinned import PinnedPool
from .txn import Change, UndoIncomplete, apply_all

_probe_result: str | None = None  # "" when re-pointing works, else why not


def _cupy() -> Any:
    import cupy

    return cupy


Geometry = tuple[tuple[int, ...], tuple[int, ...], Any]  # shape, strides, dtype


def _geometry(array: Any) -> Geometry:
    return tuple(array.shape), tuple(array.strides), array.dtype


def _init(array: Any, memptr: Any, geometry: Geometry) -> None:
    cupy = _cupy()
    shape, strides, dtype = geometry
    array._shape = ()  # __init__ pushes the dimensions onto the existing vector
    cupy.ndarray.__init__(array, shape, dtype, memptr=memptr, strides=strides)
    if _geometry(array) != geometry or array.data.ptr != memptr.ptr:
        raise RuntimeError("cupy.ndarray.__init__ did not re-point the array as expected")


def _repoint(array: Any, memptr: Any) -> None:
    """Point ``array`` (same object, shape, strides, dtype) at ``memptr``. On failure the
    array points where it did before (its own pointer object) or the error says it cannot."""
    geometry, old = _geometry(array), array.data
    try:
        _init(array, memptr, geometry)
    except BaseException as exc:
        try:
            _init(array, old, geometry)
        except BaseException as undo_exc:
            raise UndoIncomplete(exc, [f"cupy array: {undo_exc}"]) from exc
        raise


def _probe() -> str:
    """Check once that re-pointing keeps values, views and aliasing on this CuPy."""
    global _probe_result
    if _probe_result is None:
        cupy = _cupy()
        try:
            base = cupy.arange(8, dtype=cupy.float32)
            view = base[2:6:2]
            fresh = cupy.cuda.alloc(base.nbytes)
            fresh.copy_from_device(base.data, base.nbytes)
            offset = view.data.ptr - base.data.ptr
            _repoint(base, fresh)
            _repoint(view, fresh + offset)
            view[0] = -1
            ok = view.base is base and float(base[2]) == -1.0 and float(base[7]) == 7.0
            _probe_result = "" if ok else "re-pointed arrays lost their values or aliasing"
        except Exception as exc:
            _probe_result = f"{type(exc).__name__}: {exc}"
    return _probe_result


_pool: PinnedPool | None = None
#: (GPU, background) -> the copy stream of the kernel process: the release's and restore's,
#: or a pre-copy's (apart from the release's: a release never waits for a pre-copy's queue)
_streams: dict[tuple[int, bool], Any] = {}


def _pinned_alloc(nbytes: int) -> Any:
    return _cupy().cuda.alloc_pinned_memory(nbytes)


def pinned_pool() -> PinnedPool:
    global _pool
    if _pool is None:
        _pool = PinnedPool(_pinned_alloc)
    return _pool


def _copy_stream(device_id: int, background: bool = False) -> Any:
    """The device's copy stream, made to wait for the work queued on its current stream
    (call inside ``Device(device_id)``). CUDA's default priority is its lowest: the cells'
    work comes first."""
    cupy = _cupy()
    stream = _streams.get((device_id, background))
    if stream is None:
        stream = _streams[(device_id, background)] = cupy.cuda.Stream(non_blocking=True)
    stream.wait_event(cupy.cuda.get_current_stream().record())
    return stream


def _sync_devices(device_ids: Iterable[int], background: bool = False) -> None:
    """One wait per device, each waited for even if another fails."""
    cupy = _cupy()
    error: BaseException | None = None
    for device_id in dict.fromkeys(device_ids):
        stream = _streams.get((device_id, background))
        if stream is None:
            continue
        try:
            with cupy.cuda.Device(device_id):
                stream.synchronize()
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error


def array_children(array: Any) -> Iterable[Child]:
    if array.base is not None:
        yield ".base", array.base, Ref(array, "base", "fixed")


@dataclass
class _Group:
    """Arrays sharing one allocation (``array.data.mem``)."""

    mem: Any
    device_id: int
    nbytes: int
    arrays: list[Any] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    host: Any = None  # PinnedMemoryPointer while offloaded
    kept: _Kept | None = None  # the kept copy ``host`` came from (nothing was copied)

    @property
    def key(self) -> tuple[int, int]:
        return self.device_id, self.mem.ptr


# -- fingerprints: whether an allocation's bytes changed, read on its own GPU ---------------
# sum(w[i] * word[i]) mod 2**64 over the allocation's 32-bit words (the last bytes alone),
# each weight odd (column weight x row weight x chunk weight, drawn per process): any change
# of one word changes it, any other change leaves it equal with a probability below 2**-32.
# CuPy's own operations, so the same code runs on a GPU (at its memory bandwidth, temporaries
# of one chunk) and on the CPU tests' fake, whose device arrays are NumPy's.
_FP_COLUMNS = 4096  # 32-bit words per row
_FP_ROWS = 2048  # rows per chunk: 32 MiB of the allocation at a time
_SAMPLE_ALL_BELOW = 1 << 20  # "sampled" check: allocations up to 1 MiB are read whole
_SAMPLE_STRIDE = 1024  # "sampled" check: one 32-bit word per 4 KiB
_FP_SEED = int.from_bytes(os.urandom(8), "little")
_SAMPLE_OFFSET = _FP_SEED % _SAMPLE_STRIDE  # which word of each 4 KiB, drawn per process
_fp_weights: dict[int, tuple[Any, Any]] = {}  # GPU -> (column weights, row weights)


def _odd_weights(n: int, seed: int) -> Any:
    import numpy

    raw = numpy.random.default_rng(seed).bytes(8 * n)
    return numpy.frombuffer(raw, dtype=numpy.uint64) | numpy.uint64(1)


def _weights(device_id: int) -> tuple[Any, Any]:
    found = _fp_weights.get(device_id)
    if found is None:
        cupy = _cupy()
        with cupy.cuda.Device(device_id):
            found = (cupy.asarray(_odd_weights(_FP_COLUMNS, _FP_SEED)),
                     cupy.asarray(_odd_weights(_FP_ROWS, _FP_SEED + 1)))
        _fp_weights[device_id] = found
    return found


def fingerprint(pointer: Any, nbytes: int, check: str = "full") -> Any:
    """The fingerprint of ``nbytes`` at ``pointer`` (a ``MemoryPointer``; ``check``: "full"
    or "sampled": one word per 4 KiB of an allocation over 1 MiB) as a one-element uint64
    array on its GPU, queued on the current stream (read it once that stream ran)."""
    cupy = _cupy()
    nwords = nbytes // 4
    words = cupy.ndarray((nwords,), cupy.uint32, memptr=pointer)
    if check == "sampled" and nbytes > _SAMPLE_ALL_BELOW:
        return _words_fingerprint(words[_SAMPLE_OFFSET::_SAMPLE_STRIDE], pointer.device_id)
    tail = None
    if nbytes > nwords * 4:
        tail = cupy.ndarray((nbytes - nwords * 4,), cupy.uint8, memptr=pointer + nwords * 4)
    return _words_fingerprint(words, pointer.device_id, tail)


def _words_fingerprint(words: Any, device_id: int, tail: Any = None) -> Any:
    """sum(w[i] * words[i]) mod 2**64 over a flat uint32 array (and ``tail``'s bytes), chunk
    by chunk; one-element arrays throughout (no scalar arithmetic, which would warn)."""
    import numpy

    cupy = _cupy()
    cols, rows = _weights(device_id)
    chunk = _FP_COLUMNS * _FP_ROWS
    starts = range(0, int(words.size), chunk)
    per_chunk = _odd_weights(len(starts) + 1, _FP_SEED + 2)  # the last one: the tail's
    total = None
    for index, start in enumerate(starts):
        part = words[start:start + chunk].astype(numpy.uint64)
        full = int(part.size) // _FP_COLUMNS
        per_row = (part[:full * _FP_COLUMNS].reshape(full, _FP_COLUMNS) * cols).sum(axis=1)
        value = (per_row * rows[:full]).sum(keepdims=True)
        if full * _FP_COLUMNS < part.size:  # the last row, short
            rest = part[full * _FP_COLUMNS:]
            value = value + (rest * cols[:rest.size]).sum(keepdims=True) * rows[full:full + 1]
        term = value * per_chunk[index]
        total = term if total is None else total + term
    if tail is not None:
        term = (tail.astype(numpy.uint64) * cols[:tail.size]).sum(keepdims=True) * per_chunk[-1]
        total = term if total is None else total + term
    return total if total is not None else cupy.zeros(1, dtype=numpy.uint64)


def _read(values: list[Any]) -> list[int]:
    """The values of fingerprints whose streams were waited for."""
    return [int(value[0]) for value in values]


# -- kept host copies -------------------------------------------------------------------------
@dataclass
class _Kept:
    """A host copy kept while the kernel is resident: of the allocation at ``key`` (GPU,
    address) of ``nbytes``, with the fingerprint of the bytes copied under ``check`` (None:
    not taken, "counters") and the epoch it was made current at (None: not known)."""

    host: Any  # PinnedMemoryPointer of nbytes
    nbytes: int
    device_id: int
    #: the arrays of the allocation at the copy (weak): all gone, the allocation is freed
    arrays: list[weakref.ref]
    fingerprint: int | None
    check: str
    epoch: int | None
    at: float = field(default_factory=time.monotonic)

    def alive(self) -> bool:
        return any(ref() is not None for ref in self.arrays)


#: (GPU, allocation address) -> its kept host copy; process-wide (adapters are made anew for
#: each release). The release, the restore and the pre-copy thread never run at once (the
#: agent stops the pre-copy first); reports read it from the channel's thread: the lock.
_kept: dict[tuple[int, int], _Kept] = {}
_kept_lock = threading.RLock()


def _unchanged(candidates: list[tuple[_Group, _Kept]], check: str, epoch: int | None,
               report: OffloadReport, background: bool = False) -> set[tuple[int, int]]:
    """Of (group, kept copy of its size) pairs, the allocations whose kept copy is current:
    made current at ``epoch``, the agent's epoch now (no code ran since, :mod:`.quiet`), or,
    under "full" or "sampled", whose fingerprint now is the copy's. A copy taken under
    another check, or a fingerprint that cannot be taken (no room for its temporaries),
    counts as changed. ``report`` counts the bytes trusted by the epoch and those read."""
    cupy = _cupy()
    trusted = {g.key for g, e in candidates if epoch is not None and e.epoch == epoch}
    report.trusted += sum(g.nbytes for g, _ in candidates if g.key in trusted)
    rest = [(g, e) for g, e in candidates if g.key not in trusted and check != "counters"
            and e.check == check and e.fingerprint is not None]
    if not rest:
        return trusted
    try:
        queued = []
        for group, _ in rest:
            with cupy.cuda.Device(group.device_id):
                with _copy_stream(group.device_id, background):
                    queued.append(fingerprint(cupy.cuda.MemoryPointer(group.mem, 0),
                                              group.nbytes, check))
        _sync_devices((g.device_id for g, _ in rest), background)
        values = _read(queued)
    except Exception:
        return trusted
    report.checked += sum(g.nbytes for g, _ in rest)
    return trusted | {g.key for (g, e), value in zip(rest, values, strict=True)
                      if e.fingerprint == value}


def _host_buffer(group: _Group) -> Any:
    """The buffer a copy of ``group`` goes into: its stale kept copy's when the size fits (a
    written allocation pins no new host memory), else one from the pool. The kept copy stops
    being one before anything is copied into it (call with ``_kept_lock`` held)."""
    old = _kept.pop(group.key, None)
    if old is not None and old.nbytes == group.nbytes:
        return old.host
    if old is not None:
        pinned_pool().give(old.host, old.nbytes)
    del old
    return pinned_pool().take(group.nbytes)


def kept_copies() -> dict[str, int]:
    """The kept host copies now: "current", device bytes the epoch vouches for (no code ran
    since they were made current; the fingerprints are read at release only); "reused",
    those not vouched for whose allocation lives, which a release copies into the kept
    buffer if written; "kept", host bytes they hold."""
    now = quiet.epoch()
    with _kept_lock:
        entries = list(_kept.values())
    current = reused = 0
    for entry in entries:
        if not entry.alive():
            continue
        if now is not None and entry.epoch == now:
            current += entry.nbytes
        else:
            reused += entry.nbytes
    return {"current": current, "reused": reused, "kept": sum(e.nbytes for e in entries)}


def drop_kept(wanted: int | None = None) -> int:
    """Free kept host copies, oldest first, until ``wanted`` bytes are freed (None: all)."""
    freed = drop_oldest(_kept, _kept_lock, wanted)
    if freed and "cupy" in sys.modules:
        _cupy().get_default_pinned_memory_pool().free_all_blocks()
    return freed


class CupyAdapter(OffloadAdapter):
    module = "cupy"
    name = "cupy"

    def __init__(
        self,
        *,
        repoint: Callable[[Any, Any], None] | None = None,
        max_depth: int = 100,
        max_objects: int = 1_000_000,
    ) -> None:
        """repoint(array, memptr): point one array at other memory, or raise and leave it
        as it was (default: ``ndarray.__init__`` on the same object; tests inject refusals)."""
        self.repoint = repoint or _repoint
        self.walk_options = {"max_depth": max_depth, "max_objects": max_objects}
        self._groups: list[_Group] = []

    def device_bytes(self) -> int:
        return int(_cupy().get_default_memory_pool().total_bytes())

    def trim(self) -> int:
        cupy = _cupy()
        pool = cupy.get_default_memory_pool()
        before = pool.total_bytes()
        pool.free_all_blocks()
        drop_kept()  # the kept copies and pinned buffers: host memory a checkpoint needs
        pinned_pool().clear()
        cupy.get_default_pinned_memory_pool().free_all_blocks()
        return max(0, int(before - pool.total_bytes()))

    def host_copies(self) -> dict[str, int]:
        kept = kept_copies()
        reused = kept.pop("reused")
        weights = sum(int(c.nbytes) + int(r.nbytes) for c, r in list(_fp_weights.values()))
        used = int(_cupy().get_default_memory_pool().used_bytes()) - weights
        to_copy = max(0, used - kept["current"])
        return {**kept, "to_copy": to_copy, "to_copy_new": max(0, to_copy - reused)}

    def drop_host_copies(self, wanted: int | None = None) -> int:
        return drop_kept(wanted)

    def offload(self, namespace: dict[str, Any]) -> OffloadReport:
        report = OffloadReport(framework=self.name)
        if self._groups:
            return report
        start = time.perf_counter()
        cupy = _cupy()
        now = quiet.epoch()  # a kept copy current at this epoch was written by no one since
        groups = self._find_groups(namespace, report)
        if groups and (why := _probe()):
            for g in groups:
                report.skip(f"{g.paths[0]}: cannot re-point CuPy arrays ({why})")
            return report
        before = self.device_bytes()
        # 1. copy every allocation to pinned host memory, queued on each GPU's copy stream,
        # then one wait per GPU, except those whose kept copy is current; nothing has changed
        # if this fails (the kept copies taken go back)
        streams: dict[int, Any] = {}
        with _kept_lock:
            candidates = [(g, e) for g in groups
                          if (e := _kept.get(g.key)) is not None and e.nbytes == g.nbytes]
            unchanged = _unchanged(candidates, kept_check(), now, report)
            try:
                for group in groups:
                    if group.key in unchanged:
                        group.kept = _kept.pop(group.key)
                        group.host = group.kept.host
                        continue
                    with cupy.cuda.Device(group.device_id):
                        if group.device_id not in streams:
                            streams[group.device_id] = _copy_stream(group.device_id)
                        group.host = _host_buffer(group)
                        # no local name for the source pointer: it would keep the allocation alive
                        cupy.cuda.MemoryPointer(group.mem, 0).copy_to_host_async(
                            ctypes.c_void_p(group.host.ptr), group.nbytes,
                            stream=streams[group.device_id],
                        )
                    report.copied += group.nbytes
                _sync_devices(streams)
            except BaseException:
                for group in groups:
                    if group.kept is not None:
                        _kept[group.key], group.kept, group.host = group.kept, None, None
                self._drop_host_copies(groups, streams)
                raise
            # the other kept copies are of allocations gone or left on the device: freed now
            stale = bool(_kept)
            _kept.clear()
        if stale:
            cupy.get_default_pinned_memory_pool().free_all_blocks()
        # 2. re-point every array at its host copy, all or nothing. The device sees
        # page-locked host memory at the same address (UVA).
        hosts = [
            cupy.cuda.MemoryPointer(
                cupy.cuda.UnownedMemory(g.host.ptr, g.nbytes, g.host, g.device_id), 0
            )
            for g in groups
        ]
        try:
            apply_all(self._changes(groups, hosts))
        except BaseException:
            del hosts
            for group in groups:
                group.kept = None
            self._drop_host_copies(groups, {})
            raise
        for group in groups:
            group.mem = None  # the last reference to the device allocation
            group.kept = None
            report.bytes += group.nbytes
            report.count += len(group.arrays)
        self._groups = groups
        _fp_weights.clear()  # a released kernel holds nothing on the GPU
        self.trim()
        report.freed_bytes = max(0, before - self.device_bytes())
        report.seconds = time.perf_counter() - start
        return report

    def reload(self) -> OffloadReport:
        report = OffloadReport(framework=self.name)
        if not self._groups:
            return report
        start = time.perf_counter()
        cupy = _cupy()
        began = quiet.epoch()  # the kept copies are current as of it, if no code runs
        fresh = []
        streams: dict[int, Any] = {}
        try:
            # 1. allocate and fill every device allocation, queued on each GPU's copy
            # stream, then one wait per GPU
            for group in self._groups:
                with cupy.cuda.Device(group.device_id):
                    if group.device_id not in streams:
                        streams[group.device_id] = _copy_stream(group.device_id)
                    memptr = cupy.cuda.alloc(group.nbytes)
                    memptr.copy_from_host_async(ctypes.c_void_p(group.host.ptr), group.nbytes,
                                                stream=streams[group.device_id])
                    fresh.append(memptr)
            _sync_devices(streams)
            # 2. re-point every array at it, all or nothing
            apply_all(self._changes(self._groups, fresh))
        except BaseException:
            try:  # queued copies finish before their target memory goes back to the pool
                _sync_devices(streams)
            except BaseException:
                pass
            del fresh  # still fully offloaded; a later reload may find room
            cupy.get_default_memory_pool().free_all_blocks()
            raise
        for group in self._groups:
            report.bytes += group.nbytes
            report.count += len(group.arrays)
        groups, self._groups = self._groups, []
        pool = pinned_pool()
        keep: list[tuple[_Group, Any, Any]] = []  # (group, device pointer, host copy)
        for group, memptr in zip(groups, fresh, strict=True):
            host, group.host = group.host, None
            # an array the user made while offloaded still points into it (through the
            # UnownedMemory that holds it): never reuse it then. References: ``host`` and
            # getrefcount's argument
            if sys.getrefcount(host) <= 2:
                if keep_host_copies():  # the next release copies what changes
                    keep.append((group, memptr, host))
                else:  # kept for the next cycle (bounded), or freed
                    pool.give(host, group.nbytes)
            del host
        self._keep(keep, streams, began)
        del keep, fresh
        if pool.end_cycle():
            cupy.get_default_pinned_memory_pool().free_all_blocks()
        report.seconds = time.perf_counter() - start
        return report

    def _keep(self, keep: list[tuple[_Group, Any, Any]], streams: dict[int, Any],
              began: int | None) -> None:
        """Keep the restored allocations' host copies, with the fingerprints of the bytes
        restored (one wait per GPU); no room for a fingerprint's temporaries: none kept."""
        cupy = _cupy()
        check = kept_check()
        prints: list[int | None] = [None] * len(keep)
        if keep and check != "counters":
            try:
                queued = []
                for group, memptr, _ in keep:
                    with cupy.cuda.Device(group.device_id), streams[group.device_id]:
                        queued.append(fingerprint(memptr, group.nbytes, check))
                _sync_devices(streams)
                prints = list(_read(queued))
            except Exception:
                for group, _, host in keep:
                    pinned_pool().give(host, group.nbytes)
                return
        made = quiet.same_epoch(began)
        with _kept_lock:
            for (group, memptr, host), print_ in zip(keep, prints, strict=True):
                _kept[(group.device_id, memptr.mem.ptr)] = _Kept(
                    host, group.nbytes, group.device_id, [weakref.ref(a) for a in group.arrays],
                    print_, check, made)

    def precopy(self, namespace: dict[str, Any], stop: Any = None) -> OffloadReport:
        """Copy to host, while cells may run, every allocation whose kept copy is not current.

        On a thread of the agent, on each GPU's pre-copy stream (which first waits for the
        work queued by then). Each copy is queued after its allocation's fingerprint, on the
        same stream: a write between the two makes them differ, and the release copies that
        allocation again. ``stop`` set (a cell started): no further copy is queued, and
        none of this pre-copy's copies is kept (the cell may have written an allocation
        between its fingerprint and its copy and back after)."""
        report = OffloadReport(framework=self.name)
        check = kept_check()
        if self._groups or (check == "counters" and quiet.epoch() is None):
            return report  # offloaded; or nothing this pre-copy made could be trusted
        start = time.perf_counter()
        cupy = _cupy()
        groups = self._find_groups(namespace, report)
        if not groups or _probe():
            return report
        if quiet.epoch() is not None:  # trusted by the epoch: no GPU work may run behind
            for device_id in dict.fromkeys(g.device_id for g in groups):  # the copies
                with cupy.cuda.Device(device_id) as device:
                    device.synchronize()
        began = quiet.epoch()  # before any byte is read
        with _kept_lock:
            candidates = [(g, e) for g in groups
                          if (e := _kept.get(g.key)) is not None and e.nbytes == g.nbytes]
        unchanged = _unchanged(candidates, check, began, report, background=True)
        queued: list[tuple[_Group, Any]] = []
        try:
            for group in groups:
                if stop is not None and stop.is_set():
                    break
                if group.key in unchanged:
                    continue
                with cupy.cuda.Device(group.device_id):
                    stream = _copy_stream(group.device_id, background=True)
                    with stream:
                        print_ = (None if check == "counters" else
                                  fingerprint(cupy.cuda.MemoryPointer(group.mem, 0),
                                              group.nbytes, check))
                    with _kept_lock:
                        group.host = _host_buffer(group)
                    queued.append((group, print_))
                    cupy.cuda.MemoryPointer(group.mem, 0).copy_to_host_async(
                        ctypes.c_void_p(group.host.ptr), group.nbytes, stream=stream)
            _sync_devices((g.device_id for g, _ in queued), background=True)
            prints = [None if p is None else _read([p])[0] for _, p in queued]
        except BaseException:
            self._drop_host_copies([g for g, _ in queued], {}, background=True)
            raise
        if stop is not None and stop.is_set():
            report.stopped = True
            self._drop_host_copies([g for g, _ in queued], {}, background=True)
            report.seconds = time.perf_counter() - start
            return report
        made = quiet.same_epoch(began)
        with _kept_lock:
            for (group, _), print_ in zip(queued, prints, strict=True):
                host, group.host = group.host, None
                _kept[group.key] = _Kept(host, group.nbytes, group.device_id,
                                         [weakref.ref(a) for a in group.arrays], print_,
                                         check, made)
                del host
                report.copied += group.nbytes
                report.count += len(group.arrays)
            for key in unchanged:
                if (entry := _kept.get(key)) is not None:
                    entry.epoch = made
        report.seconds = time.perf_counter() - start
        return report

    def _changes(self, groups: list[_Group], bases: list[Any]) -> Iterator[Change]:
        """Re-point each group's arrays at their offsets in ``bases`` (one per group); each
        change built just before it runs, so its undo holds the pointer of that moment."""
        for group, base in zip(groups, bases, strict=True):
            for array, offset, path in zip(group.arrays, group.offsets, group.paths, strict=True):
                yield Change(
                    do=lambda a=array, p=base + offset: self.repoint(a, p),
                    undo=lambda a=array, p=array.data: self.repoint(a, p),
                    what=path,
                )

    @staticmethod
    def _drop_host_copies(groups: list[_Group], streams: dict[int, Any],
                          background: bool = False) -> None:
        """After a failed or stopped move: wait for the queued copies, then give the buffers
        back to the pool (if the wait fails, drop them: memory a copy may still write is not
        reused)."""
        try:
            _sync_devices(streams or {g.device_id for g in groups}, background)
            waited = True
        except BaseException:
            waited = False
        pool = pinned_pool()
        for group in groups:
            host, group.host = group.host, None
            if waited and host is not None:
                pool.give(host, group.nbytes)
            del host
        _cupy().get_default_pinned_memory_pool().free_all_blocks()

    def _find_groups(self, namespace: dict[str, Any], report: OffloadReport) -> list[_Group]:
        cupy = _cupy()
        result = walk_namespace(
            namespace,
            lambda obj: isinstance(obj, cupy.ndarray),
            target_children=array_children,
            **self.walk_options,
        )
        if result.truncated:
            report.skip(f"<walk>: stopped after {result.visited} objects")
        groups, pointers = _group_by_allocation(result.found.values(), report)
        result.release()

        movable = []
        for group in groups.values():
            # every reference to the allocation must come from a pointer of a found array,
            # and every such pointer from a found array; else an outside alias would split
            holders = {id(a.data): a.data for a in group.arrays}
            outside = sys.getrefcount(group.mem) - 2 - len(holders)  # -2: group.mem, argument
            for key in holders:
                # references: the arrays holding it, ``holders``, the argument
                outside += sys.getrefcount(holders[key]) - 2 - len(pointers[key])
            if outside > 0:
                report.skip(
                    f"{group.paths[0]}: allocation also referenced outside the namespace; left alone"
                )
                continue
            movable.append(group)
        return movable


def _group_by_allocation(
    found: Iterable[Any], report: OffloadReport
) -> tuple[dict[int, _Group], dict[int, list[Any]]]:
    """Arrays by allocation, and arrays by the ``MemoryPointer`` object they hold (a
    separate function so that no loop variable still holds a reference when they are counted)."""
    cupy = _cupy()
    groups: dict[int, _Group] = {}
    pointers: dict[int, list[Any]] = {}
    for entry in found:
        array = entry.obj
        pointer = array.data
        mem = pointer.mem
        if array.nbytes == 0 or mem is None or mem.ptr == 0:
            continue
        if isinstance(mem, cupy.cuda.UnownedMemory):
            report.skip(f"{entry.path}: memory owned by another library; left alone")
            continue
        group = groups.get(id(mem))
        if group is None:
            group = groups[id(mem)] = _Group(mem, mem.device_id, mem.size)
        group.arrays.append(array)
        group.offsets.append(pointer.ptr - mem.ptr)
        group.paths.append(entry.path)
        pointers.setdefault(id(pointer), []).append(array)
    return groups, pointers
