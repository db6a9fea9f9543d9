"""A restore whose room another process takes between the controller's grant and the
method's own check, right before its first call, goes back to waiting for room instead of
failing the cell; a process that keeps taking it fails the restore after a bound.

Real server, real kernels, the simulated node (one GPU of 1 GiB). The other process is an
allocation on the node under a pid that is none of the server's kernels, made from a hook on
the simulated method's reading of free memory (the hardware boundary): deterministic, at the
worst moment. The driver method's refusal is checked at its fake CUDA driver.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from jupyter_gpushare.core.controller import ROOM_TAKEN_WAITS
from jupyter_gpushare.reclaim import KernelTarget, ReclaimError
from jupyter_gpushare.reclaim.driver import DriverMethod
from tests.fakes.fake_checkpoint import FakeCheckpointDriver

from .helpers import kernel_status, wait_for
from .scenarios import MiB, hold, intact, released

OTHER = os.getpid()  # another process on the GPU: none of the server's kernels (alive)
STATE = 256  # MiB, the kernel's state
LEFT = 128 * MiB  # free once the other process took its share: less than the state



@pytest.fixture
def gpushare_config():
    return {"simulated_gpus": [1024 * MiB]}


class Taker:
    """The simulated method's ``free_bytes``: another process allocates on the GPU right
    before the method reads it, leaving ``LEFT`` free; ``keeps``: it frees again at once
    (it keeps coming back, so the controller's own check always finds room)."""

    def __init__(self, node, read, keeps: bool = False):
        self.node, self.read, self.keeps = node, read, keeps
        self.held = 0
        self.times = 0
        self.on = True

    def __call__(self, gpu: int) -> int | None:
        if self.on and (self.keeps or self.times == 0):
            self.times += 1
            n = self.node.free(gpu) - LEFT
            self.node.alloc(OTHER, gpu, n)
            self.held += n
            try:
                return self.read(gpu)
            finally:
                if self.keeps:
                    self.leave(gpu)
        return self.read(gpu)

    def leave(self, gpu: int = 0) -> None:
        self.node.release(OTHER, gpu, self.held)
        self.held = 0


def taker(app, monkeypatch, keeps: bool = False) -> Taker:
    method = app.controller.methods["simulated"]
    t = Taker(app.node, method.free_bytes, keeps)
    monkeypatch.setattr(method, "free_bytes", t)
    return t


async def test_a_restore_whose_room_was_taken_waits_and_the_cell_runs_once_it_is_back(
    jp_fetch, kernels, gpushare_app, events, monkeypatch
):
    k = await released(jp_fetch, kernels, gpushare_app, STATE)
    t = taker(gpushare_app, monkeypatch)
    try:
        msg_id = k.send(intact())
        async def said_what_it_needs():  # right after the refusal, the room wait's words follow
            text = await _waiting(jp_fetch, k.id)
            return text if text and "needs" in text else None

        waiting = await wait_for(said_what_it_needs, timeout=30,
                                 what="status to say the restore waits again, and for what")
        assert "the room was taken right before the restore (GPU 0 has 128 MiB free, " \
               "256 MiB needed)" in waiting, waiting
        assert waiting.startswith("waiting for memory: needs 256.0 MiB on GPU 0 (128.0 MiB free); "), waiting
        body = await kernel_status(jp_fetch, k.id)
        assert body is not None and body["state"] == "released" and body["error"] is None, body
        t.leave()  # the other process goes: the restore finds its room and the cell runs
        ex = await k.wait(msg_id, timeout=60)
    finally:
        t.leave()
    assert ex.status == "ok" and "intact" in ex.stdout, ex
    lines = [d.get("data", {}).get("text/plain", "") for d in ex.displays]
    assert ("gpushare: the room was taken right before the restore (GPU 0 has 128 MiB free, "
            "256 MiB needed): waiting for room again (interrupt to stop waiting)") in lines, lines
    assert t.times == 1
    mine = [e for e in events if e["kernel_id"] == k.id]
    assert [e["action"] for e in mine][-2:] == ["restore_waiting", "restored"], mine
    assert mine[-2]["reason"] == ("the room was taken right before the restore: GPU 0 has "
                                  "128 MiB free, 256 MiB needed"), mine[-2]
    body = await kernel_status(jp_fetch, k.id)
    assert body is not None and body["state"] == "active" and body["error"] is None, body


async def test_a_process_that_keeps_taking_the_room_fails_the_restore_and_the_state_stays_held(
    jp_fetch, kernels, gpushare_app, events, monkeypatch
):
    k = await released(jp_fetch, kernels, gpushare_app, STATE)
    t = taker(gpushare_app, monkeypatch, keeps=True)
    ex = await k.run(intact(), ok=False)
    assert ex.status == "error" and "intact" not in ex.stdout, ex
    assert t.times == ROOM_TAKEN_WAITS + 1  # three waits again, then the refusal fails it
    mine = [e["action"] for e in events if e["kernel_id"] == k.id]
    assert mine[-(ROOM_TAKEN_WAITS + 1):] == ["restore_waiting"] * ROOM_TAKEN_WAITS + [
        "restore_failed"], mine
    body = await kernel_status(jp_fetch, k.id)
    assert body is not None and body["state"] == "failed", body
    assert "taken right before the restore 4 times" in body["error"], body
    t.on = False  # the other process is gone: the next cell restores the state, intact
    assert "intact" in (await k.run(intact())).stdout
    await k.run(hold(64, name="y"))  # and the kernel computes as before


@pytest.mark.parametrize("gpushare_config", [
    {"simulated_gpus": [1024 * MiB, 1024 * MiB], "restore_move_after": 0.5}])
async def test_a_restore_waiting_again_moves_onto_another_gpu_as_any_waiting_restore(
    jp_fetch, kernels, gpushare_app, monkeypatch
):
    k = await released(jp_fetch, kernels, gpushare_app, STATE)
    t = taker(gpushare_app, monkeypatch)  # the other process stays on GPU 0
    try:
        ex = await k.run(intact())
        assert "intact" in ex.stdout and t.times == 1, ex
        body = await kernel_status(jp_fetch, k.id)
        assert body is not None and body["restored_onto"] == "onto GPU 1: GPU 0 had no room", body
    finally:
        t.leave()


async def test_an_interrupt_stops_a_restore_waiting_again_and_nothing_is_lost(
    jp_fetch, kernels, gpushare_app, monkeypatch
):
    k = await released(jp_fetch, kernels, gpushare_app, STATE)
    t = taker(gpushare_app, monkeypatch)
    try:
        msg_id = k.send(intact())
        await wait_for(lambda: _waiting(jp_fetch, k.id), timeout=30, what="the restore to wait again")
        r = await jp_fetch("api", "kernels", k.id, "interrupt", method="POST", body=b"")
        assert r.code == 204
        ex = await k.wait(msg_id, timeout=30)
        assert ex.status == "error" and ex.error and ex.error["ename"] == "KeyboardInterrupt", ex
        st = gpushare_app.controller.states[k.id]
        await wait_for(lambda: st.op is None, what="the restore to stop")
        assert st.state == "released" and st.held is not None and st.short_since is None
    finally:
        t.leave()
    assert "intact" in (await k.run(intact())).stdout  # the next cell restores, every byte back


def test_the_driver_refuses_a_room_taken_before_it_calls_restore():
    drv = FakeCheckpointDriver()
    free = {0: 2 << 30}
    m = DriverMethod(free.get, process_factory=drv.process)
    target = KernelTarget("k", pids=[7], gpu_bytes={0: 4 << 30})
    asyncio.run(m.release(target))
    before = list(drv.calls)
    with pytest.raises(ReclaimError) as e:
        asyncio.run(m.restore(target))
    assert e.value.no_room == "GPU 0 has 2.0 GiB free, 4.0 GiB needed", e.value
    assert e.value.retryable and drv.calls == before and drv.states[7] == "checkpointed"
    free.clear()  # unknown free memory is no room taken: refused, not waited for again
    with pytest.raises(ReclaimError, match="unknown") as e:
        asyncio.run(m.restore(target))
    assert e.value.no_room == "" and drv.calls == before


async def _waiting(jp_fetch, kernel_id: str) -> str | None:
    body = await kernel_status(jp_fetch, kernel_id)
    text = body["waiting"] if body else None
    return text if text and "taken" in text else None
