"""Incremental releases with the CuPy adapter: a host copy is kept after a restore and made
ahead by a pre-copy, and the next release copies only the allocations written (or new) since,
into their kept buffers; run through a CuPy faked at its device (tests/fakes/fake_cupy.py:
"GPU memory" is host memory, two GPUs), so the adapter's real code runs on a CPU.

CuPy has no version counters: a kept copy is current when the agent's epoch vouches for it
(no code ran since it was made current) or, under the "full" and "sampled" checks, when the
allocation's fingerprint is the copy's. The model test drives random sequences of in-place
writes (through arrays and views), new arrays and views, deletions, pre-copies (with a
cell's write, or a cell's start, landing in the middle of one), releases, restores and
failed copies and allocations against a reference namespace of NumPy arrays, and checks
after every step every byte, every ``id()``, where each array lives, and how many bytes each
release copied.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jupyter_gpushare.kernel.offload import cupy_adapter as ca
from jupyter_gpushare.kernel.offload import quiet
from jupyter_gpushare.kernel.offload.base import KEEP_HOST_COPY_ENV, KEPT_CHECK_ENV

from .fakes import fake_cupy
from .fakes.fake_cupy import CopyFailed, OutOfMemoryError, on_device
from .helpers import a_cell


def fresh_adapter_state() -> None:
    """What the adapter keeps per process, as in a new kernel."""
    ca.drop_kept()
    ca._pool = None
    ca._fp_weights.clear()
    ca._streams.clear()


@pytest.fixture(autouse=True)
def cupy(monkeypatch):
    monkeypatch.delenv(KEEP_HOST_COPY_ENV, raising=False)  # kept by default
    monkeypatch.delenv(KEPT_CHECK_ENV, raising=False)  # every byte checked
    module = fake_cupy.install(monkeypatch)
    fresh_adapter_state()
    yield module
    fresh_adapter_state()
    quiet.unwatch()


def put(values, gpu: int = 0):
    with fake_cupy.Device(gpu):
        return fake_cupy.asarray(values)


def released_and_restored(ns) -> None:
    adapter = ca.CupyAdapter()
    adapter.offload(ns)
    adapter.reload()


def test_an_unchanged_state_is_released_without_copying():
    ns = {"w": put(np.arange(1000, dtype=np.float32)), "b": put(np.ones(10), 1)}
    ns["view"] = ns["w"][10:20]
    ids = {name: id(a) for name, a in ns.items()}
    first = ca.CupyAdapter()
    report = first.offload(ns)
    assert report.copied == report.bytes == 4080
    first.reload()
    assert ca.kept_copies() == {"current": 0, "reused": 4080, "kept": 4080}  # not watched

    pinned, copies = fake_cupy.state.pinned_allocs, fake_cupy.state.copies
    adapter = ca.CupyAdapter()
    second = adapter.offload(ns)
    assert (second.bytes, second.copied, second.checked) == (4080, 0, 4080)
    assert fake_cupy.state.copies == copies  # nothing copied: the fingerprints said so
    assert all(on_device(a) is None for a in ns.values())
    assert fake_cupy.state.device_bytes == {0: 0, 1: 0}  # the GPUs hold nothing
    adapter.reload()
    assert fake_cupy.state.pinned_allocs == pinned
    assert {name: id(a) for name, a in ns.items()} == ids and ns["view"].base is ns["w"]
    assert [on_device(a) for a in ns.values()] == [0, 1, 0]
    assert np.array_equal(ns["view"].get(), np.arange(10, 20, dtype=np.float32))


def test_a_written_allocation_is_copied_into_its_kept_buffer():
    """A write through a view is seen by the fingerprint; the allocation is copied again,
    into its kept copy's buffer (no pinned memory allocated), by a pre-copy and a release."""
    ns = {"w": put(np.zeros(300, dtype=np.float32)), "same": put(np.ones(50), 1)}
    ns["view"] = ns["w"][100:110]
    released_and_restored(ns)
    pinned = fake_cupy.state.pinned_allocs
    for step in range(1, 4):
        ns["view"][step] = step  # a cell writes w through its view
        if step == 2:
            assert ca.CupyAdapter().precopy(ns).copied == 1200
            continue
        adapter = ca.CupyAdapter()
        assert adapter.offload(ns).copied == 1200  # w's allocation; 'same' taken as kept
        adapter.reload()
    assert fake_cupy.state.pinned_allocs == pinned
    assert np.array_equal(ns["w"].get()[100:104], [0, 1, 2, 3]) and on_device(ns["w"]) == 0
    assert np.array_equal(ns["same"].get(), np.ones(50))


