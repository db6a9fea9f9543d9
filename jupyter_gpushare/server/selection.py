"""Which telemetry backend and which release method a server uses, and why.

The server (``app.py``) and ``jupyter gpushare doctor`` both decide here, so the doctor says
what the server will do. The candidates are the built-ins
(``jupyter_gpushare.telemetry.BACKENDS``, ``jupyter_gpushare.reclaim.METHODS``) and the
plug-ins other installed packages register as entry points (groups
``jupyter_gpushare.telemetry_backends`` and ``jupyter_gpushare.release_methods``, one
``name = "module:Class"`` line each): nothing here names a particular method.

Plug-ins are read when a name is checked or a choice is made, never at import. A plug-in
named like a built-in (or "auto", "off") is ignored with a warning; one whose class fails to
load is not available, with the reason (a method: ``MethodChoice.unusable``; a backend: a
source whose status says why, see ``UnavailableTelemetry``), never a crash.

Nothing touches hardware at import; the functions that look (a method's ``support()``) are
called by the server at load and by the doctor.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import os
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from ..reclaim import ENTRY_POINT_GROUP as METHOD_GROUP
from ..reclaim import METHODS, MethodContext, ReclaimMethod
from ..telemetry import BACKENDS, Telemetry, TelemetrySettings, UnavailableTelemetry
from ..telemetry import ENTRY_POINT_GROUP as BACKEND_GROUP

log = logging.getLogger(__name__)

#: the environment variable that gives ``c.GPUShareApp.backend`` its default
BACKEND_ENV = "JUPYTER_GPUSHARE_BACKEND"
AUTO = "auto"
OFF = "off"
SIMULATED = "simulated"


class SettingError(ValueError):
    """A configured value that is not one of the accepted ones; the message names the setting."""


def _load(spec: str) -> Any:
    module, _, name = spec.partition(":")
    obj: Any = importlib.import_module(module.strip())
    for part in name.strip().split(".") if name.strip() else []:
        obj = getattr(obj, part)
    return obj


def _load_class(spec: str, base: type) -> Any:
    """The class ``spec`` ("module:Class") names; raises whatever its import raises, or
    TypeError when it is not a subclass of ``base``."""
    cls = _load(spec)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"{spec} is not a {base.__name__} subclass")
    return cls


def _failure(spec: str, e: BaseException) -> str:
    return f"{spec} failed to load ({type(e).__name__}: {e})"


# -- plug-ins: entry points of other packages --------------------------------------------------
@dataclass(frozen=True)
class Plugin:
    """One entry point another installed package registers."""

    group: str  # METHOD_GROUP or BACKEND_GROUP
    name: str  # the name the option takes
    spec: str  # where its class lives: "module:Class"
    dist: str = ""  # who registers it: "mypkg 1.0" ("" unknown)
    ignored: str = ""  # why it is not used ("" = it is)

    @property
    def kind(self) -> str:
        return "release method" if self.group == METHOD_GROUP else "telemetry backend"

    def __str__(self) -> str:
        who = f" (from {self.dist})" if self.dist else ""
        return f'{self.kind} "{self.name}" = {self.spec}{who}'


_warned: set[str] = set()


def _warn_once(text: str) -> None:
    """A plug-in's trouble, said once per process (names are read at each check)."""
    if text not in _warned:
        _warned.add(text)
        log.warning("gpushare: %s", text)


def _dist_label(ep: Any) -> str:
    dist = getattr(ep, "dist", None)
    try:
        return f"{dist.metadata['Name']} {dist.version}" if dist is not None else ""
    except Exception:
        return ""


def scan_plugins(group: str, builtins: Mapping[str, str], reserved: tuple[str, ...]) -> list[Plugin]:
    """Every entry point of ``group`` in the installed distributions, read now, those that
    are not used with why (``ignored``): a built-in's or a reserved name, a name registered
    twice (the first is used)."""
    try:
        entry_points = list(metadata.entry_points(group=group))
    except Exception as e:  # one distribution's broken metadata must not stop the server
        _warn_once(f"cannot read the entry points of {group}: {type(e).__name__}: {e}")
        return []
    out: list[Plugin] = []
    used: dict[str, str] = {}
    for ep in entry_points:
        if builtins.get(ep.name) == ep.value or used.get(ep.name) == ep.value:
            continue  # the same registration seen twice (a package on sys.path twice)
        why = ""
        if ep.name in builtins or ep.name in reserved:
            why = f'"{ep.name}" is built in'
        elif ep.name in used:
            why = f'"{ep.name}" is registered already ({used[ep.name]} is used)'
        else:
            used[ep.name] = ep.value
        out.append(Plugin(group, ep.name, ep.value, _dist_label(ep), why))
    return out


