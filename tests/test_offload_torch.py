"""The PyTorch offload adapter, run on a simulated device made of CPU storages.

``FakeDevice`` marks some CPU storages as "device memory" and gives the adapter copy
functions between two distinct CPU storages, so the very same in-place move logic that runs
on CUDA runs here, and the tests can see the storage really change while offloaded.
The real CUDA path is tests/gpu/test_offload_cuda.py.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import types
import warnings

import pytest

torch = pytest.importorskip("torch")

from jupyter_gpushare.kernel.offload.torch_adapter import TorchAdapter  # noqa: E402
from jupyter_gpushare.kernel.walk import names_reaching, walk_namespace  # noqa: E402

pytestmark = pytest.mark.torch


class FakeDevice:
    """CPU storages registered here count as device memory."""

    def __init__(self) -> None:
        self.storages: set[int] = set()
        self.to_host_calls = 0
        self.fail_next_reload = False

    def put(self, tensor):
        self.storages.add(tensor.untyped_storage()._cdata)
        return tensor

    def put_all(self, namespace):
        """Mark every tensor reachable from ``namespace`` (model, grads, optimizer state)."""
        from jupyter_gpushare.kernel.offload.torch_adapter import tensor_children

        result = walk_namespace(
            namespace, lambda o: isinstance(o, torch.Tensor), target_children=tensor_children
        )
        for found in result.found.values():
            self.put(found.obj)
        return namespace

    def is_device(self, tensor) -> bool:
        return tensor.untyped_storage()._cdata in self.storages

    def on_device(self, obj) -> bool:
        """The predicate that names what reaches a device tensor (see names_reaching)."""
        return isinstance(obj, torch.Tensor) and self.is_device(obj)

    def to_host(self, storage):
        self.to_host_calls += 1
        host = torch.UntypedStorage(storage.nbytes())
        host.copy_(storage)
        self.storages.discard(host._cdata)
        return host

    def to_device(self, host, device):
        if self.fail_next_reload:
            self.fail_next_reload = False
            raise torch.OutOfMemoryError("simulated: no room on the device")
        new = torch.UntypedStorage(host.nbytes())
        new.copy_(host)
        self.storages.add(new._cdata)
        return new

    def adapter(self, **options) -> TorchAdapter:
        return TorchAdapter(
            is_device=self.is_device,
            to_host=self.to_host,
            to_device=self.to_device,
            synchronize=lambda: None,
            **options,
        )


@pytest.fixture
def dev() -> FakeDevice:
    return FakeDevice()


def round_trip(adapter: TorchAdapter, namespace: dict, check=None):
    off = adapter.offload(namespace)
    if check is not None:
        check()
    back = adapter.reload()
    return off, back


def test_identity_values_and_storage_change(dev):
    torch.manual_seed(0)
    x = dev.put(torch.randn(100, 10))
    y = dev.put(torch.arange(7, dtype=torch.int64))
    keep = {"x": x.clone(), "y": y.clone()}
    ns = {"x": x, "y": y, "n": 3, "cpu": torch.ones(3)}
    ptr_before = x.data_ptr()
    adapter = dev.adapter()

    off = adapter.offload(ns)
    assert (off.count, off.bytes) == (2, x.nbytes + y.nbytes)
    assert off.skipped == []
    assert adapter.offloaded
    assert not dev.is_device(x) and not dev.is_device(y)  # bytes left "the device"
    ptr_offloaded = x.data_ptr()
    assert ptr_offloaded != ptr_before
    assert torch.equal(x, keep["x"])  # an offloaded tensor is still a readable host tensor

    back = adapter.reload()
    assert (back.count, back.bytes) == (2, off.bytes)
    assert ns["x"] is x and ns["y"] is y
    assert dev.is_device(x) and dev.is_device(y)
    assert x.data_ptr() != ptr_offloaded
    assert torch.equal(x, keep["x"]) and torch.equal(y, keep["y"])
    assert x.dtype == torch.float32 and x.shape == (100, 10)
    assert not adapter.offloaded


def test_views_keep_aliasing(dev):
    base = dev.put(torch.arange(12.0))
    v = base[2:5]
    w = base.view(3, 4)
    bits = base.view(torch.int32)  # a view that reinterprets dtype
    t = w.t()  # non-contiguous view
    ns = {"v": v, "w": w, "bits": bits, "t": t}  # the base is reachable only as v._base
    off, _ = round_trip(dev.adapter(), ns)
    assert off.count == 5  # four views plus their base, one storage
    assert off.bytes == base.nbytes
    cdata = base.untyped_storage()._cdata
    assert all(x.untyped_storage()._cdata == cdata for x in (v, w, bits, t))
    assert v._base is base and t.stride() == (1, 4)
    v[0] = 100.0
    assert base[2] == 100.0 and w[0, 2] == 100.0 and t[2, 0] == 100.0
    assert bits[2] == torch.tensor(100.0).view(torch.int32)


def test_requires_grad_and_grad(dev):
    p = dev.put(torch.randn(5, requires_grad=True))
    (p * p).sum().backward()
    grad = dev.put(p.grad)
    expected = p.grad.clone()
    ns = {"p": p}
    off, _ = round_trip(dev.adapter(), ns, check=lambda: dev.is_device(p.grad) and pytest.fail())
    assert off.count == 2  # p and p.grad (reached through the tensor)
    assert p.requires_grad and p.is_leaf and p.grad is grad
    assert torch.equal(p.grad, expected)
    assert dev.is_device(p.grad)


def _train_setup(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.randn(8, 6)
    return model, opt, data


def _step(model, opt, data):
    opt.zero_grad()
    model(data).pow(2).mean().backward()
    opt.step()


def test_adam_step_after_round_trip_is_bitwise_equal(dev):
    ref_model, ref_opt, data = _train_setup(1)
    model, opt, _ = _train_setup(1)
    _step(ref_model, ref_opt, data)
    _step(model, opt, data)

    ns = dev.put_all({"model": model, "opt": opt})
    params = list(model.parameters())
    off, _ = round_trip(dev.adapter(), ns)
    assert off.count > 0 and off.skipped == []
    # Parameter identity inside the optimizer survived
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in params]
    assert {id(p) for p in opt.state} == {id(p) for p in params}
    assert all(dev.is_device(p) for p in params)

    _step(ref_model, ref_opt, data)
    _step(model, opt, data)
    for a, b in zip(ref_model.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for p_ref, p in zip(ref_model.parameters(), params, strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ref_opt.state[p_ref][key], opt.state[p][key])


def test_module_buffers_batchnorm(dev):
    torch.manual_seed(2)
    bn = torch.nn.BatchNorm1d(4)
    bn(torch.randn(16, 4) * 3 + 1)  # running stats move away from their defaults
    expected = {k: v.clone() for k, v in bn.state_dict().items()}
    buffers = dict(bn.named_buffers())
    ns = dev.put_all({"bn": bn})
    off, _ = round_trip(dev.adapter(), ns)
    assert off.count == 5  # weight, bias, running_mean, running_var, num_batches_tracked
    assert dict(bn.named_buffers()) == buffers  # same objects
    for key, value in bn.state_dict().items():
        assert torch.equal(value, expected[key])
    assert dev.is_device(bn.running_mean)


def test_tied_weights_stay_one_parameter(dev):
    emb = torch.nn.Embedding(10, 4)
    dec = torch.nn.Linear(4, 10, bias=False)
    dec.weight = emb.weight
    ns = dev.put_all({"emb": emb, "dec": dec})
    off, _ = round_trip(dev.adapter(), ns)
    assert off.count == 1 and off.bytes == emb.weight.nbytes
    assert dec.weight is emb.weight
    assert isinstance(emb.weight, torch.nn.Parameter)


class Holder:
    def __init__(self, tensor):
        self.tensor = tensor
        self.nested = {"list": [tensor * 2]}


class Slotted:
    __slots__ = ("__hidden", "value")

    def __init__(self, value, hidden):
        self.value = value
        self.__hidden = hidden

    @property
    def hidden(self):
        return self.__hidden


def test_closures_partials_attributes_and_slots(dev):
    def make_closure(tensor):
        def inner():
            return tensor

        return inner

    def add(a, b):
        return a + b

    tensors = [dev.put(torch.full((3,), float(i))) for i in range(6)]
    holder = Holder(tensors[1])
    dev.put(holder.nested["list"][0])
    ns = {
        "f": make_closure(tensors[0]),
        "holder": holder,
        "part": functools.partial(add, tensors[2], b=tensors[3]),
        "slotted": Slotted(tensors[4], tensors[5]),
        "method": holder.__init__,  # a bound method leads to its object
    }
    all_tensors = [*tensors, holder.nested["list"][0]]

    def all_moved():
        assert not any(dev.is_device(t) for t in all_tensors)

    off, _ = round_trip(dev.adapter(), ns, check=all_moved)
    assert off.count == 7 and off.skipped == []
    assert ns["f"]() is tensors[0] and ns["slotted"].hidden is tensors[5]
    assert torch.equal(ns["part"](), torch.full((3,), 5.0))
    assert all(dev.is_device(t) for t in all_tensors)


def test_cycles_end(dev):
    t1, t2 = dev.put(torch.ones(2)), dev.put(torch.zeros(2))
    loop: list = []
    loop.append(loop)
    loop.append(t1)
    d: dict = {"t": t2}
    d["self"] = d
    holder = Holder(t1)
    holder.me = holder
    ns = {"loop": loop, "d": d, "holder": holder}
    off, _ = round_trip(dev.adapter(), ns)
    assert off.count == 2  # holder.nested's product is not on the device
    assert loop[1] is t1 and d["t"] is t2


def test_non_leaf_graph_still_backpropagates(dev):
    torch.manual_seed(3)
    x = dev.put(torch.randn(4, requires_grad=True))
    w = dev.put(torch.randn(4, requires_grad=True))
    h = x * w  # the graph saved x and w (same tensor objects): they move, versions kept
    z = h.exp()  # exp saved its own output: an alias outside the namespace
    dev.put(h)
    dev.put(z)
    z_before = z.clone()
    versions = (x._version, w._version, h._version)
    ns = {"x": x, "w": w, "h": h, "z": z}
    adapter = dev.adapter()

    off = adapter.offload(ns)
    assert off.count == 3  # x, w, h
    assert len(off.skipped) == 1 and off.skipped[0].startswith("z: its storage is also used")
    assert dev.is_device(z) and torch.equal(z, z_before)  # left alone, not corrupted
    adapter.reload()

    assert (x._version, w._version, h._version) == versions
    assert h.grad_fn is not None and z.grad_fn is not None
    z.sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    w_ref = w.detach().clone().requires_grad_()
    (x_ref * w_ref).exp().sum().backward()
    assert torch.equal(x.grad, x_ref.grad) and torch.equal(w.grad, w_ref.grad)


def test_inference_tensors_move_too(dev):
    model = torch.nn.Linear(3, 2)
    with torch.inference_mode():
        out = dev.put(model(torch.ones(1, 3)))
    expected = out.clone()
    off, _ = round_trip(dev.adapter(), {"out": out})
    assert off.count == 1 and out.is_inference() and torch.equal(out, expected)
    assert dev.is_device(out)


def test_a_release_inside_inference_mode_changes_no_tensor_kind(dev):
    """The re-point takes the dispatch keys of a tensor made for it: an ambient inference
    mode must not make a tracked tensor an inference one (nor the reverse)."""
    p = dev.put(torch.randn(3, requires_grad=True))
    with torch.inference_mode():
        frozen = dev.put(torch.ones(2))
        round_trip(dev.adapter(), {"p": p, "frozen": frozen})
    assert not p.is_inference() and p.requires_grad and p.is_leaf and p._version == 0
    assert frozen.is_inference() and dev.is_device(p) and dev.is_device(frozen)
    (p * 2).sum().backward()
    assert torch.equal(p.grad, torch.full((3,), 2.0))


def test_lazy_conjugate_and_negative_views_keep_their_bits(dev):
    """A conjugate view and a negative view are lazy: a bit in the dispatch keys, not in
    the bytes. The re-point must carry it, or the values flip sign."""
    z = dev.put(torch.tensor([1 + 2j, 3 - 4j, -5 + 0.5j]))
    c = z.conj()
    n = torch._neg_view(z)  # what the imaginary part of a conjugate view is made of
    expected = {"c": c.resolve_conj(), "n": n.resolve_neg()}

    def check():
        assert not dev.is_device(c) and c.is_conj() and n.is_neg()
        assert torch.equal(c, expected["c"]) and torch.equal(n, expected["n"])

    off, _ = round_trip(dev.adapter(), {"c": c, "n": n}, check)
    assert off.count == 3 and off.skipped == []  # c, n and their base z: one storage
    assert dev.is_device(c) and c.is_conj() and n.is_neg()
    assert torch.equal(c, expected["c"]) and torch.equal(n, expected["n"])


def test_a_quantized_tensor_stays_and_says_why(dev):
    """A quantized tensor's scale and zero point live in its quantizer, which a plain
    tensor's re-point would lose: it is left on the device, intact."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated in recent PyTorch
        q = dev.put(torch.quantize_per_tensor(torch.arange(4.0), 0.5, 2, torch.qint8))
    x = dev.put(torch.ones(2))
    off, _ = round_trip(dev.adapter(), {"q": q, "x": x})
    assert off.count == 1 and off.skipped == [
        "q: cannot be re-pointed (TypeError: a quantized tensor is not moved); left on the device"]
    assert dev.is_device(q) and (q.q_scale(), q.q_zero_point()) == (0.5, 2)
    assert torch.equal(q.dequantize(), torch.arange(4.0))