def test_the_host_copies_say_what_a_release_copies_into_new_host_memory(watching):
    ns = {"w": put(np.zeros(256, dtype=np.float32)), "b": put(np.zeros(64, dtype=np.float32))}
    released_and_restored(ns)  # from the REST API: no code ran since
    adapter = ca.CupyAdapter()
    assert adapter.host_copies() == {"current": 1280, "kept": 1280, "to_copy": 0,
                                     "to_copy_new": 0}
    a_cell(lambda: ns["w"].__iadd__(1))  # the epoch moved: not known current
    assert adapter.host_copies() == {"current": 0, "kept": 1280, "to_copy": 1280,
                                     "to_copy_new": 0}  # but every copy has its buffer
    a_cell(lambda: ns.update(new=put(np.zeros(100, dtype=np.float32))))
    assert adapter.host_copies()["to_copy_new"] == 400
    off = adapter.offload(ns)
    assert (off.copied, off.checked, off.trusted) == (1024 + 400, 1280, 0)
    adapter.reload()
    assert np.array_equal(ns["w"].get(), np.ones(256))


def test_a_release_after_a_restore_or_precopy_with_no_code_since_reads_no_byte(watching):
    ns = {"w": put(np.arange(1000, dtype=np.float32)), "b": put(np.ones(10), 1)}
    released_and_restored(ns)
    read = []
    plain = ca.fingerprint

    def counted(pointer, nbytes, check="full"):
        read.append(nbytes)  # not the pointer: it would hold the allocation
        return plain(pointer, nbytes, check)

    ca.fingerprint = counted
    try:
        adapter = ca.CupyAdapter()
        off = adapter.offload(ns)
        assert (off.copied, off.trusted, off.checked, read) == (0, 4080, 0, [])
        adapter.reload()
        a_cell(lambda: ns["w"].__imul__(2))  # a cell writes: the epoch moved
        pre = ca.CupyAdapter().precopy(ns)  # checks in the background, copies w
        assert (pre.copied, pre.checked) == (4000, 4080)
        read.clear()
        adapter = ca.CupyAdapter()
        off = adapter.offload(ns)
        assert (off.copied, off.trusted, off.checked, read) == (0, 4080, 0, [])
    finally:
        ca.fingerprint = plain
    adapter.reload()
    assert np.array_equal(ns["w"].get(), np.arange(1000) * 2)


def test_a_thread_that_writes_after_the_restore_is_caught(watching):
    """While a thread a cell started runs, nothing is trusted by the epoch: the fingerprint
    sees its write."""
    ns = {"w": put(np.zeros(64, dtype=np.float32))}
    go, wrote = threading.Event(), threading.Event()

    def later():
        go.wait()
        ns["w"][:] = 1.5
        wrote.set()

    thread = threading.Thread(target=later, daemon=True)
    a_cell(thread.start)
    released_and_restored(ns)
    go.set()
    assert wrote.wait(timeout=30)
    thread.join(timeout=30)
    adapter = ca.CupyAdapter()
    off = adapter.offload(ns)
    assert (off.copied, off.trusted, off.checked) == (256, 0, 256)
    adapter.reload()
    assert np.array_equal(ns["w"].get(), np.full(64, 1.5))


def test_a_precopy_stops_when_a_cell_starts():
    ns = {f"a{i}": put(np.zeros(16, dtype=np.float32)) for i in range(5)}
    stop = threading.Event()
    fake_cupy.state.on_copy = stop.set  # a cell arrives after the first copy
    report = ca.CupyAdapter().precopy(ns, stop)
    fake_cupy.state.on_copy = None
    # nothing kept: the cell may have written that allocation between its fingerprint and
    # its copy and back after
    assert report.stopped and report.copied == 0 and fake_cupy.state.copies == 1
    assert ca.kept_copies()["kept"] == 0
    assert ca.CupyAdapter().offload(ns).copied == 5 * 64


@pytest.mark.parametrize("failing", ["release", "precopy"])
def test_a_copy_failing_midway_into_a_kept_buffer_leaves_no_kept_copy(failing):
    """The kept copy stops being one before the copy into its buffer starts: a copy cut off
    halfway leaves the GPU state intact and nothing a later release could take, even once
    the write is undone, so that the old fingerprint matches again."""
    ns = {"w": put(np.zeros(300, dtype=np.float32)), "same": put(np.ones(50))}
    released_and_restored(ns)
    ns["w"][:] = 1.5
    fake_cupy.state.fail_copy_at = fake_cupy.state.copies + 1  # w's copy writes half, fails
    with pytest.raises(CopyFailed):
        adapter = ca.CupyAdapter()
        adapter.offload(ns) if failing == "release" else adapter.precopy(ns)
    fake_cupy.state.fail_copy_at = None
    assert on_device(ns["w"]) == 0 and np.array_equal(ns["w"].get(), np.full(300, 1.5))
    assert ca.kept_copies()["kept"] == 400  # 'same' only: w's half-written copy is gone
    ns["w"][:] = 0  # the kept copy's bytes again
    adapter = ca.CupyAdapter()
    assert adapter.offload(ns).copied == 1200  # copied, not taken from the half-written one
    adapter.reload()
    assert np.array_equal(ns["w"].get(), np.zeros(300))