def _plugins(group: str, builtins: Mapping[str, str], reserved: tuple[str, ...]) -> dict[str, str]:
    """The usable plug-ins of ``group``: name -> spec; each ignored one is warned about."""
    found: dict[str, str] = {}
    for plugin in scan_plugins(group, builtins, reserved):
        if plugin.ignored:
            _warn_once(f"the plug-in {plugin} is ignored: {plugin.ignored}")
        else:
            found[plugin.name] = plugin.spec
    return found


def all_plugins() -> list[Plugin]:
    """Every release method and telemetry backend plug-in installed, ignored ones included
    (for the doctor)."""
    return [*scan_plugins(METHOD_GROUP, METHODS, (AUTO, OFF)),
            *scan_plugins(BACKEND_GROUP, BACKENDS, (AUTO,))]


def plugin_problem(plugin: Plugin) -> str:
    """Why ``plugin``'s class cannot be used ("" when it loads)."""
    base = ReclaimMethod if plugin.group == METHOD_GROUP else Telemetry
    try:
        _load_class(plugin.spec, base)
    except Exception as e:
        return _failure(plugin.spec, e)
    return ""


def _one_of(setting: str, value: Any, accepted: list[str]) -> str:
    if isinstance(value, str) and value in accepted:
        return value
    listed = ", ".join(f'"{a}"' for a in accepted)
    hint = ""
    if isinstance(value, str):
        close = difflib.get_close_matches(value.lower(), accepted, n=1)
        hint = f' (did you mean "{close[0]}"?)' if close else ""
    raise SettingError(f"{setting} must be one of {listed}, not {value!r}{hint}")


# -- telemetry backend ----------------------------------------------------------------------
def backends() -> dict[str, str]:
    """Every telemetry backend: name -> "module:Class", the built-ins then the plug-ins."""
    return {**BACKENDS, **_plugins(BACKEND_GROUP, BACKENDS, (AUTO,))}


def backend_names() -> list[str]:
    return [AUTO, *backends()]


def check_backend(value: Any, setting: str = "GPUShareApp.backend") -> str:
    return _one_of(setting, value, backend_names())


def backend_from_environment(environ: Mapping[str, str] = os.environ) -> str:
    """``$JUPYTER_GPUSHARE_BACKEND``, checked like the trait; "auto" when unset or empty."""
    value = environ.get(BACKEND_ENV, "") or AUTO
    return check_backend(value, BACKEND_ENV)


_unavailable: dict[tuple[str, str], type[Telemetry]] = {}


def telemetry_class(backend: str) -> type[Telemetry]:
    """The class a configured backend uses ("auto" tries NVML first). A backend whose class
    fails to load gets a source that is unavailable for that reason (the same class each
    time), so the server runs and says why."""
    name = "nvml" if backend == AUTO else backend
    spec = backends()[name]
    try:
        cls: type[Telemetry] = _load_class(spec, Telemetry)
        return cls
    except Exception as e:
        why = _failure(spec, e)
        _warn_once(f'the telemetry backend "{name}" is not available: {why}')
        key = (name, why)
        if key not in _unavailable:
            _unavailable[key] = UnavailableTelemetry.failed(name, why)
        return _unavailable[key]


def backend_problem(backend: str) -> str:
    """Why a registered backend's class cannot be used ("" when it loads, or is unknown)."""
    cls = telemetry_class(backend) if backend in backends() else None
    return cls.reason if cls is not None and issubclass(cls, UnavailableTelemetry) else ""


def backend_is_simulated(backend: str) -> bool:
    """Whether a backend's GPUs are simulated (``Telemetry.simulated``); a name that is not
    registered (a ``telemetry_class`` of its own) counts when it is "simulated"."""
    if backend not in backends():
        return backend == SIMULATED
    return telemetry_class(backend).simulated


@dataclass(frozen=True)
class SourceLook:
    """What a first look at a telemetry source found."""

    name: str  # the source's backend name ("nvml", or a custom source's)
    label: str  # how a person names it ("NVML")
    available: bool
    reason: str  # why not available
    gpus: int


def nvml_look(probe: Any) -> SourceLook:
    """A ``telemetry.nvml.NVMLProbe`` as the backend choice reads it."""
    return SourceLook("nvml", "NVML", probe.ok, probe.reason, len(probe.gpus))


def resolve_backend(configured: str, look: SourceLook) -> tuple[str, str]:
    """(backend in use, why). "auto": the source when it answers with at least one GPU, else
    the simulated node; a named backend is used as configured (the reason says what is wrong)."""
    found = f"{look.label} sees {look.gpus} GPU{'s' if look.gpus != 1 else ''}"
    if not look.available:
        trouble = f"{look.label} unavailable ({look.reason})"
    else:
        trouble = f"{look.label} found no GPU" if not look.gpus else ""
    if configured == AUTO:
        return (SIMULATED, trouble) if trouble else (look.name, found)
    if configured != look.name:  # the look was at another source (the doctor's NVML probe)
        return configured, "configured"
    return look.name, f"configured, but {trouble}" if trouble else "configured"


