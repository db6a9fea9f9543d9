"""Arrays on a simulated GPU, for tests, the demo and Binder.

>>> from jupyter_gpushare.sim import simgpu
>>> x = simgpu.zeros((1024, 1024), dtype="float32", device=1)   # 4 MiB on simulated GPU 1
>>> y = (x + 1) * 2                                              # "runs on the GPU"
>>> y.get().sum()

Bytes live in this process; the simulated node accounts them per GPU, so allocating
more than a GPU holds raises :class:`OutOfMemoryError`, and arithmetic marks the GPU
busy for as long as it runs. While the kernel is released, every call blocks until the
kernel is restored, exactly as CUDA calls do under the driver's checkpoint lock.

``device=N`` is this process's N-th GPU, as in CUDA: with ``CUDA_VISIBLE_DEVICES`` set (a
kernel the gpushare server placed has it), device 0 is the first GPU it lists, and an index
past the visible ones raises :class:`InvalidDeviceError`.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .device import SimInvalidDeviceError, get_device
from .node import SimOutOfMemoryError

OutOfMemoryError = SimOutOfMemoryError
InvalidDeviceError = SimInvalidDeviceError


class SimArray:
    """A numpy array whose bytes count as device memory of one simulated GPU."""

    __array_priority__ = 1000  # so numpy defers `ndarray + SimArray` to us

    def __init__(self, data: np.ndarray, device: int = 0, *, _copy: bool = True):
        if not isinstance(device, int) or isinstance(device, bool):
            raise TypeError(f"device must be an int GPU index, got {device!r}")
        self.device = device
        self._dev: np.ndarray | None = np.array(data, copy=True) if _copy else data
        self._host: np.ndarray | None = None
        # last, so a checkpoint never finds a registered array without its bytes; raises
        # OutOfMemoryError (and the bytes are dropped with the object) when it does not fit
        get_device().register(self, device, int(data.nbytes))

    # Called by the checkpoint state machine with the device locked, in two phases so that
    # a checkpoint or restore is all or nothing: copy every array (nothing changes if a copy
    # fails), then commit every copy (plain assignments, which cannot fail halfway).
    def _copy_to_host(self) -> np.ndarray:
        assert self._dev is not None, "array is not on the device"
        return self._dev.copy()  # a real copy: the cost of moving bytes off the GPU

    def _commit_host(self, copy: np.ndarray) -> None:
        self._host, self._dev = copy, None

    def _copy_to_device(self) -> np.ndarray:
        assert self._host is not None, "array is not in host memory"
        return self._host.copy()

    def _commit_device(self, copy: np.ndarray) -> None:
        self._dev, self._host = copy, None

    def _to_host(self) -> None:
        self._commit_host(self._copy_to_host())

    def _to_device(self) -> None:
        self._commit_device(self._copy_to_device())

    def _data(self) -> np.ndarray:
        assert self._dev is not None, "array is not resident (the kernel is released)"
        return self._dev

    # -- metadata needs no device access ---------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        buf = self._dev if self._dev is not None else self._host
        assert buf is not None
        return tuple(buf.shape)

    @property
    def dtype(self) -> np.dtype:
        buf = self._dev if self._dev is not None else self._host
        assert buf is not None
        return buf.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"<simgpu.SimArray shape={self.shape} dtype={self.dtype} device={self.device}>"

    # -- device work ---------------------------------------------------------------------
    def get(self) -> np.ndarray:
        """Copy back to a numpy array (blocks while the kernel is released)."""
        with get_device().op():
            return self._data().copy()

    def _apply(self, fn, *others: Any) -> SimArray:
        with get_device().busy(self.device):
            args = [o._data() if isinstance(o, SimArray) else o for o in others]
            out = fn(self._data(), *args)
        return SimArray(np.asarray(out), self.device, _copy=False)

    def __add__(self, o):
        return self._apply(np.add, o)

    __radd__ = __add__

    def __sub__(self, o):
        return self._apply(np.subtract, o)

    def __rsub__(self, o):
        return self._apply(lambda a, b: np.subtract(b, a), o)

    def __mul__(self, o):
        return self._apply(np.multiply, o)

    __rmul__ = __mul__

    def __truediv__(self, o):
        return self._apply(np.true_divide, o)

    def __matmul__(self, o):
        return self._apply(np.matmul, o)

    def __neg__(self):
        return self._apply(np.negative)

    def __getitem__(self, index):
        return self._apply(lambda a: a[index])

    def sum(self, axis=None) -> SimArray:
        return self._apply(lambda a: np.sum(a, axis=axis))

    def mean(self, axis=None) -> SimArray:
        return self._apply(lambda a: np.mean(a, axis=axis))

    def checksum(self) -> str:
        """A CRC-32 of the bytes (runs on the device): equal before a release and after a restore."""
        import zlib

        with get_device().op():
            data = np.ascontiguousarray(self._data())
            buffer: Any = data.reshape(-1).view(np.uint8)  # numpy arrays are buffers; stubs lag
            return f"{zlib.crc32(buffer):08x}"


def array(data: Any, device: int = 0, dtype: Any = None, copy: bool = True) -> SimArray:
    """Put ``data`` (anything numpy accepts) on simulated GPU ``device``.

    ``copy=False`` takes over a numpy array without copying it (do not use it afterwards).
    """
    return SimArray(np.asarray(data, dtype=dtype), device, _copy=copy)


def zeros(shape: Any, dtype: Any = np.float32, device: int = 0) -> SimArray:
    return SimArray(np.zeros(shape, dtype=dtype), device, _copy=False)


def ones(shape: Any, dtype: Any = np.float32, device: int = 0) -> SimArray:
    return SimArray(np.ones(shape, dtype=dtype), device, _copy=False)


def random(shape: Any, device: int = 0, seed: int | None = None) -> SimArray:
    rng = np.random.default_rng(seed)
    return SimArray(rng.random(shape, dtype=np.float32), device, _copy=False)


def burn(seconds: float, device: int = 0) -> None:
    """Keep simulated GPU ``device`` busy for ``seconds`` (a long-running GPU kernel)."""
    with get_device().busy(device):
        time.sleep(seconds)


def memory_allocated(device: int | None = None) -> int:
    """Bytes this process holds on the simulated GPU(s) now (all, or its device ``device``)."""
    dev = get_device()
    return dev.allocated(None if device is None else dev.physical(device))


def device_count() -> int:
    """How many simulated GPUs this process sees (``CUDA_VISIBLE_DEVICES`` counts)."""
    return len(get_device().visible())


__all__ = [
    "InvalidDeviceError",
    "OutOfMemoryError",
    "SimArray",
    "array",
    "burn",
    "device_count",
    "memory_allocated",
    "ones",
    "random",
    "zeros",
]
