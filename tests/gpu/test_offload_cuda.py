"""The framework offload adapters on a real GPU (``pytest -m gpu`` on a GPU machine).

The CPU tests (tests/test_offload_torch.py, tests/test_offload_jax.py) run the same move
logic between CPU storages; these check the real device path: pinned host copies, memory
actually returned to the driver, and the state coming back bitwise. CuPy is tested only here.
"""

from __future__ import annotations

import importlib.util

import pytest

from .helpers import torch_cuda

# each test's own timeout (seconds), so that a hang costs one test, not the GPU proof's stage
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(60)]

MiB = 1 << 20


def _step(torch, model, opt, data):
    opt.zero_grad()
    model(data).square().mean().backward()
    opt.step()


def test_torch_mlp_with_adam_round_trip_frees_memory_and_is_bitwise():
    torch = torch_cuda()
    from jupyter_gpushare.kernel.offload.torch_adapter import TorchAdapter, tensor_children
    from jupyter_gpushare.kernel.walk import names_reaching

    def setup():
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(2048, 2048), torch.nn.BatchNorm1d(2048), torch.nn.Linear(2048, 512)
        ).cuda()
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    data = torch.randn(64, 2048, device="cuda")
    ref_model, ref_opt = setup()
    model, opt = setup()
    _step(torch, ref_model, ref_opt, data)
    _step(torch, model, opt, data)
    view = model[0].weight[:10]  # a view shares the parameter's storage
    params = list(model.parameters())
    ns = {"model": model, "opt": opt, "view": view, "data": data}
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()
    adapter = TorchAdapter()

    off = adapter.offload(ns)
    assert off.skipped == []
    assert off.bytes > 40 * MiB  # weights, grads, Adam moments, buffers, data
    assert all(not p.is_cuda and p.is_pinned() for p in params)
    assert all(not s.is_cuda for s in opt.state[params[0]].values() if torch.is_tensor(s))
    assert view.untyped_storage()._cdata == params[0].untyped_storage()._cdata
    free_offloaded, _ = torch.cuda.mem_get_info()
    assert free_offloaded - free_before >= off.bytes * 0.9
    assert off.freed_bytes >= off.bytes * 0.9
    on_cuda = names_reaching(ns, lambda o: torch.is_tensor(o) and o.is_cuda,
                             target_children=tensor_children)
    assert on_cuda == set()  # nothing any name reaches is left on the GPU

    back = adapter.reload()
    assert back.bytes == off.bytes
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert all(p.is_cuda and p.grad.is_cuda for p in params)
    assert (
        view._base is params[0]
        and view.untyped_storage()._cdata == params[0].untyped_storage()._cdata
    )
    _step(torch, ref_model, ref_opt, data)
    _step(torch, model, opt, data)
    for a, b in zip(ref_model.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_torch_trim_returns_cached_blocks():
    torch = torch_cuda()
    from jupyter_gpushare.kernel.offload.torch_adapter import TorchAdapter

    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    del x  # the block stays in the caching allocator
    assert TorchAdapter().trim() >= 64 * MiB


def test_cupy_round_trip_in_place():
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("cupy is not installed")
    import cupy

    from jupyter_gpushare.kernel.offload.cupy_adapter import CupyAdapter

    base = cupy.arange(32 * MiB // 4, dtype=cupy.float32)
    view = base[1000:2000]
    expected = cupy.asnumpy(base)
    ns = {"base": base, "view": view}
    adapter = CupyAdapter()
    adapter.trim()
    pool = cupy.get_default_memory_pool()
    before = pool.total_bytes()

    off = adapter.offload(ns)
    assert off.skipped == [] and off.count == 2 and off.bytes == base.nbytes
    assert before - pool.total_bytes() >= base.nbytes
    assert float(view[0]) == 1000.0  # still readable (pinned host memory, mapped)

    back = adapter.reload()
    assert back.count == 2 and ns["base"] is base and ns["view"] is view
    assert (cupy.asnumpy(base) == expected).all()
    view[0] = -1
    assert float(base[1000]) == -1.0  # the view still aliases its base


def test_cupy_alias_outside_namespace_is_left_alone():
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("cupy is not installed")
    import cupy

    from jupyter_gpushare.kernel.offload.cupy_adapter import CupyAdapter

    base = cupy.ones(1024, dtype=cupy.float32)
    hidden = [base[10:20]]  # not in the namespace
    adapter = CupyAdapter()
    off = adapter.offload({"base": base})
    assert off.count == 0 and "outside the namespace" in off.skipped[0]
    hidden[0][0] = 5
    assert float(base[10]) == 5.0


def test_cupy_refusal_halfway_leaves_every_array_as_it_was():
    """A re-point that refuses in the middle of an offload, then of a reload: every array
    is put back where it was (same object, pointer, values, aliasing) and the adapter can
    try again."""
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("cupy is not installed")
    import cupy

    from jupyter_gpushare.kernel.offload.cupy_adapter import CupyAdapter, _repoint

    a = cupy.arange(MiB // 4, dtype=cupy.float32)
    ns = {"a": a, "view": a[10:20], "b": cupy.ones(MiB // 4), "c": cupy.full(1000, 7.0)}
    objects = dict(ns)
    expected = {name: cupy.asnumpy(array) for name, array in ns.items()}
    refuse = {"at": 3}  # a and its view are re-pointed, then b refuses
    calls = []

    def repoint(array, memptr):
        calls.append(array)
        if len(calls) == refuse["at"]:
            raise RuntimeError("simulated: this array refuses to be re-pointed")
        _repoint(array, memptr)

    def check_intact(pointers):
        assert all(ns[name] is objects[name] for name in ns)
        assert {name: array.data.ptr for name, array in ns.items()} == pointers
        for name, array in ns.items():
            assert (cupy.asnumpy(array) == expected[name]).all(), name
        assert ns["view"].base is a

    adapter = CupyAdapter(repoint=repoint)
    on_device = {name: array.data.ptr for name, array in ns.items()}
    pool = cupy.get_default_memory_pool()
    used = pool.used_bytes()
    with pytest.raises(RuntimeError, match="refuses"):
        adapter.offload(ns)
    check_intact(on_device)
    assert pool.used_bytes() == used  # nothing was freed
    assert not adapter._groups

    calls.clear()
    refuse["at"] = None
    off = adapter.offload(ns)
    assert off.count == 4 and off.skipped == []
    offloaded = {name: array.data.ptr for name, array in ns.items()}
    calls.clear()
    refuse["at"] = 3
    with pytest.raises(RuntimeError, match="refuses"):
        adapter.reload()
    check_intact(offloaded)  # still every array in pinned host memory
    assert adapter._groups

    refuse["at"] = None
    assert adapter.reload().count == 4
    assert all(array.data.ptr not in offloaded.values() for array in ns.values())
    check_intact({name: array.data.ptr for name, array in ns.items()})
    ns["view"][0] = -1
    assert float(a[10]) == -1.0  # the view still aliases its base


def test_jax_round_trip_releases_device_buffers():
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("no GPU device visible to jax")
    from jupyter_gpushare.kernel.offload.jax_adapter import JaxAdapter

    params = {"w": jax.random.normal(jax.random.PRNGKey(0), (2048, 2048))}
    expected = jax.device_get(params["w"])
    device = params["w"].devices()
    ns = {"params": params}
    del params
    adapter = JaxAdapter()
    off = adapter.offload(ns)
    assert off.count == 1 and off.bytes == 2048 * 2048 * 4
    assert not any(a.shape == (2048, 2048) for a in jax.live_arrays())
    adapter.reload()
    assert ns["params"]["w"].devices() == device
    assert (jax.device_get(ns["params"]["w"]) == expected).all()
