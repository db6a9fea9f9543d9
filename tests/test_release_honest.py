"""A release never says "released" when it freed nothing, and release_method "auto" does not
pick a method that cannot free the kernel's memory.

Through a real server and real kernels, NVML faked at pynvml and the checkpoint driver at
cuda.core (the hardware boundaries), and in the kernel a GPU framework faked at its device
(``fakes/fake_framework.py``: arrays held from outside the namespace, an allocator pool):
a framework release that leaves most of the memory on the GPU is undone and answers an error
that names what stayed, the kernel stays active with its values, and auto turns to the driver
for that kernel. The JAX pool rule and the threshold as unit tests of the pick and the check.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from jupyter_gpushare.kernel.offload.jax_adapter import pooled_bytes
from jupyter_gpushare.reclaim.framework import FrameworkMethod, freed_too_little
from jupyter_gpushare.server.ports import AutoPick, ServerKernels
from jupyter_gpushare.server.selection import framework_covers, method_for_kernel

from .fakes.fake_pynvml import FakeProcess
from .helpers import kernel_status, rest, wait_for

MiB = 1 << 20
GiB = 1 << 30
REPO = Path(__file__).resolve().parents[1]
FAKE = f"import sys\nsys.path.insert(0, {str(REPO)!r})\nfrom tests.fakes import fake_framework as fw\n"
AUTO = {"backend": "nvml", "idle_timeout": 0}  # release_method "auto" (the default)
FRAMEWORK_ONLY = {"backend": "nvml", "idle_timeout": 0, "release_method": "framework"}


@pytest.fixture
def fake_driver(monkeypatch, fake_nvml):
    from .fakes.fake_checkpoint import FakeCheckpointDriver, install_fake_cuda_core

    install_fake_cuda_core(monkeypatch)
    return FakeCheckpointDriver()


async def framework_kernel(app, kernels, fake_nvml, cell: str, nbytes: int, fake_driver=None):
    """A kernel whose fake framework holds ``nbytes`` (``cell`` makes them), which NVML sees
    its pid hold with a CUDA context; the driver's steps, if faked, move what NVML sees."""
    if fake_driver is not None:
        app.methods["driver"]._factory = fake_driver.process
    k = await kernels.start()
    await k.run(FAKE + cell)
    pid = app.tracker.kernel_pid(k.id)
    gpu = fake_nvml.gpus[0]
    held = nbytes + app._source.context_bytes(app.context_bytes)
    gpu.processes, gpu.memory_used = [FakeProcess(pid, held)], held

    def follow(step, moved_pid):  # NVML sees what the driver does
        if step == "checkpoint":
            gpu.processes, gpu.memory_used = [], 0
        elif step == "restore":
            gpu.processes, gpu.memory_used = [FakeProcess(moved_pid, held)], held

    if fake_driver is not None:
        fake_driver.on_step = follow
    await app.poll_once()
    return k, pid


async def method_is(jp_fetch, kid: str, want: str) -> dict:
    """Wait (a poll or two: the agent's report) until status shows the kernel's method."""
    async def shown():
        status = await kernel_status(jp_fetch, kid)
        return status if status and status["method"] == want else None

    return await wait_for(shown, what=f"method {want}")


@pytest.mark.parametrize("gpushare_config", [AUTO])
async def test_a_framework_release_that_frees_nothing_is_undone_and_auto_turns_to_the_driver(
    fake_nvml, fake_driver, jp_fetch, kernels, gpushare_app
):
    k, pid = await framework_kernel(gpushare_app, kernels, fake_nvml, (
        "fw.install()\n"
        "w = fw.array([1, 2, 3], nbytes=1 << 30, held_elsewhere=True)\n"
        "v = fw.array([4, 5], nbytes=64 << 20)\n"), GiB + 64 * MiB, fake_driver)
    await method_is(jp_fetch, k.id, "framework")  # the frameworks hold all of it

    code, body = await rest(jp_fetch, "POST", "kernels", k.id, "release")
    assert code == 409, body
    said = body["message"]
    assert "not released: the framework method freed 64.0 MiB of the 1.1 GiB" in said
    assert "w: referenced from outside the user namespace; left alone" in said
    assert "moved back: the kernel runs as before" in said
    status = await kernel_status(jp_fetch, k.id)
    assert status["state"] in ("active", "idle") and status["released_bytes"] == 0
    assert status["error"].startswith("release failed: not released:")
    assert fake_driver.steps() == []
    # the next release uses the driver: the policy need not wait to retry a failed release
    assert gpushare_app.controller.states[k.id].release_failed_at is None
    shown = await k.run("print(w.values, v.values, w.on_device, v.on_device, fw.DEVICE.reserved)")
    assert shown.stdout.strip() == f"[1, 2, 3] [4, 5] True True {GiB + 64 * MiB}"

    status = await method_is(jp_fetch, k.id, "driver")  # auto: the driver from now on
    pick = gpushare_app.controller.kernels.picks[k.id]
    assert pick == ("driver: the framework method could not free this kernel's memory (its "
                    "release freed 64.0 MiB of 1.1 GiB)")
    code, body = await rest(jp_fetch, "POST", "kernels", k.id, "release")
    assert code == 200 and body["state"] == "released" and body["method"] == "driver", body
    assert fake_driver.steps() == [f"lock {pid}", f"checkpoint {pid}"]
    ex = await k.run("print(w.values, v.values)")  # the next cell restores through the gate
    assert ex.stdout.strip() == "[1, 2, 3] [4, 5]"


