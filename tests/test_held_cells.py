"""A cell held for a restore is stopped by every way Jupyter stops a cell, and says what
became of the kernel's GPU state.

JupyterLab's stop button is a REST call (``POST /api/kernels/{id}/interrupt``), not an
``interrupt_request`` on the websocket; restart and shutdown are REST too. Each answers the
held cell with an error at once, and the cell never runs later (here: when memory frees).
An interrupt keeps the held state; a restart or a kill says the state is gone.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
from tornado.httpclient import HTTPClientError

from jupyter_gpushare.server.gate import GATES_KEY

from .helpers import kernel_status, wait_for
from .scenarios import MiB, crowded, hold, intact, rest

#: two kernels of STATE MiB do not fit on one GPU (small: every byte is copied and checksummed)
SMALL_NODE, STATE = {"simulated_gpus": [256 * MiB, 256 * MiB]}, 160
#: no background polls: only the kernel manager's own call can tell the gate in time
NO_POLLS = {**SMALL_NODE, "poll_interval": 3600.0}


def touch(path: object) -> str:
    """A cell that leaves a mark if it ever runs."""
    return f"open({str(path)!r}, 'w').close()\nprint('ran')"


def stall(step: str, seconds: float | None, reached: object = None, go: object = None) -> str:
    """A cell that makes the kernel's next simulated ``step`` wait ``seconds`` (None: until
    the file ``go`` exists), in the kernel; ``reached``: a file the kernel makes once the step
    is inside its stall (wait for it)."""
    code = ("from jupyter_gpushare.sim import device as _device\n"
            f"_stall = _device.get_device().stall({step!r}, seconds={seconds})\n"
            "import os as _os, threading as _threading, time as _time\n"
            "def _watch():\n"
            "    _stall.reached.wait()\n")
    if reached is not None:
        code += f"    open({str(reached)!r}, 'w').close()\n"
    if go is not None:
        code += (f"    while not _os.path.exists({str(go)!r}):\n"
                 "        _time.sleep(0.02)\n"
                 "    _stall.release()\n")
    return code + "_threading.Thread(target=_watch, daemon=True).start()"


def queued(app: Any, kernel_id: str) -> bool:
    """A cell of the kernel is held by the gate (on one of its websockets)."""
    gates = app.settings[GATES_KEY]
    return any(conn._queued for conn in gates._of(kernel_id))


@pytest.mark.parametrize("gpushare_config", [SMALL_NODE])
async def test_rest_interrupt_stops_a_cell_waiting_for_memory_and_it_never_runs(
    jp_fetch, kernels, gpushare_app, tmp_path
):
    a, b = await crowded(jp_fetch, kernels, gpushare_app, STATE)
    mark = tmp_path / "ran"
    msg_id = a.send(touch(mark))
    await wait_for(lambda: gpushare_app.controller.states[a.id].waiting, what="a to wait for memory")
    r = await jp_fetch("api", "kernels", a.id, "interrupt", method="POST", body=b"")
    assert r.code == 204
    ex = await a.wait(msg_id, timeout=5)  # at once, not when memory frees
    assert ex.status == "error" and ex.error and ex.error["ename"] == "KeyboardInterrupt"
    assert "interrupted while waiting" in ex.error["evalue"]
    st = gpushare_app.controller.states[a.id]
    assert st.state == "released" and st.held is not None  # nothing lost
    await wait_for(lambda: st.op is None and st.waiting is None, what="the restore to stop waiting")
    await b.run("del b")  # memory frees: the interrupted cell must not run now
    await gpushare_app.poll_once()
    await asyncio.sleep(1.0)
    assert not mark.exists() and st.state == "released"
    await a.run(intact("a"))  # the next cell restores, every byte back


async def test_rest_interrupt_stops_a_cell_held_behind_a_release_in_flight(
    jp_fetch, kernels, gpushare_app, tmp_path
):
    k = await kernels.start()
    reached, go = tmp_path / "reached", tmp_path / "go"
    # the checkpoint is held in the kernel until the test makes the file go
    await k.run(hold(256) + "\n" + stall("checkpoint", None, reached, go))
    await gpushare_app.poll_once()
    pending = asyncio.ensure_future(rest(jp_fetch, k.id, "release"))
    await wait_for(reached.exists, what="the release's checkpoint held in the kernel")
    mark = tmp_path / "ran"
    msg_id = k.send(touch(mark))
    await wait_for(lambda: queued(gpushare_app, k.id), what="the cell held by the gate")
    await jp_fetch("api", "kernels", k.id, "interrupt", method="POST", body=b"")
    ex = await k.wait(msg_id)
    assert not pending.done()  # answered while the release is still in flight
    assert ex.error and ex.error["ename"] == "KeyboardInterrupt"
    go.touch()
    code, body = await pending
    assert code == 200 and body["state"] == "released", body  # the release ended whole
    await asyncio.sleep(0.5)
    st = gpushare_app.controller.states[k.id]
    assert not mark.exists() and st.state == "released" and st.op is None  # no restore for it
    await k.run(intact())


@pytest.mark.parametrize("gpushare_config", [NO_POLLS])
async def test_rest_restart_answers_a_held_cell_at_once_and_says_the_state_is_gone(
    jp_fetch, kernels, gpushare_app, tmp_path
):
    a, b = await crowded(jp_fetch, kernels, gpushare_app, STATE)
    mark = tmp_path / "ran"
    msg_id = a.send(touch(mark))
    await wait_for(lambda: gpushare_app.controller.states[a.id].waiting, what="a to wait for memory")
    restart = asyncio.ensure_future(jp_fetch("api", "kernels", a.id, "restart", method="POST", body=b""))
    ex = await a.wait(msg_id, timeout=5)
    assert not restart.done()  # answered before the restart, not when a poll sees it
    assert ex.status == "error" and ex.error and "being restarted" in ex.error["evalue"]
    assert "gone" in ex.error["evalue"] and "still held" not in ex.error["evalue"]
    await restart
    info = await kernel_status(jp_fetch, a.id)  # status agrees at once
    assert info is not None and info["state"] != "released" and "gone" in (info["error"] or ""), info
    await b.run("del b")
    await a.ready()
    assert not mark.exists()  # not run in the new process either


@pytest.mark.parametrize("gpushare_config", [NO_POLLS])
async def test_shutdown_answers_a_held_cell_at_once(jp_fetch, kernels, gpushare_app, tmp_path):
    a, _ = await crowded(jp_fetch, kernels, gpushare_app, STATE)
    msg_id = a.send(touch(tmp_path / "ran"))
    await wait_for(lambda: gpushare_app.controller.states[a.id].waiting, what="a to wait for memory")
    shutdown = asyncio.ensure_future(jp_fetch("api", "kernels", a.id, method="DELETE"))
    ex = await a.wait(msg_id, timeout=5)
    assert ex.status == "error" and ex.error and "shutting down" in ex.error["evalue"]
    await shutdown
    with pytest.raises(HTTPClientError):
        await jp_fetch("api", "kernels", a.id)


async def test_a_kernel_killed_mid_restore_answers_the_held_cell_that_its_state_is_gone(
    jp_fetch, kernels, gpushare_app, tmp_path
):
    k = await kernels.start()
    reached = tmp_path / "reached"
    await k.run(hold(256) + "\n" + stall("restore", 30.0, reached))
    await gpushare_app.poll_once()
    pid = gpushare_app.tracker.kernel_pid(k.id)
    assert (await rest(jp_fetch, k.id, "release"))[0] == 200
    msg_id = k.send("print('never runs')")
    await wait_for(lambda: gpushare_app.controller.states[k.id].state == "restoring", what="the restore")
    await wait_for(reached.exists, what="the kernel inside the stalled restore")
    os.kill(pid, 9)
    ex = await k.wait(msg_id)
    assert ex.status == "error" and ex.error
    text = ex.error["evalue"]
    assert "still held" not in text and "run the cell again" not in text, text
    assert "gone" in text and "died" in text, text
    await wait_for(lambda: gpushare_app.controller.states[k.id].held is None, what="the state dropped")
    info = await kernel_status(jp_fetch, k.id)
    assert info is not None and "gone" in (info["error"] or ""), info
