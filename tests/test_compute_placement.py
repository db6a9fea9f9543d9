"""Compute, not only memory: placement and restores weigh each GPU's SM load over a window
and the kernels placed there that have not used it yet. Real server, real kernels, the
simulated node (two GPUs of 2 GiB); a kernel keeps a GPU busy with ``simgpu.burn`` on a
thread of its own, as a training's data loader would."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest
from tornado.httpclient import HTTPClientError

from jupyter_gpushare.policy.placement import contended
from jupyter_gpushare.reclaim.framework import FrameworkMethod

from . import scenarios
from .helpers import KernelConn, kernel_status, wait_for
from .scenarios import MiB, hold, intact, rest

#: placement on; loads judged over 1 s so that a burn shows within a few polls
COMPUTE = {"placement": "room", "load_window": 1.0, **scenarios.SMALL_NODE}

PROBE = "import os\nprint(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))"
#: keeps the kernel's device 0 busy from a thread of its own, while no cell runs
BURN = ("import threading\nfrom jupyter_gpushare.sim import simgpu\n"
        "threading.Thread(target=simgpu.burn, args=(600,), daemon=True).start()")


def kernelspec(jp_data_dir: Any, name: str, **extra: Any) -> str:
    spec_dir = jp_data_dir / "kernels" / name
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": name, "language": "python", **extra,
    }))
    return name


async def start(jp_fetch: Any, jp_ws_fetch: Any, kernels: Any, app: Any,
                name: str = "python3") -> KernelConn:
    r = await jp_fetch("api", "kernels", method="POST", body=json.dumps({"name": name}))
    kid = json.loads(r.body)["id"]
    conn = KernelConn(kid, await jp_ws_fetch("api", "kernels", kid, "channels"),
                      app.serverapp.kernel_manager)
    kernels.started.append(conn)
    await conn.run("1")
    await wait_for(lambda: kid in app.channel.connections, what="the agent to connect")
    return conn


async def gpu_of(kernel: KernelConn) -> str:
    return (await kernel.run(PROBE)).stdout.strip()


def view(app: Any, gpu: int) -> Any:
    return app.controller.room.load.views({gpu: None})[gpu]


@pytest.mark.parametrize("gpushare_config", [COMPUTE])
async def test_two_kernels_started_back_to_back_land_on_different_gpus(
    jp_fetch, jp_ws_fetch, kernels, gpushare_app, monkeypatch
):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    # another user's process holds 16 MiB on GPU 0: GPU 1 has a few bytes more room
    gpushare_app.node.alloc(os.getpid(), 0, 16 * MiB)
    a = await start(jp_fetch, jp_ws_fetch, kernels, gpushare_app)
    b = await start(jp_fetch, jp_ws_fetch, kernels, gpushare_app)  # before a allocates
    assert (await gpu_of(a), await gpu_of(b)) == ("'1'", "'0'")
    await gpushare_app.poll_once()
    assert view(gpushare_app, 1).pending > 0  # a is expected to compute there

    await a.run(hold(64, name="a"))  # once a has used its GPU, its load is measured, not expected
    await gpushare_app.poll_once()
    assert view(gpushare_app, 1).pending == 0 and view(gpushare_app, 1).kernels == 1
    gpushare_app.node.release(os.getpid(), 0, 16 * MiB)


@pytest.mark.parametrize("gpushare_config", [COMPUTE])
async def test_a_busy_gpu_with_more_room_loses_to_an_idle_one_with_enough(
    jp_fetch, jp_ws_fetch, kernels, gpushare_app, monkeypatch
):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    busy = await start(jp_fetch, jp_ws_fetch, kernels, gpushare_app)
    idle = await start(jp_fetch, jp_ws_fetch, kernels, gpushare_app)
    assert (await gpu_of(busy), await gpu_of(idle)) == ("'0'", "'1'")
    await busy.run(hold(64, name="small") + "\n" + BURN)  # GPU 0: 64 MiB, SMs at 100 %
    await idle.run(hold(768, name="large"))  # GPU 1: 768 MiB, no compute
    app = gpushare_app

    async def loaded() -> bool:
        await app.poll_once()
        return view(app, 0).load >= 90 and view(app, 1).load < 10

    await wait_for(loaded, what="GPU 0's SMs busy over the window")
    late = await start(jp_fetch, jp_ws_fetch, kernels, app)
    assert await gpu_of(late) == "'1'"  # 1.2 GiB room and idle, not 1.9 GiB and busy
    assert (await kernel_status(jp_fetch, late.id))["gpus"] == [1]


async def computing_on_gpu_0(jp_fetch: Any, jp_ws_fetch: Any, kernels: Any, app: Any,
                             jp_data_dir: Any) -> None:
    """Two kernels that hold memory on GPU 0 and keep its SMs busy: GPU 0 is contended."""
    gpu0 = kernelspec(jp_data_dir, "gpu0", env={"CUDA_VISIBLE_DEVICES": "0"})
    for i in range(2):
        k = await start(jp_fetch, jp_ws_fetch, kernels, app, gpu0)
        await k.run(hold(64, name=f"w{i}") + "\n" + BURN)

    async def busy() -> bool:
        await app.poll_once()
        return contended(view(app, 0)) and view(app, 1).load < 10

    await wait_for(busy, what="GPU 0 contended")


def pid_bytes(app: Any, kernel: KernelConn) -> dict[int, int]:
    pid = app.tracker.kernels[kernel.id].pids[0]
    return app.node.pids().get(pid, {})


@pytest.mark.parametrize("gpushare_config", [COMPUTE])
async def test_a_restore_whose_gpu_is_contended_goes_to_an_idle_gpu(
    jp_fetch, jp_ws_fetch, kernels, gpushare_app, jp_data_dir, monkeypatch, events
):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    app = gpushare_app
    a = await start(jp_fetch, jp_ws_fetch, kernels, app)  # an empty node: GPU 0
    await a.run(hold(256, name="a"))
    await app.poll_once()
    code, body = await rest(jp_fetch, a.id, "release")
    assert code == 200 and body["state"] == "released", body
    await computing_on_gpu_0(jp_fetch, jp_ws_fetch, kernels, app, jp_data_dir)

    cell = await a.run(intact("a"))  # home has room, but two kernels compute there
    assert "intact" in cell.stdout
    assert "(onto GPU 1: GPU 0 busy (2 kernels computing" in cell.text  # its progress line
    await app.poll_once()
    assert pid_bytes(app, a) == {1: 256 * MiB}
    body = await kernel_status(jp_fetch, a.id)
    assert body is not None and body["restored_onto"].startswith("onto GPU 1: GPU 0 busy")
    assert app.controller.room.load.placed[a.id].gpus == [1]  # counted where it is now
    assert [e["action"] for e in events if e["kernel_id"] == a.id][-1] == "restored"
    await a.run(hold(64, device=0, name="more"))  # its device 0 is GPU 1 from now on
    assert pid_bytes(app, a) == {1: 320 * MiB}


@pytest.mark.parametrize("gpushare_config", [COMPUTE])
async def test_a_method_that_cannot_move_restores_home_and_says_why(
    jp_fetch, jp_ws_fetch, kernels, gpushare_app, jp_data_dir, monkeypatch
):
    """The framework method keeps its device ordinals inside the process: its restore stays
    on a contended GPU, and the cell and status say so. (The simulated node runs the
    simulated method; here it refuses to move as the framework method does.)"""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    app = gpushare_app
    method = app.controller.methods["simulated"]
    refusal = FrameworkMethod.move_refusal(method)  # type: ignore[arg-type]
    monkeypatch.setattr(method, "move_refusal", lambda: refusal)
    a = await start(jp_fetch, jp_ws_fetch, kernels, app)
    await a.run(hold(256, name="a"))
    await app.poll_once()
    code, _ = await rest(jp_fetch, a.id, "release")
    assert code == 200
    await computing_on_gpu_0(jp_fetch, jp_ws_fetch, kernels, app, jp_data_dir)

    cell = await a.run(intact("a"))
    assert "intact" in cell.stdout
    said = f"on GPU 0, which is busy; not moved: {refusal}"
    assert said in cell.text
    await app.poll_once()
    assert pid_bytes(app, a) == {0: 256 * MiB}
    body = await kernel_status(jp_fetch, a.id)
    assert body is not None and body["restored_onto"] == said


@pytest.mark.parametrize("gpushare_config", [COMPUTE])
async def test_a_kernelspec_says_how_much_memory_its_kernels_need(
    jp_fetch, jp_ws_fetch, kernels, gpushare_app, jp_data_dir, monkeypatch
):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    app = gpushare_app
    first = await start(jp_fetch, jp_ws_fetch, kernels, app)  # GPU 0
    await first.run(hold(1024, name="x") + "\n" + BURN)  # 1 GiB there, and busy
    await start(jp_fetch, jp_ws_fetch, kernels, app)  # GPU 1, placed, not used yet
    # 1.5 GiB fits on GPU 1 only: it goes there, busy or not, placed kernel or not
    big = await start(jp_fetch, jp_ws_fetch, kernels, app, kernelspec(
        jp_data_dir, "big", metadata={"gpushare": {"memory": "1.5GiB"}}))
    assert await gpu_of(big) == "'1'"

    for i, bad in enumerate(("lots", "25%", -5, True, "8GiB per node")):
        name = kernelspec(jp_data_dir, f"bad{i}", metadata={"gpushare": {"memory": bad}})
        with pytest.raises(HTTPClientError) as refused:
            await jp_fetch("api", "kernels", method="POST", body=json.dumps({"name": name}))
        assert refused.value.code == 400, bad
        message = json.loads(refused.value.response.body)["message"]
        assert "metadata.gpushare.memory must be bytes per GPU" in message, message


@pytest.mark.parametrize("gpushare_config", [COMPUTE])
async def test_a_kernel_is_expected_to_need_what_its_kernelspecs_kernels_held(
    jp_fetch, jp_ws_fetch, kernels, gpushare_app, jp_data_dir, monkeypatch
):
    """jupyter_client leaves a loaded kernelspec's ``name`` empty: placement reads the name
    from its folder, as the tracker keys its kernels' peaks, so a new kernel of a kernelspec
    whose kernels held 1.25 GiB goes only where 1.25 GiB fits (not where 512 MiB would)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    app = gpushare_app
    spec = kernelspec(jp_data_dir, "trainer")
    first = await start(jp_fetch, jp_ws_fetch, kernels, app, spec)  # GPU 0
    assert await gpu_of(first) == "'0'"
    await first.run(hold(1280, name="big"))
    await app.poll_once()  # its peak: 1.25 GiB on GPU 0
    await first.run("del big\nimport gc; gc.collect()\n" + hold(256, name="small"))
    await app.poll_once()
    # GPU 1: another user's process holds 1 GiB; empty of kernels, 1 GiB of room
    app.node.alloc(os.getpid(), 1, 1024 * MiB)
    try:
        second = await start(jp_fetch, jp_ws_fetch, kernels, app, spec)
        assert await gpu_of(second) == "'0'"  # 1.75 GiB of room there; GPU 1's 1 GiB is too little
    finally:
        app.node.release(os.getpid(), 1, 1024 * MiB)
