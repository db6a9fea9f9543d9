"""JAX: move device arrays bound in the namespace to host memory and back, by rebinding.

JAX arrays are immutable and expose no way to swap their buffer, so ``id()`` cannot survive.
Instead the places that hold them are rebound:

- each top-level user name (and ``Out`` entry) holding a pytree (dicts, lists, tuples,
  namedtuples, flax/optax/equinox structures) gets the same tree with NumPy leaves while
  offloaded and the same tree with fresh device arrays after the reload (containers are
  rebuilt, leaves shared between names stay shared);
- arrays inside objects that are not pytrees (attributes, closures, dict/list members) are
  rebound where they sit; arrays held only by a tuple, set or partial inside such an object
  cannot be rebound and stay on the device (reported).

Memory is released only when nothing else holds the old array. An array that is still alive
after the rebinding (held outside the namespace) is reported and, on reload, that very
array is put back, so it never exists twice on the device. ``jax.live_arrays()`` tells
what else stays on the device.

Sharding, committed placement and weak type are restored; dtype and values are bitwise.

Incremental releases: JAX arrays are immutable, so the host copy a restore came from is still
that array's bytes for as long as the very array is alive (and not donated). A restore keeps
it (``JUPYTER_GPUSHARE_KEEP_HOST_COPY=0``: not), a pre-copy makes one for arrays without,
and the next release takes it instead of copying. A host copy something else holds (a CPU
cell took the NumPy value while released, in lazy mode) is never kept: it could change.

All or nothing (:mod:`.txn`): every array is copied first; then every slot is rebound, and
if one refuses (a container that validates what it holds), the slots already rebound get
their old values back, so a failed offload or reload leaves every object as it was (same
ids, values and devices) and raises.
"""

from __future__ import annotations

import gc
import os
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..walk import Ref, namespace_roots, walk, walk_namespace
from .base import KEEP_HOST_COPY_ENV, OffloadAdapter, OffloadReport, drop_oldest, keep_host_copies
from .txn import Change, apply_all


def _setting(environ: Any, name: str) -> str:
    return str(environ.get(name, "")).strip().lower()


def pooled_bytes(environ: Any, stats: list[dict[str, Any]]) -> int:
    """GPU bytes XLA's allocator keeps reserved whatever becomes of the arrays: every byte it
    holds (reserved or pooled) unless ``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` (JAX's docs:
    the only allocator that gives memory back); with preallocation off, only where JAX's
    stats report a pool. ``stats``: each GPU's ``memory_stats()``."""
    if _setting(environ, "XLA_PYTHON_CLIENT_ALLOCATOR") == "platform":
        return 0
    preallocated = _setting(environ, "XLA_PYTHON_CLIENT_PREALLOCATE") not in ("false", "0")
    total = 0
    for one in stats:
        pool = int(one.get("pool_bytes") or 0)
        if preallocated or pool:
            total += max(int(one.get("bytes_reserved") or 0), pool, int(one.get("bytes_in_use") or 0))
    return total


def _jax() -> Any:
    import jax

    return jax


def _on_accelerator(array: Any) -> bool:
    return any(device.platform != "cpu" for device in array.devices())


def _to_numpy(array: Any) -> Any:
    import numpy

    return numpy.array(array, copy=True)  # a copy: on CPU, asarray may share the buffer


def _to_device(entry: HeldArray) -> Any:
    """Default ``to_device``: the host copy back where and how the original array was."""
    jax = _jax()
    if entry.committed:
        array = jax.device_put(entry.host, entry.sharding)
    else:  # uncommitted arrays follow their computations to any device; keep it so
        array = jax.device_put(entry.host)
    if entry.weak_type:
        from jax._src.lax import lax as lax_internal

        array = lax_internal._convert_element_type(array, weak_type=True)
    return array


@dataclass
class HeldArray:
    """One device array while offloaded: its host copy and how to put it back."""

    host: Any
    sharding: Any
    committed: bool
    weak_type: bool
    path: str
    nbytes: int
    original: weakref.ref[Any]
    new: Any = None  # the device array after reload


@dataclass
class _Binding:
    """A slot we rebound: ``ref`` holds ``host_value`` while offloaded."""

    ref: Ref
    host_value: Any
    treedef: Any  # None when the slot holds a single array found inside an object
    leaves: list[Any] = field(default_factory=list)  # HeldArray markers or the original leaves
    root: str = ""  # the top-level name it was reached from
    path: str = ""  # where the slot is, for messages