def test_a_refusal_to_re_point_leaves_every_array_as_it_was_and_the_next_release_whole():
    """A kept copy taken as it is, then an array refuses to be re-pointed: every array is
    back on its GPU with its bytes, and the next release copies everything again."""
    ns = {"w": put(np.arange(64, dtype=np.float32)), "b": put(np.ones(16), 1)}
    ns["view"] = ns["w"][8:16]
    released_and_restored(ns)
    pointers = {name: a.data.ptr for name, a in ns.items()}
    calls = []

    def repoint(array, memptr):
        calls.append(array)
        if len(calls) == 2:
            raise RuntimeError("simulated: this array refuses to be re-pointed")
        ca._repoint(array, memptr)

    with pytest.raises(RuntimeError, match="refuses"):
        ca.CupyAdapter(repoint=repoint).offload(ns)
    assert {name: a.data.ptr for name, a in ns.items()} == pointers
    assert ns["view"].base is ns["w"] and np.array_equal(ns["view"].get(), np.arange(8, 16))
    adapter = ca.CupyAdapter()
    assert adapter.offload(ns).copied == 64 * 4 + 16 * 8
    adapter.reload()
    assert np.array_equal(ns["w"].get(), np.arange(64)) and on_device(ns["b"]) == 1


BIG = (1 << 20) // 4 + 1024  # float32s: an allocation over 1 MiB, sampled under "sampled"


def off_sample_word() -> int:
    return (ca._SAMPLE_OFFSET + 1) % ca._SAMPLE_STRIDE


def test_the_sampled_check_sees_whole_rewrites_and_misses_a_word_between(monkeypatch):
    monkeypatch.setenv(KEPT_CHECK_ENV, "sampled")
    ns = {"big": put(np.zeros(BIG, dtype=np.float32)), "small": put(np.zeros(1000)),
          "between": put(np.zeros(BIG, dtype=np.float32))}
    released_and_restored(ns)
    ns["big"][:] = 1.5  # a whole rewrite
    ns["small"][999] = 2.0  # one word, of an allocation read whole
    ns["between"][off_sample_word()] = 3.0  # one word no sample reads: the opt-out's limit
    adapter = ca.CupyAdapter()
    assert adapter.offload(ns).copied == BIG * 4 + 8000
    adapter.reload()
    assert np.array_equal(ns["big"].get(), np.full(BIG, 1.5)) and ns["small"].get()[999] == 2
    assert float(ns["between"].get()[off_sample_word()]) == 0.0  # lost, as documented


def test_counters_means_the_epoch_only_for_cupy(monkeypatch, watching):
    """CuPy has no version counters: under "counters" no fingerprint is read, a kept copy the
    epoch vouches for is taken as it is, and any other is copied again (nothing is lost)."""
    monkeypatch.setenv(KEPT_CHECK_ENV, "counters")
    ns = {"w": put(np.zeros(64, dtype=np.float32))}
    released_and_restored(ns)
    adapter = ca.CupyAdapter()
    off = adapter.offload(ns)
    assert (off.copied, off.trusted, off.checked) == (0, 256, 0)
    adapter.reload()
    a_cell()  # wrote nothing, but the epoch cannot tell
    adapter = ca.CupyAdapter()
    off = adapter.offload(ns)
    assert (off.copied, off.trusted, off.checked) == (256, 0, 0)
    adapter.reload()
    quiet.unwatch()  # no epoch at all: a pre-copy would make nothing the release can trust
    assert ca.CupyAdapter().precopy(ns).copied == 0 and ca.kept_copies()["kept"] == 256


def test_a_copy_is_trusted_only_under_the_check_it_was_taken_for(monkeypatch):
    ns = {"w": put(np.zeros(64, dtype=np.float32))}
    released_and_restored(ns)  # kept under "full"
    monkeypatch.setenv(KEPT_CHECK_ENV, "sampled")
    adapter = ca.CupyAdapter()
    assert adapter.offload(ns).copied == 256
    adapter.reload()  # now kept under "sampled"
    assert ca.CupyAdapter().offload(ns).copied == 0


