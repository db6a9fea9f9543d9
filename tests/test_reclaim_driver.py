"""DriverMethod against a fake cuda.core Process (real thing: tests/gpu/test_driver_gpu.py)."""

from __future__ import annotations

import asyncio
import logging
import re
import sys

import pytest

from jupyter_gpushare.reclaim.base import KernelTarget, ReclaimError, ReclaimMethod
from jupyter_gpushare.reclaim.driver import (
    DriverMethod,
    checkpoint_uuid,
    complete_mapping,
    driver_support,
)
from jupyter_gpushare.reclaim.framework import FrameworkMethod
from jupyter_gpushare.reclaim.simulated import SimulatedMethod
from jupyter_gpushare.telemetry.nvml import NVMLProbe
from tests.fakes import fake_pynvml as fp
from tests.fakes.fake_checkpoint import FakeCheckpointDriver, install_fake_cuda_core

GiB = 1 << 30


def run(coro):
    return asyncio.run(coro)


class FakeAgent:
    def __init__(self, fail: Exception | None = None, order: list[str] | None = None) -> None:
        self.requests: list[tuple[str, float | None]] = []
        self.fail = fail
        self.order = order

    async def request(self, op, timeout=None, **args):
        self.requests.append((op, timeout))
        if self.order is not None:
            self.order.append(f"agent {op}")
        if self.fail:
            raise self.fail
        return {"ok": True}


class Room:
    """free_bytes callable: free memory per GPU, None = unknown; records what was asked."""

    def __init__(self, **free: int | None) -> None:
        self.free = {int(k[3:]): v for k, v in free.items()}  # gpu0=..., gpu1=...
        self.asked: list[int] = []

    def __call__(self, gpu: int) -> int | None:
        self.asked.append(gpu)
        return self.free.get(gpu)


@pytest.fixture
def drv():
    return FakeCheckpointDriver()


def method(drv, room=None, **kw):
    return DriverMethod(room or Room(gpu0=80 * GiB, gpu1=80 * GiB), process_factory=drv.process, **kw)


def one_pid(agent=None):
    return KernelTarget("k1", pids=[1234], gpu_bytes={0: 4 * GiB}, agent=agent)


def two_pids(agent=None, per_pid=True):
    pid_bytes = {1234: {0: 3 * GiB}, 5678: {1: 1 * GiB}} if per_pid else {}
    return KernelTarget("k2", pids=[1234, 5678], gpu_bytes={0: 3 * GiB, 1: 1 * GiB},
                        agent=agent, pid_bytes=pid_bytes)


# -- happy paths ----------------------------------------------------------------------------

def test_release_restore_one_pid(drv):
    m = method(drv, lock_timeout_ms=2500)
    lines: list[str] = []
    res = run(m.release(one_pid(), progress=lines.append))
    assert drv.steps() == ["lock 1234", "checkpoint 1234"]
    assert drv.lock_timeouts == [2500]
    assert drv.states[1234] == "checkpointed"
    assert res.bytes == 4 * GiB and res.detail == "1 pid checkpointed" and res.seconds >= 0
    assert lines == ["locking pid 1234", "checkpointing pid 1234 (4.0 GiB)"]

    lines.clear()
    res = run(m.restore(one_pid(), progress=lines.append))
    assert drv.steps()[2:] == ["restore 1234", "unlock 1234"]
    assert drv.states[1234] == "running"
    assert drv.gpu_mappings == [None]  # back onto the same GPUs
    assert res.bytes == 4 * GiB and res.detail == "1 pid restored"
    assert lines == ["restoring pid 1234 (4.0 GiB) to GPU 0"]


def test_two_pids_lock_all_before_checkpoint(drv):
    m = method(drv)
    run(m.release(two_pids()))
    assert drv.steps() == ["lock 1234", "lock 5678", "checkpoint 1234", "checkpoint 5678"]
    run(m.restore(two_pids()))
    assert drv.steps()[4:] == ["restore 1234", "unlock 1234", "restore 5678", "unlock 5678"]
    assert set(drv.states.values()) == {"running"}


