"""`jupyter gpushare doctor` against fake pynvml / cuda.core, and for real on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jupyter_gpushare import doctor
from tests.fakes import fake_pynvml as fp
from tests.fakes.fake_checkpoint import install_fake_cuda_core
from tests.fakes.fake_pynvml import FakeGPU, FakeProcess, FakePynvml, GiB


def by_name(checks):
    return {c.name: c for c in checks}


@pytest.fixture
def no_cuda_core(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.core.checkpoint", None)


def gpu_node(monkeypatch, driver="580.82.07", pids=(), mig=False):
    gpus = [
        FakeGPU(uuid="GPU-a", name="NVIDIA H100 80GB HBM3",
                processes=[FakeProcess(pid, GiB) for pid in pids]),
        FakeGPU(uuid="GPU-b", name="NVIDIA H100 80GB HBM3"),
    ]
    if mig:
        gpus[1].mig_devices = [FakeGPU(uuid="MIG-1", name="NVIDIA H100 MIG 1g.10gb",
                                       memory_total=10 * GiB)]
    fake = FakePynvml(gpus, driver_version=driver)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def test_machine_without_driver(monkeypatch, no_cuda_core, capsys):
    monkeypatch.setitem(
        sys.modules, "pynvml", FakePynvml([], init_error=fp.NVML_ERROR_LIBRARY_NOT_FOUND)
    )
    c = by_name(doctor.collect())
    assert c["NVML"].ok is None and "libnvidia-ml.so.1" in c["NVML"].detail
    assert c["GPUs"].ok is None
    assert c["cuda.core checkpoint"].ok is None  # not needed without a GPU
    assert c["telemetry backend"].detail.startswith("auto -> simulated: NVML unavailable")
    assert c["release method"].detail.startswith("auto -> simulated")
    assert doctor.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("jupyter-gpushare doctor\n")
    assert "[ -- ] release method" in out


def test_broken_driver_is_a_failure(monkeypatch, no_cuda_core):
    monkeypatch.setitem(
        sys.modules, "pynvml", FakePynvml([], init_error=fp.NVML_ERROR_DRIVER_NOT_LOADED)
    )
    c = by_name(doctor.collect())
    assert c["NVML"].ok is False and "not loaded" in c["NVML"].detail


def test_driver_580_with_cuda_core_picks_driver(monkeypatch):
    gpu_node(monkeypatch, pids=[os.getpid()])
    install_fake_cuda_core(monkeypatch)
    c = by_name(doctor.collect())
    assert c["NVML"].ok and "580.82.07" in c["NVML"].detail and "CUDA 13.0" in c["NVML"].detail
    assert c["GPUs"].detail == "0: NVIDIA H100 80GB HBM3, 80 GiB; 1: NVIDIA H100 80GB HBM3, 80 GiB"
    assert c["driver for checkpoint API"].ok and "another GPU" in c["driver for checkpoint API"].detail
    assert c["cuda.core checkpoint"].ok and "cuda.core 1.2.2" in c["cuda.core checkpoint"].detail
    assert c["pid namespace"].ok is True
    assert c["telemetry backend"].detail == "auto -> nvml: NVML sees 2 GPUs"
    assert c["release method"].detail.startswith("auto -> driver: CUDA checkpoint API available")


def test_old_driver_picks_framework(monkeypatch):
    gpu_node(monkeypatch, driver="550.163.01")
    install_fake_cuda_core(monkeypatch)
    c = by_name(doctor.collect())
    assert c["driver for checkpoint API"].ok is False
    assert "framework" in c["driver for checkpoint API"].detail
    assert c["release method"].detail.startswith("auto -> framework:")
    assert "older than 570" in c["release method"].detail


def test_575_driver_warns_about_migration(monkeypatch):
    gpu_node(monkeypatch, driver="575.51.03")
    d = by_name(doctor.collect())["driver for checkpoint API"]
    assert d.ok is True and "needs 580" in d.detail


def test_mig_picks_framework(monkeypatch):
    gpu_node(monkeypatch, mig=True)
    install_fake_cuda_core(monkeypatch)
    c = by_name(doctor.collect())
    assert "MIG instance of GPU 1" in c["GPUs"].detail
    assert "MIG enabled on GPU 1" in c["GPUs"].detail
    assert c["release method"].detail.startswith("auto -> framework:")
    assert "MIG" in c["release method"].detail


def test_no_cuda_core_on_gpu_machine_is_a_failure(monkeypatch, no_cuda_core):
    gpu_node(monkeypatch)
    c = by_name(doctor.collect())
    assert c["cuda.core checkpoint"].ok is False
    assert "jupyter-gpushare[checkpoint]" in c["cuda.core checkpoint"].detail
    assert c["release method"].detail.startswith("auto -> framework:")


def test_foreign_pids_mean_container(monkeypatch):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid does not exist here any more
    gpu_node(monkeypatch, pids=[os.getpid(), child.pid])
    c = by_name(doctor.collect())["pid namespace"]
    assert c.ok is False and "1 of 2 NVML pids do not exist here" in c.detail


def test_configured_backends(monkeypatch, no_cuda_core):
    monkeypatch.setitem(
        sys.modules, "pynvml", FakePynvml([], init_error=fp.NVML_ERROR_LIBRARY_NOT_FOUND)
    )
    c = by_name(doctor.collect("nvml"))
    assert c["telemetry backend"].ok is False
    assert c["release method"].detail.startswith("auto -> framework:")
    gpu_node(monkeypatch)
    c = by_name(doctor.collect("simulated"))
    assert c["telemetry backend"].detail == "simulated: configured"
    assert c["release method"].detail.startswith("auto -> simulated")


def test_permissions(monkeypatch):
    monkeypatch.setattr(doctor.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(doctor, "_capabilities", lambda: 1 << doctor.CAP_SYS_PTRACE)
    assert doctor._check_permissions().ok is True
    monkeypatch.setattr(doctor, "_capabilities", lambda: 0)
    p = doctor._check_permissions()
    assert p.ok is None and "need root" in p.detail
    monkeypatch.setattr(doctor.os, "geteuid", lambda: 0)
    assert doctor._check_permissions().detail.startswith("running as root")


def test_format_report_marks():
    text = doctor.format_report([
        doctor.Check("a", True, "fine"), doctor.Check("bbb", False, "broken"),
        doctor.Check("c", None, "info"),
    ])
    assert text.splitlines()[1:] == ["[ ok ] a    fine", "[FAIL] bbb  broken", "[ -- ] c    info"]


def doctor_json(*args: str, env: dict | None = None) -> dict:
    """`--json` from the real command, the backend configured by ``env`` alone."""
    clean = {k: v for k, v in os.environ.items() if k != "JUPYTER_GPUSHARE_BACKEND"}
    out = subprocess.run(
        [sys.executable, "-m", "jupyter_gpushare.doctor", "--json", *args],
        capture_output=True, text=True, timeout=120, env={**clean, **(env or {})},
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    return json.loads(out.stdout)


def test_real_machine_json():
    # whatever this machine is (no GPU in CI, a GPU node elsewhere), doctor runs and exits 0
    report = doctor_json()
    names = [c["name"] for c in report["checks"]]
    assert names[-2:] == ["telemetry backend", "release method"]
    assert set(report) == {"backend", "backend_reason", "method", "method_reason",
                           "configured_backend", "configured_method", "checks"}
    assert (report["configured_backend"], report["configured_method"]) == ("auto", "auto")
    # the chosen backend and method as fields of their own, the same the lines say
    detail = {c["name"]: c["detail"] for c in report["checks"]}
    assert report["backend"] in ("nvml", "simulated") and report["backend_reason"]
    assert detail["telemetry backend"] == f"auto -> {report['backend']}: {report['backend_reason']}"
    assert report["method"] and report["method_reason"]
    assert detail["release method"] == f"auto -> {report['method']}: {report['method_reason']}"


def test_json_gives_the_configured_and_the_chosen_backend_and_method():
    """The simulated backend, configured by the environment as the server reads it: the
    simulated method, whatever the machine has."""
    report = doctor_json(env={"JUPYTER_GPUSHARE_BACKEND": "simulated"})
    assert (report["configured_backend"], report["backend"]) == ("simulated", "simulated")
    assert report["backend_reason"] == "configured"
    assert (report["configured_method"], report["method"]) == ("auto", "simulated")
    assert "simulated" in report["method_reason"]
    report = doctor_json("--backend", "simulated", "--release-method", "off")
    assert (report["configured_method"], report["method"]) == ("off", "off")
    assert report["method_reason"] == "release_method = off: GPU memory is tracked, never released"


def test_restore_turns_say_when_other_users_processes_share_a_gpu(monkeypatch):
    """Another Unix user's process on a GPU: the default lock directory (this user's servers
    only) does not cover its restores, and the doctor says what to set."""
    from .helpers import unix_user

    uid = unix_user("gpushare-squatter", "a GPU process of another Unix user")
    other = subprocess.Popen(["sleep", "60"], user=uid)
    try:
        monkeypatch.delenv("JUPYTER_GPUSHARE_NODE_DAEMON", raising=False)
        gpu_node(monkeypatch, pids=[os.getpid(), other.pid])
        c = by_name(doctor.collect())["restore turns"]
        assert "restores on GPU 0 share it with other users' processes" in c.detail, c
        assert "node_lock_dir" in c.detail and "node_daemon_socket" in c.detail, c
        gpu_node(monkeypatch, pids=[os.getpid()])  # only this user's: the general advice
        c = by_name(doctor.collect())["restore turns"]
        assert "share it" not in c.detail and "this user's servers only" in c.detail, c
        monkeypatch.setenv("JUPYTER_GPUSHARE_NODE_DAEMON", "/run/gpushare.sock")
        c = by_name(doctor.collect())["restore turns"]
        assert c.ok is True and "placed kernels" in c.detail, c
    finally:
        other.kill()
        other.wait()
