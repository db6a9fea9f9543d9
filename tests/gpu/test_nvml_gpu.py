"""NVMLTelemetry on a real GPU (run with ``pytest -m gpu`` on a GPU machine; fakes elsewhere)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
import time

import pytest

from jupyter_gpushare.telemetry.nvml import foreign_pids

from .helpers import readline

# each test's own timeout (seconds), so that a hang costs one test, not the GPU proof's stage
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(60)]

MiB = 1 << 20

# allocates 512 MiB with torch or cupy, says "ready", keeps the GPU busy on "spin", ends on EOF
CHILD = textwrap.dedent(
    """
    import sys, time
    lib = sys.argv[1]
    if lib == "torch":
        import torch
        x = torch.ones(512 << 20, dtype=torch.uint8, device="cuda:0")
        sync = torch.cuda.synchronize
        def spin():
            a = torch.rand(4096, 4096, device="cuda:0")
            end = time.time() + 2
            while time.time() < end:
                a = a @ a; a = a / a.norm()
            sync()
    else:
        import cupy
        x = cupy.ones(512 << 20, dtype=cupy.uint8)
        sync = cupy.cuda.Device(0).synchronize
        def spin():
            a = cupy.random.rand(4096, 4096, dtype=cupy.float32)
            end = time.time() + 2
            while time.time() < end:
                a = a @ a; a = a / cupy.linalg.norm(a)
            sync()
    sync()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "spin":
            spin()
            print("spun", flush=True)
    """
)


def _framework() -> str:
    for lib in ("torch", "cupy"):
        if importlib.util.find_spec(lib) is not None:
            return lib
    pytest.skip("needs torch or cupy to allocate GPU memory in a child process")


@pytest.fixture
def child():
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, _framework()],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
    )
    assert readline(proc) == "ready"
    yield proc
    proc.stdin.close()
    proc.wait(timeout=60)


def test_lists_the_gpus(nvml):
    gpus = nvml.devices()
    assert gpus, "NVML lists no GPU"
    for g in gpus:
        assert g.uuid.startswith(("GPU-", "MIG-")) and g.name
        assert g.memory_total and g.memory_total > 0 and g.memory_used is not None
        if not g.mig:
            assert g.utilization is not None and 0 <= g.utilization <= 100
    assert nvml.driver_version() and nvml.cuda_driver_version()
    assert nvml.free_bytes(gpus[0].index) is not None


def test_sees_a_child_process_and_its_memory(nvml, child):
    usage = nvml.processes()
    mine = [u for u in usage if u.pid == child.pid]
    if mine:
        assert mine[0].memory_bytes >= 512 * MiB
    else:
        # inside a container NVML reports host pids: foreign_pids must say so
        assert foreign_pids(u.pid for u in usage), "child not listed and no foreign pid"
        assert any(u.memory_bytes >= 512 * MiB for u in usage)


def test_process_utilization_while_busy(nvml, child):
    nvml.processes()  # sets the per-device timestamp
    child.stdin.write("spin\n")
    assert readline(child) == "spun"
    deadline = time.monotonic() + 10
    seen = []
    while time.monotonic() < deadline and not seen:
        seen = [u.sm_utilization for u in nvml.processes() if u.sm_utilization is not None]
        if not seen:
            time.sleep(0.2)
    assert seen, "no per-process utilization sample after 2 s of matmuls"
    assert all(0 <= s <= 100 for s in seen) and max(seen) > 0
