"""A fake ``pynvml`` module (nvidia-ml-py) with the same names, error classes and semantics.

Inject it with ``monkeypatch.setitem(sys.modules, "pynvml", fake)``; code that does
``import pynvml`` inside a function then gets the fake. What it mirrors from the real
bindings (nvidia-ml-py 12/13):

- ``NVMLError(value)`` returns the subclass for that value (``NVMLError_NotFound`` ...),
  ``str()`` gives NVML's message, ``.value`` the code;
- calls before ``nvmlInit`` raise ``NVMLError_Uninitialized``; init is reference counted;
- ``nvmlDeviceGetProcessUtilization(h, ts)`` returns only samples newer than ``ts`` and raises
  ``NVMLError_NotFound`` when there is none; it raises ``NotSupported`` under MIG;
- ``nvmlDeviceGetMigDeviceHandleByIndex`` raises ``NotFound`` for an empty slot;
- ``usedGpuMemory`` may be ``None`` (not available), names may be ``bytes`` (old bindings).

Any call can be made to fail per device: ``fake.fail("nvmlDeviceGetMemoryInfo", gpu, code)``.
"""

from __future__ import annotations

import threading
import types
from dataclasses import dataclass, field
from typing import Any

GiB = 1 << 30

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1

_MESSAGES = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_ALREADY_INITIALIZED: "Already Initialized",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_TIMEOUT: "Timeout",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


class NVMLError(Exception):
    """Same construction trick as nvidia-ml-py: ``NVMLError(code)`` is the code's subclass."""

    _valClassMapping: dict[int, type[NVMLError]] = {}
    value: int

    def __new__(cls, value: int = NVML_ERROR_UNKNOWN):
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __init__(self, value: int = NVML_ERROR_UNKNOWN) -> None:
        super().__init__(value)

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"NVML Error with code {self.value}")


def _error_class(name: str, code: int) -> type[NVMLError]:
    def new(cls, *args):
        return NVMLError.__new__(cls, code)

    def init(self, *args):
        Exception.__init__(self, code)

    cls = type(name, (NVMLError,), {"__new__": new, "__init__": init})
    NVMLError._valClassMapping[code] = cls
    return cls


NVMLError_Uninitialized = _error_class("NVMLError_Uninitialized", NVML_ERROR_UNINITIALIZED)
NVMLError_InvalidArgument = _error_class("NVMLError_InvalidArgument", NVML_ERROR_INVALID_ARGUMENT)
NVMLError_NotSupported = _error_class("NVMLError_NotSupported", NVML_ERROR_NOT_SUPPORTED)
NVMLError_NoPermission = _error_class("NVMLError_NoPermission", NVML_ERROR_NO_PERMISSION)
NVMLError_NotFound = _error_class("NVMLError_NotFound", NVML_ERROR_NOT_FOUND)
NVMLError_DriverNotLoaded = _error_class("NVMLError_DriverNotLoaded", NVML_ERROR_DRIVER_NOT_LOADED)
NVMLError_Timeout = _error_class("NVMLError_Timeout", NVML_ERROR_TIMEOUT)
NVMLError_LibraryNotFound = _error_class("NVMLError_LibraryNotFound", NVML_ERROR_LIBRARY_NOT_FOUND)
NVMLError_FunctionNotFound = _error_class(
    "NVMLError_FunctionNotFound", NVML_ERROR_FUNCTION_NOT_FOUND
)
NVMLError_GpuIsLost = _error_class("NVMLError_GpuIsLost", NVML_ERROR_GPU_IS_LOST)
NVMLError_Unknown = _error_class("NVMLError_Unknown", NVML_ERROR_UNKNOWN)


@dataclass
class FakeProcess:
    pid: int
    used_memory: int | None  # None = NVML_VALUE_NOT_AVAILABLE (the bindings turn it into None)


@dataclass
class FakeSample:
    pid: int
    timestamp_us: int
    sm_util: int
    mem_util: int = 0


@dataclass
class FakeGPU:
    """One physical GPU, or one MIG instance when listed in a parent's ``mig_devices``."""

    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    memory_total: int = 80 * GiB
    memory_used: int = 0
    utilization: int = 0
    processes: list[FakeProcess] = field(default_factory=list)
    samples: list[FakeSample] = field(default_factory=list)
    #: not None = MIG mode enabled; the instances, in slot order
    mig_devices: list[FakeGPU] | None = None
    max_mig_devices: int = 7
    mig_supported: bool = True


@dataclass(frozen=True)
class FakeHandle:
    gpu: FakeGPU
    mig: bool

    def __hash__(self) -> int:
        return hash((self.gpu.uuid, self.mig))