def open_telemetry(backend: str, cls: Any, settings: TelemetrySettings,
                   opened: ExitStack) -> tuple[Telemetry, str, str]:
    """Create and open the server's telemetry source: (source, backend name, why).

    ``cls`` (a Telemetry subclass) is ``telemetry_class``: the class ``backend`` names unless configured otherwise
    (then it is used as it is). With "auto", NVML that answers with no GPU gives way to the
    simulated node. Each source opened is closed by ``opened``; errors are the caller's."""
    telemetry = cls.create(settings)
    opened.callback(telemetry.close)
    status = telemetry.open()
    if cls is not telemetry_class(backend):  # named explicitly: used as it is
        return telemetry, telemetry.name or "custom", f"telemetry_class = {cls.__name__}"
    gpus = len(telemetry.devices()) if status.available else 0
    look = SourceLook(telemetry.name, telemetry.label or telemetry.name, status.available,
                      status.reason, gpus)
    name, why = resolve_backend(backend, look)
    if name == SIMULATED and telemetry.name != SIMULATED:
        telemetry.close()
        telemetry = telemetry_class(SIMULATED).create(settings)
        opened.callback(telemetry.close)
        telemetry.open()
        why += ": using the simulated node"
    return telemetry, name, why


# -- release method -------------------------------------------------------------------------
def methods() -> dict[str, str]:
    """Every release method: name -> "module:Class", the built-ins then the plug-ins."""
    return {**METHODS, **_plugins(METHOD_GROUP, METHODS, (AUTO, OFF))}


def method_names() -> list[str]:
    return [AUTO, OFF, *methods()]


def check_method(value: Any, setting: str = "GPUShareApp.release_method") -> str:
    return _one_of(setting, value, method_names())


def method_class(name: str) -> type[ReclaimMethod]:
    """The class of a registered method; raises when it fails to load."""
    cls: type[ReclaimMethod] = _load_class(methods()[name], ReclaimMethod)
    return cls


@dataclass
class MethodChoice:
    """The release methods that work here and the one the server uses."""

    name: str  # the method in use, or "off"
    reason: str
    methods: dict[str, ReclaimMethod] = field(default_factory=dict)  # every usable one
    unusable: dict[str, str] = field(default_factory=dict)  # name -> why not
    support: dict[str, str] = field(default_factory=dict)  # name -> why usable


def choose_method(release_method: str, backend: str, context: MethodContext,
                  simulated: bool | None = None) -> MethodChoice:
    """Create every registered method that acts on this kind of node (``simulated``: the
    backend's GPUs are simulated; default: ask :func:`backend_is_simulated`), keep those whose
    ``support()`` says yes, and pick: "off" -> none; a named method -> it when usable (on a
    simulated node, a usable simulated method, else the best simulated one whatever is
    named); "auto" -> the usable method of the highest ``auto_rank``. A method whose class
    fails to load, or whose ``create`` or ``support`` raises, is unusable with the reason;
    named, it is refused with it (nothing is released)."""
    if simulated is None:
        simulated = backend_is_simulated(backend)
    choice = MethodChoice(OFF, "")
    broken: set[str] = set()
    candidates: dict[str, type[ReclaimMethod]] = {}
    for name, spec in methods().items():
        try:
            cls: type[ReclaimMethod] = _load_class(spec, ReclaimMethod)
        except Exception as e:
            choice.unusable[name] = _failure(spec, e)
            broken.add(name)
            _warn_once(f'the release method "{name}" is not available: {choice.unusable[name]}')
            continue
        if cls.simulated == simulated:
            candidates[name] = cls
    for name, cls in candidates.items():
        try:
            method = cls.create(context)
            support = method.support()
        except Exception as e:  # a plug-in's bug: that method is out, the server goes on
            choice.unusable[name] = f"{cls.__name__} failed: {type(e).__name__}: {e}"
            continue
        if support.ok:
            choice.methods[name] = method
            choice.support[name] = support.reason
        else:
            choice.unusable[name] = support.reason
    ranked = sorted(candidates, key=lambda n: -candidates[n].auto_rank)
    usable = [n for n in ranked if n in choice.methods]
    if release_method == OFF:
        choice.reason = "release_method = off: GPU memory is tracked, never released"
    elif release_method in choice.methods and not simulated:
        choice.name, choice.reason = release_method, "configured"
    elif release_method in broken or (release_method not in (AUTO, *choice.methods)
                                      and not simulated):
        why = choice.unusable.get(release_method) or "it acts on the simulated node only"
        choice.reason = f"release_method = {release_method}, but {why}"
    elif release_method in choice.methods:  # a simulated node, a method that acts on it
        choice.name, choice.reason = release_method, choice.support[release_method]
    elif usable:
        choice.name = usable[0]
        passed = [n for n in ranked[:ranked.index(usable[0])] if n in choice.unusable]
        choice.reason = "; ".join(f"{n} unavailable: {choice.unusable[n]}" for n in passed) \
            or choice.support[usable[0]]
    else:
        choice.reason = "; ".join(f"{n}: {why}" for n, why in choice.unusable.items()) \
            or "no release method acts on this node"
    return choice



