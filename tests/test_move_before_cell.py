"""A cell that would share a busy GPU moves its kernel first (rebalance_before_cell): a kernel
whose last GPU work was heavy, on a GPU another kernel's training keeps busy, goes to a quiet
GPU with room before its next cell runs, its data intact, and computes there; by default (the
option off), or for a kernel whose GPU is not busy, the cell runs where the kernel is. Real server,
real kernels, cells through the server's websocket, the simulated node (three GPUs)."""

from __future__ import annotations

from typing import Any

import pytest

from .helpers import kernel_status, wait_for
from .scenarios import MiB, hold, intact
from .test_rebalance import NODE, computed_on, interrupt, moves, pid_bytes, trained, training

ON = {**NODE, "rebalance_before_cell": True}


async def heavy_beside_a_training(jp_fetch: Any, kernels: Any, app: Any) -> tuple[Any, Any, str]:
    """GPU 0: kernel a (256 MiB with checksums) trained there alone, then kernel b started a
    training there that goes on; a's person is still at work (not away). Returns (a, b,
    b's cell)."""
    a = await kernels.start()
    await a.run(hold(256, name="a"))
    own = training(a)  # a training of its own, seen at full SM by a poll, then stopped
    rec = app.tracker.kernels[a.id]
    await wait_for(lambda: rec.computed_sm >= 90, timeout=120, what="a poll to see a train")
    await interrupt(jp_fetch, a, own)
    b = await kernels.start()
    await b.run(hold(256, name="b"))
    cell = training(b)
    await computed_on(app, b, 0)
    await app.poll_once()  # a's cell is over: the tracker knows it is not running one
    assert rec.computed_sm >= 90  # the peak of its last GPU work, not the stretch's last sample
    return a, b, cell


@pytest.mark.parametrize("gpushare_config", [ON, {**ON, "restore_mode": "lazy"}],
                         ids=["eager", "lazy"])
async def test_a_heavy_kernel_on_a_busy_gpu_moves_before_its_cell_and_runs_there_intact(
    jp_fetch, kernels, gpushare_app, events
):
    a, b, cell = await heavy_beside_a_training(jp_fetch, kernels, gpushare_app)
    assert not moves(events, a)  # its person is not away: rebalance alone would not move it
    out = await a.run(intact("a"))  # the gate holds the cell while a moves
    assert "intact" in out.stdout
    # the wait was said in the cell while it lasted: where the state went and why
    said = [d["data"]["text/plain"] for d in out.displays]
    assert any("to GPU 1 (onto GPU 1: GPU 0 busy with another kernel's cell)" in line
               for line in said), said
    (moved,) = moves(events, a)
    assert moved["from_gpus"] == [0] and moved["to_gpus"] == [1], moved
    assert moved["reason"] == "GPU 0 busy with another kernel's cell", moved
    actions = [e["action"] for e in events if e["kernel_id"] == a.id]
    assert actions[-3:] == ["released", "restored", "moved"], actions
    assert pid_bytes(gpushare_app, a) == {1: 256 * MiB}
    body = await kernel_status(jp_fetch, a.id)
    assert body is not None and body["moved"] == "GPU 0 -> 1: GPU 0 busy with another kernel's cell"
    await trained(gpushare_app, a, 1)  # its device 0 is GPU 1 now: it computes there
    assert 0 not in gpushare_app.tracker.kernels[a.id].gpu_bytes
    assert pid_bytes(gpushare_app, b) == {0: 256 * MiB}  # the training was not touched
    await interrupt(jp_fetch, b, cell)
    assert gpushare_app.controller.reservations.snapshot() == {}


@pytest.mark.parametrize("gpushare_config", [ON])
async def test_a_kernel_running_a_cell_is_not_moved_by_the_next_cell_it_is_sent(
    jp_fetch, kernels, gpushare_app, events
):
    a = await kernels.start()
    await a.run(hold(256, name="a"))
    b = await kernels.start()
    await b.run(hold(256, name="b"))
    long_a, long_b = training(a), training(b)  # both train on GPU 0: it reads busy
    rec = gpushare_app.tracker.kernels[a.id]
    await wait_for(lambda: rec.computed_sm >= 40 and rec.busy, timeout=120,
                   what="a poll to see a train")
    a.send(intact("a"))  # queued in the kernel behind the training: no move for it
    for _ in range(3):
        await gpushare_app.poll_once()
    assert not moves(events, a) and pid_bytes(gpushare_app, a) == {0: 256 * MiB}
    st = gpushare_app.controller.states[a.id]
    assert st.releases == 0 and st.op is None
    assert a.id not in gpushare_app.controller.rebalancer.moves  # no move was even tried
    await interrupt(jp_fetch, a, long_a)
    await interrupt(jp_fetch, b, long_b)
    assert pid_bytes(gpushare_app, a) == {0: 256 * MiB}


@pytest.mark.parametrize("gpushare_config", [NODE])
async def test_by_default_the_cell_runs_where_the_kernel_is(
    jp_fetch, kernels, gpushare_app, events
):
    a, b, cell = await heavy_beside_a_training(jp_fetch, kernels, gpushare_app)
    out = await a.run(intact("a"))
    assert "intact" in out.stdout
    assert not moves(events, a) and pid_bytes(gpushare_app, a) == {0: 256 * MiB}
    await interrupt(jp_fetch, b, cell)


@pytest.mark.parametrize("gpushare_config", [ON])
async def test_a_kernel_whose_gpu_is_not_busy_runs_its_cell_at_once(
    jp_fetch, kernels, gpushare_app, events
):
    a = await kernels.start()
    await a.run(hold(256, name="a"))
    await trained(gpushare_app, a, 0)
    await until_quiet(gpushare_app)
    out = await a.run(intact("a"))
    assert "intact" in out.stdout
    assert not moves(events, a) and pid_bytes(gpushare_app, a) == {0: 256 * MiB}
    st = gpushare_app.controller.states[a.id]
    assert st.releases == 0 and st.restores == 0


async def until_quiet(app: Any) -> None:
    """Poll until GPU 0's last reading is quiet again (the short training is over)."""
    async def quiet() -> bool:
        await app.poll_once()
        history = app.tracker.gpus[0].history
        return bool(history) and (history[-1][2] or 0.0) <= 25.0

    for _ in range(60):
        if await quiet():
            return
    raise AssertionError("GPU 0 never read quiet")

