"""A real server with ``backend=nvml`` and real ipykernels on a real GPU (``pytest -m gpu``).

What the other gpu tests check piece by piece, here through the server: NVML attributes a
kernel's PyTorch memory to that kernel in ``status``, and the driver method releases it over
REST and the next cell restores it through the gate, data intact. benchmarks/gpu/prove.sh
runs the longer version (several kernels and frameworks, timings).
"""

from __future__ import annotations

import importlib.util

import pytest

from jupyter_gpushare.reclaim.driver import driver_support

from ..helpers import kernel_status, rest, wait_for

# each test's own timeout (seconds), so that a hang costs one test, not the GPU proof's stage
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(90)]

GiB = 1 << 30

STATE = """
import torch
x = torch.randint(-2**62, 2**62, ((1 << 30) // 8,), dtype=torch.int64, device="cuda:0")
torch.cuda.synchronize()
def checksum():
    return f"{int((x ^ (x >> 17)).sum())}:{int(x[::4099].sum())}"
print(checksum())
"""


@pytest.fixture
def gpushare_config():
    return {"backend": "nvml", "release_method": "auto", "poll_interval": 0.5}


@pytest.fixture
def torch_cuda():
    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs PyTorch")


async def test_status_attributes_a_kernels_memory_and_the_driver_round_trip_keeps_it(
    nvml, torch_cuda, kernels, jp_fetch, gpushare_app
):
    k = await kernels.start()
    checksum = (await k.run(STATE, timeout=120)).stdout.strip()

    async def held():
        await gpushare_app.poll_once()
        info = await kernel_status(jp_fetch, k.id)
        return info if info and info["gpu_memory_bytes"] >= GiB else None

    info = await wait_for(held, timeout=10, what="status to show the kernel's 1 GiB")
    assert info["gpus"] == [0] and info["pids"]
    status = (await rest(jp_fetch, "GET", "status"))[1]
    assert status["backend"] == "nvml" and status["gpus"][0]["memory_total"] > GiB

    if not driver_support().ok:
        pytest.skip(f"driver method unsupported: {driver_support().reason}")
    free_before = nvml.free_bytes(0)
    code, view = await rest(jp_fetch, "POST", "kernels", k.id, "release")
    assert code == 200 and view["state"] == "released", view
    assert view["method"] == "driver"
    assert nvml.free_bytes(0) - free_before >= GiB * 0.9  # the memory really came back
    out = (await k.run("print(checksum())", timeout=120)).stdout.strip()
    assert out.splitlines()[-1] == checksum  # the gate restored before the cell ran
    info = await kernel_status(jp_fetch, k.id)
    assert info["state"] == "active" and info["restores"] == 1
