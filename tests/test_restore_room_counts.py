"""A restoring kernel's bytes count once in the room new kernels and moves are judged by.

While a restore moves, the bytes that have landed are in the GPU's used memory and the rest
is in its reservation; counting the kernel's whole held state on top ("it will come back")
under-counted the GPU's room by that state, so a new kernel was placed on a worse GPU and a
move refused for room that was there. Real server, real kernels, the simulated node."""

from __future__ import annotations

import asyncio

import pytest

from jupyter_gpushare.core.rebalance import room as rebalance_room

from .helpers import wait_for
from .scenarios import MiB, hold, intact, rest
from .test_compute_placement import gpu_of, kernelspec, start
from .test_restore_reservation import stall_restore_until

#: GPU 0 (2 GiB) takes a (512 MiB); GPU 1 has 1.25 GiB. While a's restore is held with all
#: its 512 MiB back on GPU 0, GPU 0 has 1.5 GiB of room: a new kernel expecting 1400 MiB fits
#: there and nowhere else. Counting a's state again left GPU 0 1 GiB, less than GPU 1's room,
#: and sent the kernel to GPU 1, where it does not fit.
TWO_GPUS = {"simulated_gpus": [2048 * MiB, 1280 * MiB], "placement": "room",
            "poll_interval": 3600}


@pytest.mark.parametrize("gpushare_config", [TWO_GPUS])
async def test_a_kernel_placed_during_a_restore_sees_the_restoring_gpus_true_room(
    jp_fetch, jp_ws_fetch, jp_data_dir, kernels, gpushare_app, tmp_path, monkeypatch
):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    app, go = gpushare_app, tmp_path / "go"
    await app.poll_once()
    a = await start(jp_fetch, jp_ws_fetch, kernels, app)
    assert await gpu_of(a) == "'0'"  # the most room
    await a.run(hold(512, name="a") + "\n" + stall_restore_until(str(go)))
    await app.poll_once()
    assert (await rest(jp_fetch, a.id, "release"))[0] == 200
    big = kernelspec(jp_data_dir, "big", metadata={"gpushare": {"memory": "1400MiB"}})

    restore = asyncio.ensure_future(rest(jp_fetch, a.id, "restore"))
    try:
        await wait_for(lambda: app.node.used(0) == 512 * MiB, what="a's restore to take its memory")
        assert app.controller.states[a.id].state == "restoring"
        await app.poll_once()  # the node measures a holding its 512 MiB: none reserved still
        assert app.tracker.kernels[a.id].gpu_bytes == {0: 512 * MiB}
        assert app.controller.states[a.id].state == "restoring"
        # the rebalancer's room: 1.5 GiB free on GPU 0, a's bytes counted once, as used
        assert rebalance_room(app.controller) == {0: 1536 * MiB, 1: 1280 * MiB}
        c = await start(jp_fetch, jp_ws_fetch, kernels, app, big)
        assert await gpu_of(c) == "'0'"
    finally:
        go.touch()
    code, body = await restore
    assert code == 200 and body["state"] == "active", body
    assert (await a.run(intact("a"))).stdout == "intact\n"