def test_trim_requested_first_and_async_progress(drv):
    order: list[str] = []
    agent = FakeAgent(order=order)

    async def progress(msg):
        order.append(msg)

    run(method(drv).release(one_pid(agent), progress=progress))
    assert agent.requests == [("trim", 30)]
    assert order == [
        "asking the kernel to trim its GPU caches",
        "agent trim",
        "locking pid 1234",
        "checkpointing pid 1234 (4.0 GiB)",
    ]
    assert drv.steps() == ["lock 1234", "checkpoint 1234"]


def test_trim_failure_does_not_stop_release(drv, caplog):
    agent = FakeAgent(fail=TimeoutError("agent did not answer"))
    caplog.set_level(logging.INFO, logger="jupyter_gpushare.reclaim.driver")
    run(method(drv).release(one_pid(agent)))
    assert drv.states[1234] == "checkpointed"
    assert "agent did not answer" in caplog.text


# -- release failures -----------------------------------------------------------------------

def test_lock_timeout_unlocks_the_others(drv):
    drv.fail("lock", 5678, "CUDA_ERROR_NOT_READY: timed out")
    with pytest.raises(ReclaimError) as ei:
        run(method(drv).release(two_pids()))
    msg = str(ei.value)
    assert "lock of pid 5678 failed" in msg and "CUDA_ERROR_NOT_READY" in msg
    assert "the kernel runs as before" in msg
    # nothing was checkpointed; the pid already locked is unlocked again
    assert drv.steps() == ["lock 1234", "lock 5678", "unlock 1234"]
    assert set(drv.states.values()) == {"running"}


def test_checkpoint_failure_rolls_back(drv):
    drv.fail("checkpoint", 5678, "CUDA_ERROR_NOT_SUPPORTED: UVM memory")
    room = Room(gpu0=80 * GiB, gpu1=80 * GiB)
    with pytest.raises(ReclaimError) as ei:
        run(method(drv, room).release(two_pids()))
    msg = str(ei.value)
    assert "checkpoint of pid 5678 failed: CUDA_ERROR_NOT_SUPPORTED: UVM memory" in msg
    assert "the kernel runs as before" in msg
    assert drv.steps() == [
        "lock 1234", "lock 5678", "checkpoint 1234", "checkpoint 5678",
        "unlock 5678", "restore 1234", "unlock 1234",
    ]
    assert set(drv.states.values()) == {"running"}
    assert room.asked == [0]  # room checked before the rollback restore of pid 1234


def test_rollback_never_restores_without_room(drv, caplog):
    drv.fail("checkpoint", 5678, "boom")
    room = Room(gpu0=1 * GiB, gpu1=80 * GiB)  # someone took GPU 0 meanwhile
    with pytest.raises(ReclaimError) as ei:
        run(method(drv, room).release(two_pids()))
    assert "pid 1234 stays checkpointed" in str(ei.value)
    assert "restore 1234" not in drv.steps()
    assert drv.states == {1234: "checkpointed", 5678: "running"}
    assert "rollback" in caplog.text


def test_failed_state_refused_before_anything(drv):
    drv.process(1234)
    drv.states[1234] = "failed"
    with pytest.raises(ReclaimError, match="failed checkpoint state"):
        run(method(drv).release(one_pid()))
    assert drv.calls == []


def test_release_with_no_pid_refused(drv):
    with pytest.raises(ReclaimError, match="no local process"):
        run(method(drv).release(KernelTarget("k", pids=[], gpu_bytes={})))


def test_factory_error_becomes_reclaim_error():
    def factory(pid):
        raise RuntimeError("CUDA checkpointing is not supported by the installed NVIDIA driver")

    m = DriverMethod(lambda gpu: 80 * GiB, process_factory=factory)
    with pytest.raises(ReclaimError, match=r"pid 1234: cannot open .* not supported"):
        run(m.release(one_pid()))


