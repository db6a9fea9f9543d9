"""Faults injected into release and restore, as a hostile user or a failing machine would
cause them, on a real server with real kernels (simulated node). For each: the kernel's data
is intact (or the kernel is gone by its own crash, and says so), the state shown is true,
and nothing is left locked or waiting."""

from __future__ import annotations

import asyncio
import json
import os
import uuid

import pytest

from jupyter_gpushare import clock

from .helpers import execute_request, get_json, kernel_status, wait_for
from .scenarios import MiB, crowded, hold, intact, released, rest

#: two kernels of STATE MiB do not fit on one GPU together (small: every byte is copied and
#: checksummed, and 1.25 GiB states made these tests minutes long on 2 busy cores)
SMALL_NODE, STATE = {"simulated_gpus": [256 * MiB, 256 * MiB]}, 160


def state(app, kernel) -> str:
    return app.controller.states[kernel.id].state


# -- restores that share a GPU ------------------------------------------------------------------
@pytest.mark.parametrize("gpushare_config", [SMALL_NODE])
async def test_two_restores_that_do_not_both_fit_take_turns_and_neither_fails(
    jp_fetch, kernels, gpushare_app, events
):
    a = await released(jp_fetch, kernels, gpushare_app, STATE, name="a")
    b = await released(jp_fetch, kernels, gpushare_app, STATE, name="b")
    (code_a, body_a), (code_b, body_b) = await asyncio.gather(
        rest(jp_fetch, a.id, "restore"), rest(jp_fetch, b.id, "restore"))
    assert sorted([code_a, code_b]) == [200, 202], (body_a, body_b)
    first, second = (a, b) if code_a == 200 else (b, a)
    waiting = body_b if code_a == 200 else body_a
    assert waiting["state"] == "released" and waiting["waiting"].startswith("waiting for")
    assert not [e for e in events if e["action"] == "restore_failed"]
    assert gpushare_app.node.used(0) == STATE * MiB
    await wait_for(lambda: "memory" in (gpushare_app.controller.states[second.id].waiting or ""),
                   what="the second restore to wait for memory")

    await rest(jp_fetch, first.id, "release")  # room frees: the waiting restore goes on
    await wait_for(lambda: state(gpushare_app, second) == "active", what="the second restore")
    name = "a" if second is a else "b"
    await second.run(intact(name))
    assert gpushare_app.controller.reservations.snapshot() == {}


# -- who decides "busy" -----------------------------------------------------------------------
async def test_a_release_asked_while_a_cell_runs_is_refused_and_the_cell_finishes(
    jp_fetch, kernels, gpushare_app
):
    """The last poll saw the kernel idle; a release asked mid-cell must not lock it (the cell's
    next GPU call would stall until a restore)."""
    km = gpushare_app.serverapp.kernel_manager
    k = await kernels.start()
    await k.run(hold(256))
    await gpushare_app.poll_once()
    msg_id = k.send("simgpu.burn(1.0)\n" + intact())
    await wait_for(lambda: km.get_kernel(k.id).execution_state == "busy", what="the cell to start")
    code, body = await rest(jp_fetch, k.id, "release")
    assert code == 409 and "busy running a cell" in body["message"], body
    ex = await k.wait(msg_id)
    assert ex.status == "ok" and "intact" in ex.stdout
    st = gpushare_app.controller.states[k.id]
    assert st.held is None and st.releases == 0 and gpushare_app.node.used(0) == 256 * MiB


@pytest.mark.parametrize("gpushare_config", [{"poll_interval": 3600}])
async def test_a_release_just_after_a_cell_succeeds_though_the_last_poll_saw_it_busy(
    jp_fetch, kernels, gpushare_app
):
    km = gpushare_app.serverapp.kernel_manager
    k = await kernels.start()
    await k.run(hold(256))
    msg_id = k.send("simgpu.burn(0.5)")
    await wait_for(lambda: km.get_kernel(k.id).execution_state == "busy", what="the cell to start")
    await gpushare_app.poll_once()
    assert gpushare_app.tracker.kernels[k.id].busy  # what the last poll saw
    await k.wait(msg_id)
    code, body = await rest(jp_fetch, k.id, "release")
    assert code == 200 and body["state"] == "released", body
    await k.run(intact())


