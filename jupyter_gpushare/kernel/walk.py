"""The one walk over a notebook's objects: what is reachable from the user's names.

Two questions are answered with it, each by its own predicate: the framework adapters ask
which tensors and arrays the user can still reach (to move them to host memory and back;
``offload/``), and lazy restore asks which names may reach the GPU at all (``lazy.py``).

The walk follows globals, containers (dict keys and values), object attributes
(``__dict__`` and ``__slots__``), closures, defaults, partials and bound methods. It is
breadth-first (so reported paths are the shortest ones), remembers visited ids (cycles
end), and stops at a depth and an object budget (a huge dataset in a global never stalls a
release); the result says when it stopped short, so a caller that must be conservative can
treat "not looked at" as "found". It imports no framework: callers pass ``is_target``.

Each found object carries every place it was seen (:class:`Ref`), so an adapter for immutable
arrays (JAX) can rebind them, and knows which references it cannot rebind (tuples, sets,
dict keys, partial arguments).
"""

from __future__ import annotations

import collections
import functools
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

#: top-level names IPython (or the user's shell) owns: never user state worth walking
SHELL_NAMES = frozenset({"In", "Out", "exit", "quit", "get_ipython"})

#: types that never hold tensors (checked by exact type: cheap in long lists)
_ATOMIC: frozenset[type] = frozenset(
    {
        int,
        float,
        complex,
        bool,
        str,
        bytes,
        bytearray,
        memoryview,
        range,
        slice,
        type(None),
        type(Ellipsis),
        type(NotImplemented),
    }
)

# Descending into these would walk the interpreter rather than the user's state.
_OPAQUE = (
    types.ModuleType,
    types.FrameType,
    types.CodeType,
    types.GeneratorType,
    types.CoroutineType,
    types.AsyncGeneratorType,
    types.BuiltinFunctionType,
    types.MappingProxyType,
)


def is_user_name(name: str) -> bool:
    """True for names the user bound (not ``_``, ``_i3``, ``__builtins__``, ``In``, ``Out``)."""
    return not name.startswith("_") and name not in SHELL_NAMES


@dataclass(frozen=True, slots=True)
class Ref:
    """One place an object is bound: ``container[key]`` or ``container.key``.

    ``how`` is ``"dict"``, ``"list"``, ``"attr"`` or ``"cell"`` when the slot can be rebound,
    ``"fixed"`` when it cannot (tuple item, set member, dict key, partial argument).
    """

    container: Any
    key: Any
    how: str

    @property
    def rebindable(self) -> bool:
        return self.how != "fixed"

    def rebind(self, new: Any) -> None:
        if self.how in ("dict", "list"):
            self.container[self.key] = new
        elif self.how == "attr":
            object.__setattr__(self.container, self.key, new)
        elif self.how == "cell":
            self.container.cell_contents = new
        else:
            raise TypeError(f"cannot rebind a {self.how} reference")

    def current(self) -> Any:
        """What the slot holds now (to check nobody rebound it meanwhile)."""
        if self.how in ("dict", "list"):
            return self.container[self.key]
        if self.how == "attr":
            return object.__getattribute__(self.container, self.key)
        if self.how == "cell":
            return self.container.cell_contents
        raise TypeError(f"cannot read a {self.how} reference")


@dataclass(slots=True)
class Found:
    obj: Any
    path: str  # the shortest path it was reached by, e.g. "model._parameters['weight']"
    refs: list[Ref] = field(default_factory=list)


@dataclass(slots=True)
class WalkResult:
    found: dict[int, Found] = field(default_factory=dict)  # id(obj) -> Found, in BFS order
    visited: int = 0
    truncated: bool = False  # the object budget ran out: some objects were not looked at
    too_deep: bool = False  # objects at max_depth were not looked into
    unreadable: int = 0  # objects whose references could not be read (a broken proxy)
    keepalive: list[Any] = field(default_factory=list, repr=False)

    @property
    def complete(self) -> bool:
        """Every reachable object was looked at (no budget, depth or read stopped it)."""
        return not (self.truncated or self.too_deep or self.unreadable)

    def release(self) -> None:
        """Drop the strong references that kept visited ids unique during the walk."""
        self.keepalive.clear()


Child = tuple[str, Any, Ref]  # (path suffix, object, where it is bound)