# -- restore failures -----------------------------------------------------------------------

def released(drv, target, room=None):
    m = method(drv, room)
    run(m.release(target))
    drv.calls.clear()
    return m


def test_restore_refused_without_room_never_calls_restore(drv):
    room = Room(gpu0=2 * GiB, gpu1=80 * GiB)
    m = released(drv, one_pid(), room)
    with pytest.raises(ReclaimError) as ei:
        run(m.restore(one_pid()))
    assert "GPU 0 has 2.0 GiB free, 4.0 GiB needed" in str(ei.value)
    assert drv.calls == [] and drv.states[1234] == "checkpointed"


def test_restore_refused_when_free_memory_unknown(drv):
    room = Room(gpu0=None)
    m = released(drv, one_pid(), room)
    with pytest.raises(ReclaimError, match="unknown"):
        run(m.restore(one_pid()))
    assert drv.calls == []


def test_margin_counts(drv):
    room = Room(gpu0=4 * GiB + 10)
    m = DriverMethod(room, process_factory=drv.process, margin_bytes=1 << 20)
    run(m.release(one_pid()))
    with pytest.raises(ReclaimError, match="needed"):
        run(m.restore(one_pid()))
    room.free[0] = 5 * GiB
    run(m.restore(one_pid()))
    assert drv.states[1234] == "running"


def test_restore_checks_every_gpu_before_any_restore(drv):
    room = Room(gpu0=80 * GiB, gpu1=512 << 20)  # GPU 1 short for pid 5678
    m = released(drv, two_pids(), room)
    with pytest.raises(ReclaimError, match=r"GPU 1 has 512 MiB free, 1\.0 GiB needed"):
        run(m.restore(two_pids()))
    assert drv.calls == []


def test_restore_failure_leaves_others_checkpointed_then_retry(drv):
    m = released(drv, two_pids())
    drv.fail("restore", 1234, "CUDA_ERROR_ILLEGAL_STATE: something odd")
    with pytest.raises(ReclaimError) as ei:
        run(m.restore(two_pids()))
    msg = str(ei.value)
    assert "restore of pid 1234 failed" in msg and "still held" in msg
    assert "pids 5678 stay checkpointed" in msg
    assert drv.steps() == ["restore 1234"]
    assert drv.states == {1234: "checkpointed", 5678: "checkpointed"}
    # a retry finishes the job
    run(m.restore(two_pids()))
    assert set(drv.states.values()) == {"running"}


def test_partial_restore_retry_skips_running_pids(drv):
    m = released(drv, two_pids())
    drv.fail("restore", 5678, "transient")
    with pytest.raises(ReclaimError):
        run(m.restore(two_pids()))
    assert drv.states == {1234: "running", 5678: "checkpointed"}
    drv.calls.clear()
    res = run(m.restore(two_pids()))
    assert drv.steps() == ["restore 5678", "unlock 5678"]
    assert res.bytes == 1 * GiB  # only pid 5678's bytes came back this time


def test_unlock_failure_then_retry_only_unlocks(drv):
    m = released(drv, one_pid())
    drv.fail("unlock", 1234, "CUDA_ERROR_UNKNOWN")
    with pytest.raises(ReclaimError, match="unlock of pid 1234 failed: CUDA_ERROR_UNKNOWN"):
        run(m.restore(one_pid()))
    assert drv.states[1234] == "locked"  # restored, still locked
    drv.calls.clear()
    run(m.restore(one_pid()))
    assert drv.steps() == ["unlock 1234"]
    assert drv.states[1234] == "running"


def test_restore_refuses_failed_state(drv):
    m = released(drv, one_pid())
    drv.states[1234] = "failed"
    with pytest.raises(ReclaimError, match="cannot be restored"):
        run(m.restore(one_pid()))
    assert drv.calls == []


