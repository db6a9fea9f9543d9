"""A kernel with memory on several GPUs is checkpointed and restored on all of them at once,
as the driver does for one process: the GPUs' copies overlap, the move stays all or nothing
across GPUs, and the cell's progress line says per GPU what moves and how long it took.

Unit tests drive a fresh SimDevice on a private node; the others run a real server and real
kernels on the simulated node (two GPUs, no CUDA_VISIBLE_DEVICES: a kernel sees both).
Overlap is read from the device's own record of each GPU's copy (start and end times in the
kernel), never from a wall-time budget."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from jupyter_gpushare.reclaim.simulated import done_line, fraction, moving_line
from jupyter_gpushare.sim import device as device_module
from jupyter_gpushare.sim import simgpu
from jupyter_gpushare.sim.device import (
    CHECKPOINTED,
    LOCKED,
    RUNNING,
    InjectedFault,
    LocalBackend,
    SimDevice,
)
from jupyter_gpushare.sim.node import GiB, SimNode, SimOutOfMemoryError

from .helpers import kernel_status, wait_for
from .scenarios import MiB, rest

RATE = 64 * MiB  # bytes per second per simulated GPU in the unit tests: 4 MiB take 1/16 s


@pytest.fixture
def node() -> SimNode:
    return SimNode((GiB, GiB))


@pytest.fixture
def dev(node, monkeypatch) -> SimDevice:
    device = SimDevice(LocalBackend(node))
    device.transfer_rate = RATE
    device.parallel = True
    monkeypatch.setattr(device_module, "_device", device)
    yield device
    device.clear_faults()
    if device.state in (LOCKED, CHECKPOINTED):
        device.resume()


def on_both_gpus(per_gpu: int = 2) -> list[simgpu.SimArray]:
    """``per_gpu`` arrays of 2 MiB of distinct data on each of GPU 0 and GPU 1."""
    return [simgpu.array(np.arange(1 << 19, dtype=np.uint32) * (2 * i + 1), device=i % 2)
            for i in range(2 * per_gpu)]


def until(predicate: Callable[[], object], timeout: float = 10.0) -> None:
    """Wait for a condition another thread brings about (a bound, not a timing)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


def overlap(a: dict, b: dict) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


def copies(dev: SimDevice, step: str) -> dict[int, dict]:
    """The last move's copy per GPU, from the device's transfer log."""
    return {t["gpu"]: t for t in dev.transfer_log(step)[-2:]}


# -- the device ------------------------------------------------------------------------------

def held_on_gpu0_while_gpu1_moves(dev: SimDevice, step: str, run: Callable[[], object]) -> None:
    """Run ``step`` with GPU 0's copy held after its first array until GPU 1's copy has moved
    every byte: only a move of both GPUs at once gets there."""
    stall = dev.stall(step, gpu=0, after=1)
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    assert stall.reached.wait(10)
    until(lambda: dev.progress()["gpus"].get("1") == [4 * MiB, 4 * MiB])
    assert dev.progress()["gpus"]["0"] == [2 * MiB, 4 * MiB]
    stall.release()
    worker.join(10)


def test_two_gpus_checkpoint_and_restore_at_once(dev, node):
    xs = on_both_gpus()
    sums = [x.checksum() for x in xs]
    dev.lock()
    held_on_gpu0_while_gpu1_moves(dev, "checkpoint", dev.checkpoint)
    assert dev.state == CHECKPOINTED and node.pids() == {}
    out = copies(dev, "checkpoint")
    assert sorted(out) == [0, 1] and all(c["ok"] and c["bytes"] == 4 * MiB for c in out.values())
    assert overlap(out[0], out[1]), out
    back: list[dict] = []
    held_on_gpu0_while_gpu1_moves(dev, "restore", lambda: back.append(dev.resume()))
    assert back == [{"from": CHECKPOINTED, "bytes": 8 * MiB, "arrays": 4,
                     "gpus": {"0": 4 * MiB, "1": 4 * MiB}}]
    out = copies(dev, "restore")
    assert sorted(out) == [0, 1] and all(c["ok"] and c["arrays"] == 2 for c in out.values())
    assert overlap(out[0], out[1]), out
    assert [x.checksum() for x in xs] == sums and dev.state == RUNNING
    assert node.pids() == {LocalBackend(node).pid: {0: 4 * MiB, 1: 4 * MiB}}