@pytest.mark.parametrize("gpushare_config", [FRAMEWORK_ONLY])
async def test_a_pool_that_keeps_its_memory_fails_the_release(fake_nvml, jp_fetch, kernels, gpushare_app):
    """Like XLA's allocator: the arrays go to host memory, the pool stays reserved. Without
    the driver there is nothing else: the kernel keeps the framework method, and says why."""
    k, _pid = await framework_kernel(gpushare_app, kernels, fake_nvml, (
        "fw.install(pool=True)\n"
        "xs = [fw.array([i], nbytes=256 << 20) for i in range(2)]\n"
        "a, b = xs\n"), 512 * MiB)
    code, body = await rest(jp_fetch, "POST", "kernels", k.id, "release")
    assert code == 409, body
    assert ("the framework method freed 0 B of the 512.0 MiB PyTorch, CuPy and JAX held on the "
            "GPU (a release must free at least 50%); 512.0 MiB moved to host memory, but the "
            "allocator kept its memory reserved") in body["message"]
    status = await kernel_status(jp_fetch, k.id)
    assert status["state"] in ("active", "idle") and status["method"] == "framework"
    assert gpushare_app.controller.states[k.id].release_failed_at is not None  # no other method
    ex = await k.run("print(a.values, b.values, a.on_device, b.on_device)")
    assert ex.stdout.strip() == "[0] [1] True True"


# -- the pick and the check, as rules ---------------------------------------------------------
CONTEXT = 500 * MiB


def test_jax_memory_in_a_pool_is_not_framework_freeable():
    ok, why = framework_covers(2050 * MiB, 2090 * MiB + CONTEXT, CONTEXT, pool_bytes=2050 * MiB)
    assert not ok and why.startswith("2050 MiB of the kernel's 2090 MiB (CUDA context excluded) "
                                     "is JAX's memory pool")
    report = {"framework_bytes": 2050 * MiB, "framework_pool_bytes": 2050 * MiB}
    usable = {"driver": FrameworkMethod(), "framework": FrameworkMethod()}
    assert method_for_kernel("driver", usable, report, 2090 * MiB + CONTEXT, CONTEXT)[0] == "driver"
    # a small pool beside PyTorch's state: the rest still covers the kernel
    assert framework_covers(4000 * MiB, 4000 * MiB + CONTEXT, CONTEXT, pool_bytes=100 * MiB)[0]


def test_pooled_bytes_follow_xlas_settings_and_stats():
    stats = [{"bytes_in_use": 256 * MiB, "bytes_reserved": 0, "pool_bytes": 2050 * MiB}]
    assert pooled_bytes({}, stats) == 2050 * MiB  # JAX's default: preallocated
    assert pooled_bytes({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, stats) == 2050 * MiB  # a pool
    assert pooled_bytes({"XLA_PYTHON_CLIENT_PREALLOCATE": "0"}, [{"bytes_in_use": 9}]) == 0
    assert pooled_bytes({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}, stats) == 0
    assert pooled_bytes({"XLA_PYTHON_CLIENT_PREALLOCATE": "true"}, [{"bytes_in_use": 9}]) == 9


def test_a_framework_count_above_telemetrys_covers_the_kernel():
    """On an H200 the agent counted 4182 MiB where NVML showed 3900 MiB beyond the context."""
    ok, why = framework_covers(4182 * MiB, 3900 * MiB + CONTEXT, CONTEXT)
    assert ok and why == ("PyTorch, CuPy or JAX hold 4182 MiB, all of the kernel's 3900 MiB "
                          "(CUDA context excluded)")


def test_the_threshold_is_half_of_what_the_frameworks_held():
    assert freed_too_little({"device_before": 1000, "device_after": 500}, 500, 0) is None
    short, why = freed_too_little({"device_before": 1000 * MiB, "device_after": 501 * MiB,
                                   "skipped": [f"t{i}: left" for i in range(7)] + ["... and 3 more"]},
                                  499 * MiB, 10)
    assert short == "its release freed 499.0 MiB of 1000.0 MiB"
    assert why.endswith("left on the GPU: t0: left; t1: left; t2: left; t3: left; t4: left; "
                        "and 5 more")
    assert freed_too_little({"device_before": 0, "device_after": 0}, 0, 0)[0] == \
        "PyTorch, CuPy and JAX held nothing on the GPU"
    # an agent that does not count: moving nothing while leaving objects alone fails
    assert freed_too_little({"skipped": ["x: y"]}, 0, 1)[0] == "its release left every object on the GPU"
    assert freed_too_little({}, 10, 0) is None


class KernelManager:
    def get_kernel(self, kernel_id):
        raise KeyError(kernel_id)


def test_a_restarted_kernel_gets_the_framework_method_again():
    conns = {"k": SimpleNamespace(pid=10, report={"framework_bytes": 2000 * MiB})}
    auto = AutoPick({"driver": FrameworkMethod(), "framework": FrameworkMethod()},
                    lambda kid: 2000 * MiB + CONTEXT, CONTEXT)
    driver = FrameworkMethod()
    driver.name = "driver"
    kernels = ServerKernels(KernelManager(), driver, connections=lambda: conns, auto=auto)
    assert kernels.method_for("k") == "framework"
    kernels.method_failed("k", "framework", "its release freed 0 B of 2.0 GiB")
    assert kernels.method_for("k") == "driver"
    conns["k"] = SimpleNamespace(pid=11, report={"framework_bytes": 2000 * MiB})  # a restart
    assert kernels.method_for("k") == "framework"
