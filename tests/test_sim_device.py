"""The simulated GPU's checkpoint state machine, held to the CUDA driver's rules (the same
transitions as tests/fakes/fake_checkpoint.py), its all-or-nothing moves under injected
faults, resume(), and what it tells about GPU work outside cells.

Unit tests run a fresh SimDevice on a private node, installed as the process's device so
``simgpu`` arrays live on it; one end-to-end test injects a fault from a cell of a real
kernel."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from tornado.httpclient import HTTPClientError

from jupyter_gpushare.sim import device as device_module
from jupyter_gpushare.sim import simgpu
from jupyter_gpushare.sim.device import (
    CHECKPOINTED,
    FAILED,
    LOCKED,
    RUNNING,
    STEPS,
    InjectedFault,
    LocalBackend,
    SimCheckpointError,
    SimDevice,
)
from jupyter_gpushare.sim.node import GiB, SimNode, SimOutOfMemoryError

from .fakes.fake_checkpoint import _TRANSITIONS as DRIVER_TRANSITIONS
from .helpers import kernel_status

MiB = 1 << 20


@pytest.fixture
def node() -> SimNode:
    return SimNode((GiB, GiB))


@pytest.fixture
def dev(node, monkeypatch) -> SimDevice:
    """A fresh simulated GPU on ``node``, the one ``simgpu`` uses during the test."""
    device = SimDevice(LocalBackend(node))
    monkeypatch.setattr(device_module, "_device", device)
    yield device
    device.clear_faults()
    if device.state in (LOCKED, CHECKPOINTED):
        device.resume()  # never leave a thread of a failed test blocked


def arrays(n: int = 6) -> list[simgpu.SimArray]:
    """``n`` arrays of distinct data, alternating between GPU 0 and GPU 1."""
    return [simgpu.array(np.arange(1000, dtype=np.uint32) * (i + 1), device=i % 2) for i in range(n)]


def until(predicate: Callable[[], object], timeout: float = 10.0) -> None:
    """Wait for a condition another thread brings about (never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


def in_background(target: Callable[[], object], name: str = "worker") -> threading.Thread:
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def put_in(dev: SimDevice, state: str) -> None:
    """Drive the device to ``state`` through legal steps."""
    path = {RUNNING: [], LOCKED: [dev.lock], CHECKPOINTED: [dev.lock, dev.checkpoint]}[state]
    for step in path:
        step()
    assert dev.state == state


# -- the driver's state machine -----------------------------------------------------------


@pytest.mark.parametrize("start", [RUNNING, LOCKED, CHECKPOINTED])
@pytest.mark.parametrize("step", STEPS)
def test_every_step_in_every_state_does_what_the_driver_does(node, monkeypatch, start, step):
    dev = SimDevice(LocalBackend(node))
    monkeypatch.setattr(device_module, "_device", dev)
    kept = arrays(2)
    put_in(dev, start)
    before, after = DRIVER_TRANSITIONS[step]
    call = getattr(dev, step)
    if start == before:
        call()
        assert dev.state == after
    else:
        with pytest.raises(SimCheckpointError, match=f"cannot {step}: process is {start}"):
            call()
        assert dev.state == start  # a call in the wrong state changes nothing
    assert dev.held() == {0: kept[0].nbytes, 1: kept[1].nbytes}
    dev.resume()
    assert [a.get()[1] for a in kept] == [1, 2]


def test_a_full_cycle_moves_the_bytes_off_the_node_and_back(dev, node):
    xs = arrays()
    sums = [x.checksum() for x in xs]
    used = node.pids()
    dev.lock()
    moved = dev.checkpoint()
    assert moved == {"bytes": 6 * 4000, "arrays": 6, "gpus": {"0": 12000, "1": 12000},
                     "copied": 6 * 4000}
    assert node.pids() == {} and dev.allocated() == 0 and dev.on_host() == 24000
    assert dev.placement() == {
        "state": CHECKPOINTED, "device": {}, "host": {"0": 12000, "1": 12000}, "waiting_calls": 0,
    }
    assert dev.restore() == {k: v for k, v in moved.items() if k != "copied"}
    assert dev.state == LOCKED and node.pids() == used
    dev.unlock()
    assert [x.checksum() for x in xs] == sums


def test_an_ask_that_comes_after_the_resume_ended_gets_its_end(dev, node):
    """The server asks again (``sim_resume``) 0.5 s after its first ask while the copy runs;
    when the resume ends between the two asks, the second is its end, not a new resume of a
    running device (which refused the GPU mapping: a move that had landed was reported failed,
    seen in the twin's multi-GPU run). Once told, the next ask is a new resume."""
    xs = arrays(4)
    sums = [x.checksum() for x in xs]
    dev.lock()
    dev.checkpoint()
    stall = dev.stall("restore", gpu=1, after=1)
    first = dev.resume_step({0: 1, 1: 0}, wait=0)
    assert first["done"] is False and stall.reached.wait(10)
    stall.release()
    assert dev._job is not None and dev._job.done.wait(10)  # ended; nobody told yet
    end = dev.resume_step({0: 1, 1: 0}, wait=0)
    assert end["done"] is True and end["from"] == CHECKPOINTED and end["arrays"] == 4
    assert dev.remap == {0: 1, 1: 0} and [x.checksum() for x in xs] == sums
    with pytest.raises(SimCheckpointError, match="process is running"):
        dev.resume_step({0: 1, 1: 0}, wait=10)
    assert dev.resume_step(wait=10)["from"] == RUNNING  # nothing to do, said so

    # a failure that ends between two asks is the second ask's answer, not a new resume's
    dev.lock()
    dev.checkpoint()
    dev.inject_fault("restore", "copy engine fault", after=1)
    stall = dev.stall("restore")
    assert dev.resume_step(wait=0)["done"] is False and stall.reached.wait(10)
    stall.release()
    assert dev._job is not None and dev._job.done.wait(10)
    with pytest.raises(InjectedFault, match="copy engine fault"):
        dev.resume_step(wait=0)
    assert dev.state == CHECKPOINTED
    assert dev.resume_step(wait=10)["from"] == CHECKPOINTED  # told: the next ask restores
    assert [x.checksum() for x in xs] == sums


def test_a_lock_that_times_out_leaves_the_device_running(dev):
    x = simgpu.ones(10)
    release = threading.Event()

    def long_gpu_call():
        with dev.op():
            release.wait(10)

    worker = in_background(long_gpu_call)
    until(lambda: dev._inflight == 1)
    with pytest.raises(TimeoutError, match="GPU work still running after the lock timeout"):
        dev.lock(timeout=0.05)
    assert dev.state == RUNNING
    assert float(x.sum().get()) == 10.0  # GPU calls go on
    release.set()
    worker.join(10)
    dev.lock(timeout=10)  # nothing running now
    assert dev.state == LOCKED


def test_gpu_calls_wait_while_not_running_and_go_on_after(dev):
    x = simgpu.ones(4)
    dev.lock()
    dev.checkpoint()
    got: list[float] = []
    worker = in_background(lambda: got.append(float(x.sum().get())))
    until(lambda: dev.waiting_calls() == 1)
    assert worker.is_alive() and got == []
    dev.restore()
    assert dev.waiting_calls() == 1  # restored but still locked: still waits
    dev.unlock()
    worker.join(10)
    assert got == [4.0] and dev.waiting_calls() == 0


# -- all or nothing ---------------------------------------------------------------------


def test_a_checkpoint_failing_after_half_the_arrays_leaves_everything_on_the_device(dev, node):
    xs = arrays(6)
    sums = [x.checksum() for x in xs]
    values = [x._dev.copy() for x in xs]
    used = node.pids()
    dev.lock()
    dev.inject_fault("checkpoint", MemoryError("host out of memory"), after=3)
    with pytest.raises(MemoryError, match="host out of memory"):
        dev.checkpoint()
    assert dev.state == LOCKED  # like the driver: the failed checkpoint left it locked
    for x, value in zip(xs, values, strict=True):
        assert x._host is None and np.array_equal(x._dev, value)  # on the device, same bytes
    assert node.pids() == used and dev.allocated() == 24000 and dev.on_host() == 0

    dev.unlock()  # the server's undo of a failed release
    assert [x.checksum() for x in xs] == sums
    dev.lock()
    assert dev.checkpoint()["arrays"] == 6  # the fault struck once


def test_a_restore_failing_after_half_the_arrays_leaves_everything_checkpointed(dev, node):
    xs = arrays(6)
    sums = [x.checksum() for x in xs]
    dev.lock()
    dev.checkpoint()
    values = [x._host.copy() for x in xs]
    dev.inject_fault("restore", after=3)
    with pytest.raises(InjectedFault, match="injected fault in restore"):
        dev.restore()
    assert dev.state == CHECKPOINTED
    for x, value in zip(xs, values, strict=True):
        assert x._dev is None and np.array_equal(x._host, value)  # in host memory, same bytes
    assert node.pids() == {}  # the device memory the restore had taken is back
    assert dev.placement()["host"] == {"0": 12000, "1": 12000}

    assert dev.restore()["bytes"] == 24000
    dev.unlock()
    assert [x.checksum() for x in xs] == sums


def test_a_restore_without_room_on_one_gpu_takes_nothing_on_the_other(dev, node):
    xs = arrays(4)
    dev.lock()
    dev.checkpoint()
    node.alloc(99999, 1, GiB - 100)  # another process takes GPU 1
    with pytest.raises(SimOutOfMemoryError):
        dev.restore()
    assert dev.state == CHECKPOINTED and node.pids() == {99999: {1: GiB - 100}}
    node.release(99999, 1, GiB)
    assert dev.resume()["bytes"] == sum(x.nbytes for x in xs)


# -- restore onto other GPUs ------------------------------------------------------------------

def checkpointed_on_gpu0(dev: SimDevice, n: int = 3) -> tuple[list[simgpu.SimArray], list[int]]:
    """``n`` arrays on the process's device 0 (GPU 0), and their checksums; checkpointed."""
    xs = [simgpu.array(np.arange(1000, dtype=np.uint32) * (i + 1), device=0) for i in range(n)]
    sums = [x.checksum() for x in xs]
    dev.lock()
    dev.checkpoint()
    return xs, sums


def test_a_moved_restore_brings_the_arrays_back_on_the_target_gpu(dev, node):
    xs, sums = checkpointed_on_gpu0(dev)
    back = dev.resume(gpu_mapping={0: 1})
    assert back == {"from": CHECKPOINTED, "bytes": 12000, "arrays": 3, "gpus": {"1": 12000}}
    assert dev.state == RUNNING and node.pids() == {node_pid(dev): {1: 12000}}
    assert dev.held() == {1: 12000} and dev.allocated(0) == 0 and dev.allocated(1) == 12000
    assert dev.placement()["device"] == {"1": 12000}
    assert [x.checksum() for x in xs] == sums
    assert all(x.device == 0 for x in xs)  # still the process's device 0, now physical GPU 1

    later = simgpu.ones(10, device=0)  # the process's device 0 is GPU 1 from now on
    assert dev.remap == {0: 1} and dev.physical(0) == 1
    assert node.pids()[node_pid(dev)] == {1: 12000 + later.nbytes}
    assert simgpu.memory_allocated(0) == 12000 + later.nbytes

    dev.lock()
    dev.checkpoint()
    assert dev.resume()["gpus"] == {"1": 12000 + later.nbytes}  # plain: back where it was


def node_pid(dev: SimDevice) -> int:
    backend = dev.backend
    assert isinstance(backend, LocalBackend)
    return backend.pid


def test_moves_compose_with_the_visible_devices(node, monkeypatch):
    dev = SimDevice(LocalBackend(node), visible="1")  # its device 0 is the node's GPU 1
    monkeypatch.setattr(device_module, "_device", dev)
    x = simgpu.array(np.arange(500, dtype=np.uint32), device=0)
    total = x.checksum()
    for onto, remap in [({1: 0}, {1: 0}), ({0: 1}, {})]:
        dev.lock()
        dev.checkpoint()
        dev.resume(gpu_mapping=onto)
        assert dev.remap == remap and dev.visible() == [dev.physical(0)]
        assert dev.held() == {dev.physical(0): 2000} and x.checksum() == total
    assert dev.physical(0) == 1


def test_a_moved_restore_without_room_changes_nothing(dev, node):
    xs, sums = checkpointed_on_gpu0(dev)
    node.alloc(99999, 1, GiB - 100)  # another process takes GPU 1
    before = dev.placement()
    with pytest.raises(SimOutOfMemoryError):
        dev.resume(gpu_mapping={0: 1})
    assert dev.state == CHECKPOINTED and dev.placement() == before and dev.remap == {}
    assert dev.held() == {0: 12000} and node.pids() == {99999: {1: GiB - 100}}
    assert dev.resume()["gpus"] == {"0": 12000}  # back where it was, data intact
    assert [x.checksum() for x in xs] == sums


def test_a_moved_restore_failing_in_the_copy_changes_nothing(dev, node):
    xs, _ = checkpointed_on_gpu0(dev)
    dev.inject_fault("restore", after=2)
    with pytest.raises(InjectedFault):
        dev.resume(gpu_mapping={0: 1})
    assert dev.state == CHECKPOINTED and dev.held() == {0: 12000} and dev.remap == {}
    assert node.pids() == {} and all(x._dev is None for x in xs)


@pytest.mark.parametrize("start", [RUNNING, LOCKED])
def test_a_mapping_is_refused_unless_checkpointed(dev, node, start):
    simgpu.ones(10, device=0)
    put_in(dev, start)
    used = node.pids()
    with pytest.raises(SimCheckpointError, match=f"cannot restore onto other GPUs: process is {start}"):
        dev.resume(gpu_mapping={0: 1})
    assert dev.state == start and node.pids() == used and dev.remap == {}
    assert dev.resume(gpu_mapping={0: 0})["from"] == start  # a GPU onto itself moves nothing


@pytest.mark.parametrize("mapping, error", [
    ({0: 2}, "gpu_mapping: 2 is not a GPU of this node (it has 2 simulated GPUs)"),
    ({-1: 0}, "gpu_mapping: -1 is not a GPU of this node"),
    ({True: 1}, "gpu_mapping: True is not a GPU of this node"),
    ({0: 1, 1: 1}, "gpu_mapping: GPU 1 is named twice as a target"),
])
def test_a_bad_mapping_is_refused_and_changes_nothing(dev, node, mapping, error):
    xs, _ = checkpointed_on_gpu0(dev)  # kept alive: collected arrays free their bytes
    with pytest.raises(ValueError, match=re.escape(error)):
        dev.resume(gpu_mapping=mapping)
    assert dev.state == CHECKPOINTED and dev.held() == {0: 12000} and node.pids() == {}
    assert all(x._dev is None for x in xs)


def test_a_wedging_fault_leaves_the_driver_failed_state(dev):
    x = simgpu.ones(4)
    dev.lock()
    dev.checkpoint()
    dev.inject_fault("restore", "restore without room", wedge=True)
    with pytest.raises(InjectedFault):
        dev.restore()
    assert dev.state == FAILED
    for step in STEPS:
        with pytest.raises(SimCheckpointError, match="process is failed"):
            getattr(dev, step)()
    with pytest.raises(SimCheckpointError, match="restart the kernel"):
        dev.resume()
    with pytest.raises(SimCheckpointError, match="failed checkpoint state"):
        x.get()


def test_fault_and_stall_requests_are_checked():
    dev = SimDevice(LocalBackend(SimNode((GiB,))))
    with pytest.raises(ValueError, match="step must be one of"):
        dev.inject_fault("suspend")
    with pytest.raises(ValueError, match="checkpoint and restore only"):
        dev.inject_fault("lock", after=2)
    with pytest.raises(ValueError, match="count of arrays"):
        dev.stall("restore", after=-1)
    with pytest.raises(ValueError, match="seconds"):
        dev.stall("restore", seconds=-1)
    with pytest.raises(TypeError, match="exception or a message"):
        dev.inject_fault("lock", 42)  # type: ignore[arg-type]
    dev.lock()
    assert dev.state == LOCKED  # nothing was armed by the refused requests


# -- stalls and resume ------------------------------------------------------------------


def test_a_stalled_checkpoint_shows_the_true_state_until_it_commits(dev, node):
    xs = arrays(4)
    dev.lock()
    stall = dev.stall("checkpoint", after=2)
    worker = in_background(dev.checkpoint)
    assert stall.reached.wait(10)
    assert dev.placement()["state"] == LOCKED  # halfway copied, nothing committed
    assert dev.allocated() == sum(x.nbytes for x in xs) and node.pids()
    assert [x._dev is None for x in xs] == [True, True, False, False]  # two copied so far
    stall.release()
    worker.join(10)
    assert dev.state == CHECKPOINTED and node.pids() == {}


def test_resume_from_every_state(dev, node):
    xs = arrays(2)
    sums = [x.checksum() for x in xs]
    assert dev.resume() == {"from": RUNNING, "bytes": 0, "arrays": 0, "gpus": {}}
    dev.lock()
    assert dev.resume()["from"] == LOCKED and dev.state == RUNNING
    dev.lock()
    dev.checkpoint()
    back = dev.resume()
    assert back == {"from": CHECKPOINTED, "bytes": 8000, "arrays": 2, "gpus": {"0": 4000, "1": 4000}}
    assert dev.state == RUNNING and [x.checksum() for x in xs] == sums
    dev.lock()
    dev.checkpoint()
    dev.restore()  # restored, not unlocked (an operation interrupted between the two)
    assert dev.resume()["from"] == LOCKED and dev.state == RUNNING


def test_resume_recovers_a_lock_that_ran_after_its_caller_gave_up(dev):
    x = simgpu.ones(3)
    stall = dev.stall("lock")
    late_lock = in_background(dev.lock, name="agent-handler")
    assert stall.reached.wait(10)  # the server's timeout expires here; it gives up
    assert dev.state == RUNNING
    stall.release()
    late_lock.join(10)
    assert dev.state == LOCKED  # the kernel would be wedged: every GPU call waits
    assert dev.resume()["from"] == LOCKED
    assert float(x.sum().get()) == 3.0


def test_a_stall_for_seconds_ends_by_itself(dev):
    dev.stall("unlock", seconds=0.01)
    dev.lock()
    dev.unlock()
    assert dev.state == RUNNING


# -- GPU work outside cells -------------------------------------------------------------


def test_background_users_names_live_threads_other_than_the_main_one(dev):
    x = simgpu.ones(8)
    x.sum()  # the main thread: never listed
    assert dev.background_users() == []
    stop = threading.Event()

    def serve():
        x.sum()
        stop.wait(10)

    server = in_background(serve, name="model-server")
    until(lambda: dev.background_users() == ["model-server"])
    stop.set()
    server.join(10)
    assert dev.background_users() == []


def test_a_blocked_background_thread_asks_once_and_runs_after_the_restore(dev):
    x = simgpu.array(np.arange(5.0))
    asked: list[tuple[str, str]] = []

    def ask_for_restore(thread_name: str) -> None:  # what the agent does: ask the server
        asked.append((thread_name, dev.state))
        dev.resume()

    dev.on_blocked = ask_for_restore
    dev.lock()
    dev.checkpoint()
    got: list[float] = []
    loader = in_background(lambda: got.append(float(x.sum().get())), name="data-loader")
    loader.join(10)
    assert got == [10.0]
    assert asked == [("data-loader", CHECKPOINTED)]
    assert dev.state == RUNNING


def test_a_failing_hook_does_not_stop_the_wait(dev):
    x = simgpu.ones(2)
    dev.on_blocked = lambda name: 1 / 0
    dev.lock()
    got: list[float] = []
    worker = in_background(lambda: got.append(float(x.sum().get())))
    until(lambda: dev.waiting_calls() == 1)
    dev.unlock()
    worker.join(10)
    assert got == [2.0]


def test_the_main_thread_waits_without_calling_the_hook(dev):
    x = simgpu.ones(2)
    asked: list[str] = []
    dev.on_blocked = asked.append
    dev.lock()
    unlocker = in_background(lambda: (until(lambda: dev.waiting_calls() == 1), dev.unlock()))
    assert float(x.sum().get()) == 2.0  # blocked in the main thread until unlocked
    unlocker.join(10)
    assert asked == []


# -- from a cell of a real kernel -----------------------------------------------------------

HOLD = """
from jupyter_gpushare.sim import device, simgpu
import numpy as np
xs = [simgpu.array(np.arange(1 << 18, dtype=np.uint32) * (i + 1), device=0) for i in range(4)]
sums = [x.checksum() for x in xs]
"""


async def test_a_checkpoint_fault_injected_from_a_cell_fails_the_release_and_keeps_the_data(
    jp_fetch, kernels, gpushare_app
):
    k = await kernels.start()
    await k.run(HOLD + "device.get_device().inject_fault('checkpoint', 'disk on fire', after=2)")
    await gpushare_app.poll_once()
    used = gpushare_app.node.used(0)
    assert used == 4 * MiB
    with pytest.raises(HTTPClientError) as refused:
        await jp_fetch("api", "gpushare", "kernels", k.id, "release", method="POST", body=b"")
    assert refused.value.code == 409 and "disk on fire" in refused.value.response.body.decode()
    assert gpushare_app.node.used(0) == used  # nothing left the GPU
    ex = await k.run(
        "assert [x.checksum() for x in xs] == sums\n"
        "print(device.get_device().placement()['state'], device.get_device().background_users())"
    )
    assert ex.stdout.strip() == "running []"  # cells run on the main thread: not background

    await jp_fetch("api", "gpushare", "kernels", k.id, "release", method="POST", body=b"")
    assert (await kernel_status(jp_fetch, k.id))["state"] == "released"
    assert gpushare_app.node.used(0) == 0
    ex = await k.run("assert [x.checksum() for x in xs] == sums\nprint('same data')")
    assert "same data" in ex.stdout
