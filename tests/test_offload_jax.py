"""The JAX offload adapter on the CPU device: every array counts as "device" here, so the
same rebinding logic that runs on a GPU runs, and the tests can see arrays leave and come back
(NumPy host copies while offloaded, fresh jax arrays with the same sharding after)."""

from __future__ import annotations

import types
import weakref
from typing import NamedTuple

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from jupyter_gpushare.kernel.offload.jax_adapter import JaxAdapter  # noqa: E402


class AdamState(NamedTuple):
    mu: dict
    count: object


class Holder:
    def __init__(self, w):
        self.w = w
        self.table = {"bias": w + 1}


def make_adapter() -> JaxAdapter:
    return JaxAdapter(is_device=lambda array: True)


def assert_same_array(new, expected):
    assert isinstance(new, jax.Array)
    assert new.dtype == expected.dtype and new.shape == expected.shape
    assert np.array_equal(np.asarray(new), expected)


def test_pytrees_leave_and_come_back():
    key = jax.random.PRNGKey(0)
    w = jax.random.normal(key, (64, 32))
    b = jnp.zeros(32, dtype=jnp.bfloat16)
    ns = {
        "params": {"w": w, "b": b},
        "opt": (AdamState(mu={"w": w * 0.5}, count=jnp.array(3, dtype=jnp.int32)), [jnp.ones(2)]),
        "x": jnp.arange(5),
        "n": 3,
    }
    expected = {
        "w": np.array(w),
        "b": np.array(b),
        "mu": np.array(ns["opt"][0].mu["w"]),
        "x": np.array(ns["x"]),
    }
    gone = [weakref.ref(a) for a in (w, b, ns["x"])]
    sharding = w.sharding
    del w, b, key  # only the namespace holds device arrays now
    adapter = make_adapter()

    off = adapter.offload(ns)
    assert off.count == 6 and off.skipped == []
    assert off.bytes == 64 * 32 * 4 + 32 * 2 + 64 * 32 * 4 + 4 + 2 * 4 + expected["x"].nbytes
    assert all(ref() is None for ref in gone)  # the device buffers were released
    assert isinstance(ns["params"]["w"], np.ndarray)  # readable host copies meanwhile
    assert np.array_equal(ns["params"]["w"], expected["w"])

    back = adapter.reload()
    assert back.count == 6 and back.bytes == off.bytes
    assert_same_array(ns["params"]["w"], expected["w"])
    assert_same_array(ns["params"]["b"], expected["b"])
    assert_same_array(ns["x"], expected["x"])
    state = ns["opt"][0]
    assert type(state) is AdamState and isinstance(ns["opt"], tuple)
    assert_same_array(state.mu["w"], expected["mu"])
    assert int(state.count) == 3 and ns["n"] == 3
    assert ns["params"]["w"].sharding == sharding
    assert not adapter.offloaded


def test_shared_leaf_stays_shared():
    a = jnp.arange(10.0)
    ns = {"p": {"w": a}, "q": [a]}
    del a
    off = make_adapter()
    report = off.offload(ns)
    assert report.count == 1
    off.reload()
    assert ns["p"]["w"] is ns["q"][0]


def test_objects_closures_and_unsortable_dicts():
    w = jnp.full((3,), 2.0)

    def make(v):
        return lambda: v

    ns = {
        "holder": Holder(w),
        "fn": make(jnp.arange(3)),
        "mixed": {1: jnp.ones(2), "a": jnp.zeros(2)},  # keys that tree_flatten cannot sort
    }
    del w
    adapter = make_adapter()
    off = adapter.offload(ns)
    assert off.count == 5 and off.skipped == []
    assert isinstance(ns["holder"].w, np.ndarray) and isinstance(ns["fn"](), np.ndarray)
    adapter.reload()
    assert_same_array(ns["holder"].w, np.full((3,), 2.0, dtype=np.float32))
    assert_same_array(ns["holder"].table["bias"], np.full((3,), 3.0, dtype=np.float32))
    assert_same_array(ns["fn"](), np.arange(3, dtype=np.int32))
    assert_same_array(ns["mixed"][1], np.ones(2, dtype=np.float32))


def test_tuple_inside_object_is_reported_and_untouched():
    holder = types.SimpleNamespace(pair=(jnp.ones(4),))
    ns = {"holder": holder}
    adapter = make_adapter()
    off = adapter.offload(ns)
    assert off.count == 0
    assert off.skipped and off.skipped[0].startswith("holder<0>.pair[0]: held by tuple")
    assert isinstance(holder.pair[0], jax.Array) and float(holder.pair[0].sum()) == 4.0


def test_array_alive_elsewhere_comes_back_as_itself():
    x = jnp.arange(4.0)
    hidden = types.ModuleType("hidden")  # the walk never enters modules
    hidden.keep = x
    ns = {"x": x}
    adapter = make_adapter()
    off = adapter.offload(ns)
    assert off.count == 0
    assert any(s.startswith("x: still referenced outside the namespace") for s in off.skipped)
    adapter.reload()
    assert ns["x"] is x  # no second copy on the device


def test_weak_type_and_placement_are_kept():
    weak = jax.jit(lambda a: a * 2)(3.0)
    committed = jax.device_put(jnp.ones(2), jax.devices()[0])
    loose = jnp.ones(2)
    assert weak.weak_type and committed._committed and not loose._committed
    ns = {"weak": weak, "committed": committed, "loose": loose}
    del weak, committed, loose
    adapter = make_adapter()
    adapter.offload(ns)
    adapter.reload()
    assert ns["weak"].weak_type and float(ns["weak"]) == 6.0
    assert ns["committed"]._committed and not ns["loose"]._committed


def test_no_ops_rebinding_and_failed_reload():
    ns = {"x": jnp.arange(3), "y": jnp.ones(3)}
    adapter = make_adapter()
    assert adapter.reload().count == 0
    first = adapter.offload(ns)
    assert adapter.offload(ns).count == 0 and first.count == 2

    def no_room(entry):
        raise MemoryError("simulated: no room on the device")

    adapter._to_device = no_room
    with pytest.raises(MemoryError):
        adapter.reload()
    assert adapter.offloaded and isinstance(ns["x"], np.ndarray)
    del adapter._to_device

    ns["y"] = "rebound by the user"
    back = adapter.reload()
    assert back.skipped == ["y: rebound while offloaded; kept as is"]
    assert_same_array(ns["x"], np.arange(3, dtype=np.int32))
    assert ns["y"] == "rebound by the user"
    assert adapter.reload().count == 0


def test_gpu_names_follow_offloaded_state():
    ns = {
        "params": {"w": jnp.ones(2)},
        "holder": Holder(jnp.ones(2)),
        "arr": np.ones(2),
        "_private": jnp.ones(2),
        "n": 1,
    }
    adapter = make_adapter()
    assert adapter.gpu_names(ns) == {"params", "holder"}
    adapter.offload(ns)
    assert adapter.gpu_names(ns) == {"params", "holder"}
    adapter.reload()
    assert adapter.gpu_names(ns) == {"params", "holder"}


def test_defaults_on_a_cpu_only_machine_move_nothing():
    adapter = JaxAdapter()
    ns = {"x": jnp.ones(3)}
    off = adapter.offload(ns)
    assert off.count == 0 and adapter.device_bytes() == 0 and adapter.trim() == 0
    assert adapter.gpu_names(ns) == set()