def test_the_sequential_switch_moves_one_gpu_after_the_other(dev):
    xs = on_both_gpus()
    sums = [x.checksum() for x in xs]
    dev.parallel = False
    dev.lock()
    dev.checkpoint()
    dev.resume()
    out = copies(dev, "restore")
    assert sorted(out) == [0, 1] and not overlap(out[0], out[1]), out
    assert [x.checksum() for x in xs] == sums


def test_a_fault_on_gpu_1_leaves_neither_gpu_restored_and_a_later_restore_works(dev, node):
    xs = on_both_gpus()
    sums = [x.checksum() for x in xs]
    dev.lock()
    dev.checkpoint()
    values = [x._host.copy() for x in xs]
    dev.inject_fault("restore", "copy engine fault on GPU 1", gpu=1, after=1)
    with pytest.raises(InjectedFault, match="copy engine fault on GPU 1"):
        dev.restore()
    assert dev.state == CHECKPOINTED and node.pids() == {}  # GPU 0's memory went back too
    for x, value in zip(xs, values, strict=True):
        assert x._dev is None and np.array_equal(x._host, value)
    out = copies(dev, "restore")  # GPU 0's copy: undone, or stopped before it began
    assert not out[1]["ok"] and out[1]["arrays"] == 1 and not any(c["ok"] for c in out.values())
    assert dev.placement()["host"] == {"0": 4 * MiB, "1": 4 * MiB}

    assert dev.resume()["bytes"] == 8 * MiB  # the fault struck once
    assert [x.checksum() for x in xs] == sums


def test_a_fault_on_gpu_0_while_gpu_1_is_stalled_undoes_both(dev, node):
    xs = on_both_gpus()
    dev.lock()
    stall = dev.stall("checkpoint", gpu=1, after=1)
    dev.inject_fault("checkpoint", MemoryError("host out of memory"), gpu=0, after=2)
    failed: list[BaseException] = []

    def checkpoint() -> None:
        try:
            dev.checkpoint()
        except BaseException as e:
            failed.append(e)

    worker = threading.Thread(target=checkpoint, daemon=True)
    worker.start()
    assert stall.reached.wait(10)
    stall.release()
    worker.join(10)
    assert [type(e) for e in failed] == [MemoryError], failed
    assert dev.state == LOCKED and dev.on_host() == 0 and all(x._host is None for x in xs)
    assert node.pids() == {LocalBackend(node).pid: {0: 4 * MiB, 1: 4 * MiB}}


def test_resume_on_a_thread_reports_per_gpu_progress_then_its_result(dev):
    xs = on_both_gpus()
    sums = [x.checksum() for x in xs]
    dev.lock()
    dev.checkpoint()
    stall = dev.stall("restore", gpu=1, after=1)
    assert dev.start_resume() == {"plan": {"0": 4 * MiB, "1": 4 * MiB}, "parallel": True}
    assert stall.reached.wait(10)
    assert dev.start_resume()["plan"] == {"0": 4 * MiB, "1": 4 * MiB}  # the same one, joined
    now = dev.resume_step(wait=0)  # joins the one that runs
    assert now["done"] is False and now["bytes"] == 0 and now["progress"]["step"] == "restore"
    assert now["plan"] == {"0": 4 * MiB, "1": 4 * MiB}
    assert now["progress"]["gpus"]["1"] == [2 * MiB, 4 * MiB]  # stalled after its first array
    assert dev.progress_reads == 1
    stall.release()
    end = dev.wait_resume(10)
    assert end["done"] is True and end["bytes"] == 8 * MiB and end["from"] == CHECKPOINTED
    assert sorted(t["gpu"] for t in end["transfers"]) == [0, 1] and end["seconds"] > 0
    assert dev.progress() == {"step": None, "gpus": {}}
    assert [x.checksum() for x in xs] == sums


def test_resume_on_a_thread_without_room_on_one_gpu_says_why_and_moves_nothing(dev, node):
    xs = on_both_gpus()
    dev.lock()
    dev.checkpoint()
    node.alloc(99999, 1, GiB - MiB)
    with pytest.raises(SimOutOfMemoryError, match="GPU 1"):
        dev.resume_step(wait=10)  # the agent's sim_resume: an error answer, as before
    assert dev.state == CHECKPOINTED and node.pids() == {99999: {1: GiB - MiB}}
    assert dev.transfer_log("restore") == []  # refused before any byte moved
    assert dev.on_host() == sum(x.nbytes for x in xs)
    node.release(99999, 1, GiB)
    assert dev.resume_step(wait=10)["bytes"] == sum(x.nbytes for x in xs)


