"""Releasing idle kernels' GPU memory and restoring it transparently before the next cell:
policy, REST, the gate, events and metrics, with real kernels on the simulated node."""

from __future__ import annotations

import asyncio
import json

import pytest
from tornado.httpclient import HTTPClientError

from jupyter_gpushare import clock
from jupyter_gpushare.sim.node import GiB

from . import scenarios
from .helpers import execute_request, get_json, kernel_status, wait_for
from .scenarios import MiB, crowded, hold, released

IDLE = 60.0


@pytest.fixture
def gpushare_config():
    return {"idle_timeout": IDLE, "pressure_idle_timeout": 30.0}


SMALL_NODE = {"idle_timeout": IDLE, "pressure_idle_timeout": 30.0, **scenarios.SMALL_NODE}


async def idle_past_timeout(app, seconds: float = IDLE + 1) -> None:
    await app.poll_once()
    clock.advance(seconds)
    await app.poll_once()


async def test_idle_kernel_is_released_and_next_cell_restores_identical_data(
    jp_fetch, kernels, gpushare_app, events
):
    k = await kernels.start()
    await k.run(hold(4096, chunk=1024))
    await gpushare_app.poll_once()
    assert gpushare_app.node.used(0) == 4 * GiB

    await idle_past_timeout(gpushare_app)
    await wait_for(lambda: gpushare_app.controller.states[k.id].state == "released", what="release")
    info = await kernel_status(jp_fetch, k.id)
    assert info["state"] == "released"
    assert info["released_bytes"] == 4 * GiB
    assert gpushare_app.node.used(0) == 0  # back to the pool

    ex = await k.run("assert [a.checksum() for a in x] == x_sum\nprint('same data')")
    assert "same data" in ex.stdout
    shown = [d["data"]["text/plain"] for d in ex.displays]
    assert any("restoring 4.0 GiB" in s for s in shown), shown
    assert any(s.startswith("gpushare: restored 4.0 GiB in") for s in shown), shown
    st = gpushare_app.controller.states[k.id]
    assert (st.state, st.restores, st.releases) == ("active", 1, 1)
    assert gpushare_app.node.used(0) == 4 * GiB
    actions = [e["action"] for e in events if e["kernel_id"] == k.id]
    assert actions == ["released", "restored"]
    released = next(e for e in events if e["action"] == "released")
    assert released["bytes"] == 4 * GiB and released["method"] == "simulated"


async def test_busy_kernel_is_not_released(kernels, gpushare_app):
    k = await kernels.start()
    await k.run(hold(256))
    msg_id = k.send("simgpu.burn(1.0)")
    await wait_for(lambda: gpushare_app.serverapp.kernel_manager.get_kernel(k.id).execution_state == "busy",
                   what="busy")
    await idle_past_timeout(gpushare_app)
    await asyncio.sleep(0.1)
    assert gpushare_app.controller.states[k.id].state not in ("releasing", "released")
    await k.wait(msg_id)


async def test_gpu_busy_kernel_is_not_released(kernels, gpushare_app):
    """SM utilization above idle_utilization in the window keeps a kernel resident."""
    k = await kernels.start()
    await k.run(hold(256) + "\nimport threading\nt = threading.Thread(target=simgpu.burn, args=(1.0,))\nt.start()")
    await asyncio.sleep(0.5)
    await gpushare_app.poll_once()  # samples utilization while the thread burns
    clock.advance(IDLE / 2)
    await gpushare_app.poll_once()
    assert gpushare_app.controller.states[k.id].state not in ("releasing", "released")
    await k.run("t.join()")


