"""GPU numbers from NVML (package nvidia-ml-py, ``import pynvml``).

Nothing touches NVML at import: ``pynvml`` is imported inside :meth:`NVMLTelemetry.open`, so
the server starts on machines without a driver and says why instead of failing.

Degrade, never raise: an NVML error on one device (GPU lost, call not supported, no
permission) turns that device's fields into ``None``; the other devices still report.

Indexing: physical GPUs keep their NVML index (the ``nvidia-smi`` number). When a GPU has MIG
enabled it is not listed itself; each of its MIG instances is, with ``mig=True``,
``parent_index`` = the physical GPU, and an index numbered after all physical GPUs
(``device_count + k`` in enumeration order) so indices stay unique.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import psutil

from .base import GPUInfo, ProcessUsage, Telemetry, TelemetryStatus

_LOG = logging.getLogger("jupyter_gpushare.telemetry.nvml")


def _text(value: Any) -> str:
    """Old bindings return ``bytes`` for strings; new ones ``str``."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def foreign_pids(pids: Iterable[int]) -> set[int]:
    """Pids that do not exist in this pid namespace.

    NVML reports the host's pids (sometimes mixed across calls); inside a container with its
    own pid namespace they do not match the container's pids. The tracker uses a non-empty answer to tell it is in a container and to
    fall back to the kernel agent's own report.
    """
    return {pid for pid in pids if not psutil.pid_exists(pid)}


def driver_major(version: str | None) -> int | None:
    """``"580.82.07"`` -> 580; None when unknown or unparsable."""
    if not version:
        return None
    try:
        return int(version.split(".", 1)[0])
    except ValueError:
        return None


@dataclass
class NVMLProbe:
    """A one-shot look at NVML for ``doctor`` and ``DriverMethod.support``."""

    ok: bool
    reason: str = ""
    no_driver: bool = False  # no NVML library at all: a machine without NVIDIA driver
    driver_version: str | None = None
    cuda_driver_version: int | None = None  # e.g. 12080 for CUDA 12.8
    gpus: list[GPUInfo] = field(default_factory=list)
    mig_gpus: list[int] = field(default_factory=list)  # physical indices with MIG enabled


def probe(log: logging.Logger | None = None) -> NVMLProbe:
    """Open NVML, read versions and devices, close it. Never raises.

    NVML init is reference counted, so this is safe while an :class:`NVMLTelemetry` is open.
    """
    tel = NVMLTelemetry(log=log)
    st = tel.open()
    try:
        if not st.available:
            return NVMLProbe(
                ok=False, reason=st.reason,
                no_driver=st.details.get("error") == "library_not_found",
            )
        gpus = tel.devices()
        return NVMLProbe(
            ok=True,
            driver_version=tel.driver_version(),
            cuda_driver_version=tel.cuda_driver_version(),
            gpus=gpus,
            mig_gpus=sorted({g.parent_index for g in gpus if g.mig and g.parent_index is not None}),
        )
    finally:
        tel.close()


@dataclass
class _Dev:
    """One listed device: its index, NVML handle (None when it could not be had), MIG-ness."""

    index: int
    handle: Any
    mig: bool = False
    parent_index: int | None = None
    error: str = ""