def test_fault_requests_name_a_gpu_only_for_the_copies():
    dev = SimDevice(LocalBackend(SimNode((GiB,))))
    with pytest.raises(ValueError, match="gpu applies to checkpoint and restore only"):
        dev.inject_fault("lock", gpu=0)
    with pytest.raises(ValueError, match="gpu must be a GPU index"):
        dev.stall("restore", gpu=-1)
    with pytest.raises(ValueError, match="wait must be seconds"):
        dev.wait_resume(-1)


def test_the_progress_lines_read_per_gpu():
    assert fraction(int(1.2 * GiB), 4 * GiB) == "1.2/4.0 GiB"
    assert (moving_line({0: 4 * GiB, 1: 4 * GiB}, {0: int(1.2 * GiB), 1: int(0.8 * GiB)}, True)
            == "restoring 2 GPUs in parallel: GPU 0 1.2/4.0 GiB, GPU 1 0.8/4.0 GiB")
    assert moving_line({1: 4 * GiB}, {1: GiB}, False) == "restoring GPU 1: 1.0/4.0 GiB"
    assert (done_line([(0, 4 * GiB, 1.0), (1, 4 * GiB, 0.98)], 8 * GiB, 1.02, True)
            == "restored 2 GPUs in parallel: 8.0 GiB in 1.02 s, 7.8 GiB/s "
               "(GPU 0 4.0 GiB in 1.00 s, GPU 1 4.0 GiB in 0.98 s)")


# -- a real server, a real kernel ---------------------------------------------------------------

def hold_on_both(mib_per_gpu: int = 128, chunk: int = 64) -> str:
    """A cell holding ``mib_per_gpu`` MiB on each of the kernel's GPU 0 and GPU 1, in arrays of
    ``chunk`` MiB of distinct data, with their checksums."""
    n, size = mib_per_gpu // chunk, chunk * MiB // 4
    return (
        "from jupyter_gpushare.sim import simgpu, device as _device\nimport numpy as np\n"
        f"xs = [simgpu.array(np.arange({size}, dtype=np.uint32) * (2 * i + 1), device=i % 2,"
        f" copy=False) for i in range({2 * n})]\n"
        "x_sums = [a.checksum() for a in xs]\n"
        "_dev = _device.get_device()"
    )


INTACT = "assert [a.checksum() for a in xs] == x_sums, 'data changed'\nprint('intact')"

# GPU 1 stops after its first array until the server has read the progress once more, so the
# cell shows a line with GPU 1 part-way, whatever the machine's speed (no timing involved)
STALL_UNTIL_READ = """
import threading, time
_dev.transfer_rate = 256 * 2**20
_stall = _dev.stall("restore", gpu=1, after=1)
def _let_go():
    _stall.reached.wait()
    seen = _dev.progress_reads
    while _dev.progress_reads <= seen:
        time.sleep(0.01)
    _stall.release()
threading.Thread(target=_let_go, daemon=True).start()
"""

TRANSFERS = ("import json\nprint(json.dumps({str(t['gpu']): t for t in "
             "_dev.transfer_log('restore')[-2:]}))")


def progress_texts(ex) -> list[str]:
    return [d["data"]["text/plain"] for d in ex.displays
            if d["data"].get("text/plain", "").startswith("gpushare:")]


async def released_on_both(jp_fetch, kernels, app, extra: str = ""):
    k = await kernels.start()
    await k.run(hold_on_both() + ("\n" + extra if extra else ""))
    await app.poll_once()
    code, body = await rest(jp_fetch, k.id, "release")
    assert code == 200 and body["state"] == "released", body
    assert app.controller.states[k.id].held.gpus == {0: 128 * MiB, 1: 128 * MiB}
    assert app.node.used(0) == app.node.used(1) == 0
    return k


