"""The simulated GPU as a kernel process sees it: allocations, busy time and the
emulated CUDA checkpoint state machine (running -> locked -> checkpointed -> locked ->
running), with the same rule as the driver: GPU calls block while the process is not
running and go on once it is unlocked.

Memory is accounted on a :class:`~jupyter_gpushare.sim.node.SimNode`: the server's
(through the agent channel) when the kernel was started by an enabled server, else a
private in-process node.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from ..protocol import SIMULATED_GPUS_ENV
from .node import SimNode, SimOutOfMemoryError, format_bytes, parse_gpus

RUNNING, LOCKED, CHECKPOINTED = "running", "locked", "checkpointed"


class Backend(Protocol):
    """Where a kernel's simulated allocations are accounted."""

    def alloc(self, gpu: int, nbytes: int) -> None: ...
    def free(self, gpu: int, nbytes: int) -> None: ...
    def busy_begin(self, gpu: int) -> None: ...
    def busy_end(self, gpu: int) -> None: ...
    def device_count(self) -> int: ...


class LocalBackend:
    """A private node in this process (no server reachable)."""

    def __init__(self, node: SimNode | None = None):
        self.node = node or SimNode(parse_gpus(os.environ.get(SIMULATED_GPUS_ENV)))
        self.pid = os.getpid()

    def alloc(self, gpu: int, nbytes: int) -> None:
        self.node.alloc(self.pid, gpu, nbytes)

    def free(self, gpu: int, nbytes: int) -> None:
        self.node.release(self.pid, gpu, nbytes)

    def busy_begin(self, gpu: int) -> None:
        self.node.busy_begin(self.pid, gpu)

    def busy_end(self, gpu: int) -> None:
        self.node.busy_end(self.pid, gpu)

    def device_count(self) -> int:
        return len(self.node.capacities)


@dataclass
class _Block:
    """One allocation: where its bytes are and how big it is."""

    gpu: int
    nbytes: int
    on_device: bool = True


class SimDevice:
    """Process-wide simulated GPU state (one per kernel process)."""

    def __init__(self, backend: Backend | None = None):
        self.backend: Backend = backend or LocalBackend()
        self._cond = threading.Condition()
        self.state = RUNNING
        self._inflight = 0
        self._blocks: weakref.WeakKeyDictionary[Any, _Block] = weakref.WeakKeyDictionary()

    # -- allocation ---------------------------------------------------------------
    def register(self, array: Any, gpu: int, nbytes: int) -> None:
        """Account ``nbytes`` for ``array`` on ``gpu``; freed when the array is collected."""
        with self.op():
            self.backend.alloc(gpu, nbytes)
            block = _Block(gpu, nbytes)
            self._blocks[array] = block
            weakref.finalize(array, self._release_block, block)

    def _release_block(self, block: _Block) -> None:
        if block.on_device:
            block.on_device = False
            try:
                self.backend.free(block.gpu, block.nbytes)
            except Exception:  # interpreter shutdown, server gone: nothing left to free
                pass

    def allocated(self, gpu: int | None = None) -> int:
        return sum(
            b.nbytes
            for b in list(self._blocks.values())
            if b.on_device and (gpu is None or b.gpu == gpu)
        )

    def held(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for b in list(self._blocks.values()):
            out[b.gpu] = out.get(b.gpu, 0) + b.nbytes
        return out

    # -- GPU calls ----------------------------------------------------------------
    @contextmanager
    def op(self):
        """Wrap every simulated GPU call: blocks while the process is locked or released."""
        with self._cond:
            while self.state != RUNNING:  # like CUDA under the checkpoint lock: wait
                self._cond.wait()
            self._inflight += 1
        try:
            yield
        finally:
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

    @contextmanager
    def busy(self, gpu: int):
        with self.op():
            self.backend.busy_begin(gpu)
            try:
                yield
            finally:
                self.backend.busy_end(gpu)

    # -- checkpoint state machine (driven by the server's simulated method) -------
    def lock(self, timeout: float | None = 10.0) -> None:
        """Stop new GPU calls and wait for running ones, like ``cuCheckpointProcessLock``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if self.state != RUNNING:
                raise RuntimeError(f"cannot lock: process is {self.state}")
            self.state = LOCKED
            while self._inflight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self.state = RUNNING
                    self._cond.notify_all()
                    raise TimeoutError("GPU work still running after the lock timeout")
                self._cond.wait(left)

    def checkpoint(self) -> dict[str, Any]:
        """Copy every array's bytes to host memory and free the device memory."""
        with self._cond:
            if self.state != LOCKED:
                raise RuntimeError(f"cannot checkpoint: process is {self.state}, not locked")
            moved = 0
            arrays = [(a, b) for a, b in list(self._blocks.items()) if b.on_device]
            for array, block in arrays:
                array._to_host()
                block.on_device = False
                self.backend.free(block.gpu, block.nbytes)
                moved += block.nbytes
            self.state = CHECKPOINTED
            return {"bytes": moved, "arrays": len(arrays), "gpus": _per_gpu(b for _, b in arrays)}

    def restore(self) -> dict[str, Any]:
        """Allocate everything again (all or nothing) and copy the bytes back."""
        with self._cond:
            if self.state != CHECKPOINTED:
                raise RuntimeError(f"cannot restore: process is {self.state}, not checkpointed")
            arrays = [(a, b) for a, b in list(self._blocks.items()) if not b.on_device]
            done: list[_Block] = []
            try:
                for _, block in arrays:
                    self.backend.alloc(block.gpu, block.nbytes)
                    done.append(block)
            except BaseException:
                for block in done:
                    self.backend.free(block.gpu, block.nbytes)
                raise
            moved = 0
            for array, block in arrays:
                array._to_device()
                block.on_device = True
                moved += block.nbytes
            self.state = LOCKED
            return {"bytes": moved, "arrays": len(arrays), "gpus": _per_gpu(b for _, b in arrays)}

    def unlock(self) -> None:
        with self._cond:
            if self.state != LOCKED:
                raise RuntimeError(f"cannot unlock: process is {self.state}, not locked")
            self.state = RUNNING
            self._cond.notify_all()


def _per_gpu(blocks) -> dict[str, int]:
    out: dict[str, int] = {}
    for b in blocks:
        out[str(b.gpu)] = out.get(str(b.gpu), 0) + b.nbytes
    return out


_device: SimDevice | None = None
_device_lock = threading.Lock()


def get_device() -> SimDevice:
    """The process's simulated GPU (created on first use with a local backend)."""
    global _device
    with _device_lock:
        if _device is None:
            _device = SimDevice()
        return _device


def set_backend(backend: Backend) -> SimDevice:
    """Account this process's allocations on ``backend`` (the agent does this on connect)."""
    device = get_device()
    if device.allocated():
        raise RuntimeError("cannot change the simulated GPU backend while arrays are allocated")
    device.backend = backend
    return device


__all__ = [
    "CHECKPOINTED",
    "LOCKED",
    "RUNNING",
    "LocalBackend",
    "SimDevice",
    "SimOutOfMemoryError",
    "format_bytes",
    "get_device",
    "set_backend",
]