async def test_pinned_kernel_is_not_released(jp_fetch, kernels, gpushare_app):
    k = await kernels.start()
    await k.run(hold(256))
    r = await jp_fetch("api", "gpushare", "kernels", k.id, "pin", method="PUT",
                       body=json.dumps({"pinned": True}))
    assert json.loads(r.body)["pinned"] is True
    await idle_past_timeout(gpushare_app)
    await asyncio.sleep(0.1)
    assert gpushare_app.controller.states[k.id].state == "idle"
    # pinning stops automatic releases only: a person may still release it by hand
    r = await jp_fetch("api", "gpushare", "kernels", k.id, "release", method="POST", body=b"")
    body = json.loads(r.body)
    assert (body["state"], body["pinned"]) == ("released", True)


@pytest.mark.parametrize("gpushare_config", [{"idle_timeout": IDLE, "min_release_bytes": 512 * MiB}])
async def test_kernel_under_min_release_bytes_is_not_released(kernels, gpushare_app):
    k = await kernels.start()
    await k.run(hold(256))
    await idle_past_timeout(gpushare_app)
    await asyncio.sleep(0.1)
    assert gpushare_app.controller.states[k.id].state == "idle"


async def test_execute_requests_sent_during_release_run_in_order(jp_fetch, kernels, gpushare_app):
    k = await kernels.start()
    await k.run(hold(2048) + "\nseen = []")
    await gpushare_app.poll_once()
    release = asyncio.ensure_future(
        jp_fetch("api", "gpushare", "kernels", k.id, "release", method="POST", body=b"")
    )
    await wait_for(lambda: gpushare_app.controller.states[k.id].state == "releasing", what="releasing")
    ids = [k.send(f"seen.append({i})\nassert [a.checksum() for a in x] == x_sum") for i in range(5)]
    for msg_id in ids:
        assert (await k.wait(msg_id)).status == "ok"
    assert k.order[-5:] == ids
    await release
    ex = await k.run("print(seen)")
    assert ex.stdout.strip() == "[0, 1, 2, 3, 4]"
    st = gpushare_app.controller.states[k.id]
    assert (st.releases, st.restores, st.state) == (1, 1, "active")


# make-room at home, not a move onto the empty GPU (the test moves the clock past the wait)
@pytest.mark.parametrize("gpushare_config", [{**SMALL_NODE, "restore_move_after": 0}])
async def test_restore_without_room_releases_another_idle_kernel(jp_fetch, kernels, gpushare_app):
    a, b = await crowded(jp_fetch, kernels, gpushare_app)
    clock.advance(31)  # b idle past pressure_idle_timeout, not past idle_timeout
    await gpushare_app.poll_once()
    assert gpushare_app.controller.states[b.id].state not in ("releasing", "released")

    await a.run("assert [v.checksum() for v in a] == a_sum")
    assert gpushare_app.controller.states[a.id].state == "active"
    assert gpushare_app.controller.states[b.id].state == "released"
    await b.run("assert [v.checksum() for v in b] == b_sum")  # and b comes back in turn
    assert gpushare_app.controller.states[a.id].state == "released"


@pytest.mark.parametrize("gpushare_config", [SMALL_NODE])
async def test_restore_without_room_waits_and_says_why(jp_fetch, kernels, gpushare_app, events):
    a, b = await crowded(jp_fetch, kernels, gpushare_app)  # b is recent: never evicted

    r = await jp_fetch("api", "gpushare", "kernels", a.id, "restore", method="POST", body=b"")
    assert r.code == 202
    body = json.loads(r.body)
    assert body["state"] == "released"
    assert "waiting for memory: needs 1.2 GiB on GPU 0 (768.0 MiB free)" in body["waiting"]
    assert any(e["action"] == "restore_waiting" for e in events)

    msg_id = a.send("assert [v.checksum() for v in a] == a_sum\nprint('a back')")
    await asyncio.sleep(0.3)
    assert a.executions[msg_id].status == ""  # held: no room yet
    a.ws.write_message(json.dumps({**execute_request("", a.session), "channel": "shell",
                                   "header": {**execute_request("", a.session)["header"],
                                              "msg_type": "kernel_info_request", "msg_id": "ki-1"},
                                   "content": {}}))
    while True:  # a kernel_info_request is not held behind the waiting cell
        msg = json.loads(await asyncio.wait_for(a.ws.read_message(), 30))
        if msg["header"]["msg_type"] == "kernel_info_reply":
            assert msg["parent_header"]["msg_id"] == "ki-1"
            break
    assert a.executions[msg_id].status == ""
    await b.run("del b")  # memory frees
    ex = await a.wait(msg_id)
    assert "a back" in ex.stdout
    assert gpushare_app.controller.states[a.id].state == "active"