class FakePynvml(types.ModuleType):
    """Configure ``gpus`` (list of FakeGPU) and the system answers, then inject."""

    def __init__(
        self,
        gpus: list[FakeGPU] | None = None,
        *,
        driver_version: str = "580.82.07",
        cuda_driver_version: int = 13000,
        nvml_version: str = "13.580.82.07",
        init_error: int | None = None,
        as_bytes: bool = False,
    ) -> None:
        super().__init__("pynvml")
        self.gpus: list[FakeGPU] = list(gpus or [])
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version
        self.nvml_version = nvml_version
        self.init_error = init_error
        self.as_bytes = as_bytes
        self.refcount = 0
        self.calls: list[tuple[Any, ...]] = []
        self._fail: dict[tuple[str, str | None], int] = {}
        self._stall: dict[str, threading.Event] = {}
        # the module-level names code under test uses (``pynvml.NVMLError_NotFound`` ...)
        for name, value in globals().items():
            if name.startswith(("NVML_", "NVMLError")):
                setattr(self, name, value)

    # -- test controls ------------------------------------------------------------------
    def fail(self, func: str, gpu: FakeGPU | None, code: int) -> None:
        """Make ``func`` raise ``NVMLError(code)`` for ``gpu`` (None: for every call)."""
        self._fail[(func, gpu.uuid if gpu is not None else None)] = code

    def stall(self, func: str) -> threading.Event:
        """Make every call of ``func`` hang until the returned event is set (a stuck driver)."""
        event = self._stall[func] = threading.Event()
        return event

    def called(self, func: str) -> int:
        return sum(1 for c in self.calls if c[0] == func)

    # -- helpers ------------------------------------------------------------------------
    def _enter(self, func: str, handle: FakeHandle | None = None, *args: Any) -> None:
        self.calls.append((func, handle.gpu.uuid if handle else None, *args))
        stalled = self._stall.get(func)
        if stalled is not None:
            stalled.wait(60)
        if func not in ("nvmlInit", "nvmlInitWithFlags") and self.refcount == 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        for key in ((func, None), (func, handle.gpu.uuid if handle else None)):
            if key in self._fail:
                raise NVMLError(self._fail[key])

    def _s(self, text: str) -> str | bytes:
        return text.encode() if self.as_bytes else text

    # -- the pynvml API used by jupyter_gpushare -----------------------------------------
    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.refcount += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.refcount -= 1

    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        self._enter("nvmlSystemGetDriverVersion")
        return self._s(self.driver_version)

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion")
        return self.cuda_driver_version

    def nvmlSystemGetNVMLVersion(self) -> str | bytes:
        self._enter("nvmlSystemGetNVMLVersion")
        return self._s(self.nvml_version)

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._enter("nvmlDeviceGetHandleByIndex", None, index)
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[index]
        if (("nvmlDeviceGetHandleByIndex", gpu.uuid)) in self._fail:
            raise NVMLError(self._fail[("nvmlDeviceGetHandleByIndex", gpu.uuid)])
        return FakeHandle(gpu, mig=False)

    def nvmlDeviceGetName(self, h: FakeHandle) -> str | bytes:
        self._enter("nvmlDeviceGetName", h)
        return self._s(h.gpu.name)

    def nvmlDeviceGetUUID(self, h: FakeHandle) -> str | bytes:
        self._enter("nvmlDeviceGetUUID", h)
        return self._s(h.gpu.uuid)

    def nvmlDeviceGetMemoryInfo(self, h: FakeHandle) -> types.SimpleNamespace:
        self._enter("nvmlDeviceGetMemoryInfo", h)
        g = h.gpu
        return types.SimpleNamespace(
            total=g.memory_total, used=g.memory_used, free=g.memory_total - g.memory_used
        )

    def nvmlDeviceGetUtilizationRates(self, h: FakeHandle) -> types.SimpleNamespace:
        self._enter("nvmlDeviceGetUtilizationRates", h)
        if h.mig or h.gpu.mig_devices is not None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return types.SimpleNamespace(gpu=h.gpu.utilization, memory=0)

    def nvmlDeviceGetMigMode(self, h: FakeHandle) -> list[int]:
        self._enter("nvmlDeviceGetMigMode", h)
        if not h.gpu.mig_supported or h.mig:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        mode = NVML_DEVICE_MIG_ENABLE if h.gpu.mig_devices is not None else NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, h: FakeHandle) -> int:
        self._enter("nvmlDeviceGetMaxMigDeviceCount", h)
        return h.gpu.max_mig_devices if h.gpu.mig_devices is not None else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: FakeHandle, index: int) -> FakeHandle:
        self._enter("nvmlDeviceGetMigDeviceHandleByIndex", h, index)
        slots = h.gpu.mig_devices or []
        if index >= len(slots):
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return FakeHandle(slots[index], mig=True)

    def nvmlDeviceGetComputeRunningProcesses(self, h: FakeHandle) -> list[types.SimpleNamespace]:
        self._enter("nvmlDeviceGetComputeRunningProcesses", h)
        procs = list(h.gpu.processes)
        if not h.mig and h.gpu.mig_devices:
            for inst in h.gpu.mig_devices:
                procs.extend(inst.processes)
        return [
            types.SimpleNamespace(
                pid=p.pid, usedGpuMemory=p.used_memory, gpuInstanceId=0xFFFFFFFF,
                computeInstanceId=0xFFFFFFFF,
            )
            for p in procs
        ]

    def nvmlDeviceGetProcessUtilization(self, h: FakeHandle, timestamp: int) -> list[Any]:
        self._enter("nvmlDeviceGetProcessUtilization", h, timestamp)
        if h.mig or h.gpu.mig_devices is not None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        new = [s for s in h.gpu.samples if s.timestamp_us > timestamp]
        if not new:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return [
            types.SimpleNamespace(
                pid=s.pid, timeStamp=s.timestamp_us, smUtil=s.sm_util, memUtil=s.mem_util,
                encUtil=0, decUtil=0,
            )
            for s in new
        ]


def two_gpus() -> FakePynvml:
    """The usual test node: two 80 GiB GPUs, a kernel (pid 101) on GPU 0, two pids on GPU 1."""
    gpu0 = FakeGPU(
        uuid="GPU-00000000-0000-0000-0000-000000000000",
        memory_used=5 * GiB,
        utilization=30,
        processes=[FakeProcess(101, 4 * GiB)],
        samples=[FakeSample(101, 1_000, 20), FakeSample(101, 2_000, 40)],
    )
    gpu1 = FakeGPU(
        uuid="GPU-11111111-1111-1111-1111-111111111111",
        memory_used=10 * GiB,
        utilization=0,
        processes=[FakeProcess(101, 1 * GiB), FakeProcess(202, 8 * GiB)],
        samples=[FakeSample(202, 1_500, 90)],
    )
    return FakePynvml([gpu0, gpu1])
