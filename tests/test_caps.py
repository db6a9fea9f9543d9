"""Memory caps: a kernel's cap holds where its framework can be limited (the simulated GPU
raises its own out-of-memory error at the cap, with a line that names it) and is watched
where it cannot (memory taken past the device's accounting, as raw CUDA would), flagged in
the cell, status and metrics. Real server, real kernels, the simulated node."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from traitlets import TraitError

from jupyter_gpushare.node.placement import PlacementError
from jupyter_gpushare.policy import Candidate, PolicyConfig, make_room
from jupyter_gpushare.server.options import KernelOptions

from . import test_nvml_server as nvml
from .helpers import kernel_status, rest, wait_for
from .scenarios import MiB, hold, intact
from .test_compute_placement import kernelspec, start
from .test_placement import Spec, gpu, placer

GiB = 1 << 30
fake_driver = nvml.fake_driver  # the driver, faked (NVML: the fake_nvml fixture of conftest)
CAPPED = {"metadata": {"gpushare": {"memory_limit": "64MiB"}}}


async def test_a_capped_kernels_allocation_past_its_cap_fails_and_a_restore_never_exceeds_it(
    jp_fetch, jp_ws_fetch, kernels, gpushare_app, jp_data_dir
):
    k = await start(jp_fetch, jp_ws_fetch, kernels, gpushare_app,
                    kernelspec(jp_data_dir, "capped", **CAPPED))
    assert (await kernel_status(jp_fetch, k.id))["memory_cap"] == 64 * MiB

    ex = await k.run(hold(96, chunk=32), ok=False)  # the third 32 MiB array is past the cap
    assert ex.error is not None and ex.error["ename"] == "SimOutOfMemoryError", ex.error
    assert "gpushare memory cap is 64.0 MiB per GPU" in ex.error["evalue"], ex.error
    await k.run(hold(48, chunk=48))  # under the cap: fine

    # bad input changes nothing; a kernel may lower its cap, not raise it past its kernelspec's
    for bad in ("-1GiB", "lots", "0"):
        out = await k.run(f"%gpushare cap {bad}")
        assert "nothing changed" in out.stdout, out.stdout
    raised = await k.run("%gpushare cap 1GiB")
    assert "can be at most 64 MiB per GPU" in raised.stdout, raised.stdout
    for body in ({"memory_cap": -5}, {"memory_cap": "8GiB"}, {"cap": 1}, {"memory_cap": True}):
        code, answer = await rest(jp_fetch, "PUT", "kernels", k.id, "cap", body=body)
        assert code == 400, (body, answer)
    code, answer = await rest(jp_fetch, "PUT", "kernels", k.id, "cap", body={"memory_cap": 1 << 30})
    assert code == 409 and "at most 64 MiB" in answer["message"], answer
    assert (await kernel_status(jp_fetch, k.id))["memory_cap"] == 64 * MiB

    # released, then capped below what it holds: the restore fails naming the cap and the
    # state stays held; back to its default cap, the state comes back whole
    await wait_for(lambda: gpushare_app.tracker.kernels[k.id].gpu_memory_bytes == 48 * MiB,
                   what="the server to see the 48 MiB")
    code, answer = await rest(jp_fetch, "POST", "kernels", k.id, "release")
    assert code == 200 and answer["state"] == "released", answer
    code, answer = await rest(jp_fetch, "PUT", "kernels", k.id, "cap", body={"memory_cap": 32 * MiB})
    assert code == 200 and answer["memory_cap"] == 32 * MiB, answer
    code, answer = await rest(jp_fetch, "POST", "kernels", k.id, "restore")
    assert code == 409 and "holds 48.0 MiB on GPU 0, more than its memory cap of 32 MiB per GPU" \
        in answer["message"] and "%gpushare cap off" in answer["message"], answer
    status = await kernel_status(jp_fetch, k.id)
    assert status["state"] == "released" and "memory cap of 32 MiB" in status["error"], status
    out = await k.run("%gpushare cap off")
    assert "64 MiB per GPU" in out.stdout, out.stdout
    assert "intact" in (await k.run(intact())).stdout


@pytest.mark.parametrize("gpushare_config", [{"memory_limit": "64MiB"}])
async def test_memory_no_framework_limited_is_watched_and_flagged(jp_fetch, kernels, gpushare_app):
    k = await kernels.start()  # the server's default cap applies to every kernel
    assert (await kernel_status(jp_fetch, k.id))["memory_cap"] == 64 * MiB
    # 96 MiB taken past the simulated device's own accounting, as raw CUDA takes it
    await k.run("from jupyter_gpushare.sim import device\n"
                "device.get_device().backend.alloc(0, 96 << 20)")
    over = "holds 96.0 MiB of its 64 MiB cap on GPU 0"
    status = await wait_for(_over(jp_fetch, k.id), what="the kernel flagged over its cap")
    assert status["over_cap"] == over, status
    metrics = dict(line.rsplit(" ", 1) for line in
                   (await jp_fetch("metrics")).body.decode().splitlines() if k.id in line)
    assert float(metrics[f'gpushare_kernel_over_cap{{kernel_id="{k.id}"}}']) == 1
    assert float(metrics[f'gpushare_kernel_memory_cap_bytes{{kernel_id="{k.id}"}}']) == 64 * MiB
    said = await k.run("1")  # the cell that runs next says so
    assert over in said.stderr, said.stderr
    shown = await k.run("%gpushare")
    assert over in shown.stdout or any(over in json.dumps(d) for d in shown.displays)
    with pytest.raises(TraitError, match="cannot be negative"):  # a bad default never loads
        KernelOptions(memory_limit="-3GiB")


def _over(jp_fetch, kernel_id):
    async def check():  # the kernel's status once it is flagged
        status = await kernel_status(jp_fetch, kernel_id)
        return status if status and status["over_cap"] else None
    return check


def test_kernels_over_their_cap_are_released_first_to_make_room():
    def cand(kid: str, idle: float, over: bool) -> Candidate:
        return Candidate(kid, resident=True, busy=False, pinned=False, idle_seconds=idle,
                         max_utilization=0.0, gpu_bytes={0: 4 * MiB}, over_cap=over)

    cands = [cand("long-idle", 900, False), cand("over-cap", 200, True)]
    decisions = make_room({0: 4 * MiB}, {0: 0}, cands, PolicyConfig(pressure_idle_timeout=60, min_release_bytes=0))
    assert [d.kernel_id for d in decisions or []] == ["over-cap"]


class CapSpec(Spec):
    def __init__(self, **gpushare):
        super().__init__()
        self.metadata = {"gpushare": gpushare}


async def test_placement_expects_a_capped_kernel_to_need_its_cap():
    async def need(spec, default_cap=None):
        p = placer([gpu(0), gpu(1)], default_cap=default_cap)
        await p.place("k", spec, {})
        return p.placed["k"].need.bytes

    assert await need(CapSpec(memory_limit="1GiB", memory="1.5GiB")) == 1 << 30  # it can hold no more
    assert await need(CapSpec(memory="1.5GiB"), default_cap=lambda: 768 * MiB) == 768 * MiB
    with pytest.raises(PlacementError, match="memory_limit cannot be negative"):
        await need(CapSpec(memory_limit="-1GiB"))


def test_frameworks_are_capped_before_they_start_and_said_not_to_be_after():
    """PyTorch and JAX on this machine's CPU builds, in a process of their own (the cap sets
    the process's environment and import hook): capped as they are imported, before their
    first allocation; a cap asked once JAX has started is said not to hold."""
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    code = (
        "import json, os\nfrom jupyter_gpushare.kernel import caps\nc = caps.get()\n"
        "c.set(1 << 30, 80 << 30)\n"  # before either is imported
        "import torch, jax.numpy as jnp\n"
        "before, fraction = dict(c.applied), os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION']\n"
        "jnp.zeros(3)\n"  # JAX starts
        "print(json.dumps([before, fraction, c.set(512 << 20)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    before, fraction, late = json.loads(out.stdout.strip().splitlines()[-1])
    assert before["torch"] == "PyTorch: capped at 1.0 GiB per GPU (set_per_process_memory_fraction)"
    assert before["jax"] == "JAX: capped at 1.0 GiB per GPU (XLA_PYTHON_CLIENT_MEM_FRACTION=0.0125)"
    assert fraction == "0.0125"
    assert any(line.startswith("JAX: already started: its memory cannot be limited any more")
               for line in late), late


# -- a cap that changes while the kernel runs or sits released ----------------------------------
@pytest.mark.parametrize("gpushare_config", [nvml.DRIVER])
async def test_the_driver_method_never_brings_back_more_than_a_cap_set_since_the_release(
    fake_nvml, fake_driver, jp_fetch, kernels, gpushare_app
):
    """The driver restores a process whole: a state over a cap set after its release is
    refused before the driver is asked, the state held; one over its cap at the release
    (watched, not limited) comes back as it was."""
    k, pid, _ = await nvml._driver_kernel(fake_nvml, fake_driver, kernels, gpushare_app, 4 * GiB)
    code, _ = await rest(jp_fetch, "PUT", "kernels", k.id, "cap", body={"memory_cap": 2 * GiB})
    assert code == 200
    assert (await rest(jp_fetch, "POST", "kernels", k.id, "release"))[0] == 200
    code, answer = await rest(jp_fetch, "POST", "kernels", k.id, "restore")
    assert code == 200 and answer["state"] == "active", answer  # over it before, as now
    await gpushare_app.poll_once()

    assert (await rest(jp_fetch, "POST", "kernels", k.id, "release"))[0] == 200
    code, _ = await rest(jp_fetch, "PUT", "kernels", k.id, "cap", body={"memory_cap": GiB})
    assert code == 200
    steps = fake_driver.steps()
    code, answer = await rest(jp_fetch, "POST", "kernels", k.id, "restore")
    assert code == 409, answer
    assert answer["message"].startswith("not restored: its GPU state holds 4.0 GiB on GPU 0, "
                                         "more than its memory cap of 1 GiB per GPU"), answer
    assert fake_driver.steps() == steps and fake_driver.states[pid] == "checkpointed"
    status = await kernel_status(jp_fetch, k.id)
    assert status["state"] == "released" and "memory cap of 1 GiB" in status["error"], status
    assert gpushare_app.controller.states[k.id].held.gpus == {0: 4 * GiB}

    code, _ = await rest(jp_fetch, "PUT", "kernels", k.id, "cap", body={"memory_cap": None})
    assert code == 200  # lifted: the state comes back whole
    code, answer = await rest(jp_fetch, "POST", "kernels", k.id, "restore")
    assert code == 200 and answer["state"] == "active", answer
    assert fake_driver.steps()[-2:] == [f"restore {pid}", f"unlock {pid}"]


async def _device_cap(kernel) -> int | None:
    out = await kernel.run("from jupyter_gpushare.sim import device as _d\nprint(_d.get_device().cap)")
    text = out.stdout.strip().splitlines()[-1]
    return None if text == "None" else int(text)


def _applied(kernel, cap):
    async def check():  # the kernel's agent has applied ``cap`` to its simulated GPU
        return await _device_cap(kernel) == cap
    return check


@pytest.mark.parametrize("gpushare_config", [{"memory_limit": "64MiB"}])
async def test_a_change_of_the_admins_cap_reaches_a_running_capped_kernel_tighter_or_looser(
    jp_fetch, kernels, gpushare_app
):
    k = await kernels.start()
    assert (await kernel_status(jp_fetch, k.id))["memory_cap"] == 64 * MiB
    await wait_for(_applied(k, 64 * MiB), what="the admin's cap applied in the kernel")

    gpushare_app.memory_limit = "32MiB"  # as when the hub service's cap for the person drops
    await gpushare_app.poll_once()
    assert (await kernel_status(jp_fetch, k.id))["memory_cap"] == 32 * MiB
    await wait_for(_applied(k, 32 * MiB), what="the tighter cap applied in the kernel")
    ex = await k.run(hold(48, chunk=16), ok=False)
    assert ex.error is not None and "gpushare memory cap is 32.0 MiB per GPU" in ex.error["evalue"]

    gpushare_app.memory_limit = "256MiB"
    await gpushare_app.poll_once()
    assert (await kernel_status(jp_fetch, k.id))["memory_cap"] == 256 * MiB
    await wait_for(_applied(k, 256 * MiB), what="the looser cap applied in the kernel")
    await k.run(hold(96, chunk=32))
    assert "intact" in (await k.run(intact())).stdout