# -- work outside cells -----------------------------------------------------------------------
async def test_a_widget_message_to_a_released_kernel_waits_for_the_restore(
    jp_fetch, kernels, gpushare_app, restores
):
    """A comm message runs user code (a widget callback): in eager mode it waits at the gate
    like a cell, instead of blocking in the kernel on a released GPU."""
    k = await kernels.start()
    await k.run(hold(256) + (
        "\ndef _probe(comm, msg):\n"
        "    comm.send({'intact': [a.checksum() for a in x] == x_sum})\n"
        "get_ipython().kernel.comm_manager.register_target('probe', _probe)"))
    await gpushare_app.poll_once()
    code, _ = await rest(jp_fetch, k.id, "release")
    assert code == 200
    comm_id = uuid.uuid4().hex
    msg = execute_request("", k.session)
    msg["header"]["msg_type"] = "comm_open"
    msg["content"] = {"comm_id": comm_id, "target_name": "probe", "data": {}}
    k.ws.write_message(json.dumps(msg))
    reply = None
    while reply is None:
        raw = await asyncio.wait_for(k.ws.read_message(), 30)
        got = json.loads(raw)
        if got["header"]["msg_type"] == "comm_msg" and got["content"].get("comm_id") == comm_id:
            reply = got["content"]["data"]
    assert reply == {"intact": True}
    assert restores == [(k.id, "gate")]


async def test_gpu_work_outside_cells_stops_automatic_release_and_says_why(
    jp_fetch, kernels, gpushare_app
):
    gpushare_app.controller.config = type(gpushare_app.controller.config)(
        **{**gpushare_app.controller.config.__dict__, "idle_timeout": 60.0})
    k = await kernels.start()
    await k.run(hold(256) + (
        "\nimport threading\nstop = threading.Event()\n"
        "def train():\n"
        "    while not stop.is_set():\n"
        "        simgpu.burn(0.05)\n"
        "t = threading.Thread(target=train, name='trainer')\nt.start()"))
    await wait_for(lambda: gpushare_app.tracker.kernels[k.id].gpu_work_while_idle,
                   what="GPU work while no cell runs")
    info = await kernel_status(jp_fetch, k.id)
    # the agent names the thread where its report says so (asked every poll), else the server
    # says the GPU computed while no cell ran: either way why, and the way out
    blocked = info["release_blocked"]
    assert ("background threads use the GPU (trainer)" in blocked
            or "GPU computed while no cell ran" in blocked) and "allow-background" in blocked, blocked
    clock.advance(61)
    await gpushare_app.poll_once()
    assert state(gpushare_app, k) != "released"
    await k.run("stop.set()\nt.join()")
    code, body = await rest(jp_fetch, k.id, "release")  # by hand it is the person's call
    assert code == 200 and body["state"] == "released"
    await k.run(intact())


# -- a restart while cells wait ------------------------------------------------------------------
@pytest.mark.parametrize("gpushare_config", [SMALL_NODE])
async def test_cells_held_for_a_restore_are_answered_and_never_run_when_the_kernel_restarts(
    jp_fetch, kernels, gpushare_app, tmp_path
):
    a, _ = await crowded(jp_fetch, kernels, gpushare_app, STATE)  # a's restore cannot fit
    marker = tmp_path / "ran"
    msg_id = a.send(f"open({str(marker)!r}, 'w').write('ran')")
    await wait_for(lambda: gpushare_app.controller.states[a.id].waiting, what="waiting for memory")
    await jp_fetch("api", "kernels", a.id, "restart", method="POST", body=b"")
    ex = await a.wait(msg_id)
    assert ex.status == "error", ex
    assert "restarted" in ex.error["evalue"] and "did not run" in ex.error["evalue"]
    assert "retry" not in ex.error["evalue"]
    await a.ready()
    assert not marker.exists()
    st = gpushare_app.controller.states[a.id]
    assert st.held is None and st.op is None and "restarted" in st.error


# -- what status says ---------------------------------------------------------------------------
async def test_status_right_after_a_release_counts_each_byte_once(jp_fetch, kernels, gpushare_app):
    k = await released(jp_fetch, kernels, gpushare_app, 512)
    status = await get_json(jp_fetch, "api", "gpushare", "status")
    gpu = status["gpus"][0]
    assert (gpu["memory_used"], gpu["released_bytes"]) == (0, 512 * MiB)
    kernel = next(x for x in status["kernels"] if x["id"] == k.id)
    assert (kernel["gpu_memory_bytes"], kernel["released_bytes"]) == (0, 512 * MiB)


