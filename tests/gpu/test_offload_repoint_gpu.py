"""The PyTorch adapter's re-point across devices on a real GPU (``pytest -m gpu``).

A released tensor really is a host tensor and a restored one a CUDA tensor again, the same
Python object: the adapter re-points it through ``tensor.data = ...``, because
``tensor.set_(storage, ...)`` refuses a storage of another device ("the devices must
match"). The CPU tests cannot show that refusal: their "device" storages are CPU storages,
and a CPU-only PyTorch has no second dense device (``meta`` refuses the ``.data``
assignment too). tests/gpu/test_offload_cuda.py asserts the same round trip of a model
(it would have failed on a GPU with ``set_``); this one goes through every kind of tensor
the re-point must keep, a graph built before the release, and the kept host copies.
"""

from __future__ import annotations

import pytest

from .helpers import torch_cuda

# each test's own timeout (seconds), so that a hang costs one test, not the GPU proof's stage
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(60)]

MiB = 1 << 20


@pytest.fixture
def kept_by_default(monkeypatch):
    """The kept host copies' defaults (kept, every byte checked), none left over."""
    pytest.importorskip("torch")
    from jupyter_gpushare.kernel.offload.base import KEEP_HOST_COPY_ENV, KEPT_CHECK_ENV
    from jupyter_gpushare.kernel.offload.torch_adapter import drop_kept

    monkeypatch.delenv(KEEP_HOST_COPY_ENV, raising=False)
    monkeypatch.delenv(KEPT_CHECK_ENV, raising=False)
    drop_kept()
    yield
    drop_kept()


def _bits(torch, t):
    """The tensor's values as bytes on the host (a conjugate view's conjugated values)."""
    return t.detach().resolve_conj().cpu().contiguous().view(torch.uint8)


