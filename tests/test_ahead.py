"""Restores ahead of a person's next cell (``{"trigger": "activity"}``), with real kernels on
the simulated node: answered at once, one restore per flood, never a working person's
kernel, cells first, stopped without room, released (not failed) when it fails, released
again after ``ahead_grace`` when no cell comes."""

from __future__ import annotations

import asyncio

import pytest

from jupyter_gpushare import clock
from jupyter_gpushare.core import ahead, metrics
from jupyter_gpushare.reclaim import ReclaimError

from . import scenarios
from .helpers import rest, wait_for
from .scenarios import MiB, hold, intact, released

ACTIVITY = {"trigger": "activity"}
GRACE = 30.0
#: MiB a kernel holds: small, since every byte is made, copied and checksummed on 2 shared
#: cores; what a test proves is which restores run and when, not how long bytes take
STATE = 64
#: two kernels of CROWD MiB do not fit on one GPU of SMALL_NODE together
CROWD = 160
#: how long an operation may take to end: a bound for a loaded 2-core machine, not a timing
OP_WAIT = 120.0


@pytest.fixture
def gpushare_config():
    return {"idle_timeout": 600.0, "pressure_idle_timeout": 30.0, "ahead_grace": GRACE}


SMALL_NODE = {"idle_timeout": 600.0, "pressure_idle_timeout": 30.0, "ahead_grace": GRACE,
              "simulated_gpus": [256 * MiB, 256 * MiB]}


def counted(outcome: str) -> float:
    return metrics.AHEAD_RESTORES.labels(outcome)._value.get()


def stall(step: str, seconds: float) -> str:
    """A cell that makes the kernel's next simulated ``step`` wait ``seconds`` (in the kernel)."""
    return ("from jupyter_gpushare.sim import device as _device\n"
            f"_stall = _device.get_device().stall({step!r}, seconds={seconds})")


async def resident(app, kid: str) -> None:
    await wait_for(lambda: app.controller.states[kid].held is None
                   and app.controller.states[kid].op is None, timeout=OP_WAIT,
                   what="resident")


async def test_activity_restores_ahead_and_the_cell_runs_without_a_restore(
    jp_fetch, kernels, gpushare_app, events, restores
):
    k = await released(jp_fetch, kernels, gpushare_app, STATE)
    before = counted("restored")
    code, body = await rest(jp_fetch, "POST", "kernels", k.id, "restore", body=ACTIVITY)
    assert code == 202, body
    assert body["state"] in ("released", "restoring")
    assert body["waiting"].startswith(ahead.AHEAD_TEXT)
    await resident(gpushare_app, k.id)
    assert restores == [(k.id, "activity")]
    assert counted("restored") == before + 1

    ex = await k.run(intact())  # no restore: nothing of gpushare's shows in the cell
    assert "intact" in ex.stdout and ex.displays == []
    assert restores == [(k.id, "activity")]
    st = gpushare_app.controller.states[k.id]
    assert (st.state, st.restores, st.error) == ("active", 1, None)


async def test_bad_activity_requests_are_refused_and_resident_is_a_no_op(
    jp_fetch, kernels, gpushare_app
):
    k = await kernels.start()
    await k.run(hold(STATE))
    await gpushare_app.poll_once()
    code, body = await rest(jp_fetch, "POST", "kernels", "no-such-kernel", "restore", body=ACTIVITY)
    assert code == 404 and "no kernel" in body["message"]
    for bad in ({"trigger": "Activity"}, {"trigger": "activity", "x": 1}, {"trigger": 1}):
        code, body = await rest(jp_fetch, "POST", "kernels", k.id, "restore", body=bad)
        assert code == 400 and '{"trigger": "activity"}' in body["message"], body
    # a release is never "activity"
    code, body = await rest(jp_fetch, "POST", "kernels", k.id, "release", body=ACTIVITY)
    assert code == 400
    # resident: 200, nothing done (a plain restore would be 409)
    code, body = await rest(jp_fetch, "POST", "kernels", k.id, "restore", body=ACTIVITY)
    assert code == 200 and body["state"] in ("active", "idle") and body["waiting"] is None
    assert gpushare_app.controller.states[k.id].restores == 0


async def test_a_flood_of_activity_requests_costs_one_restore(jp_fetch, kernels, gpushare_app, restores):
    k = await released(jp_fetch, kernels, gpushare_app, STATE)
    answers = await asyncio.gather(*(rest(jp_fetch, "POST", "kernels", k.id, "restore", body=ACTIVITY)
                                     for _ in range(30)))
    assert {code for code, _ in answers} <= {200, 202}
    await resident(gpushare_app, k.id)
    for _ in range(10):  # and more once it is back: no-ops
        code, _ = await rest(jp_fetch, "POST", "kernels", k.id, "restore", body=ACTIVITY)
        assert code == 200
    assert restores == [(k.id, "activity")]
    assert gpushare_app.controller.states[k.id].restores == 1


