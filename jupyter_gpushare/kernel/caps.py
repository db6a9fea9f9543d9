"""This kernel's memory cap, applied through each GPU framework it uses.

The cap is bytes per GPU. Each framework is limited in its own way, before its first
allocation where it can be:

- **PyTorch**: ``torch.cuda.set_per_process_memory_fraction(cap / total)`` on every visible
  device, queued to run when CUDA initialises (``torch.cuda._lazy_call``) so that it holds
  from the first allocation; on a PyTorch already using CUDA it holds from the next one
  (what it holds already stays). Past it PyTorch raises its own ``OutOfMemoryError``.
- **JAX**: ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (cap / total) in the environment, read when
  JAX creates its GPU client; a JAX that has created it cannot be limited any more.
- **TensorFlow**: a logical device with ``memory_limit`` on each GPU, before TensorFlow
  initialises its GPUs; afterwards it cannot be limited any more.
- **CuPy**: its default memory pool's limit (``CUPY_GPU_MEMORY_LIMIT`` before import).
- **The simulated GPU**: its allocations and restores past the cap raise its out-of-memory
  error, as a framework's limit does.

Frameworks imported later are limited as they are imported (a post-import hook on
``sys.meta_path``); one that a cell is still importing when the cap comes (the server's
word arrives on the agent channel's thread) is limited once its import ends. What cannot be
limited (raw CUDA, another language's kernel) is watched by the server, which flags a kernel
over its cap. Every line said is plain about which case
applies.

While the kernel is released (:meth:`Caps.hold`), a cap that comes makes no GPU call: under
the driver's checkpoint every CUDA call of the process blocks until the restore (PyTorch's
``set_per_process_memory_fraction`` asks the driver for free memory), and it would block the
agent's thread that serves the server. The cap is recorded, said to apply "when the kernel's
state is back on the GPU", and applied by :meth:`Caps.resume` once the restore has put the
state back, before the next cell runs. What needs no GPU call (JAX's environment, a PyTorch
whose CUDA has not started, CuPy before it is imported) is set at once.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ..units import format_bytes

log = logging.getLogger(__name__)

JAX_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
JAX_ALLOCATOR_ENV = "XLA_PYTHON_CLIENT_ALLOCATOR"
CUPY_LIMIT_ENV = "CUPY_GPU_MEMORY_LIMIT"
SIM_DEVICE = "jupyter_gpushare.sim.device"
#: limited (or said to be) the moment they are imported
HOOKED = ("torch", "jax", "tensorflow", "cupy", SIM_DEVICE)
ALWAYS = ("jax", "cupy")  # read their limit from the environment: set before they import


class Caps:
    """The cap in effect in this process and what each framework made of it."""

    def __init__(self) -> None:
        self.cap: int | None = None
        self.total: int | None = None  # memory of the smallest GPU the kernel may use
        self.applied: dict[str, str] = {}  # framework -> what the cap is there, as said
        self._lock = threading.RLock()
        self._hook: _AfterImport | None = None
        self.held = False  # the kernel is released: no GPU call until resume()
        self.pending: set[str] = set()  # frameworks whose cap waits for resume()

    def set(self, cap: int | None, total: int | None = None) -> list[str]:
        """Apply ``cap`` (None: lift it where that can be done) to every framework here now
        and to those imported later; returns one line per framework present."""
        with self._lock:
            if cap is None and self.cap is None:
                return []  # never capped: leave every framework (and its settings) as it is
            self.cap = cap
            if total:
                self.total = total
            if cap is not None and self._hook is None:
                self._hook = _AfterImport(HOOKED, self._on_import)
                sys.meta_path.insert(0, self._hook)
            lines = []
            for name, fn in APPLY.items():
                if name not in ALWAYS and _importing(name):
                    self._when_imported(name)  # half there: its names are not all set yet
                    continue
                if name in sys.modules or name in ALWAYS:
                    line = self._apply_one(name, fn)
                    if line:
                        lines.append(line)
            return lines

    def hold(self) -> None:
        """The kernel is being released: from now on a cap makes no GPU call (it waits)."""
        with self._lock:
            self.held = True

    def resume(self) -> list[str]:
        """The kernel's state is back on the GPU: apply the caps that waited; one line each."""
        with self._lock:
            self.held = False
            waiting, self.pending = sorted(self.pending), set()
            lines = []
            for name in waiting:
                if name in sys.modules:  # (a framework gone since: nothing to cap)
                    line = self._apply_one(name, APPLY[name])
                    if line:
                        lines.append(line)
            return lines

    def _apply_one(self, name: str, fn: Callable[[Caps], str]) -> str:
        if self.held and _needs_gpu_call(name):
            self.pending.add(name)
            line = _waiting_line(name, self.cap)
            self.applied[name] = line
            return line
        try:
            line = fn(self)
        except Exception as e:  # a framework in a bad state: say so, never break the kernel
            line = f"{name}: the cap could not be applied ({type(e).__name__}: {e})"
        if line:
            self.applied[name] = line
        return line

    def _when_imported(self, name: str) -> None:
        """Apply the cap to ``name`` once another thread's import of it ends: the hook does
        it when that import began after the hook was in place, a watcher thread otherwise."""
        spec = getattr(sys.modules.get(name), "__spec__", None)
        if isinstance(getattr(spec, "loader", None), _Then):
            return

        def watch() -> None:
            while _importing(name):
                time.sleep(IMPORT_WATCH)
            if name in sys.modules:  # (a failed import leaves nothing to cap)
                self._on_import(name)

        threading.Thread(target=watch, daemon=True, name=f"gpushare-cap-{name}").start()

    def _on_import(self, name: str) -> None:
        with self._lock:
            if self.cap is not None and name in APPLY:
                self._apply_one(name, APPLY[name])

    def oom_line(self) -> str:
        """The line said under a framework's out-of-memory error while a cap holds."""
        if self.cap is None:
            return ""
        return (f"gpushare: this kernel's memory cap is {format_bytes(self.cap)} per GPU "
                "(%gpushare cap shows and changes it)")