def test_keeping_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(KEEP_HOST_COPY_ENV, "0")
    ns = {"w": put(np.zeros(100, dtype=np.float32))}
    released_and_restored(ns)
    assert ca.kept_copies()["kept"] == 0
    assert ca.CupyAdapter().offload(ns).copied == 400


def test_a_fingerprint_sees_any_one_word_and_swaps():
    x = put(np.random.default_rng(1).integers(0, 1 << 31, 5000, dtype=np.uint32))

    def fp(array) -> int:
        return ca._read([ca.fingerprint(array.data, array.nbytes)])[0]

    base = fp(x)
    assert base == fp(x.copy())
    for i in range(0, 5000, 97):  # every 97th word, one bit each
        y = x.copy()
        y[i] = int(y.get()[i]) ^ (1 << (i % 32))
        assert fp(y) != base, i
    y = x.copy()
    y[[3, 4099]] = x.get()[[4099, 3]]  # a swap, a row apart
    assert fp(y) != base
    odd = put(np.arange(7, dtype=np.uint8))  # a tail of 3 bytes after one word
    z = odd.copy()
    z[6] = 9
    assert fp(odd) != fp(z)


# -- the model test ----------------------------------------------------------------------------
class IncrementalCupy(RuleBasedStateMachine):
    """The adapter on the fake CuPy against a reference namespace of NumPy arrays."""

    watched = False  # the agent's epoch (kernel/offload/quiet.py): see IncrementalCupyWatched

    def __init__(self) -> None:
        super().__init__()
        self.saved = {name: sys.modules.get(name) for name in ("cupy", "cupy.cuda")}
        fake_cupy.install_module()
        fake_cupy.state.reset()
        fresh_adapter_state()
        self.ns: dict[str, object] = {}
        self.ref: dict[str, np.ndarray] = {}
        self.ids: dict[str, int] = {}
        self.root: dict[str, str] = {}  # name -> the array whose allocation it uses
        self.sizes: dict[str, int] = {}  # root -> bytes of its allocation
        self.adapter: ca.CupyAdapter | None = None  # holding the offloaded state
        self.dirty: set[str] = set()  # allocations (roots) a release must copy
        self.new: set[str] = set()  # made since: copied unless a kept copy's bytes match
        self.counter = 0
        self.quiet = False  # no cell since every kept copy was made current
        if self.watched:
            quiet.watch()

    def cell(self) -> None:
        quiet.bump()
        self.quiet = False

    def alive_roots(self) -> set[str]:
        return {self.root[name] for name in self.ns}

    # -- the person's cells (only while resident) -------------------------------------------
    @precondition(lambda self: self.adapter is None and len(self.ns) < 8)
    @rule(size=st.integers(1, 64), gpu=st.sampled_from([0, 1]), seed=st.integers(0, 1000))
    def new_array(self, size, gpu, seed):
        self.cell()
        name = f"a{self.counter}"
        self.counter += 1
        data = np.random.default_rng(seed).integers(-1000, 1000, size, dtype=np.int32)
        self.ref[name] = data.copy()
        self.ns[name] = put(data, gpu)
        self.ids[name] = id(self.ns[name])
        self.root[name] = name
        self.sizes[name] = data.nbytes
        self.new.add(name)

    @precondition(lambda self: self.adapter is None and self.ns and len(self.ns) < 8)
    @rule(data=st.data())
    def new_view(self, data):
        self.cell()
        of = data.draw(st.sampled_from(sorted(self.ns)))
        n = len(self.ref[of])
        start = data.draw(st.integers(0, n - 1))
        stop = data.draw(st.integers(start + 1, n))
        name = f"v{self.counter}"
        self.counter += 1
        self.ns[name] = self.ns[of][start:stop]
        self.ref[name] = self.ref[of][start:stop]
        self.root[name] = self.root[of]
        self.ids[name] = id(self.ns[name])

    @precondition(lambda self: self.adapter is None and self.ns)
    @rule(data=st.data(), value=st.integers(1, 100))
    def write_in_place(self, data, value):
        self.cell()
        name = data.draw(st.sampled_from(sorted(self.ns)))
        self.ns[name] += value
        self.ref[name] += value
        self.dirty.add(self.root[name])

    @precondition(lambda self: self.adapter is None and self.ns)
    @rule(data=st.data())
    def delete(self, data):
        self.cell()
        name = data.draw(st.sampled_from(sorted(self.ns)))
        del self.ns[name], self.ref[name], self.ids[name]

    # -- the kernel's agent -------------------------------------------------------------------
    @precondition(lambda self: self.adapter is None)
    @rule(during=st.sampled_from(["nothing", "a write", "a cell starts"]), data=st.data())
    def precopy(self, during, data):
        victim = (data.draw(st.sampled_from(sorted(self.ns)))
                  if self.ns and during == "a write" else None)
        stop = threading.Event()
        wrote: list[str] = []

        def after_copy():
            if during == "a cell starts" and not stop.is_set():
                self.cell()
                stop.set()
            if victim is not None and not wrote:  # a cell writes while the pre-copy runs
                self.cell()
                self.ns[victim] += 7
                self.ref[victim] += 7
                wrote.append(self.root[victim])

        before = {root: id(self.ns[name].data.mem) for name, root in self.root.items()
                  if name in self.ns}
        order: list[str] = []
        plain = ca._host_buffer

        def noting(group):  # which allocation each copy is of
            order.append(next(r for r, m in before.items() if m == id(group.mem)))
            return plain(group)

        fake_cupy.state.on_copy = after_copy
        ca._host_buffer = noting
        try:
            report = ca.CupyAdapter().precopy(self.ns, stop)
        finally:
            fake_cupy.state.on_copy = None
            ca._host_buffer = plain
        if during == "a cell starts":
            # nothing this pre-copy copied is kept; what it would have copied still is dirty
            assert report.copied == 0 and (report.stopped or not order)
            self.dirty |= set(order)
            return
        self.dirty.clear()
        self.new.clear()
        self.quiet = not wrote
        # the write landed after the first copy: that copy is stale, and so is a kept copy
        # the pre-copy did not renew; an allocation copied after the write is current
        for root in wrote:
            if root == order[0] or root not in order:
                self.dirty.add(root)

    @precondition(lambda self: self.adapter is None)
    @rule(fail_after=st.one_of(st.none(), st.integers(1, 4)))
    def release(self, fail_after):
        alive = self.alive_roots()
        least = sum(self.sizes[r] for r in alive & self.dirty - self.new)
        most = sum(self.sizes[r] for r in alive & (self.dirty | self.new))
        needed = len(alive & (self.dirty | self.new))
        adapter = ca.CupyAdapter()
        if fail_after is not None and fail_after <= needed:
            fake_cupy.state.fail_copy_at = fake_cupy.state.copies + fail_after
            try:
                adapter.offload(self.ns)
            except CopyFailed:  # the kept copies it copied into were of dirty ones
                assert all(on_device(a) is not None for a in self.ns.values())
                return
            finally:
                fake_cupy.state.fail_copy_at = None
            # fewer copies than thought (a new allocation whose bytes a kept copy has)
        else:
            report = adapter.offload(self.ns)
            assert report.skipped == []
            assert least <= report.copied <= most, (least, report.copied, most)
            if self.watched and self.quiet:
                assert report.checked == 0
        assert all(on_device(a) is None for a in self.ns.values())
        self.adapter = adapter

    @precondition(lambda self: self.adapter is not None)
    @rule(fail=st.booleans())
    def restore(self, fail):
        if fail and self.ns:
            fake_cupy.state.fail_alloc_at = fake_cupy.state.device_allocs + 1
            with pytest.raises(OutOfMemoryError):
                self.adapter.reload()
            fake_cupy.state.fail_alloc_at = None
            assert all(on_device(a) is None for a in self.ns.values())
            return
        self.adapter.reload()
        self.adapter = None
        self.dirty.clear()
        self.new.clear()
        self.quiet = True
        assert all(on_device(a) is not None for a in self.ns.values())

    @invariant()
    def every_byte_and_identity(self):
        for name, a in self.ns.items():
            assert id(a) == self.ids[name]
            assert np.array_equal(a.get(), self.ref[name]), name
        by_root: dict[str, int] = {}
        for name, a in self.ns.items():  # views still alias their root's allocation
            mem = id(a.data.mem)
            assert by_root.setdefault(self.root[name], mem) == mem

    def teardown(self):
        if self.adapter is not None:
            self.adapter.reload()
        fresh_adapter_state()
        quiet.unwatch()
        for name, module in self.saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


class IncrementalCupyWatched(IncrementalCupy):
    """The same in a kernel whose agent watches its requests: kept copies current at the
    epoch are taken unread, and still no write is lost."""

    watched = True


TestIncrementalCupy = IncrementalCupy.TestCase
TestIncrementalCupy.settings = settings(max_examples=40, stateful_step_count=25, deadline=None,
                                        database=None)
TestIncrementalCupyWatched = IncrementalCupyWatched.TestCase
TestIncrementalCupyWatched.settings = settings(max_examples=25, stateful_step_count=25,
                                               deadline=None, database=None)
