"""A fake ``cuda.core.checkpoint.Process`` with the driver's state machine.

States and transitions as documented for the CUDA driver checkpoint API (and exposed by
cuda-core's ``Process``)::

    running --lock--> locked --checkpoint--> checkpointed --restore--> locked --unlock--> running

A call in the wrong state raises like the driver does (CUDA_ERROR_ILLEGAL_STATE); a lock that
times out leaves the process running. ``FakeCheckpointDriver`` is shared by all pids of a test:
it records the order of calls across pids and can be told to fail a given step of a given pid.
Use ``driver.process`` as ``DriverMethod(process_factory=...)``; the real thing is exercised in
tests/gpu/test_driver_gpu.py.
"""

from __future__ import annotations

from typing import Any


class FakeCUDAError(RuntimeError):
    """Stands in for cuda.core's CUDAError (a RuntimeError subclass with the driver's text)."""


_TRANSITIONS = {
    "lock": ("running", "locked"),
    "checkpoint": ("locked", "checkpointed"),
    "restore": ("checkpointed", "locked"),
    "unlock": ("locked", "running"),
}


class FakeCheckpointDriver:
    def __init__(self) -> None:
        self.states: dict[int, str] = {}
        self.calls: list[tuple[str, int]] = []  # (step, pid) in call order, failed calls included
        self.lock_timeouts: list[int] = []
        self.gpu_mappings: list[Any] = []
        self._fail: dict[tuple[str, int], tuple[str, str | None]] = {}
        #: called as on_step(step, pid) after each successful step (a test's fake NVML can
        #: then show the memory leaving and coming back, as the real driver makes it)
        self.on_step: Any = None

    def process(self, pid: int) -> FakeProcess:
        self.states.setdefault(pid, "running")
        return FakeProcess(pid, self)

    def fail(self, step: str, pid: int, message: str, new_state: str | None = None) -> None:
        """Make ``step`` of ``pid`` raise ``message`` (once); optionally move to ``new_state``
        (e.g. ``"failed"``, which is what a restore without room does on a real driver)."""
        self._fail[(step, pid)] = (message, new_state)

    def steps(self) -> list[str]:
        return [f"{step} {pid}" for step, pid in self.calls]

    def _do(self, step: str, pid: int) -> None:
        self.calls.append((step, pid))
        if (step, pid) in self._fail:
            message, new_state = self._fail.pop((step, pid))
            if new_state is not None:
                self.states[pid] = new_state
            raise FakeCUDAError(message)
        before, after = _TRANSITIONS[step]
        if self.states[pid] != before:
            raise FakeCUDAError(
                f"CUDA_ERROR_ILLEGAL_STATE: {step} needs state {before}, pid {pid} is "
                f"{self.states[pid]}"
            )
        self.states[pid] = after
        if self.on_step is not None:
            self.on_step(step, pid)


class FakeProcess:
    """Same surface as ``cuda.core.checkpoint.Process``."""

    def __init__(self, pid: int, driver: FakeCheckpointDriver) -> None:
        self._pid = pid
        self._driver = driver

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def state(self) -> str:
        return self._driver.states[self._pid]

    def lock(self, timeout_ms: int = 0) -> None:
        self._driver.lock_timeouts.append(timeout_ms)
        self._driver._do("lock", self._pid)

    def checkpoint(self) -> None:
        self._driver._do("checkpoint", self._pid)

    def restore(self, gpu_mapping: Any = None) -> None:
        self._driver.gpu_mappings.append(gpu_mapping)
        self._driver._do("restore", self._pid)

    def unlock(self) -> None:
        self._driver._do("unlock", self._pid)


def install_fake_cuda_core(
    monkeypatch: Any, bindings_version: str = "13.0.2", with_process: bool = True
) -> None:
    """Make ``cuda.core.checkpoint`` (and ``cuda.bindings``) importable for ``support()`` checks."""
    import sys
    import types

    cuda = types.ModuleType("cuda")
    core = types.ModuleType("cuda.core")
    core.__version__ = "1.2.2"  # type: ignore[attr-defined]
    ckpt = types.ModuleType("cuda.core.checkpoint")
    if with_process:
        ckpt.Process = FakeProcess  # type: ignore[attr-defined]
    bindings = types.ModuleType("cuda.bindings")
    bindings.__version__ = bindings_version  # type: ignore[attr-defined]
    for name, mod in [("cuda", cuda), ("cuda.core", core), ("cuda.core.checkpoint", ckpt),
                      ("cuda.bindings", bindings)]:
        monkeypatch.setitem(sys.modules, name, mod)
