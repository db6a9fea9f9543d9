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

Covered by tests/gpu/test_offload_cuda.py only: CuPy cannot run without a GPU (the shared
undo bookkeeping is tested on CPU in tests/test_offload_txn.py).
"""

from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..walk import Child, Ref, walk_namespace
from .base import OffloadAdapter, OffloadReport
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
_streams: dict[int, Any] = {}  # one copy stream per GPU for the kernel process


def _pinned_alloc(nbytes: int) -> Any:
    return _cupy().cuda.alloc_pinned_memory(nbytes)


def pinned_pool() -> PinnedPool:
    global _pool
    if _pool is None:
        _pool = PinnedPool(_pinned_alloc)
    return _pool


def _copy_stream(device_id: int) -> Any:
    """The device's copy stream, made to wait for the work queued on its current stream
    (call inside ``Device(device_id)``)."""
    cupy = _cupy()
    stream = _streams.get(device_id)
    if stream is None:
        stream = _streams[device_id] = cupy.cuda.Stream(non_blocking=True)
    stream.wait_event(cupy.cuda.get_current_stream().record())
    return stream


def _sync_devices(device_ids: Iterable[int]) -> None:
    """One wait per device, each waited for even if another fails."""
    cupy = _cupy()
    error: BaseException | None = None
    for device_id in dict.fromkeys(device_ids):
        stream = _streams.get(device_id)
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
        pinned_pool().clear()  # the kept pinned buffers: host memory a checkpoint needs
        cupy.get_default_pinned_memory_pool().free_all_blocks()
        return max(0, int(before - pool.total_bytes()))

    def offload(self, namespace: dict[str, Any]) -> OffloadReport:
        report = OffloadReport(framework=self.name)
        if self._groups:
            return report
        start = time.perf_counter()
        cupy = _cupy()
        groups = self._find_groups(namespace, report)
        if groups and (why := _probe()):
            for g in groups:
                report.skip(f"{g.paths[0]}: cannot re-point CuPy arrays ({why})")
            return report
        before = self.device_bytes()
        # 1. copy every allocation to pinned host memory, queued on each GPU's copy stream,
        # then one wait per GPU; nothing has changed if this fails
        pool = pinned_pool()
        streams: dict[int, Any] = {}
        try:
            for group in groups:
                with cupy.cuda.Device(group.device_id):
                    if group.device_id not in streams:
                        streams[group.device_id] = _copy_stream(group.device_id)
                    group.host = pool.take(group.nbytes)
                    # no local name for the source pointer: it would keep the allocation alive
                    cupy.cuda.MemoryPointer(group.mem, 0).copy_to_host_async(
                        ctypes.c_void_p(group.host.ptr), group.nbytes,
                        stream=streams[group.device_id],
                    )
            _sync_devices(streams)
        except BaseException:
            self._drop_host_copies(groups, streams)
            raise
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
            self._drop_host_copies(groups, {})
            raise
        for group in groups:
            group.mem = None  # the last reference to the device allocation
            report.bytes += group.nbytes
            report.count += len(group.arrays)
        self._groups = groups
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
        for group in groups:  # kept for the next cycle (bounded), or freed
            host, group.host = group.host, None
            # an array the user made while offloaded still points into it (through the
            # UnownedMemory that holds it): never reuse it then. References: ``host`` and
            # getrefcount's argument
            if sys.getrefcount(host) <= 2:
                pool.give(host, group.nbytes)
            del host
        if pool.end_cycle():
            cupy.get_default_pinned_memory_pool().free_all_blocks()
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
    def _drop_host_copies(groups: list[_Group], streams: dict[int, Any]) -> None:
        """After a failed move: wait for the queued copies, then give the buffers back to
        the pool (if the wait fails, drop them: memory a copy may still write is not reused)."""
        try:
            _sync_devices(streams)
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
