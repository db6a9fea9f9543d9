"""The NVML backend through a real server and real kernels, with NVML faked at the pynvml
boundary (beside the gpu-marked tests in tests/gpu/ that use the real library)."""

from __future__ import annotations

import sys

import pytest

from jupyter_gpushare.sim.node import GiB

from .fakes.fake_pynvml import FakeGPU, FakeProcess, FakePynvml
from .helpers import get_json, kernel_status


@pytest.fixture
def fake_nvml(monkeypatch):
    fake = FakePynvml([FakeGPU(uuid="GPU-00000000-0000-0000-0000-000000000000")])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


@pytest.fixture
def gpushare_config(fake_nvml):
    return {"backend": "auto", "idle_timeout": 0}


async def test_auto_picks_nvml_and_attributes_kernel_memory(jp_fetch, kernels, gpushare_app, fake_nvml):
    k = await kernels.start()
    status = await get_json(jp_fetch, "api", "gpushare", "status")
    assert status["backend"] == "nvml"
    assert status["method"] == "framework"  # no checkpoint-capable driver here
    assert status["gpus"][0]["name"] == "NVIDIA H100 80GB HBM3"

    pid = gpushare_app.tracker.kernel_pid(k.id)
    gpu = fake_nvml.gpus[0]
    gpu.processes = [FakeProcess(pid, 2 * GiB)]
    gpu.memory_used = 2 * GiB
    await gpushare_app.poll_once()
    info = await kernel_status(jp_fetch, k.id)
    assert info["gpu_memory_bytes"] == 2 * GiB and info["gpus"] == [0]
    assert gpushare_app.tracker.foreign_pids == set()


async def test_foreign_pids_fall_back_to_agent_reports(jp_fetch, kernels, gpushare_app, fake_nvml):
    k = await kernels.start()
    fake_nvml.gpus[0].processes = [FakeProcess(2**22 + 12345, 3 * GiB)]  # a pid not in this namespace
    await gpushare_app.poll_once()
    assert gpushare_app.tracker.foreign_pids == {2**22 + 12345}
    await gpushare_app.poll_once()  # now the agents are asked for their own count
    report = gpushare_app.channel.connections[k.id].report
    assert report["framework_bytes"] == 0 and "frameworks" in report
    info = await kernel_status(jp_fetch, k.id)
    assert info["gpu_memory_bytes"] == 0  # nothing is attributed on a guess
