"""Incremental releases with the PyTorch adapter: a host copy is kept after a restore and
made ahead by a pre-copy, and the next release copies only the storages written (or new)
since; run on two simulated GPUs made of CPU storages (``FakeGPUs``, the fast path's seam).

The model test drives random sequences of in-place writes (through tensors and views, and
through ``.data`` and DLPack, which move no version counter: the device fingerprint sees
them), new tensors and views, deletions, pre-copies (with a cell's write landing in the
middle of one), releases, restores and failed copies and allocations against a reference
namespace of plain tensors, and checks after every step every byte, every ``id()``, where
each tensor lives, and how many bytes each release copied.
"""

from __future__ import annotations

import ctypes
import threading

import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from jupyter_gpushare.kernel.offload import quiet, torch_adapter  # noqa: E402
from jupyter_gpushare.kernel.offload.base import KEPT_CHECK_ENV  # noqa: E402
from jupyter_gpushare.kernel.offload.torch_adapter import drop_kept, kept_copies  # noqa: E402

from .helpers import a_cell  # noqa: E402
from .test_offload_fast import CopyFailed, FakeGPUs  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture(autouse=True)
def no_copies_left(monkeypatch):
    monkeypatch.delenv(torch_adapter.KEEP_ENV, raising=False)  # kept by default
    monkeypatch.delenv(KEPT_CHECK_ENV, raising=False)  # every byte checked
    drop_kept()
    yield
    drop_kept()


def bits(t):
    return t.detach().contiguous().view(torch.uint8).clone()


def test_an_unchanged_state_is_released_without_copying(gpus=None):
    gpus = FakeGPUs()
    ns = {"w": gpus.put(torch.randn(1000)), "b": gpus.put(torch.randn(10), "gpu1")}
    ns["view"] = ns["w"][10:20]
    adapter = gpus.adapter()
    first = adapter.offload(ns)
    assert first.copied == first.bytes == 4040
    adapter.reload()
    assert kept_copies() == {"current": 4040, "kept": 4040}

    copies_before = gpus.copies
    second = gpus.adapter().offload(ns)
    assert second.bytes == 4040 and second.copied == 0 and gpus.copies == copies_before
    assert all(gpus.on(t) is None for t in ns.values())
    gpus.adapter().reload()  # the adapter's groups live on the adapter that offloaded


def test_a_write_through_a_view_after_the_precopy_is_copied_again():
    gpus = FakeGPUs()
    w = gpus.put(torch.zeros(256))
    other = gpus.put(torch.ones(64))
    ns = {"w": w, "other": other, "view": w[:8]}
    pre = gpus.adapter().precopy(ns)
    assert pre.copied == 256 * 4 + 64 * 4
    with torch.no_grad():
        ns["view"].add_(7)  # the cell after the pre-copy
    adapter = gpus.adapter()
    off = adapter.offload(ns)
    assert off.copied == 256 * 4  # w's storage only: other's copy is current
    adapter.reload()
    assert torch.equal(ns["w"][:8], torch.full((8,), 7.0)) and gpus.on(ns["w"]) == "gpu0"


def test_a_write_during_the_precopy_makes_that_copy_stale():
    gpus = FakeGPUs()
    ns = {"a": gpus.put(torch.zeros(32)), "b": gpus.put(torch.zeros(32))}
    plain_copy = gpus.copy

    def copy_then_a_cell_writes(dst, src, device):
        plain_copy(dst, src, device)
        with torch.no_grad():
            ns["a"].fill_(3)  # lands after a's bytes were read
            ns["b"].fill_(3)

    gpus.copy = copy_then_a_cell_writes
    gpus.adapter().precopy(ns)
    gpus.copy = plain_copy
    adapter = gpus.adapter()
    assert adapter.offload(ns).copied == 2 * 32 * 4  # both were written after their copy
    adapter.reload()
    assert torch.equal(ns["a"], torch.full((32,), 3.0)) and torch.equal(ns["b"], ns["a"])


def test_a_precopy_stops_when_a_cell_starts():
    gpus = FakeGPUs()
    ns = {f"t{i}": gpus.put(torch.zeros(16)) for i in range(5)}
    stop = threading.Event()
    plain_copy = gpus.copy

    def cell_arrives(dst, src, device):
        plain_copy(dst, src, device)
        stop.set()

    gpus.copy = cell_arrives
    report = gpus.adapter().precopy(ns, stop)
    # no copy after the cell started; the one queued before is dropped too: the cell may
    # have written that storage between its fingerprint and its copy and back after
    assert report.stopped and report.copied == 0 and gpus.copies == 1
    assert kept_copies()["kept"] == 0
    gpus.copy = plain_copy
    assert gpus.adapter().offload(ns).copied == 5 * 16 * 4


