"""Moves between cells: an idle kernel on a GPU whose SMs are contended goes to a quiet GPU
with room, its data intact, and its next cell runs there; never mid-cell; at most
``rebalance_max_per_hour`` moves per kernel per hour. Real server, real kernels, the
simulated node (three GPUs); the server's clock is moved forward instead of waiting for a
person to be away."""

from __future__ import annotations

from typing import Any

import pytest

from jupyter_gpushare import clock
from jupyter_gpushare.core.rebalance import window_of
from jupyter_gpushare.sim.node import GiB

from .helpers import get_json, kernel_status, wait_for
from .scenarios import MiB, hold, intact

NODE = {"simulated_gpus": [4 * GiB, 4 * GiB, 4 * GiB], "rebalance_idle": 120.0}
WINDOW = 600.0  # s over which a GPU's load is judged (5 x rebalance_idle): a training fills it
AWAY = 130.0  # s: past rebalance_idle, within the window


def pid_bytes(app: Any, kernel: Any) -> dict[int, int]:
    """Bytes per GPU of the kernel's process, as the simulated node accounts them."""
    pid = app.tracker.kernels[kernel.id].pids[0]
    return app.node.pids().get(pid, {})


async def computed_on(app: Any, kernel: Any, gpu: int) -> None:
    """Wait until a poll saw ``kernel`` compute on ``gpu`` (the node's numbering)."""
    rec = app.tracker.kernels[kernel.id]
    before = rec.computed.get(gpu)
    # 120 s: a bound for a loaded 2-core machine (30 s ran out at load 10-77), not a timing
    await wait_for(lambda: rec.computed.get(gpu, 0.0) != (before or 0.0) and rec.computed.get(gpu),
                   timeout=120, what=f"a poll to see kernel {kernel.id[:8]} compute on GPU {gpu}")


async def trained(app: Any, kernel: Any, gpu: int) -> None:
    """The kernel ran a short training on its device 0 (node GPU ``gpu``), seen by a poll."""
    rec = app.tracker.kernels[kernel.id]
    before = rec.computed.get(gpu)  # read before the work: the polls may see all of it first
    await kernel.run("from jupyter_gpushare.sim import simgpu\nsimgpu.burn(0.5)")
    await wait_for(lambda: rec.computed.get(gpu) not in (None, before), timeout=120,
                   what=f"a poll to see kernel {kernel.id[:8]} compute on GPU {gpu}")


def training(kernel: Any, device: int = 0) -> str:
    """Start a long training on ``device`` (the cell runs until interrupted)."""
    return kernel.send(f"from jupyter_gpushare.sim import simgpu\nsimgpu.burn(600, device={device})")


async def interrupt(jp_fetch: Any, kernel: Any, msg_id: str) -> None:
    await jp_fetch("api", "kernels", kernel.id, "interrupt", method="POST", body=b"")
    await kernel.wait(msg_id)


def moves(events: list[dict], kernel: Any) -> list[dict]:
    return [e for e in events if e["kernel_id"] == kernel.id and e["action"] == "moved"]


async def pass_time(app: Any, seconds: float) -> None:
    """Move the server's clock ``seconds`` on, with a poll after: what computes meanwhile
    counts over all of it."""
    clock.advance(seconds)
    await app.poll_once()


async def away_on_busy_gpu(jp_fetch: Any, kernels: Any, app: Any) -> tuple[Any, Any, str]:
    """GPU 0: kernel b trains there on and on; kernel a (256 MiB with checksums) trained
    there too, then its person went away. Returns (a, b, b's cell)."""
    a = await kernels.start()
    await a.run(hold(256, name="a"))
    b = await kernels.start()
    await b.run(hold(256, name="b"))
    cell = training(b)
    await computed_on(app, b, 0)
    await pass_time(app, WINDOW)
    await trained(app, a, 0)
    clock.advance(AWAY)
    return a, b, cell


@pytest.mark.parametrize("gpushare_config", [NODE])
async def test_an_idle_kernel_on_a_contended_gpu_moves_to_a_quiet_one_and_computes_there(
    jp_fetch, kernels, gpushare_app, events
):
    a, b, cell = await away_on_busy_gpu(jp_fetch, kernels, gpushare_app)
    await wait_for(lambda: moves(events, a), what="a's move", timeout=90)
    (moved,) = moves(events, a)
    assert moved["from_gpus"] == [0] and moved["to_gpus"] == [1], moved
    assert moved["reason"] == "GPU 0 busy" and moved["method"] == "simulated"
    # a release, then a restore onto GPU 1, each said as usual
    actions = [e["action"] for e in events if e["kernel_id"] == a.id]
    assert actions[-3:] == ["released", "restored", "moved"], actions
    assert pid_bytes(gpushare_app, a) == {1: 256 * MiB}
    body = await kernel_status(jp_fetch, a.id)
    assert body is not None and body["moved"] == "GPU 0 -> 1: GPU 0 busy", body
    assert body["restored_onto"] == "onto GPU 1: GPU 0 busy"

    cell_a = await a.run(intact("a"))  # the data came along
    assert "intact" in cell_a.stdout
    await trained(gpushare_app, a, 1)  # its device 0 is GPU 1 now: it computes there
    assert 0 not in gpushare_app.tracker.kernels[a.id].gpu_bytes
    await interrupt(jp_fetch, b, cell)
    assert gpushare_app.controller.reservations.snapshot() == {}