# -- host memory --------------------------------------------------------------------------------
@pytest.mark.parametrize("gpushare_config", [{"host_memory_reserve": 1 << 50, "idle_timeout": 60}])
async def test_a_release_that_would_not_fit_in_host_memory_is_refused_and_says_why(
    jp_fetch, kernels, gpushare_app
):
    k = await kernels.start()
    await k.run(hold(256))
    await gpushare_app.poll_once()
    code, body = await rest(jp_fetch, k.id, "release")
    assert code == 409 and "would not fit in host memory" in body["message"], body
    assert "available" in body["message"] and "host_memory_reserve" in body["message"]
    info = await kernel_status(jp_fetch, k.id)
    assert info["state"] in ("active", "idle") and "would not fit" in info["release_blocked"]
    assert info["host_room_bytes"] > 0
    text = (await jp_fetch("metrics")).body.decode()
    assert f'gpushare_kernel_host_room_bytes{{kernel_id="{k.id}"}}' in text
    clock.advance(61)
    await gpushare_app.poll_once()
    assert state(gpushare_app, k) == "idle"  # never released automatically either
    assert gpushare_app.node.used(0) == 256 * MiB
    await k.run(intact())


def _cgroup_v1_memory() -> str | None:
    """A writable cgroup v1 memory hierarchy (as root on these machines), else None."""
    root = "/sys/fs/cgroup/memory"
    return root if os.path.isdir(root) and os.access(root, os.W_OK) else None


@pytest.mark.skipif(_cgroup_v1_memory() is None, reason="needs a writable cgroup v1 memory hierarchy")
async def test_a_kernel_in_a_small_memory_cgroup_is_not_released_into_an_oom_kill(
    jp_fetch, kernels, gpushare_app
):
    """The kernel runs in a memory cgroup with 300 MiB to spare; releasing its 512 MiB state
    would put the bytes into that cgroup and get it OOM-killed, so the release is refused."""
    k = await kernels.start()
    await k.run(hold(512))
    pid = gpushare_app.tracker.kernel_pid(k.id)
    root = _cgroup_v1_memory()
    assert root is not None
    group = os.path.join(root, f"gpushare-test-{uuid.uuid4().hex[:8]}")
    with open(f"/proc/{pid}/cgroup") as f:
        home = next(line.split(":", 2)[2].strip() for line in f if ":memory:" in line)
    os.mkdir(group)
    try:
        with open(os.path.join(group, "memory.limit_in_bytes"), "w") as f:
            f.write(str(300 * MiB))
        with open(os.path.join(group, "cgroup.procs"), "w") as f:
            f.write(str(pid))
        await gpushare_app.poll_once()
        code, body = await rest(jp_fetch, k.id, "release")
        assert code == 409 and "memory cgroup" in body["message"] and group in body["message"], body
        await k.run(intact())
    finally:
        with open(os.path.join(root + home, "cgroup.procs"), "w") as f:
            f.write(str(pid))
        os.rmdir(group)


# -- operations interrupted from outside: the bytes in flight always land -----------------------
def stall(step: str, seconds: float, reached: object = None) -> str:
    """A cell that makes the kernel's next simulated ``step`` wait ``seconds`` (in the kernel);
    ``reached``: a file the kernel makes once the step is inside its stall (wait for it)."""
    code = ("from jupyter_gpushare.sim import device as _device\n"
            f"_stall = _device.get_device().stall({step!r}, seconds={seconds})")
    if reached is not None:
        code += ("\nimport threading as _threading\n_threading.Thread(target=lambda: "
                 f"_stall.reached.wait() and open({str(reached)!r}, 'w').close(), daemon=True).start()")
    return code


async def reconnect(jp_ws_fetch, kernel):
    """A new tab on the same kernel."""
    from .helpers import KernelConn

    ws = await jp_ws_fetch("api", "kernels", kernel.id, "channels")
    return KernelConn(kernel.id, ws, kernel.km)