# -- "auto", per kernel: the framework method where the frameworks hold the kernel's memory ---
FRAMEWORK = "framework"
#: what the frameworks' count may miss of a kernel's GPU memory (beyond its CUDA context) and
#: the framework method still be picked: a share of the kernel's memory, and a floor in
#: bytes (cuBLAS/cuDNN workspaces, the allocators' rounding)
COVER_TOLERANCE = 0.05
COVER_SLACK = 256 << 20


def framework_covers(framework_bytes: int | None, process_bytes: int | None, context_bytes: int,
                     tolerance: float = COVER_TOLERANCE, slack: int = COVER_SLACK,
                     pool_bytes: int = 0) -> tuple[bool, str]:
    """Whether the kernel's GPU memory is the frameworks' state, so that moving their tensors
    frees it: (yes, why). ``framework_bytes``: what PyTorch, CuPy and JAX hold on the GPUs by
    the kernel agent's count (allocated plus cached); ``process_bytes``: what telemetry sees
    the kernel's processes hold; ``context_bytes``: a CUDA context's share of that, which no
    offload frees; ``pool_bytes``: the part of ``framework_bytes`` an allocator keeps reserved
    whatever is moved (JAX's pool), which the framework method cannot free either. Unknown
    figures never pick the framework method. A count above telemetry's figure covers it (the
    frameworks count their reserve as soon as they take it; telemetry and the context's
    share are estimates)."""
    mib = 1 << 20
    if framework_bytes is None:
        return False, "the kernel agent gave no count of its frameworks' GPU memory"
    if process_bytes is None:
        return False, "telemetry does not attribute GPU memory to the kernel's processes"
    if framework_bytes <= 0:
        return False, "no PyTorch, CuPy or JAX memory on the GPU"
    own = max(0, process_bytes - context_bytes)
    pool = min(max(0, pool_bytes), framework_bytes)
    freeable = framework_bytes - pool
    foreign = own - freeable
    allowed = max(slack, int(own * tolerance))
    if pool and foreign > allowed:
        return False, (f"{pool // mib} MiB of the kernel's {own // mib} MiB (CUDA context "
                       "excluded) is JAX's memory pool, which stays reserved when its arrays "
                       "move to host memory (only XLA_PYTHON_CLIENT_ALLOCATOR=platform gives "
                       "memory back): only the driver frees it")
    if foreign > allowed:
        return False, (f"{foreign // mib} MiB of the kernel's {own // mib} MiB (CUDA context "
                       f"excluded) is not PyTorch, CuPy or JAX memory: only the driver moves it")
    if freeable >= own:
        return True, (f"PyTorch, CuPy or JAX hold {freeable // mib} MiB, all of the kernel's "
                      f"{own // mib} MiB (CUDA context excluded)")
    return True, (f"PyTorch, CuPy or JAX hold {freeable // mib} MiB of the kernel's "
                  f"{own // mib} MiB (CUDA context excluded)")


def _count(report: Mapping[str, Any] | None, key: str) -> int | None:
    value = report.get(key) if report else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def method_for_kernel(default: str, usable: Mapping[str, ReclaimMethod], report: Mapping[str, Any] | None,
                      process_bytes: int | None, context_bytes: int,
                      failed: str | None = None) -> tuple[str, str]:
    """The method "auto" uses for one kernel: (name, why). The framework method when it is
    usable and the frameworks hold the kernel's memory in a form it can free
    (:func:`framework_covers`; its copies run at the bus's speed, the driver checkpoint's at
    a few GB/s), else ``default`` (the node's choice, :func:`choose_method`). ``failed``: why
    a framework release of this kernel could not free its memory: ``default`` from then on."""
    if FRAMEWORK not in usable or default == FRAMEWORK:
        return default, "the node's choice"
    if failed:
        return default, f"the framework method could not free this kernel's memory ({failed})"
    ok, why = framework_covers(_count(report, "framework_bytes"), process_bytes, context_bytes,
                               pool_bytes=_count(report, "framework_pool_bytes") or 0)
    return (FRAMEWORK, why) if ok else (default, why)
