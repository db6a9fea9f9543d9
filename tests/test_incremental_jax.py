"""Incremental releases with the JAX adapter (on the CPU device, every array counted as
"device"): JAX arrays are immutable, so the host copy a restore came from, or a pre-copy
made, is still the array's bytes while that very array lives; the next release takes it
instead of copying. A new array (every "write" makes one) is copied; a host copy someone
else holds is never kept; ``JUPYTER_GPUSHARE_KEEP_HOST_COPY=0`` keeps nothing."""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from jupyter_gpushare.kernel.offload import jax_adapter  # noqa: E402
from jupyter_gpushare.kernel.offload.jax_adapter import JaxAdapter, drop_kept, kept_copies  # noqa: E402


@pytest.fixture(autouse=True)
def no_copies_left(monkeypatch):
    monkeypatch.delenv(jax_adapter.KEEP_ENV, raising=False)  # kept by default
    drop_kept()
    yield
    drop_kept()


def to_device(held):
    """As on a GPU, the new array owns its memory: on the CPU device, device_put may alias an
    aligned NumPy buffer (and hold it, so its copy would not be kept)."""
    return jax_adapter._to_device(replace(held, host=held.host.copy()))


def adapter() -> JaxAdapter:
    return JaxAdapter(is_device=lambda array: True, to_device=to_device)


def state():
    return {"w": jnp.arange(1000, dtype=jnp.float32), "tree": {"b": jnp.ones(10), "n": 3}}


def round_trip(ns):
    a = adapter()
    off = a.offload(ns)
    a.reload()
    return off


def test_an_unchanged_state_is_released_without_copying():
    ns = state()
    first = round_trip(ns)
    assert first.copied == first.bytes == 4040
    assert kept_copies() == {"current": 4040, "kept": 4040}
    second = adapter()
    off = second.offload(ns)
    assert off.copied == 0
    assert isinstance(ns["w"], np.ndarray)  # released: the host copy is in the slot
    second.reload()
    assert np.array_equal(np.asarray(ns["w"]), np.arange(1000, dtype=np.float32))
    assert np.array_equal(np.asarray(ns["tree"]["b"]), np.ones(10)) and ns["tree"]["n"] == 3


def test_a_new_array_is_copied_and_the_rest_is_not():
    ns = state()
    round_trip(ns)
    ns["w"] = ns["w"].at[5].set(-1.0)  # a "write": a new array
    ns["x"] = jnp.zeros(4)
    a = adapter()
    assert a.offload(ns).copied == 4000 + 16
    a.reload()
    assert float(ns["w"][5]) == -1.0 and float(ns["w"][6]) == 6.0


def test_a_precopy_copies_what_has_no_host_copy_and_the_release_then_copies_nothing():
    ns = state()
    pre = adapter().precopy(ns)
    assert pre.copied == 4040 and kept_copies()["current"] == 4040
    assert adapter().precopy(ns).copied == 0  # all current
    a = adapter()
    assert a.offload(ns).copied == 0
    a.reload()
    assert np.array_equal(np.asarray(ns["w"]), np.arange(1000, dtype=np.float32))


def test_a_precopy_stops_when_a_cell_starts():
    ns = {f"a{i}": jnp.full(8, i, dtype=jnp.float32) for i in range(4)}
    stop = threading.Event()
    stop.set()
    report = adapter().precopy(ns, stop)
    assert report.stopped and report.copied == 0


def test_a_host_copy_held_elsewhere_is_not_kept():
    """Released, a CPU cell (lazy mode) takes the NumPy value: after the restore that copy
    could change under us, so it is not kept and the next release copies."""
    ns = state()
    a = adapter()
    a.offload(ns)
    taken = ns["w"]  # the host copy, held by the person's own name
    a.reload()
    assert kept_copies()["current"] == 40  # the tree's leaf only
    taken[:] = 7  # their array: the device array is not affected
    b = adapter()
    assert b.offload(ns).copied == 4000
    b.reload()
    assert np.array_equal(np.asarray(ns["w"]), np.arange(1000, dtype=np.float32))


def test_a_donated_array_has_no_current_copy():
    ns = state()
    round_trip(ns)
    w = ns["w"]
    w.delete()  # as a computation that donated it
    assert jax_adapter._kept_copy(w) is None


def test_keeping_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(jax_adapter.KEEP_ENV, "0")
    ns = state()
    round_trip(ns)
    assert kept_copies()["kept"] == 0
    assert round_trip(ns).copied == 4040
