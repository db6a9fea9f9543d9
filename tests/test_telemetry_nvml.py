"""NVMLTelemetry against the fake pynvml (real thing: tests/gpu/test_nvml_gpu.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from jupyter_gpushare.telemetry.nvml import NVMLTelemetry, driver_major, foreign_pids, probe
from tests.fakes import fake_pynvml as fp
from tests.fakes.fake_pynvml import FakeGPU, FakeProcess, FakePynvml, FakeSample, GiB


@pytest.fixture
def nvml(monkeypatch):
    fake = fp.two_gpus()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


@pytest.fixture
def tel(nvml):
    t = NVMLTelemetry()
    assert t.open().available
    yield t
    t.close()


def by_key(usages):
    return {(u.pid, u.gpu): u for u in usages}


def test_import_does_not_touch_nvml():
    # a fresh interpreter: importing the module must not import pynvml
    code = (
        "import sys, jupyter_gpushare.telemetry.nvml as m; "
        "print('pynvml' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_two_gpus_devices(tel):
    gpus = tel.devices()
    assert [g.index for g in gpus] == [0, 1]
    g0, g1 = gpus
    assert g0.uuid == "GPU-00000000-0000-0000-0000-000000000000"
    assert g0.name == "NVIDIA H100 80GB HBM3"
    assert (g0.memory_total, g0.memory_used, g0.utilization) == (80 * GiB, 5 * GiB, 30.0)
    assert (g1.memory_used, g1.utilization) == (10 * GiB, 0.0)
    assert not g0.mig and g0.parent_index is None
    st = tel.status()
    assert st.available and st.name == "nvml"
    assert st.details == {"driver_version": "580.82.07", "cuda_driver_version": "13.0"}


def test_processes_memory_and_mean_utilization(tel, nvml):
    u = by_key(tel.processes())
    assert set(u) == {(101, 0), (101, 1), (202, 1)}
    assert u[(101, 0)].memory_bytes == 4 * GiB
    assert u[(101, 0)].sm_utilization == 30.0  # mean of the samples 20 and 40
    assert u[(101, 1)].sm_utilization is None  # no sample for this pid on GPU 1
    assert u[(202, 1)].sm_utilization == 90.0
    # the timestamps of the newest samples were remembered per device
    util_calls = [c for c in nvml.calls if c[0] == "nvmlDeviceGetProcessUtilization"]
    assert [c[2] for c in util_calls] == [0, 0]


def test_second_call_asks_since_last_sample_and_not_found_means_unknown(tel, nvml):
    tel.processes()
    nvml.gpus[0].samples.append(FakeSample(101, 3_000, 5))
    u = by_key(tel.processes())
    assert u[(101, 0)].sm_utilization == 5.0  # only the new sample counts
    # GPU 1 had no new sample: NVML raises NotFound -> unknown, not 0 %
    assert u[(202, 1)].sm_utilization is None
    util_calls = [c for c in nvml.calls if c[0] == "nvmlDeviceGetProcessUtilization"]
    assert [c[2] for c in util_calls[-2:]] == [2_000, 1_500]
    # and the next call on GPU 0 starts after the newest sample seen
    tel.processes()
    util_calls = [c for c in nvml.calls if c[0] == "nvmlDeviceGetProcessUtilization"]
    assert util_calls[-2][2] == 3_000


def test_not_supported_utilization_logged_once(tel, nvml, caplog):
    nvml.fail("nvmlDeviceGetProcessUtilization", nvml.gpus[1], fp.NVML_ERROR_NOT_SUPPORTED)
    caplog.set_level(logging.INFO, logger="jupyter_gpushare.telemetry.nvml")
    for _ in range(3):
        u = by_key(tel.processes())
        assert u[(202, 1)].sm_utilization is None
        assert u[(202, 1)].memory_bytes == 8 * GiB
    msgs = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert sum("not supported" in m for m in msgs) == 1


def test_none_used_memory_is_zero(nvml, tel):
    nvml.gpus[0].processes = [FakeProcess(303, None)]
    u = by_key(tel.processes())
    assert u[(303, 0)].memory_bytes == 0


def test_no_driver_at_init(monkeypatch, caplog):
    fake = FakePynvml([], init_error=fp.NVML_ERROR_DRIVER_NOT_LOADED)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    t = NVMLTelemetry()
    caplog.set_level(logging.WARNING, logger="jupyter_gpushare.telemetry.nvml")
    st = t.open()
    assert not st.available and "driver is not loaded" in st.reason
    assert t.devices() == [] and t.processes() == []
    assert t.free_bytes(0) is None and t.driver_version() is None
    t.open()  # a second attempt does not log again
    assert len([r for r in caplog.records if "NVML unavailable" in r.getMessage()]) == 1
    t.close()
    assert fake.called("nvmlShutdown") == 0  # never initialized: nothing to shut down


def test_library_missing(monkeypatch):
    monkeypatch.setitem(
        sys.modules, "pynvml", FakePynvml([], init_error=fp.NVML_ERROR_LIBRARY_NOT_FOUND)
    )
    st = NVMLTelemetry().open()
    assert not st.available
    assert "libnvidia-ml.so.1" in st.reason


def test_bindings_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    st = NVMLTelemetry().open()
    assert not st.available and "nvidia-ml-py" in st.reason


def test_mig_instances_listed_as_own_gpus(monkeypatch):
    inst_a = FakeGPU(uuid="MIG-aaaa", name="NVIDIA H100 MIG 3g.40gb", memory_total=40 * GiB,
                     memory_used=2 * GiB, processes=[FakeProcess(11, 2 * GiB)])
    inst_b = FakeGPU(uuid="MIG-bbbb", name="NVIDIA H100 MIG 3g.40gb", memory_total=40 * GiB)
    parent = FakeGPU(uuid="GPU-mig-parent", mig_devices=[inst_a, inst_b], max_mig_devices=7)
    plain = FakeGPU(uuid="GPU-plain", memory_used=1 * GiB, processes=[FakeProcess(12, GiB)],
                    samples=[FakeSample(12, 10, 50)])
    fake = FakePynvml([parent, plain])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    t = NVMLTelemetry()
    t.open()
    gpus = t.devices()
    # the physical GPU 1 keeps its index; MIG instances come after all physical GPUs
    assert [(g.index, g.uuid, g.mig, g.parent_index) for g in gpus] == [
        (1, "GPU-plain", False, None),
        (2, "MIG-aaaa", True, 0),
        (3, "MIG-bbbb", True, 0),
    ]
    mig_a = gpus[1]
    assert (mig_a.memory_total, mig_a.memory_used, mig_a.utilization) == (40 * GiB, 2 * GiB, None)
    u = by_key(t.processes())
    assert u[(11, 2)].memory_bytes == 2 * GiB and u[(11, 2)].sm_utilization is None
    assert u[(12, 1)].sm_utilization == 50.0
    # per-process utilization is never asked of a MIG instance (it is not supported there)
    asked = {c[1] for c in fake.calls if c[0] == "nvmlDeviceGetProcessUtilization"}
    assert asked == {"GPU-plain"}
    p = probe()
    assert p.ok and p.mig_gpus == [0]


def test_bytes_from_old_bindings(monkeypatch):
    fake = fp.two_gpus()
    fake.as_bytes = True
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    t = NVMLTelemetry()
    t.open()
    g0 = t.devices()[0]
    assert g0.name == "NVIDIA H100 80GB HBM3" and g0.uuid.startswith("GPU-0000")
    assert t.driver_version() == "580.82.07"


def test_one_device_erroring_other_still_reports(tel, nvml):
    lost = nvml.gpus[0]
    for func in ("nvmlDeviceGetMemoryInfo", "nvmlDeviceGetUtilizationRates",
                 "nvmlDeviceGetComputeRunningProcesses"):
        nvml.fail(func, lost, fp.NVML_ERROR_GPU_IS_LOST)
    g0, g1 = tel.devices()
    assert g0.uuid == lost.uuid and g0.memory_total is None and g0.utilization is None
    assert g1.memory_used == 10 * GiB and g1.utilization == 0.0
    assert set(by_key(tel.processes())) == {(101, 1), (202, 1)}
    assert tel.free_bytes(0) is None
    assert tel.free_bytes(1) == 70 * GiB


def test_device_without_handle_is_listed_degraded(tel, nvml):
    nvml.fail("nvmlDeviceGetHandleByIndex", nvml.gpus[1], fp.NVML_ERROR_NO_PERMISSION)
    g0, g1 = tel.devices()
    assert g0.memory_used == 5 * GiB
    assert (g1.index, g1.name, g1.memory_total) == (1, "unavailable", None)
    assert {u.gpu for u in tel.processes()} == {0}


def test_close_twice_and_after_close(nvml):
    t = NVMLTelemetry()
    t.open()
    assert nvml.refcount == 1
    t.close()
    t.close()
    assert nvml.refcount == 0 and nvml.called("nvmlShutdown") == 1
    assert t.devices() == [] and not t.status().available


def test_probe_leaves_telemetry_refcount(tel, nvml):
    p = probe()
    assert p.ok and p.driver_version == "580.82.07" and p.cuda_driver_version == 13000
    assert [g.index for g in p.gpus] == [0, 1] and p.mig_gpus == []
    assert nvml.refcount == 1  # the open telemetry still holds its reference
    assert tel.devices()


def test_driver_major():
    assert driver_major("580.82.07") == 580
    assert driver_major("570") == 570
    assert driver_major(None) is None and driver_major("abc") is None


def test_foreign_pids():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    gone = child.pid  # reaped: no longer exists in this namespace
    assert foreign_pids([os.getpid(), gone]) == {gone}
    assert foreign_pids([]) == set()
