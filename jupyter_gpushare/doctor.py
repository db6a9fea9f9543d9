"""``jupyter gpushare doctor``: what this machine supports and what the server will choose, and why.

Every check is a :class:`Check` with ``ok`` True (fine), False (a problem to act on) or None
(for information / not applicable). Nothing here raises on a machine without a GPU: each check
says why it cannot apply. The backend and the release method are chosen by
:mod:`jupyter_gpushare.server.selection`, as the server chooses them, so the doctor reports what the
server will do.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from .node.daemon_client import NODE_DAEMON_ENV
from .reclaim import MethodContext
from .reclaim.driver import MIN_DRIVER, MIN_DRIVER_MIGRATE
from .server import selection
from .telemetry.nvml import NVMLProbe, NVMLTelemetry, driver_major, foreign_pids
from .units import GiB

CAP_SYS_PTRACE = 19  # linux/capability.h

# NVML's "unavailable" warnings would repeat what the report says: keep them out of it.
_QUIET = logging.getLogger("jupyter_gpushare.doctor.quiet")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False


@dataclass
class Check:
    name: str
    ok: bool | None  # None = information, or does not apply here
    detail: str


def _cuda_driver_text(v: int | None) -> str:
    return f"CUDA {v // 1000}.{v % 1000 // 10}" if v else "CUDA version unknown"


def _check_nvml(p: NVMLProbe) -> Check:
    if not p.ok:  # no driver at all is a CPU machine (information); a broken one is a problem
        return Check("NVML", None if p.no_driver else False, p.reason)
    return Check("NVML", True, f"driver {p.driver_version}, {_cuda_driver_text(p.cuda_driver_version)}")


def _check_gpus(p: NVMLProbe) -> Check:
    if not p.ok:
        return Check("GPUs", None, "none found (NVML unavailable)")
    if not p.gpus:
        return Check("GPUs", False, "NVML works but lists no GPU")
    parts = []
    for g in p.gpus:
        mem = f", {g.memory_total / GiB:.0f} GiB" if g.memory_total else ""
        mig = f", MIG instance of GPU {g.parent_index}" if g.mig else ""
        parts.append(f"{g.index}: {g.name}{mem}{mig}")
    if p.mig_gpus:
        parts.append(f"MIG enabled on GPU {', '.join(map(str, p.mig_gpus))}")
    return Check("GPUs", True, "; ".join(parts))


def _check_driver_version(p: NVMLProbe) -> Check:
    name = "driver for checkpoint API"
    major = driver_major(p.driver_version)
    if not p.ok or major is None:
        return Check(name, None, "no NVIDIA driver to check")
    if major < MIN_DRIVER:
        return Check(name, False, f"{p.driver_version} < {MIN_DRIVER}: no CUDA checkpoint API; "
                                  "the framework method will be used")
    if major < MIN_DRIVER_MIGRATE:
        return Check(name, True, f"{p.driver_version} >= {MIN_DRIVER}; restoring onto another "
                                 f"GPU needs {MIN_DRIVER_MIGRATE}")
    return Check(name, True, f"{p.driver_version} >= {MIN_DRIVER_MIGRATE}: checkpoint, restore, "
                             "and restore onto another GPU")


def _check_cuda_core(p: NVMLProbe) -> Check:
    name = "cuda.core checkpoint"
    try:
        mod = importlib.import_module("cuda.core.checkpoint")
    except Exception as e:
        # without a GPU nothing needs it: information, not a failure
        return Check(name, False if p.ok else None, f"not importable ({e.__class__.__name__}: {e}); "
                                  "pip install 'jupyter-gpushare[checkpoint]'")
    if not hasattr(mod, "Process"):
        return Check(name, False, "cuda.core has no checkpoint.Process: upgrade cuda-core")
    versions = []
    for pkg in ("cuda.core", "cuda.bindings"):
        try:
            versions.append(f"{pkg} {importlib.import_module(pkg).__version__}")
        except Exception:
            continue
    return Check(name, True, ", ".join(versions) or "importable")


def _capabilities() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_permissions() -> Check:
    name = "permissions"
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        return Check(name, True, "running as root: can checkpoint any kernel")
    caps = _capabilities()
    if caps is not None and caps & (1 << CAP_SYS_PTRACE):
        return Check(name, True, "CAP_SYS_PTRACE: can checkpoint any kernel")
    scope = ""
    try:
        scope = Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip()
    except OSError:
        pass
    extra = f" (yama ptrace_scope={scope})" if scope else ""
    return Check(name, None, "not root, no CAP_SYS_PTRACE: kernels of this user usually work; "
                             f"other users' kernels and some driver operations need root{extra}")


def _check_pid_namespace(p: NVMLProbe) -> Check:
    name = "pid namespace"
    if not p.ok:
        return Check(name, None, "no NVML processes to compare")
    tel = NVMLTelemetry(log=_QUIET)
    try:
        tel.open()
        pids = {u.pid for u in tel.processes()}
    finally:
        tel.close()
    if not pids:
        return Check(name, None, "no GPU process running to compare with")
    foreign = foreign_pids(pids)
    if foreign:
        return Check(name, False, f"{len(foreign)} of {len(pids)} NVML pids do not exist here: "
                                  "a container with its own pid namespace; kernels are matched "
                                  "through their agents' reports and the driver method may not "
                                  "reach them")
    return Check(name, True, f"all {len(pids)} NVML pids are visible here")


def _check_restore_turns(p: NVMLProbe) -> Check:
    """Whether restores here take turns with other users' restores. The default
    node_lock_dir serves one user's servers; another user's process on a GPU means restores
    there share it with restores that take no turn with them."""
    name = "restore turns"
    daemon = os.environ.get(NODE_DAEMON_ENV, "")
    if daemon:
        return Check(name, True, f"the node daemon at {daemon} ({NODE_DAEMON_ENV}) runs every "
                                 "server's restore turns and tells each server the others' "
                                 "placed kernels and released states")
    advice = ("set GPUShareApp.node_lock_dir to a root-owned directory every server shares, "
              "or GPUShareApp.node_daemon_socket (see the admin guide)")
    others: dict[int, set[int]] = {}
    if p.ok:
        tel = NVMLTelemetry(log=_QUIET)
        try:
            tel.open()
            usage = tel.processes()
        finally:
            tel.close()
        me = os.geteuid()
        for u in usage:
            try:
                uid = psutil.Process(u.pid).uids().effective
            except (psutil.Error, OSError):
                continue  # not visible here: the pid namespace check says so
            if uid != me:
                others.setdefault(u.gpu, set()).add(uid)
    if others:
        gpus = ", ".join(f"GPU {g}" for g in sorted(others))
        return Check(name, None, f"restores on {gpus} share it with other users' processes and "
                                 "the default node_lock_dir (this user's servers only) does not "
                                 "cover them: such restores need room for twice their state, and "
                                 "placement does not see those users' new kernels; " + advice)
    return Check(name, None, "the default node_lock_dir serializes this user's servers only; "
                             "for several users' servers on a node, " + advice)


def _check_plugins(plugins: list[selection.Plugin]) -> Check | None:
    """The release methods and telemetry backends other packages register (None: none):
    a FAIL for one that is ignored (a built-in's name) or whose class does not load."""
    if not plugins:
        return None
    parts, ok = [], True
    for plugin in plugins:
        why = f"ignored: {plugin.ignored}" if plugin.ignored else selection.plugin_problem(plugin)
        ok = ok and not why
        parts.append(f"{plugin}: {why}" if why else str(plugin))
    return Check("plug-ins", ok, "; ".join(parts))


@dataclass
class Report:
    """The checks, and what the server will choose here (as ``--json`` gives it)."""

    backend: str  # the telemetry backend the server will use
    backend_reason: str
    method: str  # the release method it will use ("off": none)
    method_reason: str
    configured_backend: str  # as configured ("auto", or a backend's name)
    configured_method: str
    checks: list[Check]

    def as_json(self) -> dict[str, object]:
        return asdict(self)


def collect(backend: str = "auto", release_method: str = "auto") -> list[Check]:
    """Run every check. ``backend`` and ``release_method`` as the server is configured."""
    return diagnose(backend, release_method).checks


def diagnose(backend: str = "auto", release_method: str = "auto") -> Report:
    """Run every check and say what the server will choose (``backend`` and
    ``release_method`` as it is configured)."""
    from .telemetry.nvml import probe as nvml_probe

    p = nvml_probe(log=_QUIET)
    checks = [
        _check_nvml(p),
        _check_gpus(p),
        _check_driver_version(p),
        _check_cuda_core(p),
        _check_permissions(),
        _check_pid_namespace(p),
        _check_restore_turns(p),
    ]
    plugins = _check_plugins(selection.all_plugins())
    if plugins is not None:
        checks.append(plugins)
    chosen, why = selection.resolve_backend(backend, selection.nvml_look(p))
    ok = None if backend != "nvml" else p.ok and bool(p.gpus)
    problem = selection.backend_problem(chosen)
    if problem:  # a plug-in that does not load: the server runs, tracking nothing
        ok, why = False, f"configured, but {problem}"
    arrow = f"{backend} -> {chosen}" if backend == "auto" else backend
    checks.append(Check("telemetry backend", ok, f"{arrow}: {why}"))
    method = selection.choose_method(release_method, chosen, MethodContext(probe=p))
    checks.append(Check("release method", None, f"{release_method} -> {method.name}: {method.reason}"))
    # before the two lines that say what was chosen (they end the report)
    checks.insert(len(checks) - 2, Check("incremental releases", None, incremental_text(method.name)))
    return Report(backend=chosen, backend_reason=why, method=method.name,
                  method_reason=method.reason, configured_backend=backend,
                  configured_method=release_method, checks=checks)


def incremental_text(method: str) -> str:
    """What a release copies with ``method``: the driver's checkpoint copies everything by
    its nature; the framework and simulated methods only what changed since their host copy."""
    if method == "driver":
        return ("the driver checkpoint copies the whole process at every release; the "
                "framework method (auto picks it per kernel where it holds all the kernel's "
                "memory) copies only what changed since its kept host copy")
    if method in ("framework", "simulated"):
        return ("a release copies only what changed since the host copy kept at the last "
                "restore or made while idle (precopy_after; PyTorch: by version counters and "
                "a fingerprint of each storage read on the GPU; JAX: arrays still alive); "
                "CuPy arrays whole; "
                "JUPYTER_GPUSHARE_KEEP_HOST_COPY=0 in the kernel copies everything")
    return "no incremental releases with this method"


_MARK = {True: " ok ", False: "FAIL", None: " -- "}


def format_report(checks: list[Check]) -> str:
    width = max((len(c.name) for c in checks), default=0)
    lines = ["jupyter-gpushare doctor"]
    lines += [f"[{_MARK[c.ok]}] {c.name.ljust(width)}  {c.detail}" for c in checks]
    return "\n".join(lines)


DESCRIPTION = """\
What this machine supports for jupyter-gpushare (NVIDIA driver, NVML, the CUDA checkpoint
API, permissions, containers) and which telemetry backend and release method the server
will use here, and why. Runs anywhere, a machine without a GPU included; exits 0 unless its
own options are wrong."""

EPILOG = """\
each line: [ ok ] fine, [FAIL] a problem to act on, [ -- ] information or not applicable.
examples:
  jupyter gpushare doctor
  jupyter gpushare doctor --backend nvml --release-method driver
  jupyter gpushare doctor --json | jq '.backend, .method'
  jupyter gpushare doctor --json | jq '.checks[] | select(.ok == false)'"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The doctor's options (shared by `jupyter gpushare doctor` and `python -m`)."""
    parser.description = DESCRIPTION
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--backend", choices=selection.backend_names(), default=None,
        help=f"the telemetry backend as the server is configured (default: ${selection.BACKEND_ENV}, "
             "else auto)",
    )
    parser.add_argument(
        "--release-method", choices=selection.method_names(), default="auto",
        help="the release method as the server is configured (default: auto)",
    )
    parser.add_argument("--json", action="store_true",
                        help="print a JSON object: the chosen backend and method with their "
                             "reasons (backend, backend_reason, method, method_reason, "
                             "configured_backend, configured_method) and the checks (a list "
                             "of {name, ok, detail})")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    backend = args.backend
    if backend is None:
        try:
            backend = selection.backend_from_environment()
        except selection.SettingError as e:
            parser.error(str(e))
    report = diagnose(backend, args.release_method)
    if args.json:
        print(json.dumps(report.as_json(), indent=2))
    else:
        print(format_report(report.checks))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jupyter gpushare doctor")
    add_arguments(parser)
    return run(parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
