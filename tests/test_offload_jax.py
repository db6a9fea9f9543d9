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
from jupyter_gpushare.kernel.offload.txn import UndoIncomplete  # noqa: E402
from jupyter_gpushare.kernel.walk import names_reaching  # noqa: E402


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

    default, adapter.to_device = adapter.to_device, no_room
    with pytest.raises(MemoryError):
        adapter.reload()
    assert adapter.offloaded and isinstance(ns["x"], np.ndarray)
    adapter.to_device = default

    ns["y"] = "rebound by the user"
    back = adapter.reload()
    assert back.skipped == ["y: rebound while offloaded; kept as is"]
    assert_same_array(ns["x"], np.arange(3, dtype=np.int32))
    assert ns["y"] == "rebound by the user"
    assert adapter.reload().count == 0


def test_the_walk_names_what_reaches_a_device_array():
    ns = {
        "params": {"w": jnp.ones(2)},
        "holder": Holder(jnp.ones(2)),
        "arr": np.ones(2),
        "_private": jnp.ones(2),
        "n": 1,
    }
    adapter = make_adapter()

    def named():
        return names_reaching(ns, lambda o: isinstance(o, jax.Array) and adapter.is_device(o))

    assert named() == {"params", "holder"}
    adapter.offload(ns)
    assert named() == set()  # host copies while offloaded
    adapter.reload()
    assert named() == {"params", "holder"}


def test_defaults_on_a_cpu_only_machine_move_nothing():
    adapter = JaxAdapter()
    ns = {"x": jnp.ones(3)}
    off = adapter.offload(ns)
    assert off.count == 0 and adapter.device_bytes() == 0 and adapter.trim() == 0
    assert names_reaching(ns, lambda o: isinstance(o, jax.Array) and adapter.is_device(o)) == set()


# -- all or nothing: a failure in the middle of a move leaves every object as it was ------


class Lockable(dict):
    """A user container that refuses writes while locked. Not a pytree (JAX treats dict
    subclasses as leaves), so the adapter rebinds its items where they sit, after the
    top-level trees."""

    def __init__(self, *args, locked=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.locked = locked

    def __setitem__(self, key, value):
        if self.locked:
            raise TypeError("this container is locked")
        super().__setitem__(key, value)


class WriteOnce(Lockable):
    """Takes one write, then locks itself (so an undo, a second write, is refused)."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.locked = True


def failing_after(n: int, copy):
    """A copy hook that copies ``n`` arrays, then fails."""
    calls = []

    def hook(arg):
        calls.append(arg)
        if len(calls) > n:
            raise MemoryError("simulated: out of memory")
        return copy(arg)

    return hook


def mixed_namespace(locked=False):
    """Top-level trees, object attributes and a container, rebound in that order; and a
    getter for every slot that holds a device array."""
    ns = {
        "a": jnp.arange(4.0),
        "params": {"w": jnp.ones((3, 3)), "b": jnp.zeros(3)},
        "holder": Holder(jnp.full((2,), 5.0)),
        "box": Lockable(v=jnp.arange(3), locked=locked),
        "n": 7,
    }
    slots = {
        "a": lambda: ns["a"],
        "params": lambda: ns["params"],
        "params.w": lambda: ns["params"]["w"],
        "params.b": lambda: ns["params"]["b"],
        "holder.w": lambda: ns["holder"].w,
        "holder.bias": lambda: ns["holder"].table["bias"],
        "box.v": lambda: ns["box"]["v"],
    }
    return ns, slots


def snapshot(slots):
    return {name: get() for name, get in slots.items()}


def assert_same_objects(slots, before):
    for name, get in slots.items():
        assert get() is before[name], f"{name} was rebound"


def test_a_copy_failing_halfway_through_an_offload_changes_nothing():
    ns, slots = mixed_namespace()
    before = snapshot(slots)
    adapter = JaxAdapter(is_device=lambda a: True, to_host=failing_after(3, np.array))
    with pytest.raises(MemoryError):
        adapter.offload(ns)
    assert_same_objects(slots, before)
    assert not adapter.offloaded and adapter.reload().count == 0


def test_a_slot_refusing_halfway_through_an_offload_undoes_every_rebinding():
    ns, slots = mixed_namespace(locked=True)
    before = snapshot(slots)
    values = {name: np.array(v) for name, v in before.items() if name != "params"}
    adapter = make_adapter()
    with pytest.raises(TypeError, match="locked"):
        adapter.offload(ns)  # a, params and holder were rebound before box refused
    assert_same_objects(slots, before)
    assert all(isinstance(before[name], jax.Array) for name in values)
    assert not adapter.offloaded

    ns["box"].locked = False  # the same adapter can try again
    del before  # the test's own references would keep the device arrays alive
    off = adapter.offload(ns)
    assert off.count == 6 and isinstance(ns["a"], np.ndarray)
    assert adapter.reload().count == 6
    for name, expected in values.items():
        assert_same_array(slots[name](), expected)


def test_a_device_copy_failing_halfway_through_a_reload_keeps_everything_offloaded():
    ns, slots = mixed_namespace()
    values = {name: np.array(get()) for name, get in slots.items() if name != "params"}
    adapter = make_adapter()
    adapter.offload(ns)
    offloaded = snapshot(slots)
    default = adapter.to_device
    adapter.to_device = failing_after(3, default)
    with pytest.raises(MemoryError):
        adapter.reload()
    assert adapter.offloaded
    assert_same_objects(slots, offloaded)

    adapter.to_device = default
    assert adapter.reload().count == 6
    for name, expected in values.items():
        assert_same_array(slots[name](), expected)


def test_a_slot_refusing_halfway_through_a_reload_keeps_everything_offloaded():
    ns, slots = mixed_namespace()
    values = {name: np.array(get()) for name, get in slots.items() if name != "params"}
    adapter = make_adapter()
    adapter.offload(ns)
    offloaded = snapshot(slots)
    ns["box"].locked = True  # e.g. the user froze a config object while released
    with pytest.raises(TypeError, match="locked"):
        adapter.reload()  # a, params and holder were rebound before box refused
    assert adapter.offloaded
    assert_same_objects(slots, offloaded)
    assert isinstance(ns["a"], np.ndarray)

    ns["box"].locked = False
    assert adapter.reload().count == 6
    for name, expected in values.items():
        assert_same_array(slots[name](), expected)


def test_an_undo_that_fails_is_reported_not_hidden():
    once = WriteOnce(v=jnp.arange(3))
    ns = {"once": once, "box": Lockable(v=jnp.ones(2), locked=True)}
    adapter = make_adapter()
    with pytest.raises(UndoIncomplete) as caught:
        adapter.offload(ns)  # once['v'] moved, box refused, once refused the undo
    assert isinstance(caught.value.cause, TypeError)
    (stuck,) = caught.value.stuck
    assert stuck.startswith("once") and "locked" in stuck
    assert "1 object(s) are not as they were" in str(caught.value)
    assert isinstance(once["v"], np.ndarray)  # the truth: this one did not go back
