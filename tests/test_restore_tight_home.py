"""A restore whose home GPU has room for its state, but not for it and the pressure threshold,
goes where the threshold is kept: restored home, it would have that GPU's idle kernels
released for it at the next poll, and their people would wait for their own restores when
they come back. Real server, real kernels, the simulated node (two GPUs of 256 MiB; the
threshold, 10 %, is 25.6 MiB); other processes' memory is allocated on the node directly."""

from __future__ import annotations

import os

import pytest

from .helpers import kernel_status
from .scenarios import MiB, intact, released

STATE = 96  # MiB
# the tests' servers run without pressure releases; here the threshold is the product's default
MOVES = {"simulated_gpus": [256 * MiB] * 2, "restore_move_after": 0.5, "pressure_free_fraction": 0.1}


@pytest.mark.parametrize("gpushare_config", [MOVES])
async def test_a_restore_that_would_leave_home_under_the_threshold_goes_to_a_gpu_that_keeps_it(
    jp_fetch, kernels, gpushare_app
):
    app, me = gpushare_app, os.getpid()
    y = await released(jp_fetch, kernels, app, STATE, name="y", device=0)
    app.node.alloc(me, 0, 140 * MiB)  # GPU 0: 116 MiB free; after y's 96, 20 (< 25.6)
    try:
        await app.poll_once()
        assert "intact" in (await y.run(intact("y"))).stdout
        body = await kernel_status(jp_fetch, y.id)
        assert body is not None and body["restored_onto"] == (
            "onto GPU 1: GPU 0 would be left under 10% free"), body
        assert body["gpus"] == [1], body
        # home keeps its free memory: nothing there is under pressure
        free = app.node.free(0)
        assert free == 116 * MiB, free
    finally:
        app.node.release(me, 0, 140 * MiB)


@pytest.mark.parametrize("gpushare_config", [
    {**MOVES, "pressure_free_fraction": 0.0},  # no threshold: home has room, it goes home
    {**MOVES, "simulated_gpus": [256 * MiB, 104 * MiB]},  # GPU 1 would be left under it too
])
async def test_a_restore_stays_home_where_no_other_gpu_keeps_the_threshold(
    jp_fetch, kernels, gpushare_app
):
    app, me = gpushare_app, os.getpid()
    y = await released(jp_fetch, kernels, app, STATE, name="y", device=0)
    app.node.alloc(me, 0, 140 * MiB)
    try:
        await app.poll_once()
        assert "intact" in (await y.run(intact("y"))).stdout
        body = await kernel_status(jp_fetch, y.id)
        assert body is not None and body["restored_onto"] is None and body["gpus"] == [0], body
    finally:
        app.node.release(me, 0, 140 * MiB)