@pytest.mark.parametrize("gpushare_config", [SMALL_NODE])
async def test_interrupt_stops_a_cell_waiting_for_memory(jp_fetch, kernels, gpushare_app):
    a, _ = await crowded(jp_fetch, kernels, gpushare_app)
    msg_id = a.send("print('should not run yet')")
    await wait_for(lambda: gpushare_app.controller.states[a.id].waiting, what="waiting")
    a.send_control("interrupt_request")
    ex = await a.wait(msg_id)
    assert ex.status == "error" and ex.error["ename"] == "KeyboardInterrupt"
    assert "should not run" not in ex.stdout
    assert gpushare_app.controller.states[a.id].state == "released"  # still held, nothing lost
    await wait_for(lambda: gpushare_app.controller.states[a.id].waiting is None, what="not waiting")


async def test_rest_actions_and_their_errors(jp_fetch, kernels, gpushare_app):
    k = await kernels.start()

    async def call(action: str, method: str = "POST", body: bytes = b"", kid: str = k.id):
        try:
            r = await jp_fetch("api", "gpushare", "kernels", kid, action, method=method, body=body)
            return r.code, json.loads(r.body)
        except HTTPClientError as e:
            return e.code, json.loads(e.response.body)

    code, body = await call("release", kid="no-such-kernel")
    assert code == 404 and "no kernel" in body["message"]
    code, body = await call("release")
    assert code == 409 and "holds no GPU memory" in body["message"]
    code, body = await call("restore")
    assert code == 409 and "not released" in body["message"]

    await k.run(hold(256))
    await gpushare_app.poll_once()
    code, body = await call("release")
    assert code == 200 and body["state"] == "released" and body["released_bytes"] == 256 * MiB
    code, body = await call("release")
    assert code == 409 and "already released" in body["message"]
    code, body = await call("restore")
    assert code == 200 and body["state"] == "active"

    for bad in (b"not json", b"[1]", b'{"pinned": "yes"}', b"{}"):
        code, body = await call("pin", "PUT", bad)
        assert code == 400, bad
    code, body = await call("pin", "PUT", b'{"pinned": true}')
    assert code == 200 and body["pinned"] is True
    code, body = await call("pin", "PUT", b'{"pinned": true}', kid="nope")
    assert code == 404

    with pytest.raises(HTTPClientError) as e:
        await jp_fetch("api", "gpushare", "kernels", k.id, "release", method="POST", body=b"",
                       headers={"Authorization": "token wrong"})
    assert e.value.code == 403
    assert gpushare_app.controller.states[k.id].state == "active"  # nothing changed


async def test_release_that_fails_leaves_kernel_running(jp_fetch, kernels, gpushare_app):
    gpushare_app.methods["simulated"].lock_timeout = 0.3
    k = await kernels.start()
    await k.run(hold(256) + "\nimport threading\nt = threading.Thread(target=simgpu.burn, args=(2.0,))\nt.start()")
    await gpushare_app.poll_once()
    with pytest.raises(HTTPClientError) as e:
        await jp_fetch("api", "gpushare", "kernels", k.id, "release", method="POST", body=b"")
    assert e.value.code == 409
    message = json.loads(e.value.response.body)["message"]
    assert "release failed" in message and "lock" in message
    st = gpushare_app.controller.states[k.id]
    assert st.state in ("active", "idle") and st.error and st.releases == 0
    await k.run("t.join()\nassert [a.checksum() for a in x] == x_sum")
    assert gpushare_app.node.used(0) == 256 * MiB


