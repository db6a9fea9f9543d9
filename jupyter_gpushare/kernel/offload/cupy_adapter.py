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

Covered by tests/gpu/test_offload_cuda.py only: CuPy cannot run without a GPU.
"""

from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .base import OffloadAdapter, OffloadReport
from .walk import Child, Ref, names_reaching, walk_namespace

_probe_result: str | None = None  # "" when re-pointing works, else why not


def _cupy() -> Any:
    import cupy

    return cupy


def _repoint(array: Any, memptr: Any) -> None:
    """Point ``array`` (same object, shape, strides, dtype) at ``memptr``."""
    cupy = _cupy()
    shape, strides, dtype = array.shape, array.strides, array.dtype
    array._shape = ()  # __init__ pushes the dimensions onto the existing vector
    cupy.ndarray.__init__(array, shape, dtype, memptr=memptr, strides=strides)
    if array.shape != shape or array.strides != strides or array.data.ptr != memptr.ptr:
        raise RuntimeError("cupy.ndarray.__init__ did not re-point the array as expected")


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

    def __init__(self, *, max_depth: int = 100, max_objects: int = 1_000_000) -> None:
        self.walk_options = {"max_depth": max_depth, "max_objects": max_objects}
        self._groups: list[_Group] = []

    def device_bytes(self) -> int:
        return int(_cupy().get_default_memory_pool().total_bytes())

    def trim(self) -> int:
        cupy = _cupy()
        pool = cupy.get_default_memory_pool()
        before = pool.total_bytes()
        pool.free_all_blocks()
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
            report.skipped.extend(
                f"{g.paths[0]}: cannot re-point CuPy arrays ({why})" for g in groups
            )
            return report
        before = self.device_bytes()
        for group in groups:
            with cupy.cuda.Device(group.device_id):
                group.host = cupy.cuda.alloc_pinned_memory(group.nbytes)
                # no local name for the source pointer: it would keep the allocation alive
                cupy.cuda.MemoryPointer(group.mem, 0).copy_to_host_async(
                    ctypes.c_void_p(group.host.ptr), group.nbytes
                )
        for group in groups:
            with cupy.cuda.Device(group.device_id):
                cupy.cuda.get_current_stream().synchronize()
        for group in groups:
            # The device sees page-locked host memory at the same address (UVA).
            host = cupy.cuda.UnownedMemory(
                group.host.ptr, group.nbytes, group.host, group.device_id
            )
            for array, offset in zip(group.arrays, group.offsets, strict=True):
                _repoint(array, cupy.cuda.MemoryPointer(host, offset))
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
        try:
            for group in self._groups:
                with cupy.cuda.Device(group.device_id):
                    memptr = cupy.cuda.alloc(group.nbytes)
                    memptr.copy_from_host_async(ctypes.c_void_p(group.host.ptr), group.nbytes)
                    fresh.append(memptr)
            for group in self._groups:
                with cupy.cuda.Device(group.device_id):
                    cupy.cuda.get_current_stream().synchronize()
        except BaseException:
            del fresh  # still fully offloaded; a later reload may find room
            cupy.get_default_memory_pool().free_all_blocks()
            raise
        for group, memptr in zip(self._groups, fresh, strict=True):
            for array, offset in zip(group.arrays, group.offsets, strict=True):
                _repoint(array, memptr + offset)
            report.bytes += group.nbytes
            report.count += len(group.arrays)
        self._groups = []
        cupy.get_default_pinned_memory_pool().free_all_blocks()
        report.seconds = time.perf_counter() - start
        return report

    def gpu_names(self, namespace: dict[str, Any]) -> set[str]:
        cupy = _cupy()
        return names_reaching(
            namespace,
            lambda obj: isinstance(obj, cupy.ndarray),
            target_children=array_children,
            **self.walk_options,
        )

    def _find_groups(self, namespace: dict[str, Any], report: OffloadReport) -> list[_Group]:
        cupy = _cupy()
        result = walk_namespace(
            namespace,
            lambda obj: isinstance(obj, cupy.ndarray),
            target_children=array_children,
            **self.walk_options,
        )
        if result.truncated:
            report.skipped.append(f"<walk>: stopped after {result.visited} objects")
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
                report.skipped.append(
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
            report.skipped.append(f"{entry.path}: memory owned by another library; left alone")
            continue
        group = groups.get(id(mem))
        if group is None:
            group = groups[id(mem)] = _Group(mem, mem.device_id, mem.size)
        group.arrays.append(array)
        group.offsets.append(pointer.ptr - mem.ptr)
        group.paths.append(entry.path)
        pointers.setdefault(id(pointer), []).append(array)
    return groups, pointers
