"""Lazy restore: decide from a cell's code whether it may touch the GPU.

Conservative by design: anything we cannot rule out counts as "may touch the GPU". A
wrong "yes" costs a restore the cell did not need; a wrong "no" leaves a GPU call
blocked until the server's watchdog restores the kernel (``restore_grace``), so every
doubt resolves to "yes":

- names that reached GPU objects, GPU framework modules or user code when the kernel
  was released (:func:`gpu_names`, computed once per release with the kernel's one
  namespace walk, :mod:`.walk`, and a predicate of its own);
- names bound since then to modules, functions, classes or objects from GPU frameworks,
  from packages built on them (transformers -> torch), from ``__main__`` or from user
  modules (anything not installed in the Python environment): user code can reach
  anything;
- imports of GPU frameworks; ``exec``/``eval``/``globals()`` and friends; magics other than
  a few known to run no Python code of this kernel; code that does not parse.

Pure functions of code, namespace and ``sys.modules``: no GPU call, no framework import.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import site
import sys
import sysconfig
import types
from collections.abc import Iterable
from typing import Any

from . import walk

#: module name prefixes whose objects live on (or drive) a GPU
GPU_MODULES = ("torch", "cupy", "cupyx", "jax", "jaxlib", "tensorflow", "keras", "numba",
               "jupyter_gpushare.sim")
GPU_ROOTS = frozenset(m.split(".")[0] for m in GPU_MODULES if "." not in m)

#: names whose call can reach any object by name: we cannot see what they touch
DYNAMIC = frozenset({"exec", "eval", "compile", "globals", "locals", "vars", "__import__",
                     "get_ipython", "breakpoint"})
_BUDGET = 20_000  # objects looked into per name before we give up and say "may touch the GPU"
_MAX_DEPTH = 32  # levels of containers and attributes, likewise
_MAX_ITEMS = 100_000  # items of one container (numbers and strings cost next to nothing)

#: line magics that run no Python code of this kernel (argument expansion aside)
SAFE_LINE_MAGICS = frozenset({
    "gpushare", "pwd", "cd", "ls", "env", "who", "who_ls", "whos", "history", "hist",
    "matplotlib", "config", "lsmagic", "magic", "alias", "unalias", "bookmark", "dhist", "dirs",
    "pushd", "popd", "precision", "pprint", "colors", "xmode", "autocall", "automagic",
    "doctest_mode", "quickref", "notebook", "save",
    "pip", "conda", "mamba", "sx", "sc", "mkdir", "rmdir", "cat", "cp", "mv", "rm", "ll",
    "clear", "less", "more", "man", "lf", "lk", "lx", "ldir", "logstart", "logstop", "logstate",
    "logon", "logoff", "killbgscripts", "rehashx", "sys_info", "connect_info",
})
#: line magics whose argument is Python code of this kernel
CODE_LINE_MAGICS = frozenset({"time", "timeit", "prun", "pinfo", "pinfo2", "pdef", "pdoc",
                              "psource", "pfile", "debug"})
#: cell magics whose body is not Python run in this kernel
SAFE_CELL_MAGICS = frozenset({"bash", "sh", "script", "writefile", "file", "html", "HTML",
                              "markdown", "latex", "svg", "javascript", "js", "perl", "ruby"})
#: cell magics whose body is Python run in this kernel (checked like a cell)
CODE_CELL_MAGICS = frozenset({"time", "timeit", "prun", "capture", "gpushare"})

_GPUSHARE_LINE = re.compile(r"^\s*%gpushare(\s.*)?$")


def _matches(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def is_gpu_module_name(name: str) -> bool:
    return _matches(name or "", GPU_MODULES)


# -- which installed packages count as "user code" or "built on a GPU framework" ------------
def _install_dirs() -> tuple[str, ...]:
    """Where installed code lives: the standard library and every site-packages."""
    dirs: set[str] = set()
    for scheme_paths in (sysconfig.get_paths(), sysconfig.get_paths(vars={"base": sys.base_prefix})):
        dirs.update(scheme_paths.get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib"))
    try:
        dirs.update(site.getsitepackages())
        dirs.add(site.getusersitepackages())
    except AttributeError:  # a virtualenv's old site.py
        pass
    dirs.update(p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages"))
    return tuple(os.path.realpath(d) + os.sep for d in dirs if d)


_INSTALLED = _install_dirs()


def is_user_module(mod: Any) -> bool:
    """A module of the user's own code: ``__main__`` or a file outside the environment."""
    name = getattr(mod, "__name__", "") or ""
    if name == "__main__":
        return True
    path = getattr(mod, "__file__", None)
    if not path or not isinstance(path, str):
        return False  # built-in or namespace package
    return _is_user_path(path)


