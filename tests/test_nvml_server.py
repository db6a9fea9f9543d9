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


@pytest.fixture
def fake_driver(monkeypatch, fake_nvml):
    """cuda.core's checkpoint API faked at its boundary (tests/gpu has the real thing)."""
    from .fakes.fake_checkpoint import FakeCheckpointDriver, install_fake_cuda_core

    install_fake_cuda_core(monkeypatch)
    return FakeCheckpointDriver()


@pytest.mark.parametrize("gpushare_config", [{"backend": "nvml", "idle_timeout": 0}])
async def test_driver_method_through_the_server(fake_nvml, fake_driver, jp_fetch, kernels, gpushare_app):
    """Release over REST checkpoints the kernel's pid; the next cell restores it only once
    NVML shows room, and the gate holds the cell until then. (The fakes come first in the
    arguments: the server must start with them installed.)"""
    import asyncio
    import json

    from .helpers import wait_for

    assert gpushare_app.method_name == "driver"
    gpushare_app.methods["driver"]._factory = fake_driver.process
    k = await kernels.start()
    pid = gpushare_app.tracker.kernel_pid(k.id)
    gpu = fake_nvml.gpus[0]
    gpu.processes, gpu.memory_used = [FakeProcess(pid, 4 * GiB)], 4 * GiB
    await gpushare_app.poll_once()

    r = await jp_fetch("api", "gpushare", "kernels", k.id, "release", method="POST", body=b"")
    assert json.loads(r.body)["state"] == "released"
    assert fake_driver.steps() == [f"lock {pid}", f"checkpoint {pid}"]
    assert fake_driver.states[pid] == "checkpointed"

    # the driver freed the memory; another process takes most of the GPU meanwhile
    gpu.processes, gpu.memory_used = [FakeProcess(2**22 + 1, 78 * GiB)], 78 * GiB
    msg_id = k.send("print('after restore')")
    await wait_for(lambda: gpushare_app.controller.states[k.id].waiting, what="waiting for room")
    assert "needs 4.0 GiB on GPU 0 (2.0 GiB free)" in gpushare_app.controller.states[k.id].waiting
    await asyncio.sleep(0.3)
    assert fake_driver.steps() == [f"lock {pid}", f"checkpoint {pid}"]  # never restore without room
    assert k.executions[msg_id].status == ""

    def restored(step, restored_pid):  # the real driver brings the memory back
        if step == "restore":
            gpu.processes, gpu.memory_used = [FakeProcess(restored_pid, 4 * GiB)], 4 * GiB

    fake_driver.on_step = restored
    gpu.processes, gpu.memory_used = [], 0
    ex = await k.wait(msg_id)
    assert "after restore" in ex.stdout
    assert fake_driver.steps() == [f"lock {pid}", f"checkpoint {pid}", f"restore {pid}", f"unlock {pid}"]
    assert gpushare_app.controller.states[k.id].state == "active"
