"""DriverMethod on a real GPU: checkpoint a PyTorch process, free its memory, restore it intact.

Run with ``pytest -m gpu`` on a machine with driver >= 570, torch and cuda-core installed.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import pytest

from jupyter_gpushare.reclaim.base import KernelTarget
from jupyter_gpushare.reclaim.driver import DriverMethod

from .helpers import readline

# each test's own timeout (seconds), so that a hang costs one test, not the GPU proof's stage
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(60)]

GiB = 1 << 30

# holds 1 GiB of random int64 on GPU 0 and answers "check" with a checksum computed on the GPU
CHILD = textwrap.dedent(
    """
    import sys, torch
    torch.manual_seed(1234)
    x = torch.randint(-2**62, 2**62, ((1 << 30) // 8,), dtype=torch.int64, device="cuda:0")
    def checksum():
        mixed = x ^ (x >> 17)
        return f"{int(mixed.sum())}:{int(x[::4099].sum())}"
    print("ready", checksum(), flush=True)
    for line in sys.stdin:
        if line.strip() == "check":
            print(checksum(), flush=True)
    """
)


@pytest.fixture
def torch_child(nvml, supported):
    free_before = nvml.free_bytes(0)
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
    )
    word, checksum = readline(proc).split()
    assert word == "ready"
    held = free_before - nvml.free_bytes(0)  # its tensor and its CUDA context
    assert held >= GiB
    yield proc, checksum, held
    proc.stdin.close()
    proc.wait(timeout=60)


def test_release_frees_memory_and_restore_keeps_the_data(nvml, torch_child):
    proc, checksum, held = torch_child
    method = DriverMethod(nvml.free_bytes)
    target = KernelTarget("gpu-test", pids=[proc.pid], gpu_bytes={0: held})
    lines: list[str] = []

    free_resident = nvml.free_bytes(0)
    res = asyncio.run(method.release(target, progress=lines.append))
    assert res.bytes == held and res.detail == "1 pid checkpointed"
    assert nvml.free_bytes(0) - free_resident >= GiB  # the GPU memory really came back
    assert proc.pid not in {u.pid for u in nvml.processes()}
    assert proc.poll() is None  # the process lives on

    res = asyncio.run(method.restore(target, progress=lines.append))
    assert res.bytes == held
    assert free_resident - nvml.free_bytes(0) >= GiB * 0.9
    proc.stdin.write("check\n")
    assert readline(proc) == checksum
    assert lines[-1].startswith(f"restoring pid {proc.pid}")


def test_abort_after_release_leaves_it_running(nvml, torch_child):
    proc, checksum, held = torch_child
    method = DriverMethod(nvml.free_bytes)
    target = KernelTarget("gpu-test", pids=[proc.pid], gpu_bytes={0: held})
    asyncio.run(method.release(target))
    asyncio.run(method.abort(target))
    proc.stdin.write("check\n")
    assert readline(proc) == checksum