def unseen_write(t, how: str, value: float = 1.5) -> None:
    """Add ``value`` to ``t``'s bytes in place without moving its version counter."""
    before = t._version
    if how == "data":
        t.data.add_(value)
    elif how == "dlpack":
        torch.from_dlpack(t).add_(value)
    elif how == "numpy":  # a NumPy view of the tensor's memory (CPU storages here)
        array = t.numpy()
        array += value
    else:  # a raw pointer, as a C extension writes
        new = (t.detach() + value).contiguous()
        ctypes.memmove(t.data_ptr(), new.data_ptr(), new.numel() * new.element_size())
    assert t._version == before  # PyTorch's counters saw nothing


@pytest.mark.parametrize("how", ["data", "dlpack", "numpy", "pointer"])
def test_a_write_the_version_counters_miss_is_copied_at_release(how):
    """Restored with its host copy kept, then written through ``.data``, DLPack, NumPy or a
    raw pointer: the fingerprint differs, so the release copies it and the restore brings back
    the written bytes, never the kept ones."""
    gpus = FakeGPUs()
    ns = {"w": gpus.put(torch.zeros(300)), "same": gpus.put(torch.ones(50))}
    adapter = gpus.adapter()
    adapter.offload(ns)
    adapter.reload()
    assert kept_copies()["current"] == 1400  # by the counters, both unchanged
    unseen_write(ns["w"][100:200], how)
    adapter = gpus.adapter()
    assert adapter.offload(ns).copied == 1200  # w's storage; 'same' released without a copy
    adapter.reload()
    expected = torch.zeros(300)
    expected[100:200] = 1.5
    assert torch.equal(bits(ns["w"]), bits(expected))
    assert torch.equal(ns["same"], torch.ones(50))


def test_an_unseen_write_after_the_precopy_is_copied_at_release():
    gpus = FakeGPUs()
    ns = {"w": gpus.put(torch.zeros(64))}
    assert gpus.adapter().precopy(ns).copied == 256
    unseen_write(ns["w"], "data")
    adapter = gpus.adapter()
    assert adapter.offload(ns).copied == 256
    adapter.reload()
    assert torch.equal(ns["w"], torch.full((64,), 1.5))


# -- no code ran since the copy was made current: trusted without a fingerprint -------------
# (the agent's epoch, kernel/offload/quiet.py; here the test bumps it where a request would
# start and end, as the agent's wrapped request handlers do in a kernel:
# tests/test_incremental_server.py drives it through a real kernel)
def test_a_release_after_a_precopy_with_no_code_since_reads_no_byte(watching):
    gpus = FakeGPUs()
    ns = {"w": gpus.put(torch.randn(1000)), "b": gpus.put(torch.randn(10), "gpu1")}
    pre = gpus.adapter().precopy(ns)
    assert pre.copied == 4040 and pre.checked == 0
    read = []
    plain = torch_adapter._FINGERPRINTS["full"]
    torch_adapter._FINGERPRINTS["full"] = lambda storage: read.append(storage) or plain(storage)
    try:
        adapter = gpus.adapter()
        off = adapter.offload(ns)
    finally:
        torch_adapter._FINGERPRINTS["full"] = plain
    assert (off.copied, off.trusted, off.checked, read) == (0, 4040, 0, [])
    adapter.reload()  # kept again, current at this epoch
    assert gpus.adapter().offload(ns).trusted == 4040


def test_a_write_through_data_in_a_cell_after_the_precopy_is_copied(watching):
    gpus = FakeGPUs()
    ns = {"w": gpus.put(torch.zeros(64)), "same": gpus.put(torch.ones(16))}
    gpus.adapter().precopy(ns)
    a_cell(lambda: unseen_write(ns["w"], "data"))
    adapter = gpus.adapter()
    off = adapter.offload(ns)
    assert (off.copied, off.trusted, off.checked) == (256, 0, 320)
    adapter.reload()
    assert torch.equal(ns["w"], torch.full((64,), 1.5)) and torch.equal(ns["same"], torch.ones(16))