# -- restore is also the way back from a half-done release ------------------------------------

def test_restore_unlocks_a_pid_left_locked_without_restoring_it(drv):
    """A release that failed after its lock landed (e.g. a lock that ran late) leaves the pid
    locked: restore reads that and only unlocks; the memory never left."""
    drv.process(1234).lock(0)
    drv.process(5678)
    drv.calls.clear()
    res = run(method(drv).restore(two_pids()))
    assert drv.steps() == ["unlock 1234"]  # 5678 was running: nothing to do
    assert res.bytes == 0 and drv.states == {1234: "running", 5678: "running"}


def test_restore_finishes_what_a_partial_restore_left(drv):
    m = released(drv, two_pids())
    drv.fail("restore", 5678, "CUDA_ERROR_OUT_OF_MEMORY")
    with pytest.raises(ReclaimError, match="restore of pid 5678 failed") as e:
        run(m.restore(two_pids()))
    assert e.value.retryable and not e.value.resident
    assert drv.states == {1234: "running", 5678: "checkpointed"}
    drv.calls.clear()
    run(m.restore(two_pids()))
    assert drv.steps() == ["restore 5678", "unlock 5678"]
    assert drv.states == {1234: "running", 5678: "running"}


def test_a_hung_driver_call_ends_the_operation_with_the_reason(drv):
    """A driver call that never returns: the operation fails after call_timeout, saying so,
    and does not claim the kernel runs (the call may still land)."""
    import threading

    gate = threading.Event()
    m = method(drv, call_timeout=0.2)
    real = drv.process

    class Stuck:
        def __init__(self, pid):
            self._p = real(pid)

        def __getattr__(self, name):
            return getattr(self._p, name)

        def checkpoint(self):
            gate.wait(1)
            self._p.checkpoint()

    m._factory = Stuck
    with pytest.raises(ReclaimError, match=r"checkpoint of pid 1234 did not return in 0\.2 s") as e:
        run(m.release(one_pid()))
    assert not e.value.resident
    gate.set()


# -- restore onto other GPUs ----------------------------------------------------------------

UUIDS = {g: f"GPU-{g:08x}-1111-2222-3333-4444{g:08x}" for g in range(3)}  # NVML's form


def bare(gpu: int) -> str:
    """The UUID of GPU ``gpu`` as cuda-core takes it: no "GPU-" prefix."""
    return UUIDS[gpu][4:]


def mover(drv, room=None, driver="580.82.07", uuids=UUIDS):
    m = method(drv, room or Room(gpu0=80 * GiB, gpu1=80 * GiB, gpu2=80 * GiB),
               probe=probe_ok(driver_version=driver), gpu_uuids=lambda: dict(uuids))
    run(m.release(one_pid()))
    m.free_bytes.asked.clear()
    drv.calls.clear()
    return m


def moving(target, mapping):
    target.gpu_mapping = mapping
    return target


def test_a_move_is_completed_to_a_permutation_of_every_gpu_by_uuid(drv):
    m = mover(drv)
    lines: list[str] = []
    res = run(m.restore(moving(one_pid(), {0: 1}), progress=lines.append))
    assert drv.gpu_mappings == [{bare(0): bare(1), bare(1): bare(0), bare(2): bare(2)}]
    assert drv.steps() == ["restore 1234", "unlock 1234"] and drv.states[1234] == "running"
    assert m.free_bytes.asked == [1]  # room on the GPU it lands on
    assert lines == ["restoring pid 1234 (4.0 GiB) to GPU 1"]
    assert res.bytes == 4 * GiB


