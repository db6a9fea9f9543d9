"""The NVML backend through a real server and real kernels, with NVML faked at the pynvml
boundary (beside the gpu-marked tests in tests/gpu/ that use the real library)."""

from __future__ import annotations

import pytest

from jupyter_gpushare.sim.node import GiB

from .fakes.fake_pynvml import FakeProcess
from .helpers import get_json, kernel_status


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
    assert "needs 4.0 GiB on GPU 0 (2.0 GiB free" in gpushare_app.controller.states[k.id].waiting
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


# -- faults at the driver and NVML boundary ---------------------------------------------------
DRIVER = {"backend": "nvml", "idle_timeout": 0}


async def _driver_kernel(fake_nvml, fake_driver, kernels, app, nbytes: int = 4 * GiB):
    """A kernel whose pid NVML shows holding ``nbytes``, on the driver method (faked)."""
    app.methods["driver"]._factory = fake_driver.process
    k = await kernels.start()
    pid = app.tracker.kernel_pid(k.id)
    gpu = fake_nvml.gpus[0]
    gpu.processes, gpu.memory_used = [FakeProcess(pid, nbytes)], nbytes

    def follow(step, moved_pid):  # NVML sees what the driver does, as on a real machine
        if step == "checkpoint":
            gpu.processes = [p for p in gpu.processes if p.pid != moved_pid]
            gpu.memory_used = sum(p.used_memory or 0 for p in gpu.processes)
        elif step == "restore":
            gpu.processes = [*gpu.processes, FakeProcess(moved_pid, nbytes)]
            gpu.memory_used = sum(p.used_memory or 0 for p in gpu.processes)

    fake_driver.on_step = follow
    await app.poll_once()
    return k, pid, gpu


@pytest.mark.parametrize("gpushare_config", [DRIVER])
async def test_a_rollback_that_finds_its_memory_taken_is_failed_not_resident(
    fake_nvml, fake_driver, jp_fetch, kernels, gpushare_app
):
    """The checkpoint fails after the driver moved the memory out, and another process takes
    the GPU before the rollback: the kernel cannot be confirmed running, so it is failed
    (held), its cells wait, and it comes back once there is room."""
    from .scenarios import rest

    k, pid, gpu = await _driver_kernel(fake_nvml, fake_driver, kernels, gpushare_app)
    fake_driver.fail("checkpoint", pid, "CUDA_ERROR_UNKNOWN", new_state="checkpointed")
    gpu.processes, gpu.memory_used = [FakeProcess(2**22 + 1, 79 * GiB)], 79 * GiB
    code, body = await rest(jp_fetch, k.id, "release")
    assert code == 409 and "could not be confirmed running" in body["message"], body
    assert "stays checkpointed" in body["message"]
    info = await kernel_status(jp_fetch, k.id)
    assert info["state"] == "failed" and info["released_bytes"] == 4 * GiB
    assert fake_driver.states[pid] == "checkpointed"  # never restored without room

    msg_id = k.send("print('back')")
    import asyncio

    await asyncio.sleep(0.3)
    assert k.executions[msg_id].status == ""  # held: the kernel is not running
    gpu.processes, gpu.memory_used = [], 0
    ex = await k.wait(msg_id)
    assert "back" in ex.stdout and fake_driver.states[pid] == "running"
    assert gpushare_app.controller.states[k.id].state == "active"


@pytest.mark.parametrize("gpushare_config", [DRIVER])
async def test_a_pid_in_the_drivers_failed_state_is_shown_failed_without_a_retry_hint(
    fake_nvml, fake_driver, jp_fetch, kernels, gpushare_app
):
    from .scenarios import rest

    k, pid, _ = await _driver_kernel(fake_nvml, fake_driver, kernels, gpushare_app)
    code, _ = await rest(jp_fetch, k.id, "release")
    assert code == 200
    fake_driver.states[pid] = "failed"  # what a restore without room leaves on a real driver
    ex = await k.run("print('never')", ok=False)
    assert ex.status == "error" and "failed checkpoint state" in ex.error["evalue"]
    assert "restart the kernel" in ex.error["evalue"] and "retry" not in ex.error["evalue"]
    info = await kernel_status(jp_fetch, k.id)
    assert info["state"] == "failed" and "restart the kernel" in info["error"]


@pytest.mark.parametrize("gpushare_config", [DRIVER])
async def test_the_drivers_per_pid_lines_reach_the_cell_then_leave_it(
    fake_nvml, fake_driver, jp_fetch, kernels, gpushare_app
):
    """The controller hands the method a progress callback: the driver's own lines show in
    the cell that waits for the restore, and go once it is done (nothing saved)."""
    from .scenarios import rest

    k, pid, _ = await _driver_kernel(fake_nvml, fake_driver, kernels, gpushare_app)
    code, _ = await rest(jp_fetch, k.id, "release")
    assert code == 200
    ex = await k.run("print('back')")
    shown = [d["data"]["text/plain"] for d in ex.displays]
    assert shown == ["gpushare: restoring 4.0 GiB to GPU 0 ...",
                     f"gpushare: restoring pid {pid} (4.0 GiB) to GPU 0", shown[-1]]
    assert shown[-1].startswith("gpushare: restored 4.0 GiB in ")
    kinds = [kind for kind, _ in ex.sequence]
    assert kinds.index("clear_output") < kinds.index("execute_input")
    assert ex.stdout == "back\n" and fake_driver.states[pid] == "running"


@pytest.mark.parametrize("gpushare_config", [{"backend": "nvml", "idle_timeout": 0}])
async def test_a_stalled_nvml_call_does_not_block_the_websocket(fake_nvml, kernels, gpushare_app):
    """NVML hangs inside a poll: the poll waits on its own thread; cells keep running."""
    import asyncio

    k = await kernels.start()
    stalled = fake_nvml.stall("nvmlDeviceGetComputeRunningProcesses")
    try:
        poll = asyncio.ensure_future(gpushare_app.poll_once())
        await asyncio.sleep(0.2)
        assert not poll.done()
        ex = await k.run("print(6 * 7)")
        assert ex.stdout == "42\n" and not poll.done()
    finally:
        stalled.set()
    await poll


@pytest.mark.parametrize("gpushare_config", [{"backend": "nvml", "idle_timeout": 0}])
async def test_nvml_errors_mid_poll_keep_every_kernel_tracked(fake_nvml, jp_fetch, kernels, gpushare_app):
    from .fakes.fake_pynvml import NVML_ERROR_GPU_IS_LOST, NVML_ERROR_UNKNOWN

    k = await kernels.start()
    pid = gpushare_app.tracker.kernel_pid(k.id)
    gpu = fake_nvml.gpus[0]
    gpu.processes, gpu.memory_used = [FakeProcess(pid, 2 * GiB)], 2 * GiB
    await gpushare_app.poll_once()
    fake_nvml.fail("nvmlDeviceGetComputeRunningProcesses", None, NVML_ERROR_UNKNOWN)
    fake_nvml.fail("nvmlDeviceGetMemoryInfo", None, NVML_ERROR_GPU_IS_LOST)
    await gpushare_app.poll_once()
    status = await get_json(jp_fetch, "api", "gpushare", "status")
    assert [x["id"] for x in status["kernels"]] == [k.id]
    assert status["gpus"][0]["memory_used"] is None  # unknown, said so, not a guess
    fake_nvml._fail.clear()
    await gpushare_app.poll_once()
    assert (await kernel_status(jp_fetch, k.id))["gpu_memory_bytes"] == 2 * GiB