# a kept copy is used only while provably current (PyTorch: version counters and a device
# fingerprint; JAX: the very array alive); the switch is the base's
KEEP_ENV = KEEP_HOST_COPY_ENV


@dataclass
class _Kept:
    """A host copy of one device array: its bytes while that very array lives, undeleted."""

    array: weakref.ref[Any]
    host: Any
    nbytes: int
    at: float = field(default_factory=time.monotonic)

    def current(self, array: Any = None) -> bool:
        alive = self.array()
        if alive is None or (array is not None and alive is not array):
            return False
        try:
            return not alive.is_deleted()  # donated to a computation: gone
        except Exception:
            return False


#: id(device array) -> its kept host copy; process-wide (adapters are made anew per release)
_kept: dict[int, _Kept] = {}
_kept_lock = threading.RLock()


def kept_copies() -> dict[str, int]:
    with _kept_lock:
        entries = list(_kept.values())
    return {"current": sum(e.nbytes for e in entries if e.current()),
            "kept": sum(e.nbytes for e in entries)}


def drop_kept(wanted: int | None = None) -> int:
    """Free kept host copies, oldest first, until ``wanted`` bytes are freed (None: all)."""
    freed = drop_oldest(_kept, _kept_lock, wanted)
    return freed


def _kept_copy(array: Any) -> Any:
    """The kept host copy of ``array`` if it is current, else None."""
    with _kept_lock:
        entry = _kept.get(id(array))
    return entry.host if entry is not None and entry.current(array) else None


def _offload_changes(bindings: list[_Binding]) -> Iterator[Change]:
    for binding in bindings:
        old = binding.ref.current()  # read just before the change: what an undo puts back
        yield Change(
            do=lambda b=binding: b.ref.rebind(b.host_value),
            undo=lambda b=binding, v=old: b.ref.rebind(v),
            what=binding.path,
        )


def _root_name(path: str) -> str:
    match = re.match(r"[A-Za-z_][A-Za-z0-9_]*", path)
    return match.group(0) if match else ""


