"""CuPy faked at its device: the few parts of ``cupy`` the CuPy adapter and the tests touch,
with "GPU memory" made of host memory, so the adapter's real code (the walk, the grouping
by allocation, the re-pointing through ``ndarray.__init__``, the pinned pool, the kept host
copies and their fingerprints) runs on a CPU.

What is faked is the hardware boundary: allocations (``cuda.alloc``, numbered GPUs through
``cuda.Device``), page-locked host buffers (``cuda.alloc_pinned_memory``), the copies
between them (``MemoryPointer.copy_*``, run at once: a stream here has nothing queued) and
streams. An array's values are read and written through a NumPy view of its memory, so a
write through any array that shares an allocation is seen by all of them, as on a GPU.

Install it in a test process with :func:`install` (``monkeypatch``), or in a kernel::

    import sys; sys.path.insert(0, REPO)
    from tests.fakes import fake_cupy
    cupy = fake_cupy.install_module()

``state`` counts allocations and copies and fails the n-th one on request (``fail_copy_at``:
the copy writes half its bytes, then raises; ``fail_alloc_at``: the allocation raises
:class:`OutOfMemoryError`); ``on_copy`` (if set) runs after each copy (a cell's write landing
while a pre-copy runs).
"""

from __future__ import annotations

import ctypes
import math
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import numpy as np

uint8, uint32, uint64 = np.uint8, np.uint32, np.uint64
int32, int64, float32, float64 = np.int32, np.int64, np.float32, np.float64


class CopyFailed(RuntimeError):
    pass


class OutOfMemoryError(MemoryError):
    pass


class _State:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.device_bytes: dict[int, int] = {}  # GPU -> bytes of live allocations
        self.device_allocs = 0
        self.pinned_allocs = 0
        self.copies = 0
        self.fail_copy_at: int | None = None
        self.fail_alloc_at: int | None = None
        self.on_copy: Callable[[], None] | None = None
        self.local = threading.local()

    @property
    def device(self) -> int:
        return getattr(self.local, "device", 0)


state = _State()


# -- memory ------------------------------------------------------------------------------------
class Memory:
    """A device allocation (host memory standing for GPU memory). Like CuPy's, it cannot be
    weakly referenced: whoever wants to know it lives must hold it."""

    __slots__ = ("_buffer", "device_id", "ptr", "size")

    def __init__(self, size: int, device_id: int) -> None:
        self._buffer = np.zeros(max(size, 1), dtype=np.uint8)
        self.ptr = int(self._buffer.ctypes.data)
        self.size = size
        self.device_id = device_id
        state.device_bytes[device_id] = state.device_bytes.get(device_id, 0) + size

    def __del__(self) -> None:
        state.device_bytes[self.device_id] = state.device_bytes.get(self.device_id, 0) - self.size


class UnownedMemory:
    """Memory another object owns (CuPy's ``UnownedMemory``): here, a pinned host buffer."""

    __slots__ = ("device_id", "owner", "ptr", "size")

    def __init__(self, ptr: int, size: int, owner: Any, device_id: int = -1) -> None:
        self.ptr, self.size, self.owner = int(ptr), int(size), owner
        self.device_id = state.device if device_id < 0 else device_id


class PinnedMemoryPointer:
    """A page-locked host buffer (``alloc_pinned_memory``)."""

    __slots__ = ("_buffer", "ptr", "size")

    def __init__(self, size: int) -> None:
        self._buffer = np.zeros(max(size, 1), dtype=np.uint8)
        self.ptr = int(self._buffer.ctypes.data)
        self.size = size


