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
        #: bumped after every write in place (as PyTorch's version counter): a host copy made
        #: at version v is current while the array is still at v
        self._version = 0
        #: the host copy kept after a restore or made by a pre-copy, and its version
        self._kept: np.ndarray | None = None
        self._kept_version = -1
        self._kept_at = 0.0  # time.monotonic() the kept copy was made (dropped oldest first)
        self._host_was_kept = False  # the last checkpoint took the kept copy as it was
        # last, so a checkpoint never finds a registered array without its bytes; raises
        # OutOfMemoryError (and the bytes are dropped with the object) when it does not fit
        get_device().register(self, device, int(data.nbytes))

    # Called by the checkpoint state machine with the device locked, in two phases so that
    # a checkpoint or restore is all or nothing: copy every array (nothing changes if a copy
    # fails), then commit every copy (plain assignments, which cannot fail halfway).
    def _current_copy(self) -> np.ndarray | None:
        """The kept host copy when it still holds the array's bytes (no write since)."""
        kept = self._kept
        return kept if kept is not None and self._kept_version == self._version else None

    def _copy_to_host(self) -> np.ndarray:
        assert self._dev is not None, "array is not on the device"
        kept = self._current_copy()
        if kept is not None:
            return kept  # unchanged since its host copy was made: nothing to move
        return self._dev.copy()  # a real copy: the cost of moving bytes off the GPU

    def _commit_host(self, copy: np.ndarray) -> None:
        self._host_was_kept = copy is self._kept
        self._host, self._dev, self._kept = copy, None, None

    def _undo_host(self) -> None:
        """Undo :meth:`_commit_host`: the host copy (the very same bytes) is the device's
        again. If it was the kept copy, it stays the kept copy too: shared with the device
        buffer, it is current only until the next write (which moves the version), and a
        stale kept copy is never read, only replaced."""
        host, self._host = self._host, None
        self._dev = host
        self._kept = host if self._host_was_kept else None

    def _copy_to_device(self) -> np.ndarray:
        assert self._host is not None, "array is not in host memory"
        return self._host.copy()

    def _commit_device(self, copy: np.ndarray, keep: bool = False) -> None:
        """The bytes are on the device again; ``keep``: the host copy stays as the kept
        copy (current until the next write), so the next release need not move them."""
        host, self._dev, self._host = self._host, copy, None
        if keep and host is not None:
            self._kept, self._kept_version, self._kept_at = host, self._version, time.monotonic()
        else:
            self._kept = None

    def _precopy(self) -> int:
        """Copy the bytes to host now if the kept copy is not current (the device is running:
        a write may land meanwhile, so the copy counts as of the version read before it);
        returns the bytes copied."""
        dev, version = self._dev, self._version
        if dev is None or self._current_copy() is not None:
            return 0
        copy = dev.copy()
        self._kept, self._kept_version, self._kept_at = copy, version, time.monotonic()
        return int(copy.nbytes)

    def _drop_kept(self) -> int:
        kept, self._kept = self._kept, None
        return int(kept.nbytes) if kept is not None and self._dev is not None else 0

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
        # a copy, never a numpy view: a write through one array must not change another
        # behind its version counter
        return self._apply(lambda a: np.array(a[index], copy=True))

    # -- writes in place (the version counter says a kept host copy is stale) ------------
    def _write(self, fn, *others: Any) -> SimArray:
        with get_device().busy(self.device):
            args = [o._data() if isinstance(o, SimArray) else o for o in others]
            try:
                fn(self._data(), *args)
            finally:
                self._version += 1  # after the bytes changed: a pre-copy never misses it
        return self

    def __setitem__(self, index, value) -> None:
        self._write(lambda a, v: a.__setitem__(index, v), value)

    def __iadd__(self, o):
        return self._write(lambda a, b: np.add(a, b, out=a, casting="unsafe"), o)

    def __isub__(self, o):
        return self._write(lambda a, b: np.subtract(a, b, out=a, casting="unsafe"), o)

    def __imul__(self, o):
        return self._write(lambda a, b: np.multiply(a, b, out=a, casting="unsafe"), o)

    def fill(self, value: Any) -> SimArray:
        """Set every element to ``value``, in place."""
        return self._write(lambda a: a.fill(value))

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