def _slot_names(cls: type) -> Iterator[str]:
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        if isinstance(slots, str):
            slots = (slots,)
        for name in slots:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{klass.__name__.lstrip('_')}{name}"  # private names are mangled
            yield name


def _attr_children(obj: Any) -> Iterator[Child]:
    try:
        attrs = object.__getattribute__(obj, "__dict__")
    except Exception:
        attrs = None
    if isinstance(attrs, dict):
        for key, value in list(attrs.items()):
            yield f".{key}", value, Ref(obj, key, "attr")
    for name in _slot_names(type(obj)):
        try:
            value = object.__getattribute__(obj, name)
        except Exception:
            continue  # an unset slot
        yield f".{name}", value, Ref(obj, name, "attr")


def children(obj: Any) -> Iterator[Child]:
    """The objects ``obj`` refers to, in the ways user state usually nests."""
    kind = type(obj)
    if isinstance(obj, dict):
        for key, value in list(obj.items()):
            if type(key) not in _ATOMIC:
                yield f".keys()[{key!r:.40}]", key, Ref(obj, key, "fixed")
            yield f"[{key!r:.40}]", value, Ref(obj, key, "dict")
        if kind is not dict:
            yield from _attr_children(obj)  # OrderedDict/defaultdict subclasses with attributes
        return
    if isinstance(obj, (list, collections.deque)):
        for index, value in enumerate(list(obj)):
            yield f"[{index}]", value, Ref(obj, index, "list")
        return
    if isinstance(obj, tuple):
        for index, value in enumerate(obj):
            yield f"[{index}]", value, Ref(obj, index, "fixed")
        if kind is not tuple:
            yield from _attr_children(obj)
        return
    if isinstance(obj, (set, frozenset)):
        for index, value in enumerate(list(obj)):
            yield f".item{index}", value, Ref(obj, value, "fixed")
        return
    if isinstance(obj, types.FunctionType):
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=False):
            try:
                value = cell.cell_contents
            except ValueError:
                continue  # an empty cell
            yield f".<closure {name}>", value, Ref(cell, name, "cell")
        for index, value in enumerate(obj.__defaults__ or ()):
            yield f".__defaults__[{index}]", value, Ref(obj.__defaults__, index, "fixed")
        if obj.__kwdefaults__:
            yield ".__kwdefaults__", obj.__kwdefaults__, Ref(obj, "__kwdefaults__", "attr")
        yield from _attr_children(obj)
        return
    if isinstance(obj, types.MethodType):
        yield ".__self__", obj.__self__, Ref(obj, "__self__", "fixed")
        yield ".__func__", obj.__func__, Ref(obj, "__func__", "fixed")
        return
    if isinstance(obj, functools.partial):
        yield ".func", obj.func, Ref(obj, "func", "fixed")
        for index, value in enumerate(obj.args):
            yield f".args[{index}]", value, Ref(obj.args, index, "fixed")
        yield ".keywords", obj.keywords, Ref(obj, "keywords", "fixed")
        yield from _attr_children(obj)
        return
    if isinstance(obj, type):
        # Classes the notebook defined may keep state in class attributes; library classes
        # would lead the walk into the whole library.
        if obj.__module__ == "__main__":
            for key, value in list(vars(obj).items()):
                if not (key.startswith("__") and key.endswith("__")):
                    yield f".{key}", value, Ref(obj, key, "fixed")
        return
    yield from _attr_children(obj)


def _is_opaque(obj: Any) -> bool:
    """Objects the walk never looks into (it may still report them as targets)."""
    kind = type(obj)
    if kind in _ATOMIC or isinstance(obj, _OPAQUE):
        return True
    module = kind.__module__
    if module == "numpy" and kind.__name__ == "ndarray":
        return obj.dtype.kind != "O"  # numeric arrays hold no Python objects
    return module == "numpy" and not hasattr(obj, "__dict__")  # numpy scalars, dtypes


