"""A kernel placed on a GPU counts its expected need as wanted memory before it allocates:
idle kernels there make way at the next poll, so that its first allocation finds room instead
of failing. Real server, real kernels, the simulated node (one GPU of 256 MiB)."""

from __future__ import annotations

import pytest

from jupyter_gpushare import clock

from .helpers import wait_for
from .scenarios import MiB, hold, intact, rest
from .test_compute_placement import kernelspec, start

#: the product's release policy (the fixture's default is proactive, with no pressure releases)
ONE_GPU = {"simulated_gpus": [256 * MiB], "placement": "room", "release_policy": "needs",
           "pressure_free_fraction": 0.1, "idle_timeout": 600,
           "pressure_idle_timeout": 30, "min_release_bytes": 0,
           "context_bytes": 16 * MiB}  # the simulated node has no context to hold


@pytest.mark.parametrize("gpushare_config", [ONE_GPU])
async def test_a_placed_kernels_expected_need_has_idle_kernels_make_way(
    jp_fetch, jp_ws_fetch, jp_data_dir, kernels, gpushare_app, events
):
    app = gpushare_app
    idle = await start(jp_fetch, jp_ws_fetch, kernels, app)
    await idle.run(hold(160, name="a"))  # 96 MiB (37 %) stay free: no pressure
    clock.advance(60)  # idle past the pressure window
    await app.poll_once()
    assert app.controller.states[idle.id].state == "idle"  # nobody wants its memory yet

    big = kernelspec(jp_data_dir, "big", metadata={"gpushare": {"memory": "128MiB"}})
    new = await start(jp_fetch, jp_ws_fetch, kernels, app, big)  # placed, nothing allocated
    assert app.controller.room.load.promised() == {0: 128 * MiB}
    await app.poll_once()
    await wait_for(lambda: app.controller.states[idle.id].state == "released",
                   what="the idle kernel to make way for the placed one")
    made_way = next(e for e in events if e["action"] == "released" and e["kernel_id"] == idle.id)
    assert made_way["reason"].startswith("memory pressure on GPU 0: idle for")

    ex = await new.run(hold(128, name="b"))  # its first allocation finds the room
    assert not ex.error, ex.error
    await app.poll_once()
    assert app.controller.room.load.promised() == {}  # used: no longer expected

    code, _ = await rest(jp_fetch, new.id, "release")
    assert code == 200
    assert (await idle.run(intact("a"), timeout=60)).stdout == "intact\n"


@pytest.mark.parametrize("gpushare_config", [ONE_GPU])
async def test_a_placed_kernel_that_fits_takes_nothing_from_idle_ones(
    jp_fetch, jp_ws_fetch, jp_data_dir, kernels, gpushare_app
):
    app = gpushare_app
    idle = await start(jp_fetch, jp_ws_fetch, kernels, app)
    await idle.run(hold(96, name="a"))
    clock.advance(60)
    small = kernelspec(jp_data_dir, "small", metadata={"gpushare": {"memory": "64MiB"}})
    await start(jp_fetch, jp_ws_fetch, kernels, app, small)  # 160 - 64 MiB stay free (37 %)
    for _ in range(3):
        await app.poll_once()
    assert app.controller.states[idle.id].state == "idle"