async def test_a_two_gpu_kernel_restores_both_gpus_at_once_and_the_cell_says_per_gpu(
    jp_fetch, kernels, gpushare_app
):
    k = await released_on_both(jp_fetch, kernels, gpushare_app, STALL_UNTIL_READ)
    ex = await k.run(INTACT)
    assert ex.stdout == "intact\n"
    lines = progress_texts(ex)
    assert lines[0] == "gpushare: restoring 256.0 MiB to GPU 0, 1 ..."
    partway = r"gpushare: restoring 2 GPUs in parallel: GPU 0 [\d.]+/128\.0 MiB, GPU 1 64\.0/128\.0 MiB"
    assert any(re.fullmatch(partway, line) for line in lines), lines
    assert re.fullmatch(r"gpushare: restored 2 GPUs in parallel: 256\.0 MiB in \d+\.\d\d s, "
                        r"[\d.]+ [KMG]iB/s \(GPU 0 128\.0 MiB in \d+\.\d\d s, "
                        r"GPU 1 128\.0 MiB in \d+\.\d\d s\)", lines[-2]), lines
    assert re.fullmatch(r"gpushare: restored 256\.0 MiB in \d+\.\d\d s", lines[-1]), lines

    ex = await k.run(TRANSFERS)
    import json

    log = json.loads(ex.stdout)
    assert log["0"]["ok"] and log["1"]["ok"] and log["0"]["bytes"] == log["1"]["bytes"] == 128 * MiB
    assert overlap(log["0"], log["1"]), log  # the two GPUs' copies ran at the same time
    await gpushare_app.poll_once()
    pid = gpushare_app.tracker.kernels[k.id].pids[0]
    assert gpushare_app.node.pids()[pid] == {0: 128 * MiB, 1: 128 * MiB}


async def test_a_fault_on_gpu_1_fails_the_restore_whole_and_a_later_one_succeeds(
    jp_fetch, kernels, gpushare_app, events
):
    fault = "_dev.inject_fault('restore', 'copy engine fault on GPU 1', gpu=1, after=1)"
    k = await released_on_both(jp_fetch, kernels, gpushare_app, fault)
    ex = await k.run(INTACT, ok=False)
    assert ex.status == "error" and "copy engine fault on GPU 1" in ex.error["evalue"]
    assert "still held" in ex.error["evalue"] and "intact" not in ex.stdout
    assert progress_texts(ex)[-1] == ("gpushare: restore failed, your state is still held: "
                                      "copy engine fault on GPU 1")
    assert gpushare_app.node.used(0) == gpushare_app.node.used(1) == 0  # neither GPU restored
    body = await kernel_status(jp_fetch, k.id)
    assert body is not None and "copy engine fault on GPU 1" in body["error"]
    assert gpushare_app.controller.states[k.id].held.gpus == {0: 128 * MiB, 1: 128 * MiB}
    assert [e["action"] for e in events if e["kernel_id"] == k.id][-1] == "restore_failed"

    ex = await k.run(INTACT + "\nprint(_dev.placement()['state'])")  # the fault struck once
    assert ex.stdout == "intact\nrunning\n"
    await gpushare_app.poll_once()
    pid = gpushare_app.tracker.kernels[k.id].pids[0]
    assert gpushare_app.node.pids()[pid] == {0: 128 * MiB, 1: 128 * MiB}


@pytest.mark.parametrize("gpushare_config", [{"simulated_gpus": [GiB, GiB]}])
async def test_no_room_on_gpu_1_holds_the_restore_before_any_byte_lands_on_gpu_0(
    jp_fetch, kernels, gpushare_app
):
    """Room is checked per GPU before anything moves: GPU 0 has room, GPU 1 does not, and the
    restore waits with nothing reserved or landed on GPU 0."""
    k = await released_on_both(jp_fetch, kernels, gpushare_app)
    other = await kernels.start()
    await other.run("from jupyter_gpushare.sim import simgpu\n"
                    "big = simgpu.zeros((960 * 2**20 // 4,), device=1)")
    await gpushare_app.poll_once()
    code, body = await rest(jp_fetch, k.id, "restore")
    assert code == 202 and "on GPU 1" in body["waiting"] and "GPU 0" not in body["waiting"], body
    assert gpushare_app.node.used(0) == 0
    assert gpushare_app.controller.reservations.snapshot() == {}
    await other.run("del big")
    await wait_for(lambda: gpushare_app.controller.states[k.id].state in ("active", "idle"),
                   what="the restore once GPU 1 has room")
    ex = await k.run(INTACT)
    assert ex.stdout == "intact\n"
