"""Incremental releases on the simulated GPU: each array's host copy is kept after a
restore and made ahead by a pre-copy, and a checkpoint copies only the arrays written (or
made) since, and paces only those bytes.

The model test drives random sequences of new arrays, writes in place, deletions,
pre-copies (with a cell's write landing in the middle of one), releases, restores and
injected faults against a reference of numpy arrays, and checks every byte, every
``id()``, the device's state and the bytes each checkpoint copied.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

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
from jupyter_gpushare.sim.node import GiB, SimNode


@pytest.fixture
def dev(monkeypatch) -> SimDevice:
    device = SimDevice(LocalBackend(SimNode((GiB, GiB))))
    monkeypatch.setattr(device_module, "_device", device)
    yield device
    device.clear_faults()
    if device.state in (LOCKED, CHECKPOINTED):
        device.resume()


def cycle(dev: SimDevice) -> dict:
    dev.lock()
    out = dev.checkpoint()
    dev.resume()
    return out


def test_a_second_release_of_an_unchanged_state_copies_nothing(dev):
    xs = [simgpu.random((1000,), device=i % 2, seed=i) for i in range(4)]
    sums = [x.checksum() for x in xs]
    assert cycle(dev)["copied"] == 16000
    assert dev.host_copies() == {"current": 16000, "to_copy": 0, "kept": 16000}
    again = cycle(dev)
    assert again["bytes"] == 16000 and again["copied"] == 0
    assert [x.checksum() for x in xs] == sums


def test_only_the_written_array_is_copied_and_paced(dev):
    xs = [simgpu.zeros((1 << 18,), device=0) for _ in range(4)]  # 1 MiB each
    cycle(dev)
    xs[2][:10] = 5.0
    assert dev.host_copies()["to_copy"] == 1 << 20
    dev.transfer_rate = float(64 << 20)  # 1 MiB takes 1/64 s
    released = cycle(dev)
    assert released["copied"] == 1 << 20
    log = dev.transfer_log("checkpoint")[-1]
    assert log["bytes"] == 1 << 20 and log["arrays"] == 4
    assert float(xs[2].get()[:10].sum()) == 50.0


def test_a_write_after_the_precopy_is_never_lost(dev):
    x = simgpu.zeros((100,), device=1)
    y = simgpu.ones((100,), device=0)
    assert dev.precopy()["bytes"] == 800
    x += 3  # the cell after the pre-copy
    released = cycle(dev)
    assert released["copied"] == 400
    assert x.get().tolist() == [3.0] * 100 and y.get().tolist() == [1.0] * 100


def test_a_precopy_stops_for_a_cell_and_a_lock(dev):
    xs = [simgpu.zeros((1000,)) for _ in range(3)]
    stop = threading.Event()
    done = dev.precopy(stop, after_copy=lambda array: stop.set())
    assert done["stopped"] and done["bytes"] == 4000  # the copy that was made counts
    assert dev.host_copies()["to_copy"] == 8000
    dev.lock()
    assert dev.precopy()["stopped"]
    dev.unlock()
    assert len(xs) == 3


def test_host_copies_are_dropped_oldest_first(dev):
    old = simgpu.zeros((100,))
    dev.precopy()
    new = simgpu.zeros((50,))
    dev.precopy()
    assert dev.drop_host_copies(1) == 400
    assert dev.host_copies() == {"current": 200, "to_copy": 400, "kept": 200}
    assert cycle(dev)["copied"] == 400 and old.nbytes + new.nbytes == 600


def test_keeping_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(device_module.KEEP_ENV, "0")
    device = SimDevice(LocalBackend(SimNode((GiB,))))
    monkeypatch.setattr(device_module, "_device", device)
    x = simgpu.zeros((10,))
    cycle(device)
    assert cycle(device)["copied"] == 40 and x.nbytes == 40


class IncrementalSim(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dev = SimDevice(LocalBackend(SimNode((GiB, GiB))))
        self._saved = device_module._device
        device_module._device = self.dev
        self.xs: dict[str, simgpu.SimArray] = {}
        self.ref: dict[str, np.ndarray] = {}
        self.ids: dict[str, int] = {}
        self.dirty: set[str] = set()
        self.counter = 0

    @property
    def released(self) -> bool:
        return self.dev.state == CHECKPOINTED

    @precondition(lambda self: not self.released and len(self.xs) < 8)
    @rule(size=st.integers(1, 200), gpu=st.sampled_from([0, 1]), seed=st.integers(0, 99))
    def new_array(self, size, gpu, seed):
        name = f"a{self.counter}"
        self.counter += 1
        data = np.random.default_rng(seed).random(size, dtype=np.float32)
        self.xs[name] = simgpu.array(data, device=gpu)
        self.ref[name] = data.copy()
        self.ids[name] = id(self.xs[name])
        self.dirty.add(name)

    @precondition(lambda self: not self.released and self.xs)
    @rule(data=st.data(), value=st.floats(-4, 4, width=32))
    def write(self, data, value):
        name = data.draw(st.sampled_from(sorted(self.xs)))
        how = data.draw(st.sampled_from(["setitem", "iadd", "fill"]))
        if how == "setitem":
            self.xs[name][:3] = value
            self.ref[name][:3] = value
        elif how == "iadd":
            self.xs[name] += value
            self.ref[name] += np.float32(value)
        else:
            self.xs[name].fill(value)
            self.ref[name].fill(value)
        self.dirty.add(name)

    @precondition(lambda self: not self.released and self.xs)
    @rule(data=st.data())
    def delete(self, data):
        name = data.draw(st.sampled_from(sorted(self.xs)))
        del self.xs[name], self.ref[name], self.ids[name]
        self.dirty.discard(name)

    @precondition(lambda self: not self.released)
    @rule(data=st.data(), write_during=st.booleans())
    def precopy(self, data, write_during):
        victim = data.draw(st.sampled_from(sorted(self.xs))) if self.xs and write_during else None
        copied: list[int] = []

        def a_cell_writes(array):
            copied.append(id(array))
            if victim is not None and len(copied) == 1:
                self.xs[victim] += 1.0
                self.ref[victim] += np.float32(1.0)

        self.dev.precopy(after_copy=a_cell_writes)
        was = set(self.dirty)
        self.dirty.clear()
        if victim is not None and copied:  # the cell wrote (during the first copy)
            vid = id(self.xs[victim])
            # stale if its copy was the one in flight, or it was not copied at all
            if vid == copied[0] or vid not in copied:
                self.dirty.add(victim)
        assert {id(self.xs[n]) for n in was} <= set(copied)  # every stale array was copied

    @precondition(lambda self: not self.released)
    @rule(fail_after=st.one_of(st.none(), st.integers(0, 3)))
    def release(self, fail_after):
        self.dev.lock()
        if fail_after is not None:
            self.dev.inject_fault("checkpoint", after=fail_after)
            with pytest.raises(InjectedFault) as caught:
                self.dev.checkpoint()
            caught.value.__traceback__ = None  # its frames would keep deleted arrays alive
            assert self.dev.state == LOCKED
            self.dev.resume()
            return
        out = self.dev.checkpoint()
        # at least what the model says changed (an array deleted in the test may linger
        # until the collector runs, and is released with the others)
        assert out["copied"] >= sum(self.xs[n].nbytes for n in self.dirty)
        assert self.dev.allocated() == 0

    @precondition(lambda self: self.released)
    @rule(fail=st.booleans())
    def restore(self, fail):
        if fail:
            self.dev.inject_fault("restore", after=0)
            with pytest.raises(InjectedFault) as caught:
                self.dev.resume()
            caught.value.__traceback__ = None
            assert self.dev.state == CHECKPOINTED
            return
        self.dev.resume()
        self.dirty.clear()  # every array's host copy is kept

    @invariant()
    def every_byte_and_identity(self):
        for name, x in self.xs.items():
            assert id(x) == self.ids[name]
        if self.dev.state == RUNNING:
            for name, x in self.xs.items():
                assert np.array_equal(x.get(), self.ref[name], equal_nan=True), name
            # exactly the arrays written or made since their host copy are copied next
            stale = {name for name, x in self.xs.items() if x._current_copy() is None}
            assert stale == self.dirty

    def teardown(self):
        self.dev.clear_faults()
        if self.dev.state != RUNNING:
            self.dev.resume()
        device_module._device = self._saved


TestIncrementalSim = IncrementalSim.TestCase
TestIncrementalSim.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                       database=None,
                                       phases=[Phase.explicit, Phase.generate, Phase.shrink])
