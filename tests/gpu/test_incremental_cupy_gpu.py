"""Kept CuPy host copies on a real GPU (``pytest -m gpu``): an unchanged release copies
nothing (the fingerprints, read on the GPU, say so), a written allocation is copied into its
kept buffer, and with no code since a pre-copy the release reads no byte, while GPU work a
cell left running on a stream of its own lands before the pre-copy's copies (it waits for
the devices first). The CPU twin: tests/test_incremental_cupy.py."""

from __future__ import annotations

import pytest

from .helpers import cupy_cuda

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(60)]

MiB = 1 << 20


@pytest.fixture
def cupy(monkeypatch):
    cupy = cupy_cuda()
    from jupyter_gpushare.kernel.offload.base import KEEP_HOST_COPY_ENV, KEPT_CHECK_ENV
    from jupyter_gpushare.kernel.offload.cupy_adapter import drop_kept

    monkeypatch.delenv(KEEP_HOST_COPY_ENV, raising=False)
    monkeypatch.delenv(KEPT_CHECK_ENV, raising=False)
    drop_kept()
    yield cupy
    drop_kept()


def test_an_unchanged_release_copies_nothing_and_a_write_reuses_its_buffer(cupy):
    from jupyter_gpushare.kernel.offload.cupy_adapter import CupyAdapter, pinned_pool

    w = cupy.arange(16 * MiB // 4, dtype=cupy.float32)
    ns = {"w": w, "view": w[1000:2000], "b": cupy.ones(MiB // 8)}
    adapter = CupyAdapter()
    first = adapter.offload(ns)
    assert first.copied == first.bytes and first.skipped == []
    adapter.reload()

    adapter = CupyAdapter()
    second = adapter.offload(ns)
    assert second.copied == 0 and second.checked == first.bytes
    adapter.reload()
    allocations = pinned_pool().allocations
    ns["view"][0] = -1  # a write through a view: only w's allocation changed
    adapter = CupyAdapter()
    third = adapter.offload(ns)
    assert third.copied == ns["w"].data.mem.size  # not b's
    adapter.reload()
    assert pinned_pool().allocations == allocations  # into its kept buffer
    assert float(ns["w"][1000]) == -1.0 and float(ns["w"][1001]) == 1001.0
    assert float(ns["b"].min()) == 1.0 and ns["view"].base is ns["w"]


SPIN_FILL = r"""
extern "C" __global__ void spin_fill(float* x, long long n, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x) {
        x[i] = 7.0f;
    }
}
"""


def test_work_left_on_a_side_stream_is_in_the_trusted_copy(cupy):
    from jupyter_gpushare.kernel.offload import quiet
    from jupyter_gpushare.kernel.offload.cupy_adapter import CupyAdapter

    ns = {"w": cupy.zeros(1 << 20, dtype=cupy.float32), "b": cupy.ones(1 << 16, cupy.float32)}
    cupy.cuda.Device(0).synchronize()
    spin_fill = cupy.RawKernel(SPIN_FILL, "spin_fill")
    quiet.watch()
    try:
        quiet.bump()  # a cell queues a slow write on a stream of its own
        side = cupy.cuda.Stream(non_blocking=True)
        with side:
            spin_fill((64,), (256,), (ns["w"], cupy.int64(1 << 20), cupy.int64(200_000_000)))
        quiet.bump()  # the cell ended; its GPU work has not
        pre = CupyAdapter().precopy(ns)
        assert pre.copied == (1 << 20) * 4 + (1 << 16) * 4
        adapter = CupyAdapter()
        off = adapter.offload(ns)
        assert (off.copied, off.checked) == (0, 0) and off.trusted == pre.copied
        adapter.reload()
    finally:
        quiet.unwatch()
    assert float(ns["w"].min()) == 7.0 and float(ns["b"].min()) == 1.0