class NVMLTelemetry(Telemetry):
    """Devices, per-process memory and per-process SM utilization from NVML."""

    name = "nvml"
    label = "NVML"

    def __init__(self, log: logging.Logger | None = None) -> None:
        self.log = log or _LOG
        self._nvml: Any = None  # the pynvml module once initialized
        self._status = TelemetryStatus(name=self.name, available=False, reason="not opened")
        self._last_ts: dict[str, int] = {}  # device uuid -> last process-sample timestamp (us)
        self._logged: set[tuple[str, str]] = set()  # (what, device) already logged once
        self._devs: list[_Dev] = []  # the last enumeration (handles are stable between them)

    # -- lifecycle ----------------------------------------------------------------------
    def open(self) -> TelemetryStatus:
        if self._nvml is not None:
            return self._status
        try:
            import pynvml
        except ImportError as e:  # nvidia-ml-py missing: a broken install, say so
            return self._unavailable(f"nvidia-ml-py is not installed ({e})")
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound:
            return self._unavailable(
                "NVML library (libnvidia-ml.so.1) not found: no NVIDIA driver on this machine",
                error="library_not_found",
            )
        except pynvml.NVMLError_DriverNotLoaded:
            return self._unavailable("the NVIDIA kernel driver is not loaded")
        except pynvml.NVMLError as e:
            return self._unavailable(f"nvmlInit failed: {_text(e)}")
        except OSError as e:  # ctypes trouble loading the library
            return self._unavailable(f"nvmlInit failed: {e}")
        self._nvml = pynvml
        details = {}
        dv = self.driver_version()
        if dv:
            details["driver_version"] = dv
        cv = self.cuda_driver_version()
        if cv:
            details["cuda_driver_version"] = f"{cv // 1000}.{cv % 1000 // 10}"
        self._status = TelemetryStatus(name=self.name, available=True, details=details)
        return self._status

    def _unavailable(self, reason: str, error: str = "") -> TelemetryStatus:
        self._once("init", "", logging.WARNING, "NVML unavailable: %s", reason)
        details = {"error": error} if error else {}
        self._status = TelemetryStatus(
            name=self.name, available=False, reason=reason, details=details
        )
        return self._status

    def close(self) -> None:
        self._devs = []
        nvml, self._nvml = self._nvml, None
        if nvml is None:
            return
        self._status = TelemetryStatus(name=self.name, available=False, reason="closed")
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError as e:
            self.log.debug("nvmlShutdown: %s", e)

    def status(self) -> TelemetryStatus:
        return self._status

    def foreign_pids(self, pids: Iterable[int]) -> set[int]:
        return foreign_pids(pids)

    # -- system helpers -----------------------------------------------------------------
    def driver_version(self) -> str | None:
        """Display driver version, e.g. ``"580.82.07"``; None when unknown."""
        nvml = self._nvml
        if nvml is None:
            return None
        try:
            return _text(nvml.nvmlSystemGetDriverVersion())
        except nvml.NVMLError:
            return None

    def cuda_driver_version(self) -> int | None:
        """CUDA version the driver supports, as NVML encodes it (12080 = 12.8); None if unknown."""
        nvml = self._nvml
        if nvml is None:
            return None
        try:
            return int(nvml.nvmlSystemGetCudaDriverVersion())
        except nvml.NVMLError:
            return None

    def free_bytes(self, index: int) -> int | None:
        """Free memory on GPU ``index`` read now (not from the last poll); None = unknown.

        This is what a restore's room check asks, so it must be fresh. Device handles come
        from the last enumeration (every sample refreshes it), not a new one per call.
        """
        nvml = self._nvml
        if nvml is None:
            return None
        devs = self._devs if any(d.index == index for d in self._devs) else self._enumerate()
        for dev in devs:
            if dev.index == index and dev.handle is not None:
                try:
                    return int(nvml.nvmlDeviceGetMemoryInfo(dev.handle).free)
                except nvml.NVMLError as e:
                    self._once("memory", str(index), logging.WARNING,
                               "GPU %s: cannot read free memory: %s", index, e)
                    return None
        return None

    # -- sampling -----------------------------------------------------------------------
    def devices(self) -> list[GPUInfo]:
        nvml = self._nvml
        if nvml is None:
            return []
        out = []
        for dev in self._enumerate():
            out.append(self._info(nvml, dev))
        return out

    def processes(self) -> list[ProcessUsage]:
        nvml = self._nvml
        if nvml is None:
            return []
        usage: dict[tuple[int, int], ProcessUsage] = {}
        for dev in self._enumerate():
            if dev.handle is None:
                continue
            try:
                procs = nvml.nvmlDeviceGetComputeRunningProcesses(dev.handle)
            except nvml.NVMLError as e:
                self._once("procs", str(dev.index), logging.WARNING,
                           "GPU %s: cannot list processes: %s", dev.index, e)
                continue
            for p in procs:
                key = (int(p.pid), dev.index)
                mem = int(p.usedGpuMemory or 0)  # None = not available (WDDM, some containers)
                if key in usage:  # the same pid twice on a device (e.g. MPS): add up
                    usage[key].memory_bytes += mem
                else:
                    usage[key] = ProcessUsage(pid=key[0], gpu=dev.index, memory_bytes=mem)
            if dev.mig:
                continue  # per-process utilization is not supported under MIG
            for pid, util in self._process_utilization(nvml, dev).items():
                if (pid, dev.index) in usage:
                    usage[(pid, dev.index)].sm_utilization = util
        return list(usage.values())

    # -- internals ----------------------------------------------------------------------
    def _once(self, what: str, device: str, level: int, msg: str, *args: Any) -> None:
        """Log a degradation once per (kind, device); later repeats go to debug."""
        key = (what, device)
        if key in self._logged:
            self.log.debug(msg, *args)
        else:
            self._logged.add(key)
            self.log.log(level, msg, *args)

    def _enumerate(self) -> list[_Dev]:
        """Physical GPUs by NVML index; a MIG-enabled GPU is replaced by its instances."""
        nvml = self._nvml
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as e:
            self._once("count", "", logging.WARNING, "cannot count GPUs: %s", e)
            return []
        physical: list[_Dev] = []
        migs: list[_Dev] = []
        for i in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
            except nvml.NVMLError as e:
                self._once("handle", str(i), logging.WARNING, "GPU %s: no handle: %s", i, e)
                physical.append(_Dev(index=i, handle=None, error=_text(e)))
                continue
            instances = self._mig_instances(nvml, i, handle)
            if instances is None:
                physical.append(_Dev(index=i, handle=handle))
            else:
                for h in instances:
                    migs.append(_Dev(index=count + len(migs), handle=h, mig=True, parent_index=i))
        self._devs = physical + migs
        return self._devs

    def _mig_instances(self, nvml: Any, index: int, handle: Any) -> list[Any] | None:
        """MIG device handles when MIG is enabled on this GPU, else None."""
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError:  # NotSupported on GPUs without MIG; anything else: treat as off
            return None
        if current != nvml.NVML_DEVICE_MIG_ENABLE:
            return None
        handles: list[Any] = []
        try:
            slots = int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))
        except nvml.NVMLError as e:
            self._once("mig", str(index), logging.WARNING, "GPU %s: MIG count: %s", index, e)
            return handles
        for j in range(slots):
            try:
                handles.append(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j))
            except nvml.NVMLError_NotFound:
                continue  # empty slot
            except nvml.NVMLError as e:
                self._once("mig", f"{index}/{j}", logging.WARNING,
                           "GPU %s MIG slot %s: %s", index, j, e)
        return handles

    def _info(self, nvml: Any, dev: _Dev) -> GPUInfo:
        info = GPUInfo(
            index=dev.index, uuid="", name="unavailable", memory_total=None, memory_used=None,
            utilization=None, mig=dev.mig, parent_index=dev.parent_index,
        )
        h = dev.handle
        if h is None:
            return info
        label = str(dev.index)
        try:
            info.uuid = _text(nvml.nvmlDeviceGetUUID(h))
        except nvml.NVMLError as e:
            self._once("uuid", label, logging.WARNING, "GPU %s: uuid: %s", label, e)
        try:
            info.name = _text(nvml.nvmlDeviceGetName(h))
        except nvml.NVMLError as e:
            self._once("name", label, logging.WARNING, "GPU %s: name: %s", label, e)
        try:
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            info.memory_total, info.memory_used = int(mem.total), int(mem.used)
        except nvml.NVMLError as e:
            self._once("memory", label, logging.WARNING, "GPU %s: memory: %s", label, e)
        if not dev.mig:  # utilization rates are not reported per MIG instance
            try:
                info.utilization = float(nvml.nvmlDeviceGetUtilizationRates(h).gpu)
            except nvml.NVMLError as e:
                self._once("util", label, logging.INFO, "GPU %s: utilization: %s", label, e)
        return info

    def _process_utilization(self, nvml: Any, dev: _Dev) -> dict[int, float]:
        """Mean SM % per pid over the samples newer than the last call on this device.

        ``NotFound`` = no new sample since the timestamp: nothing is returned, so callers keep
        ``None`` ("unknown") rather than claim 0 %.
        """
        key = self._device_key(nvml, dev)
        since = self._last_ts.get(key, 0)
        try:
            samples = nvml.nvmlDeviceGetProcessUtilization(dev.handle, since)
        except nvml.NVMLError_NotFound:
            return {}
        except nvml.NVMLError_NotSupported:
            self._once("putil", key, logging.INFO,
                       "GPU %s: per-process utilization not supported", dev.index)
            return {}
        except nvml.NVMLError as e:
            self._once("putil", key, logging.WARNING,
                       "GPU %s: per-process utilization: %s", dev.index, e)
            return {}
        sums: dict[int, list[float]] = {}
        newest = since
        for s in samples:
            newest = max(newest, int(s.timeStamp))
            if int(s.timeStamp) <= since:
                continue
            util = int(s.smUtil)
            if util > 100:  # the driver's "invalid" marker (0xFFFFFFFF) on some versions
                continue
            sums.setdefault(int(s.pid), []).append(float(util))
        self._last_ts[key] = newest
        return {pid: sum(v) / len(v) for pid, v in sums.items()}

    def _device_key(self, nvml: Any, dev: _Dev) -> str:
        """Timestamps are remembered by uuid, so a changed enumeration cannot mix them up."""
        try:
            return _text(nvml.nvmlDeviceGetUUID(dev.handle))
        except nvml.NVMLError:
            return f"index:{dev.index}"