def test_a_chain_of_moves_closes_into_a_cycle_for_every_pid(drv):
    m = method(drv, Room(gpu0=80 * GiB, gpu1=80 * GiB, gpu2=80 * GiB), probe=probe_ok(),
               gpu_uuids=lambda: dict(UUIDS))
    run(m.release(two_pids()))
    m.free_bytes.asked.clear()
    run(m.restore(moving(two_pids(), {0: 1, 1: 2})))
    cycle = {bare(0): bare(1), bare(1): bare(2), bare(2): bare(0)}
    assert drv.gpu_mappings == [cycle, cycle]
    assert sorted(m.free_bytes.asked) == [1, 2]


def test_a_rollback_and_a_restore_onto_the_same_gpus_pass_no_mapping(drv):
    m = method(drv, probe=probe_ok(), gpu_uuids=lambda: dict(UUIDS))
    drv.fail("checkpoint", 5678, "CUDA_ERROR_OUT_OF_MEMORY")
    with pytest.raises(ReclaimError, match="the kernel runs as before"):
        run(m.release(moving(two_pids(), {0: 2, 1: 0})))  # a release never moves
    assert drv.gpu_mappings == [None]  # the rollback's restore of pid 1234
    run(m.release(one_pid()))
    run(m.restore(moving(one_pid(), {0: 0})))  # a GPU onto itself is no move
    assert drv.gpu_mappings == [None, None]


def test_room_is_checked_on_the_target_gpus(drv):
    m = mover(drv, Room(gpu0=80 * GiB, gpu1=2 * GiB, gpu2=80 * GiB))
    with pytest.raises(ReclaimError, match=r"GPU 1 has 2\.0 GiB free, 4\.0 GiB needed") as e:
        run(m.restore(moving(one_pid(), {0: 1})))
    assert e.value.retryable and m.free_bytes.asked == [1]
    assert drv.calls == [] and drv.states[1234] == "checkpointed"
    run(m.restore(moving(one_pid(), {0: 2})))
    assert drv.states[1234] == "running" and m.free_bytes.asked == [1, 2]


def test_below_driver_580_a_move_is_refused_before_anything(drv):
    m = mover(drv, driver="575.51.03")
    assert m.move_refusal() == "driver 575.51.03 cannot restore onto another GPU (needs 580 or newer)"
    with pytest.raises(ReclaimError, match=r"^driver 575\.51\.03 cannot restore onto another GPU") as e:
        run(m.restore(moving(one_pid(), {0: 1})))
    assert e.value.retryable and drv.calls == [] and drv.states[1234] == "checkpointed"
    run(m.restore(one_pid()))  # where it was: fine
    assert drv.states[1234] == "running"
    assert method(drv, probe=probe_ok()).move_refusal() is None


def test_move_refusal_reads_nvml_once_when_no_probe_was_given(monkeypatch):
    fake = fp.two_gpus()
    fake.driver_version = "575.51.03"
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    m = DriverMethod(lambda g: None)
    assert "driver 575.51.03 cannot" in (m.move_refusal() or "")
    fake.driver_version = "580.82.07"
    assert "driver 575.51.03 cannot" in (m.move_refusal() or "")  # kept: it does not change
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert "not known" in (DriverMethod(lambda g: None).move_refusal() or "")


def test_support_reads_the_refusal_so_later_asks_touch_no_nvml(monkeypatch):
    install_fake_cuda_core(monkeypatch)
    fake = fp.two_gpus()
    fake.driver_version = "580.82.07"
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    m = DriverMethod(lambda g: None)
    assert m.support().ok
    monkeypatch.setitem(sys.modules, "pynvml", None)  # NVML gone: the answer was kept
    assert m.move_refusal() is None


def test_uuids_default_to_the_nvml_probe(drv):
    gpus = [fp_info(g) for g in range(2)]
    m = method(drv, probe=probe_ok(gpus=gpus))
    run(m.release(one_pid()))
    run(m.restore(moving(one_pid(), {0: 1})))
    assert drv.gpu_mappings[-1] == {bare(0): bare(1), bare(1): bare(0)}


