"""``jupyter gpushare doctor``: what this machine supports and what "auto" will choose, and why.

Every check is a :class:`Check` with ``ok`` True (fine), False (a problem to act on) or None
(for information / not applicable). Nothing here raises on a machine without a GPU: each check
says why it cannot apply. The "auto" choices are made by :func:`auto_backend` and
:func:`auto_method`, which the app uses too, so the doctor reports what the server will do.
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

from .reclaim.base import Support
from .reclaim.driver import MIN_DRIVER, MIN_DRIVER_MIGRATE, driver_support
from .telemetry.nvml import NVMLProbe, NVMLTelemetry, driver_major, foreign_pids

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


def auto_backend(probe: NVMLProbe) -> tuple[str, str]:
    """Telemetry backend "auto" resolves to: ``nvml`` with at least one GPU, else ``simulated``."""
    if not probe.ok:
        return "simulated", f"NVML unavailable ({probe.reason})"
    if not probe.gpus:
        return "simulated", "NVML found no GPU"
    return "nvml", f"NVML sees {len(probe.gpus)} GPU{'s' if len(probe.gpus) != 1 else ''}"


def auto_method(backend: str, driver: Support) -> tuple[str, str]:
    """Release method "auto" resolves to, given the backend in use and the driver's support."""
    if backend == "simulated":
        return "simulated", "the simulated GPU node emulates the checkpoint state machine"
    if driver.ok:
        return "driver", driver.reason
    return "framework", f"driver checkpoint unavailable: {driver.reason}"


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
        mem = f", {g.memory_total / (1 << 30):.0f} GiB" if g.memory_total else ""
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


def collect(backend: str = "auto") -> list[Check]:
    """Run every check. ``backend``: "auto" | "nvml" | "simulated", as the server is configured."""
    from .telemetry.nvml import probe as nvml_probe

    p = nvml_probe(log=_QUIET)
    checks = [
        _check_nvml(p),
        _check_gpus(p),
        _check_driver_version(p),
        _check_cuda_core(p),
        _check_permissions(),
        _check_pid_namespace(p),
    ]
    if backend == "auto":
        chosen, why = auto_backend(p)
        checks.append(Check("telemetry backend", None, f"auto -> {chosen}: {why}"))
    elif backend == "nvml":
        chosen = "nvml"
        ok = p.ok and bool(p.gpus)
        why = "configured" if ok else f"configured, but {auto_backend(p)[1]}"
        checks.append(Check("telemetry backend", ok, f"nvml: {why}"))
    else:
        chosen = "simulated"
        checks.append(Check("telemetry backend", None, f"{backend}: configured"))
    method, why = auto_method(chosen, driver_support(p) if chosen == "nvml" else Support(False, ""))
    checks.append(Check("release method", None, f"auto -> {method}: {why}"))
    return checks


_MARK = {True: " ok ", False: "FAIL", None: " -- "}


def format_report(checks: list[Check]) -> str:
    width = max((len(c.name) for c in checks), default=0)
    lines = ["jupyter-gpushare doctor"]
    lines += [f"[{_MARK[c.ok]}] {c.name.ljust(width)}  {c.detail}" for c in checks]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="jupyter gpushare doctor",
        description="What this machine supports (driver, NVML, checkpoint API, permissions) "
                    "and which method jupyter-gpushare will use, and why.",
    )
    parser.add_argument(
        "--backend", choices=["auto", "nvml", "simulated"],
        default=os.environ.get("JUPYTER_GPUSHARE_BACKEND", "auto") or "auto",
        help="telemetry backend as configured (default: $JUPYTER_GPUSHARE_BACKEND or auto)",
    )
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    args = parser.parse_args(argv)
    checks = collect(args.backend)
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        print(format_report(checks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
