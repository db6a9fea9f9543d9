"""Restore onto another GPU: a released kernel whose GPU filled up comes back on a GPU with
room once its own has had none for ``restore_move_after`` seconds, data intact, and says
where it went. Real server, real kernels, the simulated node (two GPUs of 256 MiB)."""

from __future__ import annotations

import pytest

from .helpers import kernel_status, wait_for
from .scenarios import MiB, hold, intact, released, rest

#: two kernels of STATE MiB do not fit on one GPU (small: every byte is copied and checksummed)
NODE, STATE = {"simulated_gpus": [256 * MiB, 256 * MiB]}, 160
MOVES = {**NODE, "restore_move_after": 0.5}
STAYS = {**NODE, "restore_move_after": 0}


def pid_bytes(app, kernel) -> dict[int, int]:
    """Bytes per GPU of the kernel's process, as the simulated node accounts them."""
    pid = app.tracker.kernels[kernel.id].pids[0]
    return app.node.pids().get(pid, {})


@pytest.mark.parametrize("gpushare_config", [MOVES])
async def test_a_restore_whose_gpu_filled_up_moves_onto_the_gpu_with_room(
    jp_fetch, kernels, gpushare_app, events
):
    a = await released(jp_fetch, kernels, gpushare_app, STATE, name="a")  # from GPU 0
    b = await kernels.start()
    await b.run(hold(STATE, name="b"))  # GPU 0 is full now, and b was just used: not taken
    await gpushare_app.poll_once()

    cell = await a.run(intact("a"))  # waits for room on GPU 0, then goes onto GPU 1
    assert "intact" in cell.stdout
    await gpushare_app.poll_once()
    assert pid_bytes(gpushare_app, a) == {1: STATE * MiB}
    assert gpushare_app.node.used(0) == STATE * MiB  # b's, untouched
    body = await kernel_status(jp_fetch, a.id)
    assert body is not None and body["state"] in ("active", "idle")
    assert body["restored_onto"] == "onto GPU 1: GPU 0 had no room"
    assert body["gpu_bytes"] == {"1": STATE * MiB}
    assert [e["action"] for e in events if e["kernel_id"] == a.id][-2:] == [
        "restore_waiting", "restored"]

    # the kernel's device 0 is GPU 1 from now on, as after a CUDA restore with a GPU mapping
    await a.run(hold(32, device=0, name="more"))
    assert pid_bytes(gpushare_app, a) == {1: (STATE + 32) * MiB}
    await b.run(intact("b"))
    assert gpushare_app.controller.reservations.snapshot() == {}


@pytest.mark.parametrize("gpushare_config", [MOVES])
async def test_a_restore_that_moved_shows_it_in_the_cell_it_ran_for(jp_fetch, kernels, gpushare_app):
    a = await released(jp_fetch, kernels, gpushare_app, STATE, name="a")
    b = await kernels.start()
    await b.run(hold(STATE, name="b"))
    await gpushare_app.poll_once()
    code, body = await rest(jp_fetch, a.id, "restore")  # asked over REST: it waits, then moves
    assert code in (200, 202), body
    await wait_for(lambda: gpushare_app.controller.states[a.id].state in ("active", "idle"),
                   what="the restore onto GPU 1")
    assert gpushare_app.controller.states[a.id].restored_onto == "onto GPU 1: GPU 0 had no room"
    await a.run(intact("a"))


@pytest.mark.parametrize("gpushare_config", [STAYS])
async def test_with_restore_move_after_0_a_restore_waits_for_its_own_gpu(
    jp_fetch, kernels, gpushare_app
):
    a = await released(jp_fetch, kernels, gpushare_app, STATE, name="a")
    b = await kernels.start()
    await b.run(hold(STATE, name="b"))
    await gpushare_app.poll_once()
    code, body = await rest(jp_fetch, a.id, "restore")
    assert code == 202 and body["waiting"].startswith("waiting for memory: needs 160.0 MiB on GPU 0")
    st = gpushare_app.controller.states[a.id]
    await wait_for(lambda: st.waiting is not None, what="the restore to wait")
    await gpushare_app.poll_once()
    assert st.state == "released" and gpushare_app.node.used(1) == 0  # GPU 1 stayed empty

    await rest(jp_fetch, b.id, "release")  # room on GPU 0: it comes back where it was
    await wait_for(lambda: st.state in ("active", "idle"), what="the restore onto GPU 0")
    assert st.restored_onto is None and pid_bytes(gpushare_app, a) == {0: STATE * MiB}
    await a.run(intact("a"))