async def test_a_cell_sent_during_an_ahead_restore_joins_it(jp_fetch, kernels, gpushare_app, restores):
    # the restore's copy waits 3 s in the kernel: the cell is sent while its bytes move
    k = await released(jp_fetch, kernels, gpushare_app, STATE, extra=stall("restore", 3.0))
    code, _ = await rest(jp_fetch, "POST", "kernels", k.id, "restore", body=ACTIVITY)
    assert code == 202
    await wait_for(lambda: gpushare_app.controller.states[k.id].state == "restoring",
                   what="the ahead restore to move bytes")
    ex = await k.run(intact())
    assert "intact" in ex.stdout
    assert restores == [(k.id, "activity")]  # one restore, the ahead one


@pytest.mark.parametrize("gpushare_config", [SMALL_NODE])
async def test_ahead_restore_evicts_no_working_person_and_is_stopped_without_room(
    jp_fetch, kernels, gpushare_app, events
):
    gpushare_app.ahead.room_wait = 0.5
    a, b = await scenarios.crowded(jp_fetch, kernels, gpushare_app, CROWD)  # b was just used
    failed_restores = metrics.RESTORES.labels("simulated", "failed")._value.get()
    code, body = await rest(jp_fetch, "POST", "kernels", a.id, "restore", body=ACTIVITY)
    assert code == 202
    await wait_for(lambda: gpushare_app.controller.states[a.id].op is None
                   and gpushare_app.controller.states[a.id].error, timeout=OP_WAIT,
                   what="the ahead restore stopped")
    st = gpushare_app.controller.states[a.id]
    assert st.state == "released" and not st.failed
    assert st.error.startswith("not restored ahead of your next cell: no room within 0.5 s")
    assert gpushare_app.controller.states[b.id].state in ("active", "idle")  # not evicted
    failed = [e for e in events if e["action"] == "restore_failed" and e["kernel_id"] == a.id]
    assert failed and failed[-1]["trigger"] == "activity"
    # said as an event; not counted as a failed restore: nothing moved, nothing failed
    assert metrics.RESTORES.labels("simulated", "failed")._value.get() == failed_restores
    code, body = await rest(jp_fetch, "POST", "kernels", a.id, "restore", body=b"")
    assert code == 202  # a restore without the hint waits as before (and says so)
    assert body["state"] == "released" and "waiting for memory" in body["waiting"]


@pytest.mark.parametrize("gpushare_config", [SMALL_NODE])
async def test_ahead_restore_makes_room_as_make_room_does(jp_fetch, kernels, gpushare_app, restores):
    a, b = await scenarios.crowded(jp_fetch, kernels, gpushare_app, CROWD)
    clock.advance(31)  # b idle past pressure_idle_timeout: make-room may take it
    await gpushare_app.poll_once()
    code, _ = await rest(jp_fetch, "POST", "kernels", a.id, "restore", body=ACTIVITY)
    assert code == 202
    await resident(gpushare_app, a.id)
    assert gpushare_app.controller.states[b.id].state == "released"
    assert restores == [(a.id, "activity")]


@pytest.mark.parametrize("gpushare_config", [SMALL_NODE])
async def test_a_cell_arriving_while_the_ahead_restore_waits_restores_by_itself(
    jp_fetch, kernels, gpushare_app, restores
):
    gpushare_app.ahead.room_wait = 60
    a, b = await scenarios.crowded(jp_fetch, kernels, gpushare_app, CROWD)
    code, _ = await rest(jp_fetch, "POST", "kernels", a.id, "restore", body=ACTIVITY)
    assert code == 202
    await wait_for(lambda: gpushare_app.controller.states[a.id].waiting, what="waiting for memory")
    msg_id = a.send(intact("a"))
    await wait_for(lambda: (op := gpushare_app.controller.states[a.id].op) is not None
                   and op.trigger == "gate", what="the cell's own restore")
    await b.run("del b\nimport gc; gc.collect()")
    ex = await a.wait(msg_id)
    assert ex.status == "ok" and "intact" in ex.stdout
    assert any("gpushare: restored" in d["data"]["text/plain"] for d in ex.displays)
    assert restores == [(a.id, "gate")]