def walk(
    roots: Iterable[tuple[str, Any, Ref | None]],
    is_target: Callable[[Any], bool],
    *,
    target_children: Callable[[Any], Iterable[Child]] | None = None,
    max_depth: int = 100,
    max_objects: int = 1_000_000,
    stop_at_first: bool = False,
) -> WalkResult:
    """Breadth-first search from ``roots`` (``(path, object, ref)``) for ``is_target`` objects.

    Targets are not descended into the generic way (a tensor's ``__dict__`` is rarely what
    matters); ``target_children`` says what they lead to (a tensor's ``.grad`` and ``._base``).
    ``stop_at_first`` ends the walk at the first target (a yes/no question). An exception in
    ``is_target`` counts as "not a target"; a predicate that must err the other way catches
    its own exceptions.
    """
    result = WalkResult()
    seen: set[int] = set()
    queue: collections.deque[tuple[str, Any, int]] = collections.deque()
    done = False

    def visit(path: str, obj: Any, ref: Ref | None, depth: int) -> None:
        nonlocal done
        if type(obj) in _ATOMIC:
            return
        key = id(obj)
        try:
            target = is_target(obj)
        except Exception:
            target = False
        if target:
            entry = result.found.get(key)
            if entry is None:
                entry = result.found[key] = Found(obj, path)
            if ref is not None:
                entry.refs.append(ref)
            done = stop_at_first
        if key in seen or _is_opaque(obj):
            return
        seen.add(key)
        result.keepalive.append(obj)  # ids stay unique while the walk runs
        if depth < max_depth:
            queue.append((path, obj, depth))
        else:
            result.too_deep = True

    for path, obj, ref in roots:
        visit(path, obj, ref, 0)
        if done:
            return result
    while queue:
        if result.visited >= max_objects:
            result.truncated = True
            break
        path, obj, depth = queue.popleft()
        result.visited += 1
        try:
            if id(obj) in result.found:
                kids = list(target_children(obj)) if target_children else []
            else:
                kids = list(children(obj))
        except Exception:
            result.unreadable += 1
            continue  # a proxy or a broken object: nothing we can safely follow
        for suffix, child, ref in kids:
            visit(path + suffix, child, ref, depth + 1)
            if done:
                return result
    return result


def namespace_roots(
    namespace: dict[str, Any], *, include_output_history: bool = True
) -> list[tuple[str, Any, Ref | None]]:
    """The user's top-level names, plus the places outside them that keep results alive.

    ``Out`` (IPython's output cache, also behind ``_``, ``__`` and ``_N``) and the last
    traceback's frames hold objects the user cannot see by name but that still occupy memory.
    """
    roots: list[tuple[str, Any, Ref | None]] = [
        (name, value, Ref(namespace, name, "dict"))
        for name, value in list(namespace.items())
        if is_user_name(name)
    ]
    if not include_output_history:
        return roots
    out = namespace.get("Out")
    if isinstance(out, dict):
        for number, value in list(out.items()):
            roots.append((f"Out[{number}]", value, Ref(out, number, "dict")))
    traceback = getattr(sys, "last_traceback", None)
    while traceback is not None:
        frame = traceback.tb_frame
        try:
            local_vars = dict(frame.f_locals) if frame.f_globals is not namespace else {}
        except Exception:
            local_vars = {}
        for name, value in local_vars.items():
            roots.append((f"<traceback {frame.f_code.co_name}>.{name}", value, None))
        traceback = traceback.tb_next
    return roots


def walk_namespace(
    namespace: dict[str, Any],
    is_target: Callable[[Any], bool],
    *,
    include_output_history: bool = True,
    **options: Any,
) -> WalkResult:
    """:func:`walk` from a namespace's user names (see :func:`namespace_roots`)."""
    roots = namespace_roots(namespace, include_output_history=include_output_history)
    return walk(roots, is_target, **options)


def names_reaching(
    namespace: dict[str, Any],
    is_target: Callable[[Any], bool],
    *,
    conservative: bool = False,
    **options: Any,
) -> set[str]:
    """Top-level user names from which at least one ``is_target`` object is reachable.

    Each name is walked on its own, so the budget is per name. ``conservative``: a name whose
    walk stopped short (budget, depth, an unreadable object) counts as reaching a target.
    """
    names = set()
    for name, value in list(namespace.items()):
        if not is_user_name(name) or type(value) in _ATOMIC:
            continue
        result = walk([(name, value, None)], is_target, stop_at_first=True, **options)
        if result.found or (conservative and not result.complete):
            names.add(name)
        result.release()
    return names