async def test_kernel_restart_while_released_drops_held_state(jp_fetch, kernels, gpushare_app):
    k = await released(jp_fetch, kernels, gpushare_app, 512)
    await jp_fetch("api", "kernels", k.id, "restart", method="POST", body=b"")
    await wait_for(lambda: gpushare_app.controller.states[k.id].state != "released", what="drop")
    st = gpushare_app.controller.states[k.id]
    assert st.released_bytes == 0 and "restarted" in (st.error or "")
    await k.ready()
    ex = await k.run("print('x' in dir())")
    assert ex.stdout.strip() == "False"  # a fresh process, as a restart means
    await gpushare_app.poll_once()
    assert gpushare_app.node.used(0) == 0


async def test_released_kernel_shutdown_frees_everything(jp_fetch, kernels, gpushare_app):
    k = await released(jp_fetch, kernels, gpushare_app, 512)
    await jp_fetch("api", "kernels", k.id, method="DELETE")
    await wait_for(lambda: k.id not in gpushare_app.channel.connections, what="disconnect")
    await gpushare_app.poll_once()
    assert k.id not in gpushare_app.controller.states
    assert gpushare_app.node.used(0) == 0


async def test_server_shutdown_restores_released_kernels(jp_fetch, kernels, gpushare_app):
    k = await released(jp_fetch, kernels, gpushare_app, 256)
    await gpushare_app.controller.shutdown()
    assert gpushare_app.controller.states[k.id].state == "active"
    await k.run("assert [a.checksum() for a in x] == x_sum")


async def test_status_lists_release_time_and_state(jp_fetch, kernels, gpushare_app):
    k = await kernels.start()
    await k.run(hold(256))
    await gpushare_app.poll_once()
    clock.advance(20)
    await gpushare_app.poll_once()
    info = await kernel_status(jp_fetch, k.id)
    assert 35 <= info["release_in_seconds"] <= 41
    status = await get_json(jp_fetch, "api", "gpushare", "status")
    assert status["idle_timeout"] == IDLE


async def test_client_bypassing_the_gate_is_restored_by_the_agent(jp_fetch, kernels, gpushare_app, events):
    """Restore trigger 2: nbclient-style clients talk to the kernel's ZMQ ports directly."""
    k = await released(jp_fetch, kernels, gpushare_app, 256)
    client = gpushare_app.serverapp.kernel_manager.get_kernel(k.id).client()
    client.start_channels()
    try:
        outputs: list[dict] = []
        reply = await client._async_execute_interactive(
            "assert [a.checksum() for a in x] == x_sum\nprint('direct ok')",
            output_hook=lambda msg: outputs.append(msg), timeout=60,
        )
    finally:
        client.stop_channels()
    assert reply["content"]["status"] == "ok"
    assert any("direct ok" in m["content"].get("text", "") for m in outputs)
    assert any("restored" in m["content"].get("data", {}).get("text/plain", "") for m in outputs)
    restored = [e for e in events if e["action"] == "restored"]
    assert restored and restored[-1]["reason"] == "agent"


async def test_release_and_restore_update_metrics(jp_fetch, kernels, gpushare_app):
    def sample(name: str, **labels: str) -> float:
        from prometheus_client import REGISTRY

        return REGISTRY.get_sample_value(name, labels) or 0.0

    before = (sample("gpushare_releases_total", method="simulated", outcome="ok"),
              sample("gpushare_restores_total", method="simulated", outcome="ok"),
              sample("gpushare_restore_seconds_count"))
    k = await released(jp_fetch, kernels, gpushare_app, 256)
    text = (await jp_fetch("metrics")).body.decode()
    assert f'gpushare_kernel_released_bytes{{kernel_id="{k.id}"}} 2.68435456e+08' in text
    assert "gpushare_released_bytes 2.68435456e+08" in text
    await jp_fetch("api", "gpushare", "kernels", k.id, "restore", method="POST", body=b"")
    after = (sample("gpushare_releases_total", method="simulated", outcome="ok"),
             sample("gpushare_restores_total", method="simulated", outcome="ok"),
             sample("gpushare_restore_seconds_count"))
    assert [b - a for a, b in zip(before, after, strict=True)] == [1, 1, 1]
    assert sample("gpushare_released_bytes") == 0