def _repoints(func) -> bool:
    """Whether ``func`` (as ``__torch_function__`` sees it) re-points a tensor at another
    storage: ``tensor.data = ...`` (what the adapter does) or ``tensor.set_(...)``."""
    return func == torch.Tensor.data.__set__ or func == torch.Tensor.set_


class Frozen(torch.Tensor):
    """A subclass that refuses to be re-pointed (as some tensor subclasses do)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if _repoints(func):
            raise RuntimeError("frozen tensors refuse to be re-pointed")
        return super().__torch_function__(func, types, args, kwargs)


def test_a_refusing_tensor_stays_and_the_rest_moves(dev):
    a = dev.put(torch.ones(2))
    b = dev.put(torch.zeros(2).as_subclass(Frozen))
    c = dev.put(torch.full((2,), 2.0))
    b_ptr = b.data_ptr()
    adapter = dev.adapter()
    off = adapter.offload({"a": a, "b": b, "c": c})
    assert off.count == 2 and off.bytes == 16
    assert len(off.skipped) == 1 and off.skipped[0].startswith("b: cannot be re-pointed")
    assert not dev.is_device(a) and not dev.is_device(c)
    assert dev.is_device(b) and b.data_ptr() == b_ptr
    assert b.untyped_storage().tolist() == [0] * 8  # untouched
    assert adapter.reload().count == 2
    assert dev.is_device(a) and torch.equal(a, torch.ones(2)) and a._version == 0
    assert torch.equal(c, torch.full((2,), 2.0))


class Lockable(torch.Tensor):
    """A subclass that refuses to be re-pointed while ``locked`` is set."""

    locked = False

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if cls.locked and _repoints(func):
            raise RuntimeError("locked tensors refuse to be re-pointed")
        return super().__torch_function__(func, types, args, kwargs)


def test_a_tensor_refusing_the_reload_leaves_every_tensor_offloaded(dev, monkeypatch):
    a = dev.put(torch.ones(2))
    b = dev.put(torch.zeros(2).as_subclass(Lockable))
    c = dev.put(torch.full((2,), 2.0))
    adapter = dev.adapter()
    moved = adapter.offload({"a": a, "b": b, "c": c}).count
    host_ptrs = [t.data_ptr() for t in (a, b, c)]
    monkeypatch.setattr(Lockable, "locked", True)
    with pytest.raises(RuntimeError, match="refuse to be re-pointed"):
        adapter.reload()  # a was re-pointed at its device storage before b refused
    assert adapter.offloaded
    assert [t.data_ptr() for t in (a, b, c)] == host_ptrs
    assert not any(dev.is_device(t) for t in (a, b, c))
    assert a._version == 0 and torch.equal(a, torch.ones(2))

    monkeypatch.setattr(Lockable, "locked", False)
    assert adapter.reload().count == moved
    assert all(dev.is_device(t) for t in (a, b, c)) and torch.equal(c, torch.full((2,), 2.0))


def test_alias_outside_namespace_is_reported_not_split(dev):
    base = dev.put(torch.arange(6.0))
    hidden = types.ModuleType("hidden")  # modules are never walked
    hidden.alias = base[1:3]
    ns = {"base": base, "hidden": hidden}
    off, _ = round_trip(dev.adapter(), ns)
    assert off.count == 0 and off.skipped[0].startswith("base: its storage is also used by 1")
    hidden.alias[0] = -1.0
    assert base[1] == -1.0  # still one storage


def test_output_history_is_moved_but_not_named(dev):
    t = dev.put(torch.ones(3))
    ns = {"Out": {4: t}, "_": t, "_4": t}
    adapter = dev.adapter()
    assert names_reaching(ns, dev.on_device) == set()  # none of them is a user's name
    off = adapter.offload(ns)
    assert off.count == 1 and not dev.is_device(t)
    adapter.reload()
    assert dev.is_device(t)


def test_second_offload_and_lone_reload_are_no_ops(dev):
    x = dev.put(torch.randn(3))
    ns = {"x": x}
    adapter = dev.adapter()
    assert adapter.reload().count == 0
    assert dev.is_device(x)
    first = adapter.offload(ns)
    calls = dev.to_host_calls
    second = adapter.offload(ns)
    assert first.count == 1 and second.count == 0 and second.bytes == 0
    assert dev.to_host_calls == calls
    assert adapter.reload().count == 1
    assert adapter.reload().count == 0
    assert dev.is_device(x)


def test_failed_reload_keeps_state_for_a_retry(dev):
    x = dev.put(torch.randn(10))
    expected = x.clone()
    adapter = dev.adapter()
    adapter.offload({"x": x})
    dev.fail_next_reload = True
    with pytest.raises(torch.OutOfMemoryError):
        adapter.reload()
    assert adapter.offloaded and not dev.is_device(x) and torch.equal(x, expected)
    assert adapter.reload().count == 1
    assert dev.is_device(x) and torch.equal(x, expected)


def test_tensor_without_storage_is_reported():
    sparse = torch.eye(3).to_sparse()
    adapter = TorchAdapter(
        is_device=lambda t: t.layout != torch.strided,
        to_host=lambda s: s,
        to_device=lambda s, d: s,
        synchronize=lambda: None,
    )
    off = adapter.offload({"sp": sparse})
    assert off.count == 0 and off.skipped and off.skipped[0].startswith("sp: ")
    assert torch.equal(sparse.to_dense(), torch.eye(3))


def test_walk_budget_is_reported(dev):
    ns = {"many": [[i] for i in range(50)], "x": dev.put(torch.ones(1))}
    off = dev.adapter(max_objects=10).offload(ns)
    assert any(s.startswith("<walk>: stopped after 10 objects") for s in off.skipped)


def test_the_walk_names_what_reaches_a_device_tensor(dev):
    from jupyter_gpushare.kernel.offload.torch_adapter import tensor_children

    model = dev.put_all({"m": torch.nn.Linear(2, 2)})["m"]
    secret = dev.put(torch.ones(2))

    def uses_secret():
        return secret

    ns = {
        "model": model,
        "fn": uses_secret,
        "cpu_tensor": torch.ones(2),
        "n": 1,
        "_hidden": secret,
        "Out": {1: secret},
        "torch": torch,
    }

    def named():
        return names_reaching(ns, dev.on_device, target_children=tensor_children)

    adapter = dev.adapter()
    assert named() == {"model", "fn"}
    adapter.offload(ns)
    assert named() == set()  # every tensor those names reach left the device
    adapter.reload()
    assert named() == {"model", "fn"}


def test_trim_and_device_bytes_without_cuda():
    adapter = TorchAdapter()
    assert adapter.device_bytes() == 0 and adapter.trim() == 0
    off = adapter.offload({"x": torch.ones(3)})  # CPU tensors are not device tensors
    assert off.count == 0 and off.freed_bytes == 0


def test_importing_the_registry_imports_no_framework():
    code = (
        "import sys\n"
        "import jupyter_gpushare.kernel.offload as offload\n"
        "assert not {'torch', 'cupy', 'jax'} & set(sys.modules), sys.modules.keys()\n"
        "assert offload.present_adapters() == []\n"
        "import torch\n"
        "print([type(a).__name__ for a in offload.present_adapters()])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['TorchAdapter']"
