"""Where released states that will come back leave no GPU room for a new kernel, it starts on a
GPU where its expected need is free now, not on the one with the most room once those states
are counted: it allocates at its first cell, while a released state comes back when its person
does (its restore then makes room, moves or waits by its own rules). Real server, real kernels,
the simulated node (two GPUs of 256 MiB)."""

from __future__ import annotations

import os

import pytest

from jupyter_gpushare import clock

from .helpers import kernel_status, wait_for
from .scenarios import MiB, hold, intact, rest
from .test_compute_placement import kernelspec, start

#: the product's release policy: an idle kernel makes way for a restore (the fixture's
#: idle_timeout 0 would keep every kernel)
TWO = {"simulated_gpus": [256 * MiB] * 2, "placement": "room", "context_bytes": 16 * MiB,
       "release_policy": "needs", "idle_timeout": 600, "pressure_idle_timeout": 30,
       "min_release_bytes": 0}


@pytest.mark.parametrize("gpushare_config", [TWO])
async def test_a_new_kernel_starts_where_its_need_is_free_now_not_where_returning_states_leave_most(
    jp_fetch, jp_ws_fetch, jp_data_dir, kernels, gpushare_app, monkeypatch
):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    app = gpushare_app
    # a holds 200 MiB on its GPU, then is released: its state will come back there (room 56)
    a = await start(jp_fetch, jp_ws_fetch, kernels, app)
    await a.run(hold(200, name="a"))
    await app.poll_once()
    home = (await kernel_status(jp_fetch, a.id))["gpus"]
    code, body = await rest(jp_fetch, a.id, "release")
    assert code == 200 and body["state"] == "released", body
    # the other GPU: another process holds 190 MiB there (66 MiB free, room 66)
    other = 1 - home[0]
    app.node.alloc(os.getpid(), other, 190 * MiB)
    try:
        # a kernel expected to need 96 MiB: no GPU has room for it with a's state counted;
        # a's home has it free now, the other GPU has more room counted but only 66 MiB free
        spec = kernelspec(jp_data_dir, "needs96", metadata={"gpushare": {"memory": "96MiB"}})
        c = await start(jp_fetch, jp_ws_fetch, kernels, app, spec)
        assert (await kernel_status(jp_fetch, c.id))["gpus"] == home
        ex = await c.run(hold(96, name="c"))  # its first allocation finds the room
        assert not ex.error, ex.error
        assert "gpushare:" not in ex.stderr  # no "no GPU had room" note: it had, now

        # a's person comes back: c is idle long enough to make way; a's state is whole
        clock.advance(60)
        await app.poll_once()
        out = await a.run(intact("a"), timeout=60)
        assert out.stdout == "intact\n", out
        await wait_for(lambda: app.controller.states[a.id].state in ("idle", "active"),
                       what="a restored")
        assert (await c.run(intact("c"), timeout=60)).stdout == "intact\n"
    finally:
        app.node.release(os.getpid(), other, 190 * MiB)