def _count_copy(dst: int, src: int, size: int) -> None:
    state.copies += 1
    if state.fail_copy_at == state.copies:
        ctypes.memmove(dst, src, size // 2)
        raise CopyFailed(f"simulated: copy {state.copies} failed halfway")
    ctypes.memmove(dst, src, size)
    if state.on_copy is not None:
        state.on_copy()


class MemoryPointer:
    __slots__ = ("device_id", "mem", "ptr")

    def __init__(self, mem: Any, offset: int) -> None:
        self.mem = mem
        self.ptr = mem.ptr + offset
        self.device_id = mem.device_id

    def __add__(self, offset: int) -> MemoryPointer:
        return MemoryPointer(self.mem, self.ptr - self.mem.ptr + offset)

    def copy_to_host_async(self, dst: ctypes.c_void_p, size: int, stream: Any = None) -> None:
        _count_copy(int(dst.value or 0), self.ptr, size)

    def copy_from_host_async(self, src: ctypes.c_void_p, size: int, stream: Any = None) -> None:
        _count_copy(self.ptr, int(src.value or 0), size)

    def copy_from_device(self, src: MemoryPointer, size: int) -> None:
        ctypes.memmove(self.ptr, src.ptr, size)


def alloc(size: int) -> MemoryPointer:
    state.device_allocs += 1
    if state.fail_alloc_at == state.device_allocs:
        raise OutOfMemoryError(f"simulated: out of memory allocating {size} bytes")
    return MemoryPointer(Memory(size, state.device), 0)


def alloc_pinned_memory(size: int) -> PinnedMemoryPointer:
    state.pinned_allocs += 1
    return PinnedMemoryPointer(size)


class Device:
    def __init__(self, device: int = 0) -> None:
        self.id = device
        self._before: list[int] = []

    def __enter__(self) -> Device:
        self._before.append(state.device)
        state.local.device = self.id
        return self

    def __exit__(self, *exc: Any) -> None:
        state.local.device = self._before.pop()

    def synchronize(self) -> None:
        pass


class Event:
    pass


class Stream:
    def __init__(self, null: bool = False, non_blocking: bool = False,
                 priority: int | None = None) -> None:
        self.priority = priority

    def record(self) -> Event:
        return Event()

    def wait_event(self, event: Event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


_null_stream = Stream(null=True)


def get_current_stream() -> Stream:
    return _null_stream


class _Pool:
    def total_bytes(self) -> int:
        return sum(state.device_bytes.values())

    def used_bytes(self) -> int:
        return self.total_bytes()

    def free_all_blocks(self) -> None:
        pass


_pool, _pinned_pool = _Pool(), _Pool()


def get_default_memory_pool() -> _Pool:
    return _pool


def get_default_pinned_memory_pool() -> _Pool:
    return _pinned_pool


# -- arrays ------------------------------------------------------------------------------------
class ndarray:  # CuPy's name
    """A device array: a shape, strides and dtype over a ``MemoryPointer``. Its values are
    read and written through a NumPy view of that memory."""

    __slots__ = ("__weakref__", "_shape", "_strides", "base", "data", "dtype")

    def __init__(self, shape: Any, dtype: Any = float, memptr: MemoryPointer | None = None,
                 strides: Any = None) -> None:
        shape = (shape,) if isinstance(shape, int) else tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        if strides is None:
            strides, step = [], self.dtype.itemsize
            for n in reversed(shape):
                strides.insert(0, step)
                step *= n
        self._shape, self._strides = shape, tuple(int(s) for s in strides)
        if memptr is None:
            memptr = alloc(self.nbytes)
        self.data = memptr
        if not hasattr(self, "base"):
            self.base = None

    shape = property(lambda self: self._shape)
    strides = property(lambda self: self._strides)
    ndim = property(lambda self: len(self._shape))
    size = property(lambda self: math.prod(self._shape))
    nbytes = property(lambda self: self.size * self.dtype.itemsize)
    device = property(lambda self: Device(self.data.device_id))

    def _numpy(self) -> np.ndarray:
        """A NumPy view of the array's memory (what a kernel on the device reads)."""
        mem = self.data.mem
        span = (ctypes.c_char * max(mem.size, 1)).from_address(mem.ptr)
        return np.ndarray(self._shape, self.dtype, buffer=span,
                          offset=self.data.ptr - mem.ptr, strides=self._strides)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        view = self._numpy()
        return view if dtype is None else view.astype(dtype)

    def _view_of(self, view: np.ndarray) -> ndarray:
        offset = view.__array_interface__["data"][0] - self.data.ptr
        out = ndarray(view.shape, view.dtype, memptr=self.data + offset, strides=view.strides)
        out.base = self.base if self.base is not None else self
        return out

    def __getitem__(self, key: Any) -> ndarray:
        view = self._numpy()[key]
        if not isinstance(view, np.ndarray):  # one element: a 0-d view of it, as CuPy gives
            view = self._numpy()[(key if isinstance(key, tuple) else (key,)) + (Ellipsis,)]
        return self._view_of(view)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._numpy()[key] = np.asarray(value)

    def view(self, dtype: Any) -> ndarray:
        return self._view_of(self._numpy().view(dtype))

    def __iadd__(self, other: Any) -> ndarray:
        view = self._numpy()
        view += np.asarray(other)
        return self

    def __imul__(self, other: Any) -> ndarray:
        view = self._numpy()
        view *= np.asarray(other)
        return self

    def astype(self, dtype: Any) -> np.ndarray:
        """A new array computed on the device; here the device's result is a NumPy array
        (its memory is host memory either way)."""
        return self._numpy().astype(dtype)

    def get(self) -> np.ndarray:
        return self._numpy().copy()

    def copy(self) -> ndarray:
        return asarray(self._numpy())

    def __float__(self) -> float:
        return float(self._numpy())

    def __int__(self) -> int:
        return int(self._numpy())

    def __len__(self) -> int:
        return self._shape[0]

    def __repr__(self) -> str:
        return f"fake_cupy.array({self._numpy()!r}, gpu={self.data.device_id})"


def asarray(values: Any, dtype: Any = None) -> ndarray:
    """A new device array on the current GPU holding ``values``."""
    host = np.ascontiguousarray(values if dtype is None else np.asarray(values, dtype=dtype))
    out = ndarray(host.shape, host.dtype)
    out._numpy()[...] = host
    return out


array = asarray


def arange(*args: Any, dtype: Any = None) -> ndarray:
    return asarray(np.arange(*args, dtype=dtype))


def zeros(shape: Any, dtype: Any = float) -> ndarray:
    return asarray(np.zeros(shape, dtype=dtype))


def on_device(array: ndarray) -> int | None:
    """The GPU an array's memory is on (None: host memory, as while released)."""
    mem = array.data.mem
    return mem.device_id if isinstance(mem, Memory) else None


def _modules() -> tuple[types.ModuleType, types.ModuleType]:
    module = sys.modules[__name__]
    cuda = types.ModuleType("cupy.cuda")
    for name in ("Device", "Stream", "MemoryPointer", "UnownedMemory", "alloc",
                 "alloc_pinned_memory", "get_current_stream"):
        setattr(cuda, name, getattr(module, name))
    cuda.memory = types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError)  # type: ignore[attr-defined]
    module.cuda = cuda  # type: ignore[attr-defined]
    return module, cuda


def install_module() -> types.ModuleType:
    """Make ``import cupy`` give this fake (for a kernel); returns the module."""
    module, cuda = _modules()
    sys.modules["cupy"], sys.modules["cupy.cuda"] = module, cuda
    return module


def install(monkeypatch: Any) -> types.ModuleType:
    """The same for one test (``monkeypatch`` puts the modules back), with fresh counts."""
    module, cuda = _modules()
    monkeypatch.setitem(sys.modules, "cupy", module)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    state.reset()
    return module