def test_every_tensor_goes_to_host_and_back_in_place(kept_by_default):
    torch = torch_cuda()
    from jupyter_gpushare.kernel.offload.torch_adapter import TorchAdapter, tensor_children
    from jupyter_gpushare.kernel.walk import names_reaching

    torch.cuda.empty_cache()  # the state in segments of its own, none shared with earlier tests
    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 2048).cuda()  # 16 MiB each: segments of their own
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 2048, device="cuda")).square().mean().backward()
    opt.step()  # Adam's moments, on the GPU
    x = torch.randn(64 * MiB // 4, device="cuda")
    with torch.inference_mode():
        frozen = torch.randn(1024, device="cuda")
    z = torch.randn(256, dtype=torch.complex64, device="cuda")
    ns = {"model": model, "opt": opt, "x": x, "view": x[10:20], "frozen": frozen,
          "zc": z.conj(), "alias": model.weight.data}
    params = list(model.parameters())
    grads = [p.grad for p in params]
    moments = [s for p in params for s in opt.state[p].values() if s.is_cuda]
    tensors = [*params, *grads, *moments, x, ns["view"], frozen, ns["zc"], ns["alias"]]
    assert len(moments) == 4 and all(t.is_cuda for t in tensors)
    before = [_bits(torch, t) for t in tensors]
    versions = [None if t.is_inference() else t._version for t in tensors]
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()

    adapter = TorchAdapter()
    off = adapter.offload(ns)
    assert off.skipped == [] and off.bytes >= 128 * MiB
    assert all(t.device.type == "cpu" and t.is_pinned() for t in tensors)
    assert names_reaching(ns, lambda o: torch.is_tensor(o) and o.is_cuda,
                          target_children=tensor_children) == set()
    assert allocated - torch.cuda.memory_allocated() >= off.bytes
    assert reserved - torch.cuda.memory_reserved() >= off.bytes * 0.9
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert [id(k) for k in opt.state] == [id(p) for p in params]
    assert [id(p.grad) for p in params] == [id(g) for g in grads]
    assert all(torch.equal(_bits(torch, t), b) for t, b in zip(tensors, before, strict=True))
    assert [None if t.is_inference() else t._version for t in tensors] == versions
    assert ns["zc"].is_conj() and frozen.is_inference() and not x.is_inference()
    assert all(p.requires_grad and p.is_leaf and isinstance(p, torch.nn.Parameter)
               for p in params)

    back = adapter.reload()
    assert (back.bytes, back.count) == (off.bytes, off.count)
    assert all(t.is_cuda for t in tensors)
    assert all(torch.equal(_bits(torch, t), b) for t, b in zip(tensors, before, strict=True))
    assert [None if t.is_inference() else t._version for t in tensors] == versions
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert [id(p.grad) for p in params] == [id(g) for g in grads]
    assert all(g.is_cuda for g in grads)
    assert ns["zc"].is_conj() and frozen.is_inference()
    assert ns["view"]._base is x
    ns["view"].fill_(7.0)  # still one storage: the view, its base and the .data alias
    assert float(x[10]) == 7.0
    ns["alias"][0, 0] = 3.0
    assert float(model.weight[0, 0]) == 3.0
    opt.step()  # the optimizer still holds the very parameters, moments on the GPU
    assert all(s.is_cuda for s in moments)


def test_a_graph_built_before_the_release_and_the_tensors_hooks_work_after_it(
        kept_by_default):
    """A leaf moved to another device gets a new gradient accumulator at its next use (as
    with ``.cpu()`` / ``.cuda()``): a graph built before keeps its own, which accumulates
    into the same ``.grad``; hooks on the tensor fire for both."""
    torch = torch_cuda()
    from jupyter_gpushare.kernel.offload.torch_adapter import TorchAdapter

    torch.manual_seed(1)
    w = torch.randn(MiB // 4, device="cuda", requires_grad=True)
    b = torch.randn(MiB // 4, device="cuda", requires_grad=True)
    seen: list[str] = []
    w.register_hook(lambda grad: seen.append("hook"))
    w.register_post_accumulate_grad_hook(lambda p: seen.append("accumulated"))
    h = w * b  # mul saves w and b themselves (the same objects): they move with it
    ns = {"w": w, "b": b, "h": h}
    adapter = TorchAdapter()
    off = adapter.offload(ns)
    assert off.skipped == [] and off.count == 3 and not h.is_cuda
    adapter.reload()

    h.sum().backward()
    assert torch.equal(w.grad, b.detach()) and torch.equal(b.grad, w.detach())
    (w * b).sum().backward()  # a graph built after
    assert torch.equal(w.grad, 2 * b.detach())
    assert seen == ["hook", "accumulated"] * 2


def test_a_kept_copy_is_used_and_a_write_it_cannot_count_is_copied(kept_by_default):
    """After a restore the host copy is kept: an unchanged state is released without a
    copy; a write through ``.data`` (no version counter moves) is seen by the device
    fingerprint, and that storage alone is copied; the written value comes back."""
    torch = torch_cuda()
    from jupyter_gpushare.kernel.offload.torch_adapter import TorchAdapter, kept_copies

    ns = {"a": torch.zeros(32 * MiB // 4, device="cuda"),
          "b": torch.ones(32 * MiB // 4, device="cuda")}
    adapter = TorchAdapter()
    first = adapter.offload(ns)
    assert first.skipped == [] and first.copied == first.bytes == 64 * MiB
    adapter.reload()
    assert kept_copies()["current"] == 64 * MiB

    adapter = TorchAdapter()
    unchanged = adapter.offload(ns)
    assert unchanged.copied == 0 and unchanged.bytes == 64 * MiB
    assert not ns["a"].is_cuda
    adapter.reload()

    version = ns["a"]._version
    ns["a"].data[7] = 5.0  # through .data: the counter does not move
    assert ns["a"]._version == version
    adapter = TorchAdapter()
    written = adapter.offload(ns)
    assert written.copied == 32 * MiB and written.bytes == 64 * MiB
    adapter.reload()
    assert float(ns["a"][7]) == 5.0 and float(ns["b"].sum()) == 32 * MiB // 4
