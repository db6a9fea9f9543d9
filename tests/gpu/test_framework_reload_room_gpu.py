"""A framework restore that runs out of GPU memory halfway, on a real GPU (``pytest -m gpu``):
PyTorch comes back, CuPy finds no room (another allocation took it), and the agent puts
PyTorch back in host memory, so the kernel is exactly as released and the reply says only
room was short. The CPU twin is tests/test_framework_reload_room.py.
"""

from __future__ import annotations

import types

import pytest

from .helpers import torch_cuda

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(60)]

MiB = 1 << 20


def test_no_room_for_cupy_puts_pytorch_back_in_host_memory():
    torch = torch_cuda()
    cupy = pytest.importorskip("cupy")
    from jupyter_gpushare.kernel import agent as agent_module
    from jupyter_gpushare.kernel.reload import NoRoomToReload
    from jupyter_gpushare.reclaim.framework import NO_ROOM_KIND

    ns = {"w": torch.randn(32 * MiB, device="cuda"), "b": torch.randn(32 * MiB, device="cuda"),
          "x": cupy.arange(16 * MiB, dtype=cupy.float64), "y": cupy.full(16 * MiB, 7.0)}
    ns["view"] = ns["w"][3:9]
    expected = {k: (v.cpu().clone() if isinstance(v, torch.Tensor) else cupy.asnumpy(v))
                for k, v in ns.items()}
    ids = {k: id(v) for k, v in ns.items()}
    agent = agent_module.Agent(types.SimpleNamespace(user_ns=ns))
    assert agent._offload({})["bytes"] == 512 * MiB
    offloaded = list(agent._offloaded)

    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    # another allocation leaves room for PyTorch's 256 MiB and less than CuPy's 256 MiB more
    hog = torch.empty(free - 256 * MiB - 160 * MiB, dtype=torch.uint8, device="cuda")
    try:
        with pytest.raises(NoRoomToReload) as e:
            agent._reload({})
        assert type(e.value).__name__ == NO_ROOM_KIND
        assert str(e.value).startswith("CuPy ran out of GPU memory allocating "), e.value
        assert agent._offloaded == offloaded
        assert not any(v.is_cuda for k, v in ns.items() if isinstance(v, torch.Tensor))
        assert all(type(ns[k].data.mem).__name__ == "UnownedMemory" for k in ("x", "y"))
    finally:
        del hog
        torch.cuda.empty_cache()

    assert agent._reload({})["bytes"] == 512 * MiB
    assert {k: id(v) for k, v in ns.items()} == ids
    for k, v in ns.items():
        if isinstance(v, torch.Tensor):
            assert v.is_cuda and torch.equal(v.cpu(), expected[k]), k
        else:
            assert (cupy.asnumpy(v) == expected[k]).all(), k
