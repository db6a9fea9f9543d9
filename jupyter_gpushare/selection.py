"""Which telemetry backend and which release method a server uses, and why.

The server (``app.py``) and ``jupyter gpushare doctor`` both decide here, so the doctor says
what the server will do. The candidates come from the registries
(``jupyter_gpushare.telemetry.BACKENDS``, ``jupyter_gpushare.reclaim.METHODS``): nothing here
names a particular method.

Nothing touches hardware at import; the functions that look (a method's ``support()``) are
called by the server at load and by the doctor.
"""

from __future__ import annotations

import difflib
import importlib
import os
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from .reclaim import METHODS, MethodContext, ReclaimMethod
from .telemetry import BACKENDS, Telemetry, TelemetrySettings

#: the environment variable that gives ``c.GPUShareApp.backend`` its default
BACKEND_ENV = "JUPYTER_GPUSHARE_BACKEND"
AUTO = "auto"
OFF = "off"
SIMULATED = "simulated"


class SettingError(ValueError):
    """A configured value that is not one of the accepted ones; the message names the setting."""


def _load(spec: str) -> Any:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


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
def backend_names() -> list[str]:
    return [AUTO, *BACKENDS]


def check_backend(value: Any, setting: str = "GPUShareApp.backend") -> str:
    return _one_of(setting, value, backend_names())


def backend_from_environment(environ: Mapping[str, str] = os.environ) -> str:
    """``$JUPYTER_GPUSHARE_BACKEND``, checked like the trait; "auto" when unset or empty."""
    value = environ.get(BACKEND_ENV, "") or AUTO
    return check_backend(value, BACKEND_ENV)


def telemetry_class(backend: str) -> type[Telemetry]:
    """The class a configured backend uses ("auto" tries NVML first)."""
    cls: type[Telemetry] = _load(BACKENDS["nvml" if backend == AUTO else backend])
    return cls


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
def method_names() -> list[str]:
    return [AUTO, OFF, *METHODS]


def check_method(value: Any, setting: str = "GPUShareApp.release_method") -> str:
    return _one_of(setting, value, method_names())


def method_class(name: str) -> type[ReclaimMethod]:
    cls: type[ReclaimMethod] = _load(METHODS[name])
    return cls


@dataclass
class MethodChoice:
    """The release methods that work here and the one the server uses."""

    name: str  # the method in use, or "off"
    reason: str
    methods: dict[str, ReclaimMethod] = field(default_factory=dict)  # every usable one
    unusable: dict[str, str] = field(default_factory=dict)  # name -> why not
    support: dict[str, str] = field(default_factory=dict)  # name -> why usable


def choose_method(release_method: str, backend: str, context: MethodContext) -> MethodChoice:
    """Create every registered method that acts on this kind of node, keep those whose
    ``support()`` says yes, and pick: "off" -> none; a named method -> it when usable (on the
    simulated node, the simulated method whatever is named); "auto" -> the usable method of
    the highest ``auto_rank``."""
    simulated = backend == SIMULATED
    candidates = {n: method_class(n) for n in METHODS}
    candidates = {n: c for n, c in candidates.items() if c.simulated == simulated}
    choice = MethodChoice(OFF, "")
    for name, cls in candidates.items():
        method = cls.create(context)
        support = method.support()
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
    elif release_method not in (AUTO, *choice.methods) and not simulated:
        why = choice.unusable.get(release_method) or "it acts on the simulated node only"
        choice.reason = f"release_method = {release_method}, but {why}"
    elif usable:
        choice.name = usable[0]
        passed = [n for n in ranked[:ranked.index(usable[0])] if n in choice.unusable]
        choice.reason = "; ".join(f"{n} unavailable: {choice.unusable[n]}" for n in passed) \
            or choice.support[usable[0]]
    else:
        choice.reason = "; ".join(f"{n}: {why}" for n, why in choice.unusable.items()) \
            or "no release method acts on this node"
    return choice