async def test_kernels_that_come_and_go_leave_nothing_behind(jp_fetch, kernels, gpushare_app):
    from jupyter_gpushare.core import metrics

    started = [await kernels.start() for _ in range(3)]
    for k in started:
        await k.run(hold(256))
    await gpushare_app.poll_once()
    await jp_fetch("api", "gpushare", "kernels", started[0].id, "release", method="POST", body=b"")
    for k in started:
        await jp_fetch("api", "kernels", k.id, method="DELETE")
    await wait_for(lambda: not gpushare_app.channel.connections, what="all agents gone")
    await gpushare_app.poll_once()
    assert gpushare_app.tracker.kernels == {}
    assert gpushare_app.controller.states == {}
    assert gpushare_app.node.pids() == {}
    assert not any(kid in str(key) for key in metrics._known_kernel_series for kid in
                   (k.id for k in started))
    assert not any(kid in str(key) for key in metrics._known_host_room for kid in
                   (k.id for k in started))


async def test_gpushare_magic_cells_pass_the_gate_without_a_restore(jp_fetch, kernels, gpushare_app):
    k = await released(jp_fetch, kernels, gpushare_app, 256)
    ex = await k.run("# what is my state?\n%gpushare")
    assert "released" in ex.text
    assert gpushare_app.controller.states[k.id].state == "released"
    await k.run("%gpushare restore")
    assert gpushare_app.controller.states[k.id].state == "active"



@pytest.mark.parametrize("gpushare_config", [SMALL_NODE])
async def test_shutdown_while_a_restore_waits_drops_everything_cleanly(jp_fetch, kernels, gpushare_app):
    a, b = await crowded(jp_fetch, kernels, gpushare_app)
    a.send("print('never runs')")
    await wait_for(lambda: gpushare_app.controller.states[a.id].waiting, what="waiting")
    await jp_fetch("api", "kernels", a.id, method="DELETE")
    await wait_for(lambda: a.id not in gpushare_app.channel.connections, what="agent gone")
    await gpushare_app.poll_once()
    assert a.id not in gpushare_app.controller.states
    assert gpushare_app.node.used(0) == 1280 * MiB  # only b's memory is accounted
    await b.run("assert [v.checksum() for v in b] == b_sum")  # the other kernel is unharmed


async def test_restore_queued_behind_another_on_its_gpu_is_not_waiting_for_memory(
    jp_fetch, kernels, gpushare_app
):
    """Restores on one GPU take turns; a turn is not "waiting for memory": no `waiting`, no
    202 (the load benchmark saw 202s on a node with plenty of room)."""
    k = await released(jp_fetch, kernels, gpushare_app)
    ledger = gpushare_app.controller.reservations
    other = await ledger.acquire([0])  # another kernel's restore holds GPU 0
    try:
        request = asyncio.ensure_future(
            jp_fetch("api", "gpushare", "kernels", k.id, "restore", method="POST", body=b""))
        await wait_for(lambda: ledger._locks[0]._waiters, what="the restore to queue for GPU 0")
        assert gpushare_app.controller.states[k.id].waiting is None
        shown = await kernel_status(jp_fetch, k.id)
        assert (shown["state"], shown["waiting"]) == ("released", None)
    finally:
        other.release()
    r = await request
    assert r.code == 200
    assert json.loads(r.body)["state"] == "active"
    await k.run("assert [a.checksum() for a in x] == x_sum")