async def test_a_tab_closed_while_a_restore_moves_bytes_leaves_the_kernel_restored(
    jp_fetch, jp_ws_fetch, kernels, gpushare_app
):
    k = await kernels.start()
    await k.run(hold(256) + "\n" + stall("restore", 2.0))
    await gpushare_app.poll_once()
    assert (await rest(jp_fetch, k.id, "release"))[0] == 200
    k.send(intact())  # the gate starts the restore for this cell...
    await wait_for(lambda: state(gpushare_app, k) == "restoring", what="the restore to move bytes")
    k.ws.close()  # ...and the tab goes away while the bytes move
    await wait_for(lambda: state(gpushare_app, k) == "active", what="the restore to finish")
    st = gpushare_app.controller.states[k.id]
    assert st.op is None and st.held is None and st.error is None
    again = await reconnect(jp_ws_fetch, k)
    ex = await again.run(intact() + "\nfrom jupyter_gpushare.sim import device\n"
                         "print(device.get_device().state)")
    assert "intact" in ex.stdout and "running" in ex.stdout
    again.ws.close()


async def test_an_interrupt_while_a_restore_moves_bytes_lets_it_finish_and_the_cell_run(
    jp_fetch, kernels, gpushare_app
):
    k = await kernels.start()
    await k.run(hold(256) + "\n" + stall("restore", 1.5))
    await gpushare_app.poll_once()
    assert (await rest(jp_fetch, k.id, "release"))[0] == 200
    msg_id = k.send(intact())
    await wait_for(lambda: state(gpushare_app, k) == "restoring", what="the restore to move bytes")
    k.send_control("interrupt_request")
    ex = await k.wait(msg_id)
    assert ex.status == "ok" and "intact" in ex.stdout
    assert state(gpushare_app, k) == "active"


MAKE_ROOM = {**SMALL_NODE, "pressure_idle_timeout": 30.0, "idle_timeout": 3600.0}


@pytest.mark.parametrize("gpushare_config", [MAKE_ROOM])
async def test_a_victim_released_to_make_room_is_released_whole_when_the_waiter_goes_away(
    jp_fetch, kernels, gpushare_app
):
    a, b = await crowded(jp_fetch, kernels, gpushare_app, STATE)
    await b.run(stall("checkpoint", 2.0))
    clock.advance(31)  # b idle past pressure_idle_timeout: make-room may take it
    await gpushare_app.poll_once()
    a.send(intact("a"))
    await wait_for(lambda: state(gpushare_app, b) == "releasing", what="make-room to take b")
    a.ws.close()  # a's tab goes away while b's bytes move
    await wait_for(lambda: gpushare_app.controller.states[b.id].op is None, what="b's release to end")
    assert state(gpushare_app, b) == "released"
    assert gpushare_app.controller.states[b.id].released_bytes == STATE * MiB
    await wait_for(lambda: gpushare_app.controller.states[a.id].op is None, what="a's restore to end")
    clock.advance(31)  # a idle past pressure_idle_timeout too: b need not wait 30 s for its room
    await b.run(intact("b"), timeout=60)  # b comes back whole (taking a's room if it must)


async def test_server_shutdown_while_a_restore_moves_bytes_waits_for_it(jp_fetch, kernels, gpushare_app):
    k = await kernels.start()
    await k.run(hold(256) + "\n" + stall("restore", 1.0))
    await gpushare_app.poll_once()
    assert (await rest(jp_fetch, k.id, "release"))[0] == 200
    msg_id = k.send(intact())
    await wait_for(lambda: state(gpushare_app, k) == "restoring", what="the restore to move bytes")
    await gpushare_app.controller.shutdown()
    assert state(gpushare_app, k) == "active"
    ex = await k.wait(msg_id)
    assert "intact" in ex.stdout