def fp_info(gpu: int):
    from jupyter_gpushare.telemetry.base import GPUInfo

    return GPUInfo(index=gpu, uuid=UUIDS[gpu], name="H100", memory_total=80 * GiB, memory_used=0,
                   utilization=0.0)


@pytest.mark.parametrize("mapping, uuids, error", [
    ({0: 5}, UUIDS, "not restoring onto other GPUs: GPU 5 is not one the driver sees (it sees 3)"),
    ({0: 1}, {**UUIDS, 2: ""}, "not restoring onto other GPUs: the UUID of GPU 2 is not known ('')"),
    ({0: 1}, {**UUIDS, 1: "MIG-0000"}, "the UUID of GPU 1 is not known ('MIG-0000')"),
    ({0: 1, 2: 1}, UUIDS, "cannot restore GPUs 0 and 2 both onto GPU 1"),
    ({0: -1}, UUIDS, "cannot restore onto other GPUs: -1 is not a GPU index"),
])
def test_a_mapping_that_cannot_be_honoured_is_refused_before_anything(drv, mapping, uuids, error):
    m = mover(drv, uuids=uuids)
    with pytest.raises(ReclaimError, match=re.escape(error)) as e:
        run(m.restore(moving(one_pid(), mapping)))
    assert e.value.retryable and drv.calls == [] and drv.states[1234] == "checkpointed"


def test_a_move_onto_a_gpu_the_kernel_keeps_is_refused(drv):
    m = method(drv, probe=probe_ok(), gpu_uuids=lambda: dict(UUIDS))
    run(m.release(two_pids()))
    drv.calls.clear()
    with pytest.raises(ReclaimError, match="this kernel's memory on GPU 1 does not move"):
        run(m.restore(moving(two_pids(), {0: 1})))
    assert drv.calls == []


def test_a_move_of_a_kernel_whose_memory_never_left_is_refused(drv):
    drv.process(1234).lock(0)  # a release that failed after its lock: nothing checkpointed
    drv.calls.clear()
    m = method(drv, probe=probe_ok(), gpu_uuids=lambda: dict(UUIDS))
    with pytest.raises(ReclaimError, match="no process of this kernel is checkpointed"):
        run(m.restore(moving(one_pid(), {0: 1})))
    assert drv.calls == [] and drv.states[1234] == "locked"


def test_complete_mapping_and_uuids():
    assert complete_mapping({0: 1}, range(3)) == {0: 1, 1: 0, 2: 2}
    assert complete_mapping({0: 2, 2: 0}, range(3)) == {0: 2, 1: 1, 2: 0}
    assert complete_mapping({3: 1, 1: 0}, range(4)) == {0: 3, 1: 0, 2: 2, 3: 1}
    assert checkpoint_uuid("GPU-" + "ab" * 16) == "ab" * 16
    assert checkpoint_uuid(UUIDS[1]) == bare(1)
    assert checkpoint_uuid("MIG-" + "ab" * 16) is None and checkpoint_uuid("GPU-abc") is None


# -- the other built-in methods' side of a move ------------------------------------------------

class RecordingAgent:
    def __init__(self) -> None:
        self.requests: list[tuple[str, dict]] = []

    async def request(self, op, timeout=None, **args):
        self.requests.append((op, args))
        return {"bytes": 4 * GiB, "arrays": 1}


def test_the_simulated_method_moves_and_passes_pairs():
    agent = RecordingAgent()
    m = SimulatedMethod()
    assert m.move_refusal() is None
    run(m.restore(moving(one_pid(agent), {0: 1, 1: 1})))  # {1: 1} stays: not sent
    run(m.restore(one_pid(agent)))
    assert agent.requests == [("sim_resume", {"gpu_mapping": [[0, 1]]}), ("sim_resume", {})]


