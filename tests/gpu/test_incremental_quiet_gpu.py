"""Kept PyTorch copies trusted by the agent's epoch on a real GPU (``pytest -m gpu``): with no
code since a pre-copy, the release reads no byte; GPU work a cell left running on a stream of
its own lands before the pre-copy's copies (it waits for every stream first), so trusting
them never loses that write. The CPU twin: tests/test_incremental_torch.py."""

from __future__ import annotations

import pytest

from .helpers import torch_cuda

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(60)]


@pytest.fixture
def watching():
    from jupyter_gpushare.kernel.offload import quiet
    from jupyter_gpushare.kernel.offload.torch_adapter import drop_kept

    drop_kept()
    quiet.watch()
    yield quiet
    quiet.unwatch()
    drop_kept()


def test_work_left_on_a_side_stream_is_in_the_trusted_copy(watching, monkeypatch):
    torch = torch_cuda()
    from jupyter_gpushare.kernel.offload.base import KEEP_HOST_COPY_ENV, KEPT_CHECK_ENV
    from jupyter_gpushare.kernel.offload.torch_adapter import TorchAdapter

    monkeypatch.delenv(KEEP_HOST_COPY_ENV, raising=False)
    monkeypatch.delenv(KEPT_CHECK_ENV, raising=False)
    ns = {"w": torch.zeros(1 << 20, device="cuda:0"), "b": torch.ones(1 << 16, device="cuda:0")}
    torch.cuda.synchronize()
    side = torch.cuda.Stream(device="cuda:0")
    watching.bump()  # a cell queues a slow write on a stream of its own, behind the counters
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time
        ns["w"].data.fill_(7.0)
    watching.bump()  # the cell ended; its GPU work has not
    pre = TorchAdapter().precopy(ns)
    assert pre.copied == (1 << 20) * 4 + (1 << 16) * 4
    adapter = TorchAdapter()
    off = adapter.offload(ns)
    assert (off.copied, off.checked) == (0, 0) and off.trusted == pre.copied
    adapter.reload()
    assert float(ns["w"].min()) == 7.0 and float(ns["b"].min()) == 1.0