@functools.lru_cache(maxsize=4096)
def _is_user_path(path: str) -> bool:
    return not os.path.realpath(path).startswith(_INSTALLED)


_gpu_packages_cache: tuple[int, frozenset[str]] = (-1, frozenset())


def gpu_packages() -> frozenset[str]:
    """Top-level packages (not GPU frameworks) whose modules hold GPU framework modules or
    functions: calling into them may touch the GPU (transformers, lightning, ...).

    Scans ``sys.modules`` once per change in its size (a release-time cost, milliseconds)."""
    global _gpu_packages_cache
    size = len(sys.modules)
    if _gpu_packages_cache[0] == size:
        return _gpu_packages_cache[1]
    found: set[str] = set()
    for name, mod in list(sys.modules.items()):
        root = name.split(".")[0]
        if mod is None or root in found or root in GPU_ROOTS or is_gpu_module_name(name):
            continue
        try:
            values = list(vars(mod).values())
        except TypeError:
            continue
        for v in values:
            # only modules, functions and classes: reading attributes of arbitrary objects
            # could run code (lazy loaders)
            if isinstance(v, types.ModuleType):
                vname = v.__dict__.get("__name__")
            elif isinstance(v, (types.FunctionType, types.BuiltinFunctionType, type)):
                vname = getattr(v, "__module__", None)
            else:
                continue
            if isinstance(vname, str) and is_gpu_module_name(vname):
                found.add(root)
                break
    result = frozenset(found - {"__main__", "__mp_main__"})
    _gpu_packages_cache = (size, result)
    return result


def _module_may_touch(modname: str, packages: frozenset[str]) -> bool:
    if is_gpu_module_name(modname) or modname.split(".")[0] in packages:
        return True
    if modname == "__main__":
        return True
    mod = sys.modules.get(modname)
    return mod is not None and is_user_module(mod)


def _may_touch_itself(obj: Any, packages: frozenset[str]) -> bool:
    """Whether ``obj`` itself (not what it refers to) is a GPU framework's module, function,
    class or object, code of a package built on one, or user code. The walk's predicate."""
    try:
        if isinstance(obj, types.ModuleType):
            return _module_may_touch(obj.__name__, packages) or is_user_module(obj)
        if isinstance(obj, types.MethodType):
            return _may_touch_itself(obj.__func__, packages) or _may_touch_itself(obj.__self__, packages)
        if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, type,
                            types.BuiltinMethodType)):
            return _module_may_touch(getattr(obj, "__module__", None) or "", packages)
        if _module_may_touch(type(obj).__module__ or "", packages):
            return True  # a GPU framework's object (even on the CPU: .cuda()), or user class
        # too long to look through every item: assume the worst
        return isinstance(obj, (dict, list, tuple, set, frozenset)) and len(obj) > _MAX_ITEMS
    except Exception:  # an exotic object: assume the worst
        return True


def may_reach_gpu(value: Any, packages: frozenset[str] | None = None, deep: bool = True) -> bool:
    """Whether ``value`` is or reaches (through containers and attributes) a GPU object, a GPU
    module, or code that may touch the GPU. ``deep=False`` looks at the object itself only.

    A walk that stops short (object budget, depth, an object it cannot read) counts as
    "reaches": what was not looked at cannot be ruled out."""
    packages = gpu_packages() if packages is None else packages
    if not deep:
        return _may_touch_itself(value, packages)
    result = walk.walk([("", value, None)], functools.partial(_may_touch_itself, packages=packages),
                       stop_at_first=True, max_objects=_BUDGET, max_depth=_MAX_DEPTH)
    reaches = bool(result.found) or not result.complete
    result.release()
    return reaches


def gpu_names(namespace: dict[str, Any], packages: frozenset[str] | None = None) -> set[str]:
    """Top-level names in the user namespace that may reach the GPU now (see module doc)."""
    packages = gpu_packages() if packages is None else packages
    return walk.names_reaching(namespace, functools.partial(_may_touch_itself, packages=packages),
                               conservative=True, max_objects=_BUDGET, max_depth=_MAX_DEPTH)