IMPORT_WATCH = 0.05  # s between looks at an import another thread is running


def _importing(name: str) -> bool:
    """``name`` is in ``sys.modules`` but its import has not ended (a cell's thread runs it)."""
    spec = getattr(sys.modules.get(name), "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


_ORIGINAL_ENV: dict[str, str | None] = {}  # what the kernel had before the cap set it


def _set_env(name: str, value: str) -> None:
    _ORIGINAL_ENV.setdefault(name, os.environ.get(name))
    os.environ[name] = value


def _restore_env(name: str) -> None:
    """The cap is lifted: the variable as the kernel had it (its own setting stays)."""
    if name not in _ORIGINAL_ENV:
        return
    original = _ORIGINAL_ENV.pop(name)
    if original is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = original


def _fraction(caps: Caps) -> float | None:
    if caps.cap is None or not caps.total:
        return None
    return min(1.0, caps.cap / caps.total)


# -- what a released kernel's cap waits for -------------------------------------------------------
LABELS = {"torch": "PyTorch", "jax": "JAX", "tensorflow": "TensorFlow", "cupy": "CuPy",
          SIM_DEVICE: "simulated GPU"}
WAITS = "applies when the kernel's state is back on the GPU (it is released now)"


def _needs_gpu_call(name: str) -> bool:
    """Applying the cap to ``name`` now would call into the GPU driver."""
    module = sys.modules.get(name)
    if module is None:
        return False  # only the environment is set (JAX, CuPy before import)
    if name == "torch":
        cuda = getattr(module, "cuda", None)
        started = getattr(cuda, "is_initialized", None)
        return bool(started()) if callable(started) else False  # else: queued for CUDA's start
    # JAX reads the environment only; the simulated GPU's cap is an attribute its calls read
    return name not in ("jax", SIM_DEVICE)


def _waiting_line(name: str, cap: int | None) -> str:
    label = LABELS.get(name, name)
    if cap is None:
        return f"{label}: no cap; it {WAITS}"
    return f"{label}: capped at {format_bytes(cap)} per GPU; the cap {WAITS}"


# -- the frameworks ---------------------------------------------------------------------------
def _torch(caps: Caps) -> str:
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None:
        return ""
    cap = caps.cap

    def apply() -> None:
        now = caps.cap  # as it is when CUDA starts, not when this was queued
        for i in range(cuda.device_count()):
            total = cuda.get_device_properties(i).total_memory
            cuda.set_per_process_memory_fraction(1.0 if now is None else min(1.0, now / total), i)

    if cap is None:
        if cuda.is_initialized():
            apply()
        return "PyTorch: no cap"
    if cuda.is_initialized():
        apply()
        held = sum(cuda.memory_reserved(i) for i in range(cuda.device_count()))
        return (f"PyTorch: already using the GPU; capped at {format_bytes(cap)} per GPU from its "
                f"next allocation (set_per_process_memory_fraction); the {format_bytes(held)} "
                "it holds now stay")
    cuda._lazy_call(apply)  # runs when CUDA initialises: before the first allocation
    return f"PyTorch: capped at {format_bytes(cap)} per GPU (set_per_process_memory_fraction)"


def _jax_started() -> bool:
    """JAX created its backends (its memory settings are read then, once)."""
    if "jax" not in sys.modules:
        return False
    bridge = sys.modules.get("jax._src.xla_bridge")
    started = getattr(bridge, "backends_are_initialized", None)
    if callable(started):
        return bool(started())
    return bool(getattr(bridge, "_backends", None))


def _jax(caps: Caps) -> str:
    imported = "jax" in sys.modules
    if _jax_started():
        return ("JAX: already started: its memory cannot be limited any more in this "
                "kernel (restart the kernel: the cap then holds from its start)"
                if caps.cap is not None else "")
    if caps.cap is None:
        _restore_env(JAX_FRACTION_ENV)
        return "JAX: no cap" if imported else ""
    fraction = _fraction(caps)
    if fraction is None:
        return ("JAX: not limited: the GPU's memory is not known here, so no fraction can be "
                "set" if imported else "")
    _set_env(JAX_FRACTION_ENV, f"{fraction:.4f}")
    if os.environ.get(JAX_ALLOCATOR_ENV, "").lower() == "platform":
        return (f"JAX: not limited: {JAX_ALLOCATOR_ENV}=platform ignores "
                f"{JAX_FRACTION_ENV}")
    return (f"JAX: capped at {format_bytes(caps.cap)} per GPU ({JAX_FRACTION_ENV}="
            f"{fraction:.4f})" if imported else "")


def _tensorflow(caps: Caps) -> str:
    tf = sys.modules.get("tensorflow")
    config = getattr(tf, "config", None)
    if config is None or caps.cap is None:
        return ""
    try:
        gpus = config.list_physical_devices("GPU")
    except Exception:  # a build without GPU support
        return ""
    mib = max(1, caps.cap >> 20)
    try:
        for gpu in gpus:
            config.set_logical_device_configuration(
                gpu, [config.LogicalDeviceConfiguration(memory_limit=mib)])
    except RuntimeError:
        return ("TensorFlow: already using the GPU: its memory cannot be limited any more in "
                "this kernel (restart the kernel: the cap then holds from its start)")
    return f"TensorFlow: capped at {format_bytes(caps.cap)} per GPU (logical device memory_limit)"


def _cupy(caps: Caps) -> str:
    if caps.cap is None:
        _restore_env(CUPY_LIMIT_ENV)
    else:
        _set_env(CUPY_LIMIT_ENV, str(caps.cap))
    cupy = sys.modules.get("cupy")
    if cupy is None or not hasattr(cupy, "get_default_memory_pool"):
        return ""
    pool = cupy.get_default_memory_pool()
    for i in range(cupy.cuda.runtime.getDeviceCount()):
        with cupy.cuda.Device(i):
            pool.set_limit(size=caps.cap or 0)
    return ("CuPy: no cap" if caps.cap is None
            else f"CuPy: capped at {format_bytes(caps.cap)} per GPU (memory pool limit)")


def _simulated(caps: Caps) -> str:
    module = sys.modules.get(SIM_DEVICE)
    if module is None:
        return ""
    dev = module.get_device()
    dev.cap = caps.cap  # a plain attribute: no device call, so it never blocks while released
    if caps.cap is None:
        return "simulated GPU: no cap"
    held = max(dev.held().values(), default=0)
    now = f" (it holds {format_bytes(held)} already)" if held > caps.cap else ""
    return f"simulated GPU: capped at {format_bytes(caps.cap)} per GPU{now}"


APPLY: dict[str, Callable[[Caps], str]] = {
    "torch": _torch,
    "jax": _jax,
    "tensorflow": _tensorflow,
    "cupy": _cupy,
    SIM_DEVICE: _simulated,
}


def is_oom(error: BaseException | None) -> bool:
    """``error`` is a GPU framework's out-of-memory error (by its type's name and message:
    no framework is imported to tell)."""
    if error is None:
        return False
    name = type(error).__name__
    if name in ("OutOfMemoryError", "SimOutOfMemoryError", "ResourceExhaustedError"):
        return True
    return name in ("XlaRuntimeError", "JaxRuntimeError") and "RESOURCE_EXHAUSTED" in str(error)


# -- limiting frameworks as they are imported ------------------------------------------------------
class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then(name)`` once each of ``names`` has been imported (a top-level package)."""

    def __init__(self, names: tuple[str, ...], then: Callable[[str], None]):
        self.names = names
        self.then = then
        self._finding: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.names or fullname in self._finding:
            return None
        self._finding.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Then(spec.loader, lambda: self._then(fullname))
        return spec

    def _then(self, name: str) -> None:
        try:
            self.then(name)
        except Exception:  # never break an import over the cap
            log.exception("gpushare: applying the memory cap to %s failed", name)


class _Then(importlib.abc.Loader):
    def __init__(self, loader: Any, then: Callable[[], None]):
        self.loader = loader
        self.then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        self.then()

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ...
        return getattr(self.loader, name)


_caps = Caps()


def get() -> Caps:
    return _caps