def test_a_precopy_after_a_cell_checks_in_the_background_so_the_release_need_not(watching):
    gpus = FakeGPUs()
    ns = {"w": gpus.put(torch.zeros(64))}
    released_and_restored(gpus, ns)
    a_cell()  # a cell that wrote nothing: the copy may be stale, the pre-copy reads it
    pre = gpus.adapter().precopy(ns)
    assert (pre.copied, pre.checked) == (0, 256)
    off = gpus.adapter().offload(ns)
    assert (off.copied, off.trusted, off.checked) == (0, 256, 0)


@pytest.mark.parametrize("ends", ["before the release", "after the release"])
def test_a_thread_a_cell_started_that_writes_after_the_precopy_is_caught(watching, ends):
    """A thread alive at the pre-copy (or the release) can write at any time: while one
    runs, nothing is trusted by the epoch and the configured check runs."""
    gpus = FakeGPUs()
    ns = {"w": gpus.put(torch.zeros(64))}
    go, wrote, leave = threading.Event(), threading.Event(), threading.Event()

    def later():
        go.wait()
        unseen_write(ns["w"], "data")
        wrote.set()
        if ends == "after the release":
            leave.wait()

    thread = threading.Thread(target=later, daemon=True)
    a_cell(thread.start)
    assert quiet.epoch() is None and "thread" in quiet.others_running()
    gpus.adapter().precopy(ns)
    go.set()
    wrote.wait(timeout=30)
    if ends == "before the release":
        thread.join(timeout=30)
        assert quiet.epoch() is not None  # quiet again, but the copy was made while it ran
    adapter = gpus.adapter()
    off = adapter.offload(ns)
    leave.set()
    assert (off.copied, off.trusted, off.checked) == (256, 0, 256)
    adapter.reload()
    assert torch.equal(ns["w"], torch.full((64,), 1.5))


def test_a_fingerprint_sees_any_one_word_and_sign_flips_and_swaps():
    fp = torch_adapter.fingerprint
    x = torch.randn(5000)
    base = int(fp(x.untyped_storage()))
    assert base == int(fp(x.clone().untyped_storage()))
    for i in range(0, 5000, 97):  # every 97th word, one bit each
        y = x.clone()
        y.view(torch.int32)[i] ^= 1 << (i % 32)
        assert int(fp(y.untyped_storage())) != base, i
    y = x.clone()
    y[[3, 4100]] = -y[[3, 4100]]  # two sign bits
    assert int(fp(y.untyped_storage())) != base
    y = x.clone()
    y[[3, 4099]] = y[[4099, 3]]  # a swap, a row apart
    assert int(fp(y.untyped_storage())) != base
    odd = torch.arange(7, dtype=torch.uint8)  # a tail of 3 bytes after one word
    z = odd.clone()
    z[6] = 9
    assert int(fp(odd.untyped_storage())) != int(fp(z.untyped_storage()))


def test_a_changed_storage_is_copied_into_its_kept_buffer():
    """A storage written since its kept copy is copied into that copy's buffer, by a pre-copy
    and by a release: no host buffer allocated (pinning can cost as much as the copy)."""
    gpus = FakeGPUs()
    ns = {"w": gpus.put(torch.zeros(300)), "same": gpus.put(torch.ones(50), "gpu1")}
    adapter = gpus.adapter()
    adapter.offload(ns)
    buffer = ns["w"].data_ptr()  # w's host copy, kept after the restore
    adapter.reload()
    allocated = gpus.host_allocs
    for step in range(1, 4):
        with torch.no_grad():
            ns["w"][step] = step  # a cell writes w through PyTorch
        if step == 2:
            assert gpus.adapter().precopy(ns).copied == 1200
            continue
        adapter = gpus.adapter()
        assert adapter.offload(ns).copied == 1200  # w's storage; 'same' taken as kept
        assert ns["w"].data_ptr() == buffer  # the very buffer, overwritten in place
        adapter.reload()
    assert gpus.host_allocs == allocated
    assert torch.equal(ns["w"][:4], torch.tensor([0.0, 1, 2, 3])) and gpus.on(ns["w"]) == "gpu0"