# -- the kernel dies or stops mid-operation ------------------------------------------------------
@pytest.mark.parametrize("step", ["checkpoint", "restore"])
async def test_a_kernel_killed_mid_operation_ends_with_its_state_dropped_and_says_so(
    step, jp_fetch, kernels, gpushare_app, tmp_path
):
    k = await kernels.start()
    reached = tmp_path / "reached"
    await k.run(hold(256) + "\n" + stall(step, 30.0, reached))
    await gpushare_app.poll_once()
    pid = gpushare_app.tracker.kernel_pid(k.id)
    if step == "checkpoint":
        pending = asyncio.ensure_future(rest(jp_fetch, k.id, "release"))
        await wait_for(lambda: state(gpushare_app, k) == "releasing", what="the release")
    else:
        assert (await rest(jp_fetch, k.id, "release"))[0] == 200
        msg_id = k.send("print('never runs')")
        await wait_for(lambda: state(gpushare_app, k) == "restoring", what="the restore")
    await wait_for(reached.exists, what="the kernel inside the stalled step")
    os.kill(pid, 9)
    if step == "checkpoint":
        code, body = await pending
        assert code == 409 and "not confirmed" in body["message"], body
    else:
        ex = await k.wait(msg_id)
        assert ex.status == "error" and "never runs" not in ex.stdout
    # the kernel manager restarts the dead kernel: the held state goes with the old process
    await wait_for(lambda: gpushare_app.tracker.kernel_pid(k.id) not in (None, pid), what="restart")
    await wait_for(lambda: (gpushare_app.controller.states[k.id].held is None
                            and gpushare_app.controller.states[k.id].op is None),
                   what="the held state to be dropped")
    await gpushare_app.poll_once()
    info = await kernel_status(jp_fetch, k.id)
    assert info["state"] == "untracked" and "gone" in info["error"]
    assert pid not in gpushare_app.node.pids()  # the dead process's memory is free again
    await k.ready()
    assert (await k.run("print(1 + 1)")).stdout == "2\n"


async def test_a_lock_that_runs_after_the_server_gave_up_ends_held_then_comes_back(
    jp_fetch, kernels, gpushare_app
):
    """The kernel's lock is held up past the server's timeout: the server cannot confirm where
    the kernel is, so it shows failed (held); the next cell resumes it, data intact."""
    method = gpushare_app.methods["simulated"]
    method.lock_timeout, method.undo_timeout = 0.2, 0.5
    k = await kernels.start()
    await k.run(hold(256) + "\n" + stall("lock", 6.0))
    await gpushare_app.poll_once()
    code, body = await rest(jp_fetch, k.id, "release")
    assert code == 409 and "lock failed" in body["message"] and "not confirmed" in body["message"]
    assert "the kernel did not answer in time" in body["message"]
    info = await kernel_status(jp_fetch, k.id)
    assert info["state"] == "failed" and info["error"]
    ex = await k.run(intact() + "\nfrom jupyter_gpushare.sim import device\n"
                     "print(device.get_device().state)", timeout=60)
    assert "intact" in ex.stdout and "running" in ex.stdout
    assert state(gpushare_app, k) == "active"


async def test_a_stopped_kernel_is_not_released_and_runs_on_when_continued(
    jp_fetch, kernels, gpushare_app
):
    """SIGSTOP across the timeouts: nothing is taken from a kernel that cannot answer."""
    import signal

    gpushare_app.controller.agent_timeout = 1.0
    k = await kernels.start()
    await k.run(hold(256))
    await gpushare_app.poll_once()
    pid = gpushare_app.tracker.kernel_pid(k.id)
    os.kill(pid, signal.SIGSTOP)
    try:
        code, body = await rest(jp_fetch, k.id, "release")
    finally:
        os.kill(pid, signal.SIGCONT)
    assert code == 409 and "did not answer" in body["message"], body
    assert state(gpushare_app, k) in ("active", "idle")
    await k.run(intact())
    code, _ = await rest(jp_fetch, k.id, "release")  # and a later release works
    assert code == 200
    await k.run(intact())


# -- make-room with a victim that cannot be released ---------------------------------------------
@pytest.mark.parametrize("gpushare_config", [MAKE_ROOM])
async def test_a_victim_whose_release_fails_is_not_retried_in_a_hot_loop(
    jp_fetch, kernels, gpushare_app, events
):
    a, b = await crowded(jp_fetch, kernels, gpushare_app, STATE)
    await b.run("from jupyter_gpushare.sim import device\n"
                "device.get_device().inject_fault('lock', RuntimeError('injected: lock refused'))")
    clock.advance(31)
    await gpushare_app.poll_once()
    msg_id = a.send(intact("a"))
    await wait_for(lambda: gpushare_app.controller.states[a.id].waiting, what="a waits for memory")
    await asyncio.sleep(2.0)
    tries = [e for e in events if e["kernel_id"] == b.id and e["action"] == "release_failed"]
    assert len(tries) == 1, tries  # once, then left alone for a while
    assert state(gpushare_app, b) in ("active", "idle")  # the failed release was undone
    a.send_control("interrupt_request")  # waiting is set, so an interrupt stops it
    ex = await a.wait(msg_id)
    assert ex.error and ex.error["ename"] == "KeyboardInterrupt"
    assert state(gpushare_app, a) == "released"
    await b.run(intact("b"))