class JaxAdapter(OffloadAdapter):
    module = "jax"
    name = "jax"

    def __init__(
        self,
        *,
        is_device: Callable[[Any], bool] | None = None,
        to_host: Callable[[Any], Any] | None = None,
        to_device: Callable[[HeldArray], Any] | None = None,
        max_depth: int = 100,
        max_objects: int = 1_000_000,
    ) -> None:
        """is_device(array): which arrays to move (default: on a non-CPU device);
        to_host(array) -> a host copy (default: a NumPy copy);
        to_device(held) -> a new device array from ``held.host`` (default: ``device_put``
        with the original sharding, committed placement and weak type)."""
        self.is_device = is_device or _on_accelerator
        self.to_host = to_host or _to_numpy
        self.to_device = to_device or _to_device
        self.walk_options = {"max_depth": max_depth, "max_objects": max_objects}
        self._held: list[HeldArray] = []
        self._bindings: list[_Binding] = []

    @property
    def offloaded(self) -> bool:
        return bool(self._bindings)

    def device_bytes(self) -> int:
        total = 0
        for device in _jax().local_devices():
            if device.platform == "cpu":
                continue
            stats = device.memory_stats() or {}
            total += max(
                stats.get("bytes_reserved", 0),
                stats.get("pool_bytes", 0),
                stats.get("bytes_in_use", 0),
            )
        return total

    def pool_bytes(self) -> int:
        stats = [device.memory_stats() or {} for device in _jax().local_devices()
                 if device.platform != "cpu"]
        return pooled_bytes(os.environ, stats)

    def trim(self) -> int:
        """JAX offers no way to return its allocator's cache; with
        ``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` freed buffers go back at once. Frees the
        kept host copies (host memory a driver checkpoint needs room in)."""
        drop_kept()
        return 0

    # -- host copies kept while resident -------------------------------------------------------

    def precopy(self, namespace: dict[str, Any], stop: Any = None) -> OffloadReport:
        """Copy to host every device array reachable from the namespace that has no kept
        copy. Safe while cells run: an array never changes, and one made meanwhile is new."""
        report = OffloadReport(framework=self.name)
        if self._bindings:
            return report
        start = time.perf_counter()
        result = walk_namespace(namespace, self._is_target, **self.walk_options)
        arrays = [found.obj for found in result.found.values()]
        result.release()
        for array in arrays:
            if stop is not None and stop.is_set():
                report.stopped = True
                break
            if _kept_copy(array) is not None:
                continue
            try:
                host = self.to_host(array)
            except Exception:  # deleted (donated) meanwhile: nothing to keep
                continue
            with _kept_lock:
                _kept[id(array)] = _Kept(weakref.ref(array), host, int(array.nbytes))
            report.copied += int(array.nbytes)
            report.count += 1
        report.seconds = time.perf_counter() - start
        return report

    def host_copies(self) -> dict[str, int]:
        kept = kept_copies()
        try:
            live = sum(int(a.nbytes) for a in _jax().live_arrays() if self.is_device(a))
        except Exception:
            live = kept["current"]
        return {**kept, "to_copy": max(0, live - kept["current"])}

    def drop_host_copies(self, wanted: int | None = None) -> int:
        return drop_kept(wanted)

    # -- offload ----------------------------------------------------------------------------

    def _is_target(self, obj: Any) -> bool:
        return isinstance(obj, _jax().Array) and self.is_device(obj)

    def offload(self, namespace: dict[str, Any]) -> OffloadReport:
        report = OffloadReport(framework=self.name)
        if self._bindings:
            return report
        start = time.perf_counter()
        before = self.device_bytes()
        held: dict[int, HeldArray] = {}
        originals: list[Any] = []  # alive until every slot is rebound (ids stay unique)

        def hold(array: Any, path: str) -> HeldArray:
            entry = held.get(id(array))
            if entry is None:
                originals.append(array)
                host = _kept_copy(array)
                if host is None:  # no current host copy: copied now
                    host = self.to_host(array)
                    report.copied += int(array.nbytes)
                entry = held[id(array)] = HeldArray(
                    host=host,
                    sharding=array.sharding,
                    committed=bool(getattr(array, "_committed", True)),
                    weak_type=bool(getattr(array, "weak_type", False)),
                    path=path,
                    nbytes=int(array.nbytes),
                    original=weakref.ref(array),
                )
            return entry

        # 1. copy every device array to host (in ``hold``); nothing has changed if this fails
        bindings, objects = self._bind_trees(namespace, hold)
        bindings += self._bind_in_objects(objects, hold, report)
        # 2. rebind every slot to its host value, all or nothing
        apply_all(_offload_changes(bindings))
        objects.clear()
        originals.clear()  # from here on only the rebound slots decide what stays alive
        drop_kept()  # taken, or of arrays no longer reachable
        self._held = list(held.values())
        self._bindings = bindings
        held.clear()

        alive = self._still_alive()
        for entry in self._held:
            if entry.original() is None:
                report.bytes += entry.nbytes
                report.count += 1
        for entry in alive:
            report.skip(
                f"{entry.path}: still referenced outside the namespace; "
                f"{entry.nbytes} bytes stay on the device"
            )
        self._report_unreachable(report)
        report.freed_bytes = max(0, before - self.device_bytes())
        report.seconds = time.perf_counter() - start
        return report

    def _bind_trees(
        self, namespace: dict[str, Any], hold: Callable[[Any, str], HeldArray]
    ) -> tuple[list[_Binding], list[tuple[str, Any]]]:
        """Rebuild each top-level pytree with host leaves; return the non-pytree leaves."""
        tree_util = _jax().tree_util
        bindings = []
        objects: list[tuple[str, Any]] = []
        for path, value, ref in namespace_roots(namespace):
            if ref is None:
                continue  # traceback frames: cannot rebind, reported via live arrays
            try:
                leaves, treedef = tree_util.tree_flatten(value)
            except Exception:
                leaves, treedef = [value], None
            if treedef is None:
                objects.append((path, value))
                continue
            marked = []
            for index, leaf in enumerate(leaves):
                if self._is_target(leaf):
                    marked.append(
                        hold(leaf, path if treedef.num_leaves == 1 else f"{path}<{index}>")
                    )
                else:
                    marked.append(leaf)
                    objects.append((f"{path}<{index}>", leaf))
            if any(isinstance(leaf, HeldArray) for leaf in marked):
                host_leaves = [m.host if isinstance(m, HeldArray) else m for m in marked]
                host_value = tree_util.tree_unflatten(treedef, host_leaves)
                bindings.append(
                    _Binding(ref, host_value, treedef, marked, _root_name(path), path)
                )
        return bindings, objects

    def _bind_in_objects(
        self,
        objects: list[tuple[str, Any]],
        hold: Callable[[Any, str], HeldArray],
        report: OffloadReport,
    ) -> list[_Binding]:
        """Arrays inside objects that are not pytrees: rebind them where they sit."""
        result = walk([(p, o, None) for p, o in objects], self._is_target, **self.walk_options)
        if result.truncated:
            report.skip(f"<walk>: stopped after {result.visited} objects")
        bindings = []
        for found in result.found.values():
            fixed = [ref for ref in found.refs if not ref.rebindable]
            if fixed:
                kinds = sorted({type(ref.container).__name__ for ref in fixed})
                report.skip(
                    f"{found.path}: held by {', '.join(kinds)} (cannot rebind); left on the device"
                )
                continue
            entry = hold(found.obj, found.path)
            root = _root_name(found.path)
            bindings.extend(
                _Binding(ref, entry.host, None, [entry], root, found.path) for ref in found.refs
            )
        result.release()
        return bindings

    def _still_alive(self) -> list[HeldArray]:
        alive = [entry for entry in self._held if entry.original() is not None]
        if alive:
            gc.collect()  # a reference cycle may be all that keeps them
            alive = [entry for entry in alive if entry.original() is not None]
        return alive

    def _report_unreachable(self, report: OffloadReport) -> None:
        known = {id(entry.original()) for entry in self._held if entry.original() is not None}
        rest = [a for a in _jax().live_arrays() if id(a) not in known and self._is_target(a)]
        if rest:
            nbytes = sum(int(a.nbytes) for a in rest)
            report.skip(
                f"<live arrays>: {len(rest)} device arrays ({nbytes} bytes) not reachable from "
                "the namespace (closures in tuples, jit constants, library state) stay on the device"
            )

    # -- reload ------------------------------------------------------------------------------

    def reload(self) -> OffloadReport:
        report = OffloadReport(framework=self.name)
        if not self._bindings:
            return report
        start = time.perf_counter()
        jax = _jax()
        fresh: list[HeldArray] = []  # made from their host copy: the copy may be kept
        try:
            # 1. a device array for every held one (the original where it is still alive)
            for entry in self._held:
                entry.new = entry.original()
                if entry.new is None:
                    entry.new = self.to_device(entry)
                    fresh.append(entry)
                    report.bytes += entry.nbytes
                    report.count += 1
            jax.block_until_ready([entry.new for entry in self._held])
            # 2. rebind every slot to it, all or nothing; slots the user rebound stay as are
            apply_all(self._reload_changes(report))
        except BaseException:
            for entry in self._held:
                entry.new = None  # still offloaded; a later reload may find room
            raise
        self._held, self._bindings = [], []
        if keep_host_copies():
            self._keep(fresh)
        report.seconds = time.perf_counter() - start
        return report

    @staticmethod
    def _keep(fresh: list[HeldArray]) -> None:
        """Keep the host copies the restored arrays came from, for the next release: only
        those nothing else holds (the entry's own reference, and getrefcount's argument)."""
        with _kept_lock:
            for entry in fresh:
                host, new = entry.host, entry.new
                entry.new = None
                if sys.getrefcount(host) <= 3 and new is not None:  # + the local name
                    _kept[id(new)] = _Kept(weakref.ref(new), host, entry.nbytes)
                del host, new

    def _reload_changes(self, report: OffloadReport) -> Iterator[Change]:
        tree_util = _jax().tree_util
        for binding in self._bindings:
            if binding.ref.current() is not binding.host_value:
                report.skip(f"{binding.root}: rebound while offloaded; kept as is")
                continue
            if binding.treedef is None:
                value = binding.leaves[0].new
            else:
                leaves = [m.new if isinstance(m, HeldArray) else m for m in binding.leaves]
                value = tree_util.tree_unflatten(binding.treedef, leaves)
            yield Change(
                do=lambda b=binding, v=value: b.ref.rebind(v),
                undo=lambda b=binding: b.ref.rebind(b.host_value),
                what=binding.path,
            )