# -- the decision ------------------------------------------------------------------------------
def only_gpushare_magics(code: str) -> bool:
    """A cell made only of ``%gpushare ...`` line magics (and blank or comment lines).

    Such a cell never needs the GPU state: ``%gpushare`` shows the state as it is, and
    ``%gpushare restore`` restores by itself with progress. The gate and the agent let it run
    on a released kernel without a restore. (``%%gpushare release-after`` is a cell magic
    whose body may touch the GPU; it is not such a cell.)"""
    lines = [ln for ln in code.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return bool(lines) and all(_GPUSHARE_LINE.match(ln) for ln in lines)


class _Checker:
    def __init__(self, shell: Any, gpu_bound: set[str], packages: frozenset[str]):
        self.shell = shell
        self.ns: dict[str, Any] = getattr(shell, "user_ns", None) or {}
        self.gpu_bound = gpu_bound
        self.packages = packages

    def source(self, code: str) -> bool:
        """True if ``code`` (IPython syntax) may touch the GPU."""
        try:
            if self.shell is not None:
                code = self.shell.transform_cell(code)
            tree = ast.parse(code)
        except Exception:
            return True
        return self.node(tree)

    def node(self, node: ast.AST) -> bool:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            return self.imports(node)
        if isinstance(node, ast.Name):
            return self.name(node.id)
        if isinstance(node, ast.Call):
            magic = self.magic(node)
            if magic is not None:
                return magic
        return any(self.node(child) for child in ast.iter_child_nodes(node))

    def imports(self, node: ast.Import | ast.ImportFrom) -> bool:
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:  # a relative import in a notebook: unknown code
                return True
            mods = [base, *(f"{base}.{a.name}" for a in node.names)]
        return any(
            is_gpu_module_name(m) or m.split(".")[0] in GPU_ROOTS or m.split(".")[0] in self.packages
            for m in mods
        )

    def name(self, ident: str) -> bool:
        if ident in self.gpu_bound:
            return True
        if ident in self.ns:
            # bound since the release (or not reaching the GPU then): look at it shallowly
            return may_reach_gpu(self.ns[ident], self.packages, deep=False)
        return ident in DYNAMIC

    def magic(self, call: ast.Call) -> bool | None:
        """``get_ipython().run_line_magic(...)`` and friends, as IPython's transforms emit
        them; None when ``call`` is not one (then it is checked as ordinary code)."""
        func = call.func
        if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Call)
                and isinstance(func.value.func, ast.Name) and func.value.func.id == "get_ipython"
                and not func.value.args):
            return None
        if call.keywords or not all(
            isinstance(a, ast.Constant) and isinstance(a.value, str) for a in call.args
        ):
            return True  # built at run time: unknown
        args = [str(a.value) for a in call.args if isinstance(a, ast.Constant)]
        kind = func.attr
        if kind in ("system", "getoutput"):
            # `!cmd` runs in a child process; {expr} and $name expand Python in this kernel
            return not args or "{" in args[0] or "$" in args[0]
        if kind == "run_line_magic" and len(args) == 2:
            name, line = args
            if name in SAFE_LINE_MAGICS:
                return "{" in line or "$" in line
            if name in CODE_LINE_MAGICS:
                return self.statement(line)
            return True
        if kind == "run_cell_magic" and len(args) == 3:
            name, line, body = args
            if name in SAFE_CELL_MAGICS:
                return False
            if name in CODE_CELL_MAGICS:
                return self.source(body) or (bool(line.strip()) and name != "gpushare"
                                             and self.statement(line))
            return True
        return True

    def statement(self, line: str) -> bool:
        """The statement of ``%timeit -n 10 -r 3 x.sum()`` and friends. Options may or may
        not take a value (``-q x`` vs ``-n 10 x``): both readings are checked."""
        with_values = _OPTIONS_WITH_VALUES.sub("", line, count=1)
        flags_only = _FLAGS.sub("", line, count=1)
        return self.source(with_values) or self.source(flags_only)


_OPTIONS_WITH_VALUES = re.compile(r"^\s*((-[A-Za-z]+(\s+(?!-)\S+)?|--\S+)\s+)*")
_FLAGS = re.compile(r"^\s*((-[A-Za-z]+|--\S+)\s+)*")


def may_touch_gpu(
    code: str, shell: Any = None, gpu_bound: set[str] | frozenset[str] = frozenset(),
    packages: frozenset[str] | None = None,
) -> bool:
    """True unless the cell provably touches no GPU object, GPU module or user code.

    ``gpu_bound``: :func:`gpu_names` of the namespace at release time; ``shell``: the IPython
    shell (magics are transformed with it; its ``user_ns`` is checked for names bound later).
    """
    if only_gpushare_magics(code):
        return False
    packages = gpu_packages() if packages is None else packages
    return _Checker(shell, set(gpu_bound), packages).source(code)
