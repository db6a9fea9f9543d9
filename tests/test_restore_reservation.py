"""A restore's reservation counts only the bytes that have not landed yet.

Landed bytes are in the GPU's used memory as soon as the node measures the restoring process
holding them; reserved as well, the GPU looked short twice over while a restore moved, and
the policy released idle kernels for pressure that was not there."""

from __future__ import annotations

import asyncio

import pytest

from jupyter_gpushare import clock
from jupyter_gpushare.core.reservations import Reservations

from .helpers import wait_for
from .scenarios import MiB, hold, intact, rest


def test_a_reservation_shrinks_by_what_the_node_measured_landing_and_no_more():
    """Landed = what the process holds now beyond what it held when it reserved, as measured;
    an unmeasured process keeps its whole reservation until the restore ends."""
    async def scenario() -> None:
        ledger = Reservations()
        measured: dict[str, dict[int, int] | None] = {"a": {0: 64 * MiB}}  # a release left 64 MiB
        a = await ledger.acquire([0])
        a.reserve({0: 512 * MiB}, lambda: measured["a"])
        assert ledger.reserved(0) == 512 * MiB  # nothing landed yet
        measured["a"] = {0: 64 * MiB + 200 * MiB}
        assert ledger.reserved(0) == 312 * MiB and ledger.seen_free(0, 400 * MiB) == 88 * MiB
        measured["a"] = None  # the process is not measured any more: all of it counts
        assert ledger.snapshot() == {0: 512 * MiB}
        measured["a"] = {0: 64 * MiB + 600 * MiB}  # more than reserved: never below 0
        assert ledger.reserved(0) == 0 and ledger.snapshot() == {}

        unmeasured = await ledger.acquire([1])
        unmeasured.reserve({1: 256 * MiB}, lambda: None)
        blind = await ledger.acquire([2])
        blind.reserve({2: 128 * MiB})
        assert ledger.snapshot() == {1: 256 * MiB, 2: 128 * MiB}
        for grant in (a, unmeasured, blind):
            grant.release()
        assert ledger.snapshot() == {} and not any(ledger.busy(g) for g in range(3))

    asyncio.run(scenario())


#: one 1 GiB GPU; pressure under 20 % free (205 MiB). a (512 MiB) restores while b (256 MiB)
#: idles: 256 MiB stay free, no pressure; the whole reservation on top of a's landed bytes
#: made it look 256 MiB short
ONE_GPU = {"simulated_gpus": [1024 * MiB], "release_policy": "needs", "idle_timeout": 3600,
           "pressure_free_fraction": 0.2, "pressure_idle_timeout": 30, "poll_interval": 3600}


def stall_restore_until(path: str) -> str:
    """A cell that makes the kernel's next restore stop after its first array (its device
    memory taken by then) until ``path`` exists (at most 60 s, so a failed test ends)."""
    return (
        "import os, threading, time\nfrom jupyter_gpushare.sim import device as _device\n"
        "_stall = _device.get_device().stall('restore', seconds=60, after=1)\n"
        "def _let_go():\n"
        "    _stall.reached.wait()\n"
        f"    while not os.path.exists({path!r}):\n"
        "        time.sleep(0.01)\n"
        "    _stall.release()\n"
        "threading.Thread(target=_let_go, daemon=True).start()"
    )


@pytest.mark.parametrize("gpushare_config", [ONE_GPU])
async def test_a_restore_in_flight_does_not_release_an_idle_kernel_when_the_gpu_has_room(
    jp_fetch, kernels, gpushare_app, events, tmp_path
):
    app, go = gpushare_app, tmp_path / "go"
    a = await kernels.start()
    await a.run(hold(512, name="a") + "\n" + stall_restore_until(str(go)))
    await app.poll_once()
    assert (await rest(jp_fetch, a.id, "release"))[0] == 200
    b = await kernels.start()
    await b.run(hold(256, name="b"))
    await app.poll_once()
    clock.advance(60)  # b idle past pressure_idle_timeout: it goes if its GPU is under pressure

    restore = asyncio.ensure_future(rest(jp_fetch, a.id, "restore"))
    try:
        await wait_for(lambda: app.node.used(0) == 768 * MiB, what="a's restore to take its memory")
        assert app.controller.states[a.id].state == "restoring"
        # the last poll saw none of a's bytes: all of its room is still reserved
        assert app.controller.reservations.snapshot() == {0: 512 * MiB}
        await app.poll_once()  # the node now measures a holding its 512 MiB; the policy runs
        assert app.tracker.kernels[a.id].gpu_bytes == {0: 512 * MiB}
        st_b = app.controller.states[b.id]
        assert (st_b.state, st_b.op, st_b.releases) == ("idle", None, 0), st_b.error
        assert app.controller.reservations.snapshot() == {}
        assert app.controller.seen_free() == {0: 256 * MiB}  # counted once, as used
    finally:
        go.touch()
    code, body = await restore
    assert code == 200 and body["state"] == "active", body
    assert not [e for e in events if e["kernel_id"] == b.id and e["action"] == "released"]
    assert (await a.run(intact("a"))).stdout == "intact\n"
    assert (await b.run(intact("b"))).stdout == "intact\n"
    assert app.controller.reservations.snapshot() == {}
