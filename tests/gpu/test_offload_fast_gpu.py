"""The PyTorch adapter's fast path on real GPUs (``pytest -m gpu`` on a GPU machine): pinned
buffers kept across cycles, one copy stream and one wait per GPU, bitwise round trips.

The CPU twin (tests/test_offload_fast.py) drives the same code through its hooks; this runs
the CUDA defaults: ``torch.cuda.Stream`` per device, ``pin_memory`` buffers, real waits.
"""

from __future__ import annotations

import pytest

from .helpers import torch_cuda

# each test's own timeout (seconds), so that a hang costs one test, not the GPU proof's stage
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(60)]

MiB = 1 << 20


def test_cycles_reuse_pinned_buffers_wait_once_per_gpu_and_are_bitwise(monkeypatch):
    torch = torch_cuda()
    from jupyter_gpushare.kernel.offload.pinned import PinnedPool
    from jupyter_gpushare.kernel.offload.torch_adapter import (
        StreamCopies,
        TorchAdapter,
        _pinned_alloc,
        _storage_shared,
    )

    n_gpus = torch.cuda.device_count()
    torch.manual_seed(0)
    ns = {f"t{i}": torch.randn(1 << 18, device=f"cuda:{i % n_gpus}") for i in range(40)}
    ns["view"] = ns["t0"][5:100]
    # a kernel still queued on the compute stream when the release starts: the copy stream
    # must wait for it (the value written last must be the one offloaded)
    big = torch.randn(4096, 4096, device="cuda:0")
    ns["product"] = big @ big
    expected = {k: v.clone() for k, v in ns.items()}
    ids = {k: id(v) for k, v in ns.items()}

    pool = PinnedPool(_pinned_alloc, limit=1 << 34, shared=_storage_shared)
    copies = StreamCopies(pool=pool)
    waits: list[object] = []
    real_sync = copies.sync
    monkeypatch.setattr(copies, "sync", lambda device: (waits.append(device), real_sync(device)))

    adapter = TorchAdapter(copies=copies)
    off = adapter.offload(ns)
    assert off.skipped == [] and off.bytes >= 40 * MiB
    assert all(not t.is_cuda and t.is_pinned() for t in ns.values())
    assert len(waits) == n_gpus  # one wait per GPU, not one per tensor
    adapter.reload()
    assert len(waits) == 2 * n_gpus
    allocated = pool.allocations
    assert allocated == len(ns) - 1  # the view shares t0's storage

    for _ in range(2):
        adapter = TorchAdapter(copies=copies)
        adapter.offload(ns)
        adapter.reload()
    assert pool.allocations == allocated  # no pinned allocation after the first cycle
    assert {k: id(v) for k, v in ns.items()} == ids
    for k, v in ns.items():  # float32 without NaN: equal values are equal bits
        assert v.is_cuda and torch.equal(v, expected[k]), k
    assert ns["view"]._base is ns["t0"]
    assert pool.clear() > 0 and pool.kept_bytes == 0


def test_the_reports_carry_bytes_and_seconds():
    """Speed is the benchmark's (benchmarks/framework_offload.py); here only that the report
    carries bytes and seconds from which the event's rate is computed."""
    torch = torch_cuda()
    from jupyter_gpushare.kernel.offload.torch_adapter import TorchAdapter

    ns = {"x": torch.randn(64 * MiB // 4, device="cuda")}
    adapter = TorchAdapter()
    off = adapter.offload(ns)
    back = adapter.reload()
    assert off.bytes == back.bytes == 64 * MiB and off.seconds > 0 and back.seconds > 0
