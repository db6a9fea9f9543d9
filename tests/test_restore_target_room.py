"""A restore that moves onto another GPU leaves room there for this server's other released
kernels' states: a GPU that reads as roomy only because a released kernel's memory left it is
that kernel's room (its restore comes back there), as placement and the rebalancer count it.
Real server, real kernels, the simulated node (three GPUs of 256 MiB); other processes' memory
is allocated on the node directly (as another user's process shows in NVML)."""

from __future__ import annotations

import os

import pytest

from .helpers import kernel_status
from .scenarios import MiB, intact, released, rest

STATE = 96  # MiB, each kernel's state
MOVES = {"simulated_gpus": [256 * MiB] * 3, "restore_move_after": 0.5}


@pytest.mark.parametrize("gpushare_config", [MOVES])
async def test_a_moved_restore_does_not_take_the_room_another_released_kernel_comes_back_to(
    jp_fetch, kernels, gpushare_app
):
    app, me = gpushare_app, os.getpid()
    y = await released(jp_fetch, kernels, app, STATE, name="y", device=0)
    x = await released(jp_fetch, kernels, app, STATE, name="x", device=1)
    app.node.alloc(me, 0, 192 * MiB)  # GPU 0: 64 MiB free, y's home lacks room
    app.node.alloc(me, 1, 96 * MiB)  # GPU 1: 160 MiB free, 96 of them x's to take back
    app.node.alloc(me, 2, 128 * MiB)  # GPU 2: 128 MiB free, nobody's to take back
    try:
        await app.poll_once()
        # y waits at home, then moves: onto GPU 2, where its state fits without x's room
        assert "intact" in (await y.run(intact("y"))).stdout
        body = await kernel_status(jp_fetch, y.id)
        assert body is not None and body["restored_onto"] == "onto GPU 2: GPU 0 had no room", body
        await app.poll_once()
        # x comes back home at once, whole
        code, body = await rest(jp_fetch, x.id, "restore")
        assert code == 200 and body["state"] == "active", body
        assert "intact" in (await x.run(intact("x"))).stdout
        assert app.controller.states[x.id].restored_onto is None
    finally:
        for g, n in ((0, 192), (1, 96), (2, 128)):
            app.node.release(me, g, n * MiB)
