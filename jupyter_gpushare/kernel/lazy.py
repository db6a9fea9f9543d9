"""Lazy restore: decide from a cell's code whether it may touch the GPU.

Conservative by design: anything we cannot rule out counts as "may touch the GPU" (the
cost of a wrong "yes" is a restore; of a wrong "no" a GPU call that waits for the
server's watchdog).
"""

from __future__ import annotations

import ast
import types
from typing import Any

GPU_MODULES = ("torch", "cupy", "jax", "jaxlib", "tensorflow", "numba", "jupyter_gpushare.sim")
_SKIP = {"In", "Out", "get_ipython", "exit", "quit", "_oh", "_ih", "_dh"}


def _is_gpu_module(mod: types.ModuleType) -> bool:
    name = getattr(mod, "__name__", "") or ""
    return any(name == m or name.startswith(m + ".") for m in GPU_MODULES)


def _holds_gpu(obj: Any, depth: int = 0, seen: set[int] | None = None) -> bool:
    """Whether ``obj`` is or reaches (a few levels deep) a GPU object."""
    seen = seen if seen is not None else set()
    if id(obj) in seen or depth > 4:
        return False
    seen.add(id(obj))
    mod = type(obj).__module__ or ""
    if mod.startswith("jupyter_gpushare.sim"):
        return True
    if mod.startswith("torch") and getattr(obj, "is_cuda", False):
        return True
    if mod.startswith("cupy"):
        return True
    if mod.startswith(("jax", "jaxlib")):
        return True
    if mod.startswith("torch.nn") or (hasattr(obj, "parameters") and mod.startswith("torch")):
        return True
    if isinstance(obj, dict):
        return any(_holds_gpu(v, depth + 1, seen) for v in list(obj.values())[:1000])
    if isinstance(obj, (list, tuple, set, frozenset)):
        return any(_holds_gpu(v, depth + 1, seen) for v in list(obj)[:1000])
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict) and not isinstance(obj, (type, types.ModuleType, types.FunctionType)):
        return any(_holds_gpu(v, depth + 1, seen) for v in list(attrs.values())[:1000])
    return False


def gpu_names(namespace: dict[str, Any]) -> set[str]:
    """Top-level names in the user namespace that are or reach GPU objects now."""
    names = set()
    for name, value in list(namespace.items()):
        if name.startswith("_") or name in _SKIP:
            continue
        if isinstance(value, types.ModuleType):
            if _is_gpu_module(value):
                names.add(name)
            continue
        try:
            if _holds_gpu(value):
                names.add(name)
        except Exception:  # an exotic object: assume the worst
            names.add(name)
    return names


def may_touch_gpu(code: str, shell: Any, gpu_bound: set[str]) -> bool:
    """True unless the cell provably uses no GPU object, GPU module or user function."""
    try:
        source = shell.transform_cell(code) if shell is not None else code
        tree = ast.parse(source)
    except Exception:
        return True
    ns = getattr(shell, "user_ns", {}) if shell is not None else {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(m.split(".")[0] in {g.split(".")[0] for g in GPU_MODULES} for m in mods):
                return True
        elif isinstance(node, ast.Name):
            if node.id in gpu_bound:
                return True
            value = ns.get(node.id)
            if isinstance(value, types.ModuleType) and _is_gpu_module(value):
                return True
            if isinstance(value, (types.FunctionType, type)) and getattr(value, "__module__", "") == "__main__":
                return True  # user code can reach anything: conservative
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("exec", "eval", "get_ipython"):
            return True
    return False