@pytest.mark.parametrize("failing", ["release", "precopy"])
def test_a_copy_failing_midway_into_a_kept_buffer_leaves_no_kept_copy(failing):
    """The kept copy stops being one before the copy into its buffer starts: a copy cut off
    halfway leaves the GPU state intact and nothing a later release could take, even once
    a write behind the counters is undone, so that the old fingerprint matches again."""
    gpus = FakeGPUs()
    ns = {"w": gpus.put(torch.zeros(300)), "same": gpus.put(torch.ones(50))}
    released_and_restored(gpus, ns)
    unseen_write(ns["w"], "data")  # counters unchanged, fingerprint not: w is copied again
    gpus.fail_copy_at = gpus.copies + 1  # its copy writes half of w's bytes, then fails
    with pytest.raises(CopyFailed):
        adapter = gpus.adapter()
        adapter.offload(ns) if failing == "release" else adapter.precopy(ns)
    gpus.fail_copy_at = None
    assert gpus.on(ns["w"]) == "gpu0" and torch.equal(ns["w"], torch.full((300,), 1.5))
    assert torch.equal(ns["same"], torch.ones(50))
    assert kept_copies()["kept"] == 200  # 'same' only: w's half-written copy is gone
    unseen_write(ns["w"], "data", -1.5)  # the kept copy's bytes again, behind the counters
    adapter = gpus.adapter()
    assert adapter.offload(ns).copied == 1200  # copied, not taken from the half-written one
    adapter.reload()
    assert torch.equal(bits(ns["w"]), bits(torch.zeros(300)))


def test_kept_copies_are_dropped_oldest_first():
    gpus = FakeGPUs()
    ns = {"old": gpus.put(torch.zeros(100))}
    gpus.adapter().precopy(ns)
    ns["new"] = gpus.put(torch.zeros(50))
    gpus.adapter().precopy(ns)
    assert kept_copies()["current"] == 600
    assert drop_kept(1) == 400 and kept_copies()["current"] == 200
    assert gpus.adapter().offload(ns).copied == 400


def test_the_cpu_fingerprint_is_the_devices_product_and_sum():
    """The CPU path (blocks of rows widened into one buffer, a matrix-vector product) gives
    the value of the GPU path's product and sum, across blocks, a short last row and a tail."""
    x = torch.randint(-(1 << 31), (1 << 31) - 1, (300 * 4096 + 77,), dtype=torch.int32)
    data = torch.cat([x.view(torch.uint8), torch.tensor([5, 6, 7], dtype=torch.uint8)])
    cols, rows = torch_adapter._weights(data.device)
    full = 300 * 4096
    per_row = (x[:full].view(-1, 4096) * cols).sum(dim=1)
    value = (per_row * rows[:300]).sum() + (x[full:] * cols[:77]).sum() * rows[300]
    expected = value * torch_adapter._chunk_weight(0)
    expected += (data[-3:].to(torch.int64) * cols[:3]).sum() * torch_adapter._chunk_weight(-2)
    assert int(torch_adapter.fingerprint(data.untyped_storage())) == int(expected)


BIG = (1 << 20) // 4 + 1024  # float32s: a storage over 1 MiB, sampled under "sampled"


def off_sample_word() -> int:
    """A 32-bit word the "sampled" check does not read."""
    return (torch_adapter._SAMPLE_OFFSET + 1) % torch_adapter._SAMPLE_STRIDE


def released_and_restored(gpus, ns) -> None:
    adapter = gpus.adapter()
    adapter.offload(ns)
    adapter.reload()


def test_the_sampled_check_sees_whole_rewrites_and_counted_writes(monkeypatch):
    """``JUPYTER_GPUSHARE_KEPT_CHECK=sampled``: a rewrite of a whole tensor behind the
    counters, and any write through PyTorch's ops (its counter), are copied; a small storage
    is read whole."""
    monkeypatch.setenv(KEPT_CHECK_ENV, "sampled")
    gpus = FakeGPUs()
    ns = {"big": gpus.put(torch.zeros(BIG)), "small": gpus.put(torch.zeros(1000)),
          "counted": gpus.put(torch.zeros(BIG))}
    released_and_restored(gpus, ns)
    unseen_write(ns["big"], "data")  # e.g. a hand-written optimizer step through .data
    unseen_write(ns["small"][999:], "dlpack")  # one word, of a storage read whole
    with torch.no_grad():
        ns["counted"][off_sample_word()] = 2.0  # one word, but through an in-place op
    adapter = gpus.adapter()
    assert adapter.offload(ns).copied == 2 * BIG * 4 + 4000
    adapter.reload()
    assert torch.equal(ns["big"], torch.full((BIG,), 1.5)) and float(ns["small"][999]) == 1.5
    assert float(ns["counted"][off_sample_word()]) == 2.0
    assert gpus.adapter().offload(ns).copied == 0  # and unchanged again: nothing to copy