def test_the_framework_method_refuses_a_move_before_asking_the_kernel():
    agent = RecordingAgent()
    m = FrameworkMethod()
    refusal = m.move_refusal()
    assert refusal == ("the framework method cannot restore onto another GPU: the kernel "
                       "process's device list is fixed")
    with pytest.raises(ReclaimError, match=re.escape(refusal)) as e:
        run(m.restore(moving(one_pid(agent), {0: 1})))
    assert e.value.retryable and not e.value.resident and agent.requests == []


def test_a_method_cannot_move_unless_it_says_so():
    class Plain(ReclaimMethod):
        name = "plain"

        def support(self):
            raise NotImplementedError

        async def release(self, target, progress=None):
            raise NotImplementedError

        async def restore(self, target, progress=None):
            raise NotImplementedError

    assert Plain().move_refusal() == "the plain method cannot restore onto another GPU"


# -- support --------------------------------------------------------------------------------

def probe_ok(**kw):
    args = {"ok": True, "driver_version": "580.82.07", "cuda_driver_version": 13000}
    args.update(kw)
    return NVMLProbe(**args)


def test_support_without_cuda_core(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.core.checkpoint", None)
    s = driver_support(probe_ok())
    assert not s.ok and "jupyter-gpushare[checkpoint]" in s.reason


def test_support_ok_and_driver_checks(monkeypatch):
    install_fake_cuda_core(monkeypatch)
    s = driver_support(probe_ok())
    assert s.ok and "580.82.07" in s.reason
    s = driver_support(probe_ok(driver_version="575.51.03"))
    assert s.ok and "another GPU needs 580" in s.reason
    s = driver_support(probe_ok(driver_version="550.163.01"))
    assert not s.ok and "older than 570" in s.reason
    s = driver_support(probe_ok(mig_gpus=[1]))
    assert not s.ok and "MIG is enabled on GPU 1" in s.reason
    s = driver_support(NVMLProbe(ok=False, reason="no driver"))
    assert not s.ok and "no driver" in s.reason


def test_support_old_bindings(monkeypatch):
    install_fake_cuda_core(monkeypatch, bindings_version="13.0.1")
    s = driver_support(probe_ok())
    assert not s.ok and "13.0.1" in s.reason
    install_fake_cuda_core(monkeypatch, bindings_version="12.9.0")
    assert driver_support(probe_ok()).ok


def test_support_probes_nvml_when_not_given(monkeypatch):
    install_fake_cuda_core(monkeypatch)
    fake = fp.two_gpus()
    fake.driver_version = "560.35.03"
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    s = DriverMethod(lambda g: None).support()
    assert not s.ok and "560.35.03" in s.reason
    assert fake.refcount == 0  # the probe closed NVML again


def test_cuda_core_wording_gets_a_hint(drv):
    drv.fail("checkpoint", 1234, "CUDA checkpointing is not supported by the installed NVIDIA "
                                 "driver. Upgrade to a driver version with CUDA checkpoint API support.")
    with pytest.raises(ReclaimError) as ei:
        run(method(drv).release(one_pid()))
    assert "the pid may have no CUDA context" in str(ei.value)
    assert drv.states[1234] == "running"


def test_no_cuda_core_fails_before_trim():
    agent = FakeAgent()

    def factory(pid):
        raise ImportError("No module named 'cuda'")

    with pytest.raises(ReclaimError, match="cannot open"):
        run(DriverMethod(lambda g: None, process_factory=factory).release(one_pid(agent)))
    assert agent.requests == []


def test_without_cuda_core_the_real_factory_refuses_cleanly(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.core.checkpoint", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(ReclaimError, match="CUDA checkpoint API is unavailable"):
        run(DriverMethod(lambda g: 80 * GiB).release(one_pid()))


def test_import_touches_no_hardware_library():
    import subprocess

    code = (
        "import sys, jupyter_gpushare.reclaim.driver, jupyter_gpushare.doctor; "
        "print(sorted(m for m in ('pynvml', 'cuda', 'cuda.core') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