async def test_a_channel_dropped_mid_release_leaves_the_state_held_until_the_agent_is_back(
    jp_fetch, kernels, gpushare_app, tmp_path
):
    """The agent channel breaks while the kernel checkpoints: the server cannot confirm where
    the state is, so it keeps it held; the agent reconnects, learns its state, and the next
    cell brings the data back."""
    gpushare_app.methods["simulated"].undo_timeout = 0.5
    k = await kernels.start()
    reached = tmp_path / "reached"
    # 3 s: the channel is closed while the checkpoint is held, however slow the machine
    await k.run(hold(256) + "\n" + stall("checkpoint", 3.0, reached))
    await gpushare_app.poll_once()
    conn = gpushare_app.channel.connections[k.id]
    pending = asyncio.ensure_future(rest(jp_fetch, k.id, "release"))
    await wait_for(reached.exists, what="the kernel inside the stalled checkpoint")
    conn._close()
    code, body = await pending
    assert code == 409 and "not confirmed" in body["message"], body
    assert state(gpushare_app, k) == "failed"
    await wait_for(lambda: (k.id in gpushare_app.channel.connections
                            and gpushare_app.channel.connections[k.id] is not conn),
                   what="the agent to reconnect")
    ex = await k.run(intact() + "\nfrom jupyter_gpushare.sim import device\n"
                     "print(device.get_device().state)")
    assert "intact" in ex.stdout and "running" in ex.stdout
    assert state(gpushare_app, k) == "active"


@pytest.mark.parametrize("gpushare_config", [{"idle_timeout": 60.0}])
async def test_a_model_serving_thread_keeps_its_kernel_until_allowed_then_brings_it_back(
    jp_fetch, kernels, gpushare_app, restores, tmp_path
):
    """A thread that works on GPU data now and then (a model server, a scheduled job) is named
    as the reason the kernel is not released; once the person allows it, the kernel is
    released, and the thread's next GPU call brings the state back by itself."""
    k = await kernels.start()
    inbox = tmp_path / "requests"  # requests reach the thread from outside, not through a cell
    inbox.mkdir()
    await k.run(hold(256) + (
        "\nimport os, threading, time\nanswers = []\n"
        "def serve():\n"
        "    while True:\n"
        f"        for name in sorted(os.listdir({str(inbox)!r})):\n"
        f"            os.remove(os.path.join({str(inbox)!r}, name))\n"
        "            answers.append([a.checksum() for a in x] == x_sum)\n"
        "        time.sleep(0.05)\n"
        "server = threading.Thread(target=serve, name='model-server', daemon=True)\n"
        "server.start()"))
    (inbox / "1").touch()
    await k.run("while not answers: time.sleep(0.05)")
    await gpushare_app.poll_once()
    clock.advance(61)
    await gpushare_app.poll_once()
    await wait_for(lambda: gpushare_app.controller.states[k.id].op is None, what="no operation")
    info = await kernel_status(jp_fetch, k.id)
    assert info["state"] == "idle" and "model-server" in (info["release_blocked"] or ""), info
    ex = await k.run("%gpushare")
    assert "model-server" in ex.text

    await k.run("%gpushare allow-background")
    clock.advance(61)
    await gpushare_app.poll_once()
    await wait_for(lambda: state(gpushare_app, k) == "released", what="the automatic release")
    (inbox / "2").touch()  # no cell runs: only the thread's GPU call can bring the state back
    await wait_for(lambda: (k.id, "background") in restores, what="the thread's restore")
    await wait_for(lambda: state(gpushare_app, k) == "active", what="active again")
    ex = await k.run("while len(answers) < 2: time.sleep(0.05)\nprint(answers)")
    assert ex.stdout == "[True, True]\n"