@pytest.mark.parametrize("gpushare_config", [SMALL_NODE])
async def test_ahead_restore_lets_a_cells_restore_go_first(jp_fetch, kernels, gpushare_app, restores):
    """a and c released on GPU 0, d fills it; c's cell waits for room, then a person opens a's
    notebook: when d frees, c's cell gets the room, not a's hint."""
    gpushare_app.ahead.room_wait = 60
    a = await released(jp_fetch, kernels, gpushare_app, CROWD, name="a")
    c = await released(jp_fetch, kernels, gpushare_app, CROWD, name="c")
    d = await kernels.start()
    await d.run(hold(CROWD, name="d"))
    await gpushare_app.poll_once()
    cell = c.send(intact("c"))
    await wait_for(lambda: gpushare_app.controller.states[c.id].waiting, what="c waits for memory")
    code, _ = await rest(jp_fetch, "POST", "kernels", a.id, "restore", body=ACTIVITY)
    assert code == 202
    await asyncio.sleep(0.5)
    assert gpushare_app.controller.states[a.id].waiting is None  # it yields: no room asked
    await d.run("del d\nimport gc; gc.collect()")
    ex = await c.wait(cell)
    assert ex.status == "ok" and "intact" in ex.stdout
    assert restores[0] == (c.id, "gate")
    st = gpushare_app.controller.states[a.id]
    assert st.held is not None and not st.failed


async def test_ahead_restore_that_fails_leaves_the_kernel_released(
    jp_fetch, kernels, gpushare_app, events, monkeypatch
):
    k = await released(jp_fetch, kernels, gpushare_app, STATE)
    method = gpushare_app.methods["simulated"]

    async def broken(target, progress):
        raise ReclaimError("simulated fault")

    monkeypatch.setattr(method, "restore", broken)
    code, _ = await rest(jp_fetch, "POST", "kernels", k.id, "restore", body=ACTIVITY)
    assert code == 202
    await wait_for(lambda: gpushare_app.controller.states[k.id].op is None, timeout=OP_WAIT,
                   what="the restore's end")
    st = gpushare_app.controller.states[k.id]
    assert (st.state, st.failed) == ("released", False)
    assert st.error == "restore ahead of your next cell failed: simulated fault"
    info = await rest(jp_fetch, "GET", "status")
    shown = next(x for x in info[1]["kernels"] if x["id"] == k.id)
    assert shown["state"] == "released" and "simulated fault" in shown["error"]
    failed = [e for e in events if e["action"] == "restore_failed"]
    assert failed[-1]["trigger"] == "activity"
    monkeypatch.undo()
    ex = await k.run(intact())  # the cell restores as without a hint
    assert "intact" in ex.stdout
    assert gpushare_app.controller.states[k.id].error is None


async def test_kernel_restored_ahead_without_a_cell_is_released_after_ahead_grace(
    jp_fetch, kernels, gpushare_app, events
):
    k = await released(jp_fetch, kernels, gpushare_app, STATE)
    await rest(jp_fetch, "POST", "kernels", k.id, "restore", body=ACTIVITY)
    await resident(gpushare_app, k.id)
    await gpushare_app.poll_once()
    clock.advance(GRACE / 2)
    await gpushare_app.poll_once()
    assert gpushare_app.controller.states[k.id].state in ("active", "idle")
    clock.advance(GRACE / 2 + 1)  # far less than idle_timeout (600 s)
    await gpushare_app.poll_once()
    await wait_for(lambda: gpushare_app.controller.states[k.id].state == "released",
                   timeout=OP_WAIT, what="release")
    last = [e for e in events if e["action"] == "released"][-1]
    assert "ahead_grace 30 s" in last["reason"]


async def test_kernel_restored_ahead_then_used_keeps_its_idle_timeout(jp_fetch, kernels, gpushare_app):
    k = await released(jp_fetch, kernels, gpushare_app, STATE)
    await rest(jp_fetch, "POST", "kernels", k.id, "restore", body=ACTIVITY)
    await resident(gpushare_app, k.id)
    await gpushare_app.poll_once()
    await k.run(intact())
    await gpushare_app.poll_once()
    assert k.id not in gpushare_app.ahead.unused
    clock.advance(GRACE + 1)
    await gpushare_app.poll_once()
    await asyncio.sleep(0.2)
    assert gpushare_app.controller.states[k.id].state in ("active", "idle")


async def test_pinned_kernel_restored_ahead_is_not_released_after_ahead_grace(
    jp_fetch, kernels, gpushare_app
):
    k = await released(jp_fetch, kernels, gpushare_app, STATE)
    await rest(jp_fetch, "PUT", "kernels", k.id, "pin", body={"pinned": True})
    await rest(jp_fetch, "POST", "kernels", k.id, "restore", body=ACTIVITY)
    await resident(gpushare_app, k.id)
    await gpushare_app.poll_once()
    clock.advance(GRACE + 1)
    await gpushare_app.poll_once()
    await asyncio.sleep(0.2)
    assert gpushare_app.controller.states[k.id].state in ("active", "idle")


def test_ahead_grace_option_is_checked():
    from traitlets import TraitError

    from jupyter_gpushare.server.app import GPUShareApp

    assert GPUShareApp().ahead_grace == 300.0
    with pytest.raises(TraitError, match="ahead_grace must be >= 0"):
        GPUShareApp(ahead_grace=-1)
