"""A real PyTorch out-of-memory error reads as the agent's ``out_of_memory`` request needs it:
the bytes the allocation asked for, and the node's GPU it failed on."""

from __future__ import annotations

import os

import pytest

from jupyter_gpushare.kernel import caps, oom

from .helpers import torch_cuda

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(60)]


def test_pytorchs_out_of_memory_error_says_the_bytes_and_the_gpu():
    torch = torch_cuda()
    with pytest.raises(torch.OutOfMemoryError) as raised:
        torch.empty(1 << 40, dtype=torch.uint8, device="cuda:0")  # 1 TiB: more than any GPU
    assert caps.is_oom(raised.value)
    fields = oom.parse(raised.value)
    assert fields["bytes"] == 1 << 40, str(raised.value)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    first = oom.visible_gpus(visible)
    expected = 0 if not first else first[0]
    assert fields["gpu"] == (None if first is None else expected), (visible, str(raised.value))