def test_the_sampled_and_counters_checks_miss_what_they_do_not_read(monkeypatch):
    """The opt-outs' documented limit: a small write behind the counters, between the
    sampled words ("sampled") or anywhere ("counters"), is not copied, and the restore
    brings back the bytes from before it."""
    for check in ("sampled", "counters"):
        monkeypatch.setenv(KEPT_CHECK_ENV, check)
        drop_kept()
        gpus = FakeGPUs()
        ns = {"w": gpus.put(torch.zeros(BIG))}
        released_and_restored(gpus, ns)
        word = off_sample_word()
        unseen_write(ns["w"][word:word + 1], "data")
        adapter = gpus.adapter()
        assert adapter.offload(ns).copied == 0, check
        adapter.reload()
        assert float(ns["w"][word]) == 0.0, check  # the write is lost: why "full" is default


def test_a_copy_is_trusted_only_under_the_check_it_was_taken_for(monkeypatch):
    gpus = FakeGPUs()
    ns = {"w": gpus.put(torch.zeros(64))}
    released_and_restored(gpus, ns)  # kept under "full"
    monkeypatch.setenv(KEPT_CHECK_ENV, "counters")
    adapter = gpus.adapter()
    assert adapter.offload(ns).copied == 256  # no "counters" copy: copied again
    adapter.reload()  # now kept under "counters"
    assert gpus.adapter().offload(ns).copied == 0


def test_a_storage_resized_in_place_is_copied_again(monkeypatch):
    """``untyped_storage().resize_`` moves the bytes and no counter: the kept copy's address
    and size no longer match, so even "counters" copies it."""
    monkeypatch.setenv(KEPT_CHECK_ENV, "counters")
    gpus = FakeGPUs()
    ns = {"w": gpus.put(torch.arange(16.0))}
    released_and_restored(gpus, ns)
    ns["w"].untyped_storage().resize_(32 * 4)
    adapter = gpus.adapter()
    assert adapter.offload(ns).copied == 128
    adapter.reload()
    assert torch.equal(ns["w"], torch.arange(16.0)) and ns["w"].untyped_storage().nbytes() == 128


class LateFingerprints:
    """A device whose results land only when its copy stream is waited for (a real GPU's
    copy stream runs apart from the stream that reads): until then a fingerprint's memory
    holds what the last fingerprint of that storage left there (the caching allocator hands
    the same block back)."""

    def __init__(self, copies) -> None:
        self.copies = copies
        self.last: dict[int, int] = {}
        self.pending: list[tuple[object, int, object]] = []

    def __getattr__(self, name):
        return getattr(self.copies, name)

    def for_background(self):
        return self

    def fingerprint(self, storage, device, check="full"):
        value = self.copies.fingerprint(storage, device, check)
        shown = value.clone()
        if storage._cdata in self.last:
            shown.fill_(self.last[storage._cdata])
        self.pending.append((shown, storage._cdata, value))
        return shown

    def synchronize(self, devices):
        self.copies.synchronize(devices)
        for shown, key, value in self.pending:
            shown.copy_(value)
            self.last[key] = int(value)
        self.pending.clear()


def test_a_release_reads_the_fingerprints_only_once_the_copy_stream_ran():
    gpus = FakeGPUs()
    ns = {"w": gpus.put(torch.zeros(64))}
    late = LateFingerprints(gpus.adapter().copies)
    first = gpus.adapter()
    first.copies = late
    first.precopy(ns)  # the kept copy's fingerprint, as its stream left it
    unseen_write(ns["w"], "data")
    adapter = gpus.adapter()
    adapter.copies = late
    assert adapter.offload(ns).copied == 256  # not the stale fingerprint, which matched
    adapter.reload()
    assert torch.equal(ns["w"], torch.full((64,), 1.5))