@pytest.mark.parametrize("gpushare_config", [NODE])
async def test_a_kernel_running_a_cell_is_never_moved(jp_fetch, kernels, gpushare_app, events):
    a = await kernels.start()
    await a.run(hold(256, name="a"))
    b = await kernels.start()
    await b.run(hold(256, name="b"))
    long_a, long_b = training(a), training(b)  # both compute on GPU 0: it is contended
    await computed_on(gpushare_app, a, 0)
    await computed_on(gpushare_app, b, 0)
    await pass_time(gpushare_app, WINDOW)
    for _ in range(5):
        await gpushare_app.poll_once()
        status = await kernel_status(jp_fetch, a.id)
        assert status is not None and status["state"] in ("active", "idle"), status
    assert gpushare_app.controller.rebalancer.seen[0].contended
    assert not moves(events, a) and not moves(events, b)
    assert pid_bytes(gpushare_app, a) == {0: 256 * MiB}

    await interrupt(jp_fetch, a, long_a)  # the cell ended: a moves once its person is away
    await gpushare_app.poll_once()
    assert not moves(events, a)  # just used
    clock.advance(AWAY)
    await wait_for(lambda: moves(events, a), what="a's move once it is idle", timeout=90)
    assert pid_bytes(gpushare_app, a) == {1: 256 * MiB}
    await a.run(intact("a"))
    await interrupt(jp_fetch, b, long_b)


@pytest.mark.parametrize("gpushare_config", [{**NODE, "rebalance_max_per_hour": 1}])
async def test_moves_per_kernel_per_hour_are_bounded(jp_fetch, kernels, gpushare_app, events):
    a, b, cell_b = await away_on_busy_gpu(jp_fetch, kernels, gpushare_app)
    await wait_for(lambda: moves(events, a), what="a's first move", timeout=90)
    assert pid_bytes(gpushare_app, a) == {1: 256 * MiB}

    # GPU 1 gets contended too: kernel c trains there on and on, a trained there, went away
    c = await kernels.start()
    await c.run(hold(256, device=1, name="c"))
    cell_c = training(c, device=1)
    await computed_on(gpushare_app, c, 1)
    await pass_time(gpushare_app, WINDOW)
    await trained(gpushare_app, a, 1)
    clock.advance(AWAY)
    for _ in range(5):
        await gpushare_app.poll_once()
    assert gpushare_app.controller.rebalancer.seen[1].contended
    assert len(moves(events, a)) == 1  # one move this hour: it stays
    assert pid_bytes(gpushare_app, a) == {1: 256 * MiB}

    clock.advance(3600)  # an hour later it may move again (after training there once more)
    await trained(gpushare_app, a, 1)
    clock.advance(AWAY)
    await wait_for(lambda: len(moves(events, a)) == 2, what="a's second move", timeout=90)
    assert moves(events, a)[-1]["to_gpus"] == [2]  # GPU 0 is still busy with b's training
    assert pid_bytes(gpushare_app, a) == {2: 256 * MiB}
    await a.run(intact("a"))
    await interrupt(jp_fetch, b, cell_b)
    await interrupt(jp_fetch, c, cell_c)


@pytest.mark.parametrize("gpushare_config", [{**NODE, "rebalance_idle": 30.0, "load_window": 60.0}])
async def test_the_rebalance_window_follows_rebalance_idle(jp_fetch, kernels, gpushare_app):
    """Contention is judged over 5 x rebalance_idle, at least load_window: with 30 s idle,
    150 s. A training fills that window; 160 s after it stopped the GPU reads quiet (over the
    default 600 s it would still read half busy)."""
    assert (window_of(120.0, 120.0), window_of(30.0, 60.0), window_of(0.0, 60.0)) == (600, 150, 60)
    b = await kernels.start()
    await b.run(hold(64, name="b"))
    cell = training(b)
    await computed_on(gpushare_app, b, 0)
    await pass_time(gpushare_app, 150.0)
    gpu0 = (await get_json(jp_fetch, "api", "gpushare", "status"))["gpus"][0]
    assert gpu0["load"] >= 90 and gpu0["computing"] == [b.id], gpu0
    await interrupt(jp_fetch, b, cell)
    await pass_time(gpushare_app, 160.0)
    gpu0 = (await get_json(jp_fetch, "api", "gpushare", "status"))["gpus"][0]
    assert gpu0["load"] < 10 and gpu0["computing"] == [], gpu0
    assert gpushare_app.controller.rebalancer.load.window == 150.0  # the moves' views too
