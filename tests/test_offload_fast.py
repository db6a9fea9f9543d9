"""The PyTorch adapter's fast path (pooled pinned buffers, one copy stream and one wait per
GPU), run on two simulated GPUs made of CPU storages.

``FakeGPUs`` gives :class:`StreamCopies` its hooks: which "GPU" a storage lives on, a device
allocation, an asynchronous copy on a device's stream (logged), a per-device wait (logged),
and the host allocation behind the real :class:`PinnedPool` (counted). Everything else (the
walk, the grouping, the two-phase all-or-nothing move, the pool's bookkeeping) is the code
that runs on CUDA; the real thing is tests/gpu/test_offload_fast_gpu.py.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from jupyter_gpushare.kernel.offload.pinned import (  # noqa: E402
    DEFAULT_KEEP,
    KEEP_ENV,
    PinnedPool,
    keep_limit,
)
from jupyter_gpushare.kernel.offload.torch_adapter import (  # noqa: E402
    StreamCopies,
    TorchAdapter,
    _storage_shared,
)

from .test_offload_torch import Lockable  # noqa: E402  (a tensor that refuses to be re-pointed)

pytestmark = pytest.mark.torch


class CopyFailed(RuntimeError):
    pass


class FakeGPUs:
    """CPU storages registered here live on "gpu0" or "gpu1"."""

    def __init__(self, limit: int = 1 << 30) -> None:
        self.where: dict[int, str] = {}
        self.log: list[tuple[str, str]] = []
        self.host_allocs = 0
        #: the n-th copy (from 1) fails midway: it writes the first half of its bytes, then
        #: raises (what a copy cut off by a bus or driver error leaves in its destination)
        self.fail_copy_at: int | None = None
        self.fail_alloc_at: int | None = None  # the n-th device allocation raises
        self.copies = 0
        self.device_allocs = 0
        self.pool = PinnedPool(self.alloc_host, limit=limit, shared=_storage_shared)

    def put(self, tensor, device: str = "gpu0"):
        self.where[tensor.untyped_storage()._cdata] = device
        return tensor

    def on(self, tensor) -> str | None:
        return self.where.get(tensor.untyped_storage()._cdata)

    def alloc_host(self, nbytes: int):
        self.host_allocs += 1
        host = torch.UntypedStorage(nbytes)
        self.where.pop(host._cdata, None)  # an address a freed "device" storage had
        return host

    def alloc_device(self, nbytes: int, device: str):
        self.device_allocs += 1
        if self.fail_alloc_at == self.device_allocs:
            raise torch.OutOfMemoryError(f"simulated: no room on {device}")
        new = torch.UntypedStorage(nbytes)
        self.where[new._cdata] = device
        return new

    def copy(self, dst, src, device: str) -> None:
        self.copies += 1
        if self.fail_copy_at == self.copies:
            half = src.nbytes() // 2
            _bytes(dst)[:half].copy_(_bytes(src)[:half])
            raise CopyFailed(f"simulated: copy {self.copies} failed halfway")
        self.log.append(("copy", device))
        dst.copy_(src)

    def sync(self, device: str) -> None:
        self.log.append(("sync", device))

    def adapter(self) -> TorchAdapter:
        copies = StreamCopies(pool=self.pool, alloc_device=self.alloc_device, copy=self.copy,
                              sync=self.sync)
        return TorchAdapter(is_device=lambda t: self.on(t) is not None,
                            device_of=lambda s: self.where[s._cdata], copies=copies)

    def take_log(self) -> list[tuple[str, str]]:
        log, self.log = self.log, []
        return log


def _bytes(storage):
    return torch.empty(0, dtype=torch.uint8).set_(storage)


@pytest.fixture
def gpus() -> FakeGPUs:
    return FakeGPUs()


@pytest.fixture
def no_kept_copies(monkeypatch):
    """The pool's own cycle: no host copy kept after a restore (with one kept, the next
    release copies nothing; tests/test_incremental_torch.py covers that)."""
    monkeypatch.setenv("JUPYTER_GPUSHARE_KEEP_HOST_COPY", "0")


def state(gpus: FakeGPUs, n: int = 20) -> dict:
    """n tensors over two GPUs, with a view, a gradient and values whose bits matter (NaN
    payloads, -0.0, denormals)."""
    torch.manual_seed(0)
    ns = {}
    for i in range(n):
        t = torch.randn(64 + i)
        t[0] = -0.0
        t[1] = float.fromhex("0x1p-149")  # the smallest float32 denormal
        t.view(torch.int32)[2] = 0x7FC0_1234  # a NaN with a payload
        ns[f"t{i}"] = gpus.put(t, "gpu0" if i % 2 == 0 else "gpu1")
    ns["view"] = ns["t0"][3:9]
    p = gpus.put(torch.randn(16, requires_grad=True), "gpu1")
    p.grad = gpus.put(torch.randn(16), "gpu1")
    ns["p"] = p
    return ns


def bits(ns: dict) -> dict:
    out = {}
    for k, v in ns.items():
        t = v.detach()
        out[k] = t.clone().view(torch.uint8) if t.is_contiguous() else t.contiguous().view(torch.uint8)
    out["p.grad"] = ns["p"].grad.clone().view(torch.uint8)
    return out


def same_bits(before: dict, ns: dict) -> bool:
    return all(torch.equal(before[k], v) for k, v in bits(ns).items())


def test_round_trip_is_bitwise_keeps_ids_and_devices(gpus):
    ns = state(gpus)
    before, ids = bits(ns), {k: id(v) for k, v in ns.items()}
    grad_id = id(ns["p"].grad)
    devices = {k: gpus.on(v) for k, v in ns.items()}
    adapter = gpus.adapter()

    off = adapter.offload(ns)
    assert off.count == 23 and off.skipped == []  # 20, the view of t0, p, p.grad
    assert not any(gpus.on(v) for v in ns.values())
    assert same_bits(before, ns)  # offloaded tensors read as host tensors
    back = adapter.reload()
    assert back.bytes == off.bytes
    assert {k: id(v) for k, v in ns.items()} == ids and id(ns["p"].grad) == grad_id
    assert {k: gpus.on(v) for k, v in ns.items()} == devices  # each back on its own GPU
    assert same_bits(before, ns)
    assert ns["view"]._base is ns["t0"]
    assert ns["view"].untyped_storage()._cdata == ns["t0"].untyped_storage()._cdata


def buffers(ns: dict) -> set[int]:
    """Where the bytes of every tensor of the state are (p.grad included)."""
    return {t.untyped_storage().data_ptr() for t in [*ns.values(), ns["p"].grad]}


def test_the_second_cycle_allocates_no_host_buffer(gpus, no_kept_copies):
    ns = state(gpus)
    before = bits(ns)
    adapter = gpus.adapter()
    off = adapter.offload(ns)
    adapter.reload()
    storages = off.count - 1  # the view shares t0's storage
    assert gpus.host_allocs == storages
    assert gpus.pool.kept_bytes == off.bytes  # the last cycle's buffers, kept
    host_ptrs: set[int] = set()

    for _ in range(3):  # a new adapter each release, as the agent makes them
        adapter = gpus.adapter()
        adapter.offload(ns)
        host_ptrs = host_ptrs or buffers(ns)
        adapter.reload()
        assert same_bits(before, ns)
    assert gpus.host_allocs == storages  # no new allocation after the first cycle
    assert gpus.pool.reuses == 3 * storages
    adapter = gpus.adapter()
    adapter.offload(ns)
    # the very same buffers (two of one size may swap places: p and p.grad)
    assert buffers(ns) == host_ptrs


def test_one_wait_per_gpu_per_move_after_every_copy_is_queued(gpus):
    ns = state(gpus, n=50)
    adapter = gpus.adapter()
    gpus.take_log()
    adapter.offload(ns)
    offload_log = gpus.take_log()
    adapter.reload()
    reload_log = gpus.take_log()
    for log in (offload_log, reload_log):
        copies = [e for e in log if e[0] == "copy"]
        waits = [e for e in log if e[0] == "sync"]
        assert len(copies) == 52  # one per storage (50 tensors, p, p.grad; t0's view shares)
        assert {d for _, d in copies} == {"gpu0", "gpu1"}
        assert sorted(waits) == [("sync", "gpu0"), ("sync", "gpu1")]  # not one per tensor
        assert log[-2:] == waits  # both GPUs' copies queued before the first wait


def test_a_copy_failing_half_way_leaves_everything_as_it_was(gpus):
    ns = state(gpus)
    before = bits(ns)
    storages = {k: v.untyped_storage()._cdata for k, v in ns.items()}
    adapter = gpus.adapter()
    gpus.fail_copy_at = 7
    with pytest.raises(CopyFailed):
        adapter.offload(ns)
    assert not adapter.offloaded
    assert {k: v.untyped_storage()._cdata for k, v in ns.items()} == storages
    assert all(gpus.on(v) for v in ns.values()) and same_bits(before, ns)
    log = gpus.take_log()
    assert sorted(e for e in log if e[0] == "sync") == [("sync", "gpu0"), ("sync", "gpu1")]
    assert gpus.pool.kept_bytes > 0  # the taken buffers went back once the queue drained

    gpus.fail_copy_at = None
    adapter.offload(ns)
    adapter.reload()
    assert same_bits(before, ns) and all(gpus.on(v) for v in ns.values())


def test_no_room_half_way_through_the_reload_keeps_it_offloaded_for_a_retry(gpus):
    ns = state(gpus)
    before = bits(ns)
    adapter = gpus.adapter()
    adapter.offload(ns)
    host_ptrs = {k: v.data_ptr() for k, v in ns.items()}
    gpus.take_log()
    gpus.fail_alloc_at = gpus.device_allocs + 5
    with pytest.raises(torch.OutOfMemoryError):
        adapter.reload()
    assert adapter.offloaded
    assert {k: v.data_ptr() for k, v in ns.items()} == host_ptrs
    assert not any(gpus.on(v) for v in ns.values())
    assert {e for e in gpus.take_log() if e[0] == "sync"}  # the queued copies were waited for
    assert adapter.reload().count == 23
    assert same_bits(before, ns) and all(gpus.on(v) for v in ns.values())


def test_a_tensor_refusing_the_reload_puts_every_tensor_back(gpus, monkeypatch):
    ns = state(gpus)
    ns["locked"] = gpus.put(torch.arange(4.0).as_subclass(Lockable), "gpu1")
    before = bits(ns)
    adapter = gpus.adapter()
    adapter.offload(ns)
    host_ptrs = {k: v.data_ptr() for k, v in ns.items()}
    monkeypatch.setattr(Lockable, "locked", True)
    with pytest.raises(RuntimeError, match="refuse to be re-pointed"):
        adapter.reload()
    assert {k: v.data_ptr() for k, v in ns.items()} == host_ptrs
    assert adapter.offloaded and gpus.pool.kept_bytes == 0  # nothing recycled: still in use
    monkeypatch.setattr(Lockable, "locked", False)
    adapter.reload()
    assert same_bits(before, ns) and all(gpus.on(v) for v in ns.values())


def test_a_buffer_the_user_still_holds_is_never_reused(gpus):
    x = gpus.put(torch.arange(8.0))
    ns = {"x": x}
    adapter = gpus.adapter()
    adapter.offload(ns)
    kept_view = x[:4]  # taken while offloaded: a view of the pinned host buffer
    adapter.reload()
    assert gpus.pool.kept_bytes == 0 and gpus.host_allocs == 1  # not kept
    with torch.no_grad():
        x.mul_(-1)
    adapter = gpus.adapter()
    adapter.offload(ns)
    adapter.reload()
    assert gpus.host_allocs == 2  # a fresh buffer: the user's view was not overwritten
    assert torch.equal(kept_view, torch.arange(4.0))
    assert torch.equal(x, -torch.arange(8.0))


def test_the_pool_keeps_at_most_its_limit_and_the_last_cycle(no_kept_copies):
    gpus = FakeGPUs(limit=3 * 256)
    ns = {f"t{i}": gpus.put(torch.zeros(64)) for i in range(5)}  # 5 x 256 bytes
    adapter = gpus.adapter()
    adapter.offload(ns)
    adapter.reload()
    assert gpus.pool.kept_bytes == 3 * 256  # bounded: two buffers freed
    adapter.offload(ns)
    assert gpus.host_allocs == 5 + 2
    adapter.reload()
    del ns["t0"], ns["t1"], ns["t2"], ns["t3"]  # the state shrank
    ns["big"] = gpus.put(torch.zeros(128))
    adapter.offload(ns)
    adapter.reload()
    # the last cycle used one 256-byte buffer and a new 512-byte one; the rest was freed
    assert gpus.pool.kept_bytes == 256 + 512
    assert gpus.pool.clear() == 768 and gpus.pool.kept_bytes == 0


def test_limit_zero_allocates_every_cycle_as_before(no_kept_copies):
    gpus = FakeGPUs(limit=0)
    ns = {"x": gpus.put(torch.ones(4)), "y": gpus.put(torch.ones(4), "gpu1")}
    for _ in range(3):
        adapter = gpus.adapter()
        adapter.offload(ns)
        adapter.reload()
    assert gpus.host_allocs == 6 and gpus.pool.kept_bytes == 0


def test_trim_frees_the_kept_buffers(gpus, no_kept_copies):
    ns = state(gpus)
    adapter = gpus.adapter()
    adapter.offload(ns)
    adapter.reload()
    assert gpus.pool.kept_bytes > 0
    adapter.trim()  # no CUDA here: only the host pool has something to free
    assert gpus.pool.kept_bytes == 0


@pytest.mark.parametrize(("text", "limit"), [
    ("", DEFAULT_KEEP), ("0", 0), ("1048576", 1 << 20), ("512M", 512 << 20), ("2GiB", 2 << 30),
    ("1.5g", 3 << 29), ("lots", DEFAULT_KEEP), ("-5", 0),
])
def test_keep_limit_from_the_environment(text, limit):
    assert keep_limit({KEEP_ENV: text}) == limit


def test_the_default_adapter_uses_the_process_pool_and_touches_no_cuda():
    from jupyter_gpushare.kernel.offload.torch_adapter import default_pool

    a, b = TorchAdapter(), TorchAdapter()
    assert isinstance(a.copies, StreamCopies) and a.copies.pool is b.copies.pool is default_pool()
    assert a.offload({"x": torch.ones(3)}).count == 0  # a CPU tensor is not on a device
    assert not torch.cuda.is_initialized()