class IncrementalTorch(RuleBasedStateMachine):
    """The adapter on fake GPUs against a reference namespace of plain tensors."""

    def __init__(self) -> None:
        super().__init__()
        drop_kept()
        self.gpus = FakeGPUs()
        self.ns: dict[str, torch.Tensor] = {}
        self.ref: dict[str, torch.Tensor] = {}
        self.ids: dict[str, int] = {}
        self.base: dict[str, str] = {}  # view name -> the name whose storage it shares
        self.adapter = None  # the adapter holding the offloaded state, while released
        self.dirty: set[int] = set()  # storages a release must copy
        #: storages that lost a tensor: copied again unless a view kept that tensor alive
        #: (its ``._base``), then still current
        self.maybe: set[int] = set()
        self.counter = 0
        #: no cell ran since every kept copy was made current (a restore, a pre-copy that
        #: no cell overlapped): with the epoch watched, a release then reads no fingerprint
        self.quiet = False

    watched = False  # the agent's epoch (kernel/offload/quiet.py): see IncrementalTorchWatched

    def cell(self) -> None:
        """A cell runs (each cell rule calls it first): the epoch moves, as the agent's
        wrapped request handlers move it."""
        quiet.bump()
        self.quiet = False

    # -- helpers ---------------------------------------------------------------------------
    def root(self, name: str) -> str:
        return self.base.get(name, name)

    def storage_key(self, name: str) -> int:
        return self.ns[name].untyped_storage()._cdata

    def mark(self, name: str) -> None:
        self.dirty.add(self.storage_key(name))

    def expected_copied(self) -> tuple[int, int]:
        """(at least, at most) the bytes the next release copies."""
        seen: dict[int, int] = {}
        for t in self.ns.values():
            seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        least = sum(n for k, n in seen.items() if k in self.dirty)
        return least, least + sum(n for k, n in seen.items() if k in self.maybe - self.dirty)

    def clean(self) -> None:
        self.dirty.clear()
        self.maybe.clear()

    # -- the person's cells (only while resident) -------------------------------------------
    @precondition(lambda self: self.adapter is None and len(self.ns) < 8)
    @rule(size=st.integers(1, 64), gpu=st.sampled_from(["gpu0", "gpu1"]),
          seed=st.integers(0, 1000))
    def new_tensor(self, size, gpu, seed):
        self.cell()
        name = f"t{self.counter}"
        self.counter += 1
        data = torch.randn(size, generator=torch.Generator().manual_seed(seed))
        self.ref[name] = data.clone()
        self.ns[name] = self.gpus.put(data, gpu)
        self.ids[name] = id(self.ns[name])
        self.mark(name)

    @precondition(lambda self: self.adapter is None and self.ns and len(self.ns) < 8)
    @rule(data=st.data())
    def new_view(self, data):
        self.cell()
        of = data.draw(st.sampled_from(sorted(self.ns)))
        n = self.ns[of].numel()
        start = data.draw(st.integers(0, n - 1))
        stop = data.draw(st.integers(start + 1, n))
        name = f"v{self.counter}"
        self.counter += 1
        self.ns[name] = self.ns[of][start:stop]
        self.ref[name] = self.ref[of][start:stop]
        self.base[name] = self.root(of)
        self.ids[name] = id(self.ns[name])
        # a new user of the storage: its group changed (copied again, unless it goes again)
        self.maybe.add(self.storage_key(name))

    @precondition(lambda self: self.adapter is None and self.ns)
    @rule(data=st.data(), value=st.floats(-4, 4, allow_nan=False))
    def write_in_place(self, data, value):
        self.cell()
        name = data.draw(st.sampled_from(sorted(self.ns)))
        with torch.no_grad():
            self.ns[name].add_(value)
            self.ref[name].add_(value)
        self.mark(name)

    @precondition(lambda self: self.adapter is None and self.ns)
    @rule(data=st.data(), how=st.sampled_from(["data", "dlpack", "numpy", "pointer"]),
          value=st.floats(0.5, 4))
    def write_unseen(self, data, how, value):
        """A write no version counter sees: the fingerprint must."""
        self.cell()
        name = data.draw(st.sampled_from(sorted(self.ns)))
        unseen_write(self.ns[name], how, value)
        with torch.no_grad():
            self.ref[name].add_(value)
        self.mark(name)

    @precondition(lambda self: self.adapter is None and self.ns)
    @rule(data=st.data())
    def delete(self, data):
        self.cell()
        name = data.draw(st.sampled_from(sorted(self.ns)))
        self.maybe.add(self.storage_key(name))  # the group lost a tensor (or the storage goes)
        del self.ns[name], self.ref[name], self.ids[name]
        self.base.pop(name, None)

    # -- the kernel's agent -------------------------------------------------------------------
    @precondition(lambda self: self.adapter is None)
    @rule(write_during=st.booleans(), unseen=st.booleans(), data=st.data())
    def precopy(self, write_during, unseen, data):
        victim = data.draw(st.sampled_from(sorted(self.ns))) if self.ns and write_during else None
        plain_copy = self.gpus.copy
        wrote = []
        copied: list[int] = []  # device storages copied, in order

        def copy_and_write(dst, src, device):
            plain_copy(dst, src, device)
            copied.append(src._cdata)
            if victim is not None and not wrote:  # a cell writes while the pre-copy runs
                self.cell()
                with torch.no_grad():
                    if unseen:  # through .data: no counter moves
                        self.ns[victim].data.mul_(-1)
                    else:
                        self.ns[victim].mul_(-1)
                    self.ref[victim].mul_(-1)
                wrote.append(self.storage_key(victim))

        self.gpus.copy = copy_and_write
        try:
            self.gpus.adapter().precopy(self.ns)
        finally:
            self.gpus.copy = plain_copy
        self.clean()
        self.quiet = not wrote
        # the write landed after the first copy: that copy is stale, and so is a kept copy
        # the pre-copy did not renew; a storage copied after the write is current
        for key in wrote:
            if key == copied[0] or key not in copied:
                self.dirty.add(key)

    @precondition(lambda self: self.adapter is None)
    @rule(fail_after=st.one_of(st.none(), st.integers(1, 4)))
    def release(self, fail_after):
        least, most = self.expected_copied()
        adapter = self.gpus.adapter()
        copies_needed = len({self.storage_key(n) for n in self.ns
                             if self.storage_key(n) in self.dirty})
        if fail_after is not None and fail_after <= copies_needed:
            self.gpus.fail_copy_at = self.gpus.copies + fail_after
            with pytest.raises(CopyFailed):
                adapter.offload(self.ns)
            self.gpus.fail_copy_at = None
            assert all(self.gpus.on(t) is not None for t in self.ns.values())
            return
        report = adapter.offload(self.ns)
        assert report.skipped == []
        assert least <= report.copied <= most
        if self.watched and self.quiet:
            assert report.checked == 0
        assert all(self.gpus.on(t) is None for t in self.ns.values())
        self.adapter = adapter

    @precondition(lambda self: self.adapter is not None)
    @rule(fail=st.booleans())
    def restore(self, fail):
        if fail and self.ns:
            self.gpus.fail_alloc_at = self.gpus.device_allocs + 1
            with pytest.raises(torch.OutOfMemoryError):
                self.adapter.reload()
            self.gpus.fail_alloc_at = None
            assert all(self.gpus.on(t) is None for t in self.ns.values())
            return
        self.adapter.reload()
        self.adapter = None
        self.clean()  # every storage has its host copy kept
        self.quiet = True
        assert all(self.gpus.on(t) is not None for t in self.ns.values())

    @invariant()
    def every_byte_and_identity(self):
        for name, t in self.ns.items():
            assert id(t) == self.ids[name]
            assert torch.equal(bits(t), bits(self.ref[name])), name
        for name, of in self.base.items():  # views still alias their base's storage
            if of in self.ns and name in self.ns:
                assert self.storage_key(name) == self.storage_key(of)

    def teardown(self):
        if self.adapter is not None:
            self.adapter.reload()
        drop_kept()
        quiet.unwatch()


class IncrementalTorchWatched(IncrementalTorch):
    """The same, in a kernel whose agent watches its requests: kept copies current at the
    epoch are trusted unread, and still no write is lost."""

    watched = True

    def __init__(self) -> None:
        super().__init__()
        quiet.watch()


TestIncrementalTorch = IncrementalTorch.TestCase
TestIncrementalTorch.settings = settings(max_examples=40, stateful_step_count=25, deadline=None, database=None)
TestIncrementalTorchWatched = IncrementalTorchWatched.TestCase
TestIncrementalTorchWatched.settings = settings(max_examples=25, stateful_step_count=25,
                                                deadline=None, database=None)


def test_keeping_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(torch_adapter.KEEP_ENV, "0")
    gpus = FakeGPUs()
    ns = {"w": gpus.put(torch.randn(100))}
    adapter = gpus.adapter()
    adapter.offload(ns)
    adapter.reload()
    assert kept_copies()["kept"] == 0
    assert gpus.adapter().offload(ns).copied == 400
