"""The GPU proof of issue 24 in one command: every GPU path, run for real, one report.

    bash benchmarks/gpu/prove.sh [--out DIR] [--part all|1|2|NAME[,NAME]] [--simulated] [--quick]

Parts (each in its own process, time-boxed; a part that cannot run here is *skipped* with
the reason, never a failure of the whole run):

- ``env``: versions, NVML's view of the GPUs, the wheelhouse, ``jupyter gpushare doctor``.
- ``pytest``: ``pytest -m gpu tests/gpu`` (real kernels and a real server with backend=nvml).
- ``nvml``: kernels holding 1, 4, 20 GiB (PyTorch) show that much in ``status`` within two
  polls, each attributed to its own kernel; SM utilization follows a matmul loop.
- ``driver``: the driver method end to end through a server and the gate: PyTorch (model +
  Adam), CuPy and JAX (75 % preallocated) kernels released, memory free per NVML, restored by
  the next cell with every checksum equal; a restore without room waits; a lock while a long
  GPU kernel runs says why; restore onto another GPU (two GPUs only); shutting down a
  restored kernel does not hang.
- ``framework``: the framework method for the PyTorch and CuPy kernels: bitwise equal,
  ``id()`` kept, an optimizer step after the round trip equals one without, bytes freed.
- ``bandwidth``: pinned host<->device copies vs release/restore of 1, 4, 16, 40 GiB by each
  method: GB/s, fraction of pinned, fixed overhead (intercept); the ``cuInit`` a fresh
  process pays.
- ``lazy``: restore_mode=lazy: a CPU-only cell on a released kernel runs without a restore; a
  GPU cell restores.

``--part 1`` = env, pytest, nvml, driver, lazy; ``--part 2`` = env, framework, bandwidth
(each under the device's 10 minutes). Without a GPU it says so, checks what it can (imports,
wheelhouse, the report's shape) and exits 0. ``--simulated`` rehearses the same parts on the
simulated backend (those that make sense there) and writes the same report shape; ``--jobs N``
runs them side by side (the rehearsal only: on a GPU the parts run one at a time).
Writes ``gpu-proof.json`` and ``gpu-proof.md`` under ``--out`` (default: $OUT, else
/tmp/gpushare-proof). ``--merge A.json B.json`` joins the reports of two ``--part`` runs.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
WHEELHOUSE = REPO / ".gpu-wheels"
SCHEMA = "jupyter-gpushare/gpu-proof/1"
MiB, GiB = 1 << 20, 1 << 30

PARTS = ["env", "pytest", "nvml", "driver", "framework", "bandwidth", "lazy"]
GROUPS = {
    "all": PARTS,
    "1": ["env", "pytest", "nvml", "driver", "lazy"],
    "2": ["env", "framework", "bandwidth"],
}
#: seconds each part may take on a GPU (a part that does not end in time is stopped)
BUDGET = {"env": 30, "pytest": 160, "nvml": 100, "driver": 170, "lazy": 60,
          "framework": 120, "bandwidth": 360}
#: seconds for a whole run: one group stays inside the device's 10 minutes a command (with the
#: wheelhouse's install before it), all parts inside 20 minutes
DEADLINE_GROUP, DEADLINE_ALL = 540.0, 1080.0
#: what each part measures (the report's headings)
WHAT = {
    "env": "versions, GPUs, wheelhouse, doctor",
    "pytest": "pytest -m gpu tests/gpu (real server, backend=nvml)",
    "nvml": "NVML attribution: memory within two polls, per kernel; SM utilization",
    "driver": "driver method end to end through the server and the gate",
    "framework": "framework method: bitwise, id() kept, optimizer step, bytes freed",
    "bandwidth": "release/restore GB/s vs pinned copies, fixed overhead",
    "lazy": "lazy mode: CPU cells without restore, GPU cells restore",
}
#: parts that mean nothing on the simulated node
NOT_SIMULATED = {
    "pytest": "the gpu-marked tests need a real GPU (NVML, CUDA)",
    "framework": "the framework method moves PyTorch/CuPy/JAX objects on a CUDA device; "
                 "the simulated node has only the simulated method",
}
STATUSES = ("ran", "failed", "skipped", "timeout")

sys.path.insert(0, str(HERE.parent))  # benchmarks/: _server, driver_release_restore
sys.path.insert(0, str(HERE))  # cells


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def source_hash() -> str:
    """A hash of the package's Python sources (the wheelhouse records the one it was built from)."""
    h = hashlib.sha256()
    for p in sorted((REPO / "jupyter_gpushare").rglob("*.py")):
        if "labextension" in p.parts:
            continue
        h.update(str(p.relative_to(REPO)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


# -- the record a part builds (in its own process) -------------------------------------------
class Skip(Exception):
    """This part (or the rest of it) cannot run here; the message says why."""


class Ctx:
    """What a part writes: checks and figures, flushed to ``path`` after each one."""

    def __init__(self, part: str, mode: str, path: Path, deadline: float, quick: bool,
                 out: Path | None = None):
        self.part = part
        self.out = out or path.parent  # where logs worth keeping go (beside the report)
        self.mode = mode  # "gpu" | "simulated"
        self.path = path
        self.deadline = deadline  # time.monotonic() by which the part must be done
        self.quick = quick
        self.checks: list[dict[str, Any]] = []
        self.figures: dict[str, Any] = {}
        self.pids: list[list[float]] = []  # [pid, create_time] of servers to kill if stopped
        self.status = "running"
        self.reason: str | None = None
        self.flush()

    @property
    def real(self) -> bool:
        return self.mode == "gpu"

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def check(self, name: str, ok: bool | None, detail: str = "") -> bool | None:
        """ok: True passed, False failed, None = not applicable here (detail says why)."""
        self.checks.append({"name": name, "ok": ok, "detail": detail})
        mark = {True: "ok", False: "FAIL", None: "--"}[ok]
        print(f"  [{mark:>4}] {self.part}: {name}: {detail}", flush=True)
        self.flush()
        return ok

    def figure(self, key: str, value: Any) -> None:
        self.figures[key] = value
        self.flush()

    def note_server(self, srv: Any) -> None:
        import psutil

        with contextlib.suppress(psutil.Error):
            p = psutil.Process(srv.pid)
            self.pids.append([p.pid, p.create_time()])
            self.flush()

    def flush(self) -> None:
        data = {"status": self.status, "reason": self.reason, "checks": self.checks,
                "figures": self.figures, "pids": self.pids}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str))
        tmp.replace(self.path)


# -- talking to servers and kernels ----------------------------------------------------------
def server_config(ctx: Ctx, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"poll_interval": 0.5, "idle_timeout": 0, "min_release_bytes": 0,
                           "pressure_free_fraction": 0.0, "lock_timeout": 2.0,
                           # no kernel is released to make room for another's restore here
                           "pressure_idle_timeout": 3600}
    if ctx.real:
        cfg.update(backend="nvml")
    else:  # a small node, polled faster: the rehearsal must stay quick
        cfg.update(backend="simulated", simulated_gpus=[512 * MiB, 512 * MiB], poll_interval=0.25,
                   lock_timeout=1.0)
        cfg.pop("release_method", None)
        extra.pop("release_method", None)
    cfg.update(extra)
    return cfg


@contextlib.asynccontextmanager
async def server(ctx: Ctx, name: str, **extra: Any) -> AsyncIterator[Any]:
    from _server import Server

    async with Server(name, gpushare=server_config(ctx, **extra)) as srv:
        ctx.note_server(srv)
        yield srv


async def start_kernels(srv: Any, n: int) -> list[Any]:
    kernels = await asyncio.gather(*(srv.start_kernel() for _ in range(n)))
    srv._note_tree()
    return list(kernels)


def cell(kind: str, what: str, **kw: Any) -> str:
    from cells import KINDS

    return KINDS[kind][what].format(**kw)


async def view(srv: Any, kid: str) -> dict[str, Any]:
    return await srv.kernel_status(kid)


async def post(srv: Any, path: str) -> tuple[int, dict[str, Any]]:
    """POST to the gpushare API; (HTTP code, JSON body) also for 4xx/5xx answers."""
    from tornado.httpclient import HTTPClientError

    try:
        return 200, await srv.api("POST", f"/api/gpushare/{path}")
    except HTTPClientError as e:
        body = e.response.body if e.response is not None else b""
        try:
            return e.code, json.loads(body or b"{}")
        except ValueError:
            return e.code, {"message": body.decode(errors="replace")}


async def wait_polls(srv: Any, n: int = 2) -> None:
    await asyncio.sleep(srv.gpushare["poll_interval"] * n + 0.1)


def nvml_free() -> Callable[[int], int | None]:
    """Free bytes on a GPU as NVML sees them (real mode only)."""
    from jupyter_gpushare.telemetry.nvml import NVMLTelemetry

    tel = NVMLTelemetry()
    tel.open()
    return tel.free_bytes


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "?"
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.0f} MiB"


# -- parts -----------------------------------------------------------------------------------
def part_env(ctx: Ctx) -> None:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for mod, dist in (("jupyter_gpushare", "jupyter-gpushare"), ("jupyter_server", "jupyter_server"),
                      ("jupyter_client", "jupyter_client"), ("ipykernel", "ipykernel"),
                      ("pytest", "pytest"), ("pytest_jupyter", "pytest-jupyter"),
                      ("pynvml", "nvidia-ml-py"), ("cuda.core", "cuda-core"),
                      ("cuda.bindings", "cuda-bindings"), ("torch", "torch"), ("jax", "jax"),
                      ("cupy", "cupy-cuda13x"), ("numpy", "numpy")):
        try:
            m = importlib.import_module(mod)
            versions[dist] = str(getattr(m, "__version__", "") or _dist_version(dist) or "?")
        except Exception as e:  # absent, or failing to load its library
            versions[dist] = None
            if mod in ("jupyter_gpushare", "jupyter_server", "jupyter_client", "ipykernel"):
                ctx.check(f"import {mod}", False, f"{e.__class__.__name__}: {e}")
    ctx.figure("versions", versions)
    needed = {"jupyter_gpushare": "jupyter-gpushare", "jupyter_server": "jupyter_server",
              "ipykernel": "ipykernel", "pytest_jupyter": "pytest-jupyter"}
    missing = [m for m in needed if not _importable(m)]
    ctx.check("Jupyter packages importable", not missing,
              "missing: " + ", ".join(missing) + " (carry the wheelhouse: wheelhouse.sh)"
              if missing else ", ".join(f"{m} {versions.get(d) or '?'}" for m, d in needed.items()))
    try:
        import _server  # noqa: F401  (the benchmarks' server harness, jupyter_server's API)

        ctx.check("benchmark server harness imports", True, "benchmarks/_server.py")
    except Exception as e:
        ctx.check("benchmark server harness imports", False, f"{e.__class__.__name__}: {e}")

    wheels = sorted(WHEELHOUSE.rglob("*.whl")) if WHEELHOUSE.is_dir() else []
    manifest = WHEELHOUSE / "MANIFEST.json"
    info: dict[str, Any] = {"path": str(WHEELHOUSE), "wheels": len(wheels),
                            "bytes": sum(w.stat().st_size for w in wheels)}
    if manifest.exists():
        info.update(json.loads(manifest.read_text()))
    ctx.figure("wheelhouse", info)
    if not wheels:
        ctx.check("wheelhouse", None if not missing else False,
                  f"no wheels in {WHEELHOUSE} (run benchmarks/gpu/wheelhouse.sh before going to "
                  "the GPU machine)")
    else:
        built_from = info.get("source_hash")
        same = built_from == source_hash()
        ctx.check("wheelhouse", True if same else None,
                  f"{len(wheels)} wheels, {fmt_bytes(info['bytes'])}; "
                  + ("built from these sources" if same else
                     f"built from other sources ({built_from}): the repo's code is used (PYTHONPATH)"))

    from jupyter_gpushare.telemetry.nvml import probe

    p = probe()
    gpus: list[dict[str, Any]] = [{"index": g.index, "name": g.name, "uuid": g.uuid,
                                   "memory_total": g.memory_total, "mig": g.mig} for g in p.gpus]
    ctx.figure("nvml", {"ok": p.ok, "reason": p.reason, "driver": p.driver_version,
                        "cuda_driver": p.cuda_driver_version, "gpus": gpus})
    if ctx.real:
        ctx.check("NVML sees a GPU", bool(p.ok and gpus),
                  f"driver {p.driver_version}: " + "; ".join(
                      f"{g['index']}: {g['name']} {fmt_bytes(g['memory_total'])}" for g in gpus))
    else:
        ctx.check("NVML", None, p.reason or f"driver {p.driver_version} (not used: simulated)")
    try:
        import psutil

        ctx.figure("host", {"cpus": os.cpu_count(), "ram_bytes": psutil.virtual_memory().total,
                            "available_bytes": psutil.virtual_memory().available,
                            "kernel": platform.release()})
    except ImportError:
        pass
    for args, key in ((["--backend", "nvml" if ctx.real else "simulated"], "doctor"),):
        r = subprocess.run([sys.executable, "-m", "jupyter_gpushare.doctor", *args],
                           capture_output=True, text=True, timeout=60)
        ctx.figure(key, (r.stdout + r.stderr).strip())
        ctx.check("jupyter gpushare doctor", r.returncode == 0,
                  f"exit {r.returncode}; {len(r.stdout.splitlines())} lines in the report")


def _dist_version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _installed(mod: str) -> bool:
    """Whether ``mod`` can be found (not imported: jax and cupy take seconds to import)."""
    return importlib.util.find_spec(mod) is not None


def _importable(mod: str) -> bool:
    try:
        importlib.import_module(mod)
        return True
    except Exception:
        return False


def part_pytest(ctx: Ctx) -> None:
    if not ctx.real:
        raise Skip(NOT_SIMULATED["pytest"])
    out = ctx.out / "pytest-gpu.log"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-p", "no:cacheprovider",
           "-o", "addopts=", "-q", "-rs", "--timeout", "150"]
    try:
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                           timeout=max(ctx.left() - 10, 30))
        text, code = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        code = -1
    out.write_text(text)
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    summary = next((ln for ln in reversed(lines) if " in " in ln and ("passed" in ln or "failed" in ln
                    or "skipped" in ln or "error" in ln)), lines[-1] if lines else "")
    ctx.figure("summary", summary.strip("= "))
    ctx.figure("skips", [ln for ln in lines if ln.startswith("SKIPPED")])
    ctx.figure("failures", [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))])
    ctx.check("pytest -m gpu", code == 0 if code != 5 else None,
              f"exit {code}: {summary.strip('= ')}" if code != -1 else "timed out")


async def part_nvml(ctx: Ctx) -> None:
    sizes = ([GiB // 4, GiB] if ctx.quick else [GiB, 4 * GiB, 20 * GiB]) if ctx.real else \
        [8 * MiB, 48 * MiB]
    kind = "torch" if ctx.real else "sim"
    if ctx.real:
        free = nvml_free()(0) or 0
        sizes = [s for s in sizes if s + len(sizes) * GiB < free * 0.9] or sizes[:1]
    async with server(ctx, "nvml") as srv:
        poll = srv.gpushare["poll_interval"]
        kernels = await start_kernels(srv, len(sizes))
        base = {k.id: (await view(srv, k.id)).get("gpu_memory_bytes") or 0 for k in kernels}
        if ctx.real:  # the CUDA context first, so the allocation is what shows up next
            await asyncio.gather(*(k.run("import torch; torch.zeros(1, device='cuda')")
                                   for k in kernels))
            await wait_polls(srv, 2)
            base = {k.id: (await view(srv, k.id)).get("gpu_memory_bytes") or 0 for k in kernels}
        ctx.figure("context_bytes", base)
        seen: dict[str, float | None] = {}
        for k, n in zip(kernels, sizes, strict=True):
            await k.run(cell(kind, "ALLOC", n=n), timeout=300)
            t0 = time.monotonic()
            try:
                await srv.wait_kernel(k.id, lambda v, k=k, n=n: (v.get("gpu_memory_bytes") or 0)
                                      >= base[k.id] + n * 0.99, f"{n} bytes", timeout=10 * poll + 5)
                seen[k.id] = time.monotonic() - t0
            except TimeoutError:
                seen[k.id] = None
        views = {k.id: await view(srv, k.id) for k in kernels}
        rows: list[dict[str, Any]] = []
        for k, n in zip(kernels, sizes, strict=True):
            got = views[k.id].get("gpu_memory_bytes") or 0
            t = seen[k.id]
            rows.append({"alloc_bytes": n, "status_bytes": got, "context_bytes": base[k.id],
                         "seconds_to_show": t, "polls": None if t is None else round(t / poll, 2)})
            # a loaded CI machine (the rehearsal) gets more slack than the GPU run
            ctx.check(f"{fmt_bytes(n)} shows in status within two polls",
                      t is not None and t <= 2 * poll + (0.3 if ctx.real else 1.0),
                      f"{fmt_bytes(got)} after {t if t is None else round(t, 2)} s "
                      f"(poll {poll} s; context {fmt_bytes(base[k.id])})")
        ctx.figure("attribution", rows)
        # each kernel holds its own size: attributed separately (within its context)
        slack = GiB if ctx.real else MiB
        separate = all(n <= r["status_bytes"] - r["context_bytes"] <= n + slack
                       for n, r in zip(sizes, rows, strict=True))
        ctx.check("kernels attributed separately", separate,
                  "; ".join(f"{fmt_bytes(r['alloc_bytes'])} -> {fmt_bytes(r['status_bytes'])}"
                            for r in rows))

        # SM utilization follows a matmul loop in the first kernel, the others stay idle
        busy, idle = kernels[0], kernels[1:]
        spin_s = 6 if ctx.real else 2
        spin = asyncio.ensure_future(busy.run(cell(kind, "SPIN", s=spin_s), timeout=120))
        series: list[list[Any]] = []
        t0 = time.monotonic()
        while not spin.done() or time.monotonic() - t0 < spin_s + 4 * poll:
            st = await srv.api("GET", "/api/gpushare/status")
            util = {k["id"]: k.get("sm_utilization") for k in st["kernels"]}
            series.append([round(time.monotonic() - t0, 2), util.get(busy.id),
                           max((util.get(k.id) or 0) for k in idle) if idle else None])
            await asyncio.sleep(poll)
            if time.monotonic() - t0 > 40:
                break
        await spin
        ctx.figure("sm_series", series)
        during = [s[1] or 0 for s in series if spin_s * 0.25 <= s[0] <= spin_s - 0.3]
        after = [s[1] or 0 for s in series if s[0] >= spin_s + 3 * poll]
        others = [s[2] or 0 for s in series]
        ctx.check("SM utilization follows the loop",
                  bool(during) and max(during) >= 30 and bool(after) and after[-1] <= 10,
                  f"busy kernel: max {max(during, default=0)} % during, {after[-1] if after else '?'} % "
                  f"after; others max {max(others, default=0)} %")
        ctx.check("an idle kernel shows no SM use", max(others, default=0) <= 10,
                  f"max {max(others, default=0)} %")


async def kernel_state(ctx: Ctx, srv: Any, kind: str, n: int) -> tuple[Any, str]:
    k = (await start_kernels(srv, 1))[0]
    ck = await k.value(cell(kind, "STATE", n=n), timeout=300)
    await srv.wait_kernel(k.id, lambda v: (v.get("gpu_memory_bytes") or 0) >= n * 0.9,
                          f"{kind} kernel to show its memory", timeout=30)
    return k, ck


async def round_trip(ctx: Ctx, srv: Any, k: Any, label: str, ck: str,
                     free: Callable[[int], int | None] | None) -> dict[str, Any]:
    """Release over REST, check the memory is free, restore by the next cell, compare."""
    held = (await view(srv, k.id)).get("gpu_memory_bytes") or 0
    free0 = free(0) if free else None
    code, v = await post(srv, f"kernels/{k.id}/release")
    ok = code == 200 and v.get("state") == "released"
    ctx.check(f"{label}: release", ok, f"HTTP {code}, {v.get('state')}, {fmt_bytes(v.get('released_bytes'))}"
              f" in {v.get('last_release_seconds')} s" + (f"; {v.get('error')}" if v.get("error") else ""))
    if not ok:
        return {"kernel": label, "released": False, "error": v.get("error") or v.get("message")}
    await wait_polls(srv)
    after = await view(srv, k.id)
    freed = (free(0) or 0) - free0 if free and free0 is not None else None
    ctx.check(f"{label}: memory free (NVML)" if ctx.real else f"{label}: memory free",
              (after.get("gpu_memory_bytes") or 0) == 0 and (freed is None or freed >= held * 0.9),
              f"kernel shows {fmt_bytes(after.get('gpu_memory_bytes'))}; GPU 0 free +{fmt_bytes(freed)} "
              f"of {fmt_bytes(held)} held")
    t0 = time.monotonic()
    ck2 = await k.value("print(json.dumps(checksum()))", timeout=300)
    cell_s = time.monotonic() - t0
    back = await view(srv, k.id)
    ctx.check(f"{label}: next cell restores, checksum equal", ck2 == ck and back.get("state") == "active",
              f"{back.get('state')}, restore {back.get('last_restore_seconds')} s, cell {cell_s:.2f} s")
    return {"kernel": label, "held_bytes": held, "freed_bytes": freed,
            "release_s": v.get("last_release_seconds"), "restore_s": back.get("last_restore_seconds"),
            "cell_s": round(cell_s, 3), "checksum_equal": ck2 == ck}


async def part_driver(ctx: Ctx) -> None:
    if ctx.real:
        from jupyter_gpushare.reclaim.driver import driver_support

        s = driver_support()
        if not s.ok:
            raise Skip(f"driver method unsupported here: {s.reason}")
        free: Callable[[int], int | None] | None = nvml_free()
        kinds = [("torch", GiB if ctx.quick else 4 * GiB), ("cupy", GiB), ("jax", GiB)]
        for k, _n in kinds:
            if not _installed(k):
                ctx.check(f"{k} kernel", None, f"{k} is not installed")
        kinds = [(k, n) for k, n in kinds if _installed(k)]
        if not kinds or kinds[0][0] != "torch":
            raise Skip("PyTorch is not installed")
        env = {"TF_FORCE_GPU_ALLOW_GROWTH": "true"}  # JAX keeps its default: 75 % up front
    else:
        free = None
        kinds = [("sim", 32 * MiB), ("sim", 64 * MiB)]
        env = {}
    async with server(ctx, "driver", kernel_env=env, release_method="driver") as srv:
        ks: list[tuple[str, Any, str]] = []
        for kind, n in kinds:
            k, ck = await kernel_state(ctx, srv, kind, n)
            ks.append((kind, k, ck))
            v = await view(srv, k.id)
            ctx.check(f"{kind} kernel holds its state", True,
                      f"{fmt_bytes(v.get('gpu_memory_bytes'))} on GPU {v.get('gpus')}")
        rows = []
        for i, (kind, k, ck) in enumerate(ks[:-1]):
            rows.append(await round_trip(ctx, srv, k, f"{kind}#{i}", ck, free))
        ctx.figure("round_trips", rows)

        # a restore without room waits (the last kernel: JAX's 75 %, or the bigger sim state)
        first_kind, first, _ = ks[0]
        kind, k, ck = ks[-1]
        held = (await view(srv, k.id)).get("gpu_memory_bytes") or 0
        code, v = await post(srv, f"kernels/{k.id}/release")
        ctx.check(f"{kind}: release", code == 200 and v.get("state") == "released",
                  f"HTTP {code}, {fmt_bytes(v.get('released_bytes'))} in {v.get('last_release_seconds')} s")
        await wait_polls(srv)
        if ctx.real and free is not None:
            room = free(0) or 0
        else:
            st = await srv.api("GET", "/api/gpushare/status")
            g0 = st["gpus"][0]
            room = g0["memory_total"] - g0["memory_used"]
        filler = int(room - held // 2)
        if "ALLOC" not in __import__("cells").KINDS[first_kind] or filler <= 0:
            ctx.check("a restore without room waits", None, "no kernel to fill the GPU with")
        else:
            await first.run(cell(first_kind, "ALLOC", n=filler), timeout=300)
            await wait_polls(srv)
            t0 = time.monotonic()
            pending = asyncio.ensure_future(k.value("print(json.dumps(checksum()))", timeout=300))
            try:
                w = await srv.wait_kernel(k.id, lambda v: bool(v.get("waiting")), "waiting", timeout=30)
                waiting = w.get("waiting")
            except TimeoutError:
                waiting = None
            await asyncio.sleep(2 if ctx.real else 0.5)  # and still waiting a while later
            mid = await view(srv, k.id)
            driver_state = _pid_state(mid.get("pids") or []) if ctx.real else None
            ctx.check("a restore without room waits (no driver call)",
                      bool(waiting) and mid.get("restores") == 0 and not pending.done()
                      and driver_state in (None, "checkpointed"),
                      f"waiting: {waiting!r}; state {mid.get('state')}; "
                      f"driver state {driver_state or 'not read'}")
            await first.run(cell(first_kind, "FREE"), timeout=120)
            try:
                ck2 = await asyncio.wait_for(pending, 120)
            except (asyncio.TimeoutError, Exception) as e:
                ck2 = f"no answer: {e}"
            ctx.figure("room_wait_s", round(time.monotonic() - t0, 2))
            ctx.check(f"{kind}: restored once room was made, checksum equal", ck2 == ck,
                      f"after {time.monotonic() - t0:.1f} s")

        # a lock while a long GPU kernel runs: a clear message, nothing lost
        if "SPIN_BACKGROUND" in __import__("cells").KINDS[first_kind]:
            ck_first = ks[0][2]
            spin_s = 12 if ctx.real else 2
            t_spin = time.monotonic()
            if ctx.real:  # nothing cached, so the agent's trim has no cudaFree to wait on
                await first.run("torch.cuda.empty_cache()")
            await first.run(cell(first_kind, "SPIN_BACKGROUND", s=spin_s))
            t_post = time.monotonic()
            code, v = await post(srv, f"kernels/{first.id}/release")
            took = time.monotonic() - t_post
            msg = v.get("message") or v.get("error") or v.get("state")
            ctx.figure("busy_release_message", msg)
            ctx.check("a release while a GPU kernel runs says why",
                      code != 200 or v.get("state") != "released",
                      f"HTTP {code} after {took:.1f} s: {msg}" + (
                          "" if code != 200 else " (the release waited for the GPU kernel "
                          "instead of timing out: trim or lock waited)"))
            await first.run(cell(first_kind, "SYNC", s=max(spin_s - (time.monotonic() - t_spin), 0) + 0.2),
                            timeout=120)
            if (await view(srv, first.id)).get("state") == "released":
                await post(srv, f"kernels/{first.id}/restore")
            ck2 = await first.value("print(json.dumps(checksum()))", timeout=300)
            st = await view(srv, first.id)
            ctx.check("the busy kernel runs on, state intact",
                      ck2 == ck_first and st.get("state") == "active", f"state {st.get('state')}")

        # restore onto another GPU
        gpus = (await srv.api("GET", "/api/gpushare/status"))["gpus"]
        if ctx.real and len(gpus) >= 2:
            ctx.check("restore onto another GPU", *_migrate_check())
        else:
            ctx.check("restore onto another GPU", None,
                      f"{len(gpus)} GPU(s) here; needs two (and driver >= 580)" if ctx.real else
                      "the product's restore does not move GPUs yet; on a two-GPU machine the proof "
                      "checks cuda-core's gpu_mapping directly")

        # shutting down a kernel that was restored does not hang the host
        t0 = time.monotonic()
        try:
            await srv.api("DELETE", f"/api/kernels/{first.id}", timeout=60)
            srv.kernel_ids.remove(first.id)
            gone = time.monotonic() - t0
            ok = True
        except Exception as e:
            gone, ok = time.monotonic() - t0, False
            ctx.figure("shutdown_error", str(e))
        fresh = _fresh_cuda_process() if ctx.real else (True, "simulated")
        ctx.check("shutting down a restored kernel does not hang", ok and fresh[0],
                  f"DELETE in {gone:.2f} s; a fresh CUDA process afterwards: {fresh[1]}")


def _pid_state(pids: list[int]) -> str | None:
    """The driver's checkpoint state of the first pid, read with cuda-core (None: unreadable)."""
    try:
        from cuda.bindings import driver as cu
        from cuda.core.checkpoint import Process

        cu.cuInit(0)
        return str(Process(pids[0]).state) if pids else None
    except Exception:
        return None


def _fresh_cuda_process() -> tuple[bool, str]:
    code = "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize(); print('ok')"
    t0 = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return False, "did not finish in 120 s (the host may hang)"
    return r.returncode == 0, f"exit {r.returncode} in {time.monotonic() - t0:.1f} s"


MIGRATE_CHILD = """
import sys, torch
x = torch.randint(-2**62, 2**62, ((256 << 20) // 8,), dtype=torch.int64, device="cuda:0")
def ck():
    return f"{int((x ^ (x >> 17)).sum())}:{x.device}:{torch.cuda.current_device()}"
print("ready", ck(), flush=True)
for line in sys.stdin:
    print(ck(), flush=True)
"""


def _migrate_check() -> tuple[bool | None, str]:
    """cuda-core's restore with gpu_mapping (GPU 0 <-> GPU 1) on a child holding 256 MiB."""
    from cuda.bindings import driver as cu
    from cuda.core.checkpoint import Process

    from jupyter_gpushare.reclaim.driver import MIN_DRIVER_MIGRATE
    from jupyter_gpushare.telemetry.nvml import NVMLTelemetry, driver_major

    tel = NVMLTelemetry()
    tel.open()
    try:
        if (driver_major(tel.driver_version()) or 0) < MIN_DRIVER_MIGRATE:
            return None, f"driver {tel.driver_version()} < {MIN_DRIVER_MIGRATE}: no GPU mapping"
        uu = [g.uuid.removeprefix("GPU-") for g in tel.devices()]
        cu.cuInit(0)
        proc = subprocess.Popen([sys.executable, "-c", MIGRATE_CHILD], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, bufsize=1)
        try:
            _word, before = (proc.stdout.readline() if proc.stdout else "").split()
            p = Process(proc.pid)
            p.lock(10_000)
            p.checkpoint()
            mapping = {uu[0]: uu[1], uu[1]: uu[0], **{u: u for u in uu[2:]}}
            p.restore(gpu_mapping=mapping)
            p.unlock()
            used1 = [u for u in tel.processes() if u.pid == proc.pid and u.gpu == 1]
            assert proc.stdin and proc.stdout
            proc.stdin.write("check\n")
            after = proc.stdout.readline().strip()
            same = after.split(":")[0] == before.split(":")[0]
            return same, f"checksum {'equal' if same else 'DIFFERS'}; on GPU 1 per NVML: {bool(used1)}"
        except Exception as e:
            return False, f"{e.__class__.__name__}: {e}"
        finally:
            if proc.stdin:
                proc.stdin.close()
            proc.kill()
            proc.wait(30)
    finally:
        tel.close()


async def part_framework(ctx: Ctx) -> None:
    if not ctx.real:
        raise Skip(NOT_SIMULATED["framework"])
    if not _installed("torch"):
        raise Skip("PyTorch is not installed")
    from cells import CUPY_AFTER_ROUND_TRIP, CUPY_IDS, TORCH_AFTER_ROUND_TRIP, TORCH_REFERENCE_STEP

    free = nvml_free()
    n = GiB if ctx.quick else 4 * GiB
    async with server(ctx, "framework", release_method="framework") as srv:
        plan = [("torch", n, TORCH_REFERENCE_STEP, TORCH_AFTER_ROUND_TRIP)]
        if _installed("cupy"):
            plan.append(("cupy", GiB, CUPY_IDS, CUPY_AFTER_ROUND_TRIP))
        else:
            ctx.check("cupy kernel", None, "CuPy is not importable")
        rows = []
        for kind, size, before_code, after_code in plan:
            k, ck = await kernel_state(ctx, srv, kind, size)
            await k.value(before_code.format(), timeout=300)
            await wait_polls(srv)
            held = (await view(srv, k.id)).get("gpu_memory_bytes") or 0
            free0 = free(0) or 0
            code, v = await post(srv, f"kernels/{k.id}/release")
            ctx.check(f"{kind}: release (framework)", code == 200 and v.get("state") == "released",
                      f"HTTP {code}, {fmt_bytes(v.get('released_bytes'))} in "
                      f"{v.get('last_release_seconds')} s; {v.get('error') or v.get('message') or ''}")
            await wait_polls(srv)
            freed = (free(0) or 0) - free0
            left = (await view(srv, k.id)).get("gpu_memory_bytes")
            ctx.check(f"{kind}: bytes freed as NVML sees them", freed >= size * 0.9,
                      f"GPU 0 free +{fmt_bytes(freed)} of {fmt_bytes(held)} held; the kernel still "
                      f"holds {fmt_bytes(left)} (its CUDA context)")
            res = await k.value(after_code.format(), timeout=300)
            back = await view(srv, k.id)
            ctx.check(f"{kind}: bitwise equal after the round trip", res["checksum"] == ck,
                      f"restore {back.get('last_restore_seconds')} s")
            ctx.check(f"{kind}: id() kept", res["ids_kept"], "")
            if "step_equal" in res:
                ctx.check("torch: an optimizer step after the round trip equals one without",
                          res["step_equal"] and res["on_cuda"], f"parameters on CUDA: {res['on_cuda']}")
            if "view_aliases" in res:
                ctx.check("cupy: a view still aliases its base", res["view_aliases"], "")
            rows.append({"kernel": kind, "held_bytes": held, "freed_bytes": freed, "left_bytes": left,
                         "release_s": v.get("last_release_seconds"),
                         "restore_s": back.get("last_restore_seconds")})
        ctx.figure("round_trips", rows)


#: The children's state: ``n`` bytes of random int64 on GPU 0 and a checksum read by chunks
#: (``before``), so a round trip is judged bit for bit.
TENSOR_AND_CHECKSUM = """x = torch.randint(-2**62, 2**62, (n // 8,), dtype=torch.int64, device="cuda:0")
def ck():
    s = 0
    for i in range(0, x.numel(), 1 << 25):
        c = x[i:i + (1 << 25)]
        s += int((c ^ (c >> 17)).sum())
    return s
before = ck()
"""

FRAMEWORK_CHILD = """
import json, sys, torch
from jupyter_gpushare.kernel.offload.torch_adapter import TorchAdapter
n, repeat = int(sys.argv[1]), int(sys.argv[2])
""" + TENSOR_AND_CHECKSUM + """ns = {"x": x}
adapter = TorchAdapter()
out, rel, rst = [], [], []
for _ in range(repeat):
    off = adapter.offload(ns)
    back = adapter.reload()
    rel.append(off.seconds)
    rst.append(back.seconds)
    out.append(ck() == before)
print(json.dumps({"release": rel, "restore": rst, "intact": all(out), "bytes": off.bytes}))
"""


def fit(points: list[tuple[int, float]]) -> dict[str, float | None]:
    """seconds = overhead + bytes / bandwidth, least squares; GB/s = 1e9 bytes/s."""
    if len(points) < 2:
        return {"overhead_s": None, "GBps": None}
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return {"overhead_s": None, "GBps": None}
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return {"overhead_s": my - slope * mx, "GBps": (1 / slope / 1e9) if slope > 0 else None}


async def part_bandwidth(ctx: Ctx) -> None:
    rows: list[dict[str, Any]] = []
    if ctx.real:
        await asyncio.to_thread(_bandwidth_real, ctx, rows)
    else:
        await _bandwidth_sim(ctx, rows)
    ctx.figure("rows", rows)
    fits = {}
    for method in sorted({r["method"] for r in rows}):
        mine = [r for r in rows if r["method"] == method]
        fits[method] = {"release": fit([(r["bytes"], r["release_s"]) for r in mine]),
                        "restore": fit([(r["bytes"], r["restore_s"]) for r in mine])}
    base = [r for r in rows if r["method"] == rows[0]["method"]] if rows else []
    fits["pinned copy" if ctx.real else "copy in kernel"] = {
        "release": fit([(r["bytes"], r["d2h_pinned_s"]) for r in base]),
        "restore": fit([(r["bytes"], r["h2d_pinned_s"]) for r in base])}
    ctx.figure("fits", fits)
    for method, f in fits.items():
        for d in ("release", "restore"):
            o = f[d]["overhead_s"]
            ctx.check(f"{method} {d}: fixed overhead (intercept)", None,
                      "n/a" if o is None else f"{o * 1e3:.0f} ms; slope {f[d]['GBps'] or 0:.1f} GB/s")
    for r in rows:
        ctx.check(f"{r['method']} {fmt_bytes(r['bytes'])}: state intact", r["intact"],
                  f"release {r['release_s']:.3f} s ({r['release_frac']:.0%} of pinned D2H), "
                  f"restore {r['restore_s']:.3f} s ({r['restore_frac']:.0%} of pinned H2D)")


def _bandwidth_real(ctx: Ctx, rows: list[dict[str, Any]]) -> None:
    import psutil
    import torch
    from driver_release_restore import copy_baseline

    from jupyter_gpushare.reclaim.base import KernelTarget
    from jupyter_gpushare.reclaim.driver import DriverMethod, driver_support
    from jupyter_gpushare.telemetry.nvml import NVMLTelemetry

    sizes = [1, 4] if ctx.quick else [1, 4, 16, 40]
    methods = ["driver", "framework"]
    s = driver_support()
    if not s.ok:
        methods.remove("driver")
        ctx.check("driver method", None, f"unsupported here: {s.reason}")
    torch.cuda.init()
    nvml = NVMLTelemetry()
    nvml.open()
    # what each run of the cuda-checkpoint binary pays and an initialised process does not
    r = subprocess.run([sys.executable, "-c", "import time; t = time.perf_counter(); "
                        "from cuda.bindings import driver as cu; cu.cuInit(0); "
                        "print(time.perf_counter() - t)"], capture_output=True, text=True, timeout=120)
    cold = float(r.stdout.strip()) if r.returncode == 0 and r.stdout.strip() else None
    ctx.figure("fresh_process_cuInit_s", cold)
    ctx.check("a fresh process's import + cuInit (what a cuda-checkpoint run pays)", None,
              f"{cold:.3f} s" if cold is not None else r.stderr[-200:])
    last: dict[str, tuple[int, float]] = {}
    try:
        for size in sizes:
            n = size * GiB
            free = nvml.free_bytes(0) or 0
            avail = psutil.virtual_memory().available
            if n > free * 0.85 or 2.2 * n > avail:
                ctx.check(f"{size} GiB", None, f"skipped: GPU 0 has {fmt_bytes(free)} free, host "
                          f"{fmt_bytes(avail)} available (needs {fmt_bytes(n)} and {fmt_bytes(2.2 * n)})")
                continue
            if "size" in last:  # the whole size (baseline and methods), scaled from the last
                est = last["size"][1] * size / last["size"][0]
                if ctx.left() < est + 20:
                    ctx.check(f"{size} GiB", None, f"skipped: about {est:.0f} s needed, "
                              f"{ctx.left():.0f} s left in the part's time box")
                    continue
            t_size = time.monotonic()
            repeat = 3 if size <= 4 else 2
            base = copy_baseline(torch, n, repeat)
            for method in methods:
                # the last size's time for this method, scaled by size (the baseline's otherwise)
                prev = last.get(method)
                est = prev[1] * size / prev[0] if prev else (time.monotonic() - t_size) * 3
                if ctx.left() < est + 20:
                    ctx.check(f"{method} {size} GiB", None,
                              f"skipped: {ctx.left():.0f} s left in the part's time box")
                    continue
                t_method = time.monotonic()
                if method == "driver":
                    rel, rst, intact = _driver_round_trips(n, repeat, nvml, DriverMethod,
                                                           KernelTarget)
                else:
                    out = subprocess.run([sys.executable, "-c", FRAMEWORK_CHILD, str(n), str(repeat)],
                                         capture_output=True, text=True, timeout=max(ctx.left(), 30))
                    if out.returncode != 0:
                        ctx.check(f"framework {size} GiB", False, out.stderr[-300:])
                        continue
                    fr = json.loads(out.stdout.strip().splitlines()[-1])
                    rel, rst = statistics.median(fr["release"]), statistics.median(fr["restore"])
                    intact = fr["intact"]
                last[method] = (size, time.monotonic() - t_method)
                rows.append({"method": method, "bytes": n, "release_s": rel, "restore_s": rst,
                             "d2h_pinned_s": base["d2h_pinned"], "h2d_pinned_s": base["h2d_pinned"],
                             "d2h_pageable_s": base["d2h_pageable"],
                             "h2d_pageable_s": base["h2d_pageable"],
                             "release_GBps": n / rel / 1e9, "restore_GBps": n / rst / 1e9,
                             "pinned_d2h_GBps": n / base["d2h_pinned"] / 1e9,
                             "pinned_h2d_GBps": n / base["h2d_pinned"] / 1e9,
                             "release_frac": base["d2h_pinned"] / rel,
                             "restore_frac": base["h2d_pinned"] / rst, "intact": intact})
                ctx.figure("rows", rows)
            last["size"] = (size, time.monotonic() - t_size)
    finally:
        nvml.close()


DRIVER_CHILD = """
import sys, torch
n = int(sys.argv[1])
""" + TENSOR_AND_CHECKSUM + """torch.cuda.empty_cache()  # the checksum's temporaries: not part of the state
print("ready", flush=True)
for line in sys.stdin:
    print("intact" if ck() == before else "CHANGED", flush=True)
    torch.cuda.empty_cache()
"""


def _driver_round_trips(n: int, repeat: int, nvml: Any, method_cls: Any,
                        target_cls: Any) -> tuple[float, float, bool]:
    """Median release and restore seconds of a child holding ``n`` bytes, and whether its
    data came back intact every time (a checksum over chunks: no temporaries of size n)."""
    import select

    free0 = nvml.free_bytes(0)
    proc = subprocess.Popen([sys.executable, "-c", DRIVER_CHILD, str(n)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, bufsize=1)
    assert proc.stdin is not None and proc.stdout is not None
    out = proc.stdout

    def line(timeout: float = 300) -> str:
        ready, _, _ = select.select([out], [], [], timeout)
        if not ready:
            raise TimeoutError("the child did not answer")
        return out.readline().strip()

    try:
        if line() != "ready":
            raise RuntimeError(f"the child holding {fmt_bytes(n)} did not start")
        held = free0 - nvml.free_bytes(0)
        method = method_cls(nvml.free_bytes)
        target = target_cls("proof", pids=[proc.pid], gpu_bytes={0: held})
        rel, rst, intact = [], [], True
        for _ in range(repeat):
            rel.append(asyncio.run(method.release(target)).seconds)
            rst.append(asyncio.run(method.restore(target)).seconds)
            proc.stdin.write("check\n")
            intact = intact and line() == "intact"
        return statistics.median(rel), statistics.median(rst), intact
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()


SIM_COPY = """
import json, time
_t = time.perf_counter(); _y = x.get(); _a = time.perf_counter() - _t
_t = time.perf_counter(); _z = simgpu.array(_y, device=0); _b = time.perf_counter() - _t
del _y, _z
print(json.dumps([_a, _b]))
"""


async def _bandwidth_sim(ctx: Ctx, rows: list[dict[str, Any]]) -> None:
    sizes = [4 * MiB, 16 * MiB, 32 * MiB]
    async with server(ctx, "bandwidth") as srv:
        k = (await start_kernels(srv, 1))[0]
        for n in sizes:
            ck = await k.value(cell("sim", "STATE", n=n), timeout=120)
            await srv.wait_kernel(k.id, lambda v, n=n: (v.get("gpu_memory_bytes") or 0) >= n,
                                  "state", timeout=30)
            d2h, h2d = await k.value(SIM_COPY)
            await srv.wait_kernel(k.id, lambda v: v.get("execution_state") == "idle", "idle")
            code, v = await post(srv, f"kernels/{k.id}/release")
            code2, w = await post(srv, f"kernels/{k.id}/restore")
            intact = code == code2 == 200 and await k.value("print(json.dumps(checksum()))") == ck
            rel, rst = v.get("last_release_seconds") or 1e-9, w.get("last_restore_seconds") or 1e-9
            rows.append({"method": "simulated", "bytes": n, "release_s": rel, "restore_s": rst,
                         "d2h_pinned_s": d2h, "h2d_pinned_s": h2d, "release_GBps": n / rel / 1e9,
                         "restore_GBps": n / rst / 1e9, "pinned_d2h_GBps": n / d2h / 1e9,
                         "pinned_h2d_GBps": n / h2d / 1e9, "release_frac": d2h / rel,
                         "restore_frac": h2d / rst, "intact": intact})


async def part_lazy(ctx: Ctx) -> None:
    if ctx.real:
        from jupyter_gpushare.reclaim.driver import driver_support

        s = driver_support()
        if not s.ok:
            raise Skip(f"lazy mode needs the driver method: {s.reason}")
    kind, n = ("torch", GiB) if ctx.real else ("sim", 16 * MiB)
    async with server(ctx, "lazy", restore_mode="lazy", release_method="driver") as srv:
        k, ck = await kernel_state(ctx, srv, kind, n)
        code, v = await post(srv, f"kernels/{k.id}/release")
        ctx.check("release", code == 200 and v.get("state") == "released", f"HTTP {code}")
        t0 = time.monotonic()
        out = await k.value("print(json.dumps(sum(range(10))))", timeout=120)
        cpu_s = time.monotonic() - t0
        st = await view(srv, k.id)
        ctx.check("a CPU-only cell runs without a restore",
                  out == 45 and st.get("state") == "released" and st.get("restores") == 0,
                  f"answer {out}, state {st.get('state')}, restores {st.get('restores')}, "
                  f"cell {cpu_s:.2f} s")
        t0 = time.monotonic()
        ck2 = await k.value("print(json.dumps(checksum()))", timeout=300)
        gpu_s = time.monotonic() - t0
        st = await view(srv, k.id)
        ctx.check("a GPU cell restores first, checksum equal",
                  ck2 == ck and st.get("state") == "active" and st.get("restores") == 1,
                  f"state {st.get('state')}, restores {st.get('restores')}, cell {gpu_s:.2f} s")
        ctx.figure("cells", {"cpu_cell_s": round(cpu_s, 3), "gpu_cell_s": round(gpu_s, 3),
                             "restore_s": st.get("last_restore_seconds")})


PART_FUNCS: dict[str, Callable[[Ctx], Any]] = {
    "env": part_env, "pytest": part_pytest, "nvml": part_nvml, "driver": part_driver,
    "framework": part_framework, "bandwidth": part_bandwidth, "lazy": part_lazy,
}


def run_one(part: str, mode: str, path: Path, seconds: float, quick: bool, out: Path) -> int:
    """The child: run one part, record into ``path``."""
    out.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(part, mode, path, time.monotonic() + seconds, quick, out)

    def stop(*_: Any) -> None:
        # where it was when the time box ran out: the stacks of the running tasks
        with contextlib.suppress(Exception):
            stacks = []
            for task in asyncio.all_tasks(asyncio.get_running_loop()):
                frames = task.get_stack()
                stacks.append(" <- ".join(f"{f.f_code.co_name}:{f.f_lineno}" for f in reversed(frames)))
            ctx.figures["stuck_at"] = stacks
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, stop)
    try:
        res = PART_FUNCS[part](ctx)
        if asyncio.iscoroutine(res):
            asyncio.run(res)
        ctx.status = "failed" if any(c["ok"] is False for c in ctx.checks) else "ran"
    except Skip as e:
        ctx.status, ctx.reason = "skipped", str(e)
    except SystemExit:
        ctx.status, ctx.reason = "timeout", f"stopped after its time box of {seconds:.0f} s"
    except BaseException as e:
        ctx.status = "failed"
        ctx.reason = f"{e.__class__.__name__}: {e}"
        ctx.figures["traceback"] = traceback.format_exc()[-3000:]
    ctx.flush()
    return 0


# -- the parent: run the parts, time-boxed, and write the report -----------------------------
def run_part(part: str, mode: str, seconds: float, work: Path, quick: bool,
             out: Path) -> dict[str, Any]:
    path = work / f"{part}.json"
    t0 = time.monotonic()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run-part", part, "--mode", mode,
           "--state", str(path), "--seconds", str(seconds), "--out", str(out)]
    cmd += ["--quick"] if quick else []
    proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True)
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the part stops its servers on SIGTERM
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        rec = {"status": "failed", "reason": f"the part's process exited {proc.returncode} "
               "without a record", "checks": [], "figures": {}, "pids": []}
    if rec["status"] == "running":  # killed before it could write its end
        rec["status"], rec["reason"] = "timeout", f"stopped after its time box of {seconds:.0f} s"
    _kill_leftovers(rec.pop("pids", []))
    rec["seconds"] = round(time.monotonic() - t0, 1)
    rec["budget_s"] = round(seconds)
    rec["what"] = WHAT[part]
    return rec


def _kill_leftovers(pids: list[list[float]]) -> None:
    """Kill the process trees of servers a stopped part left (pid + start time, so no reuse)."""
    import psutil

    for pid, created in pids:
        try:
            p = psutil.Process(int(pid))
            if abs(p.create_time() - created) > 1:
                continue
            tree = [*p.children(recursive=True), p]
        except psutil.Error:
            continue
        for q in tree:
            with contextlib.suppress(psutil.Error):
                q.kill()
        psutil.wait_procs(tree, timeout=10)


def detect_gpu() -> tuple[bool, str]:
    try:
        from jupyter_gpushare.telemetry.nvml import probe
    except Exception as e:
        return False, f"jupyter_gpushare is not importable ({e})"
    p = probe()
    if not p.ok:
        return False, p.reason or "NVML unavailable"
    if not p.gpus:
        return False, "NVML works but lists no GPU"
    return True, f"{len(p.gpus)} GPU(s), driver {p.driver_version}"


def skipped(part: str, reason: str) -> dict[str, Any]:
    return {"status": "skipped", "reason": reason, "checks": [], "figures": {}, "seconds": 0.0,
            "budget_s": BUDGET[part], "what": WHAT[part]}


def goals(parts: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's goals, where the report has the figures."""
    out: list[dict[str, Any]] = []
    bw = parts.get("bandwidth", {}).get("figures", {})
    for r in bw.get("rows", []):
        if r["bytes"] >= GiB:
            for d in ("release", "restore"):
                out.append({"goal": f"{r['method']} {d} {r['bytes'] // GiB} GiB >= 70 % of pinned",
                            "value": round(r[f"{d}_frac"], 3), "met": r[f"{d}_frac"] >= 0.7})
    for method, f in bw.get("fits", {}).items():
        if method in ("pinned copy", "copy in kernel"):
            continue
        for d in ("release", "restore"):
            o = f[d]["overhead_s"]
            if o is not None:
                out.append({"goal": f"{method} {d} fixed overhead <= 50 ms",
                            "value": round(o, 4), "met": o <= 0.05})
    nv = parts.get("nvml", {})
    for c in nv.get("checks", []):
        if "within two polls" in c["name"]:
            out.append({"goal": f"status shows {c['name'].split(' shows')[0]} within two polls",
                        "value": c["detail"], "met": c["ok"]})
    return out


def summarize(report: dict[str, Any]) -> None:
    parts = report["parts"]
    report["summary"] = {s: sum(1 for p in parts.values() if p["status"] == s) for s in STATUSES}
    report["summary"]["checks_failed"] = sum(
        1 for p in parts.values() for c in p["checks"] if c["ok"] is False)
    report["goals"] = goals(parts)


def validate(report: dict[str, Any]) -> list[str]:
    """What is wrong with a report's shape ([] = nothing)."""
    errs = []
    for key in ("schema", "mode", "started", "seconds", "machine", "parts", "summary", "goals"):
        if key not in report:
            errs.append(f"missing {key}")
    if report.get("schema") != SCHEMA:
        errs.append(f"schema is {report.get('schema')!r}")
    if report.get("mode") not in ("gpu", "simulated", "no-gpu"):
        errs.append(f"mode is {report.get('mode')!r}")
    for name, p in (report.get("parts") or {}).items():
        if name not in PARTS:
            errs.append(f"unknown part {name}")
        if p.get("status") not in STATUSES:
            errs.append(f"{name}: status {p.get('status')!r}")
        if p.get("status") in ("skipped", "timeout") and not p.get("reason"):
            errs.append(f"{name}: {p.get('status')} without a reason")
        for c in p.get("checks", []):
            if set(c) != {"name", "ok", "detail"} or c["ok"] not in (True, False, None):
                errs.append(f"{name}: bad check {c}")
        for k in ("seconds", "budget_s", "what", "figures"):
            if k not in p:
                errs.append(f"{name}: missing {k}")
    return errs


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [f"# GPU proof ({report['mode']}): {report['started']}", ""]
    lines.append(f"Machine: {m.get('gpus') or 'no GPU'}; driver {m.get('driver') or '-'}; "
                 f"{m.get('cpus')} CPUs; Python {m.get('python')}; {m.get('host')}. "
                 f"Ran {report['seconds']:.0f} s" + (f" ({report['note']})" if report.get("note") else "")
                 + ".")
    s = report["summary"]
    lines += ["", f"Parts: {s['ran']} ran, {s['failed']} failed, {s['skipped']} skipped, "
              f"{s['timeout']} timed out; {s['checks_failed']} check(s) failed.", "",
              "| part | status | s (box) | checks ok / failed / n.a. | what / why not |",
              "|---|---|---|---|---|"]
    for name, p in report["parts"].items():
        cs = p["checks"]
        counts = (f"{sum(c['ok'] is True for c in cs)} / {sum(c['ok'] is False for c in cs)} / "
                  f"{sum(c['ok'] is None for c in cs)}")
        why = p["what"] + (f" -- {p['reason']}" if p.get("reason") else "")
        lines.append(f"| {name} | **{p['status']}** | {p['seconds']:.0f} ({p['budget_s']}) | "
                     f"{counts} | {why} |")
    if report["goals"]:
        lines += ["", "## Goals", "", "| goal | value | met |", "|---|---|---|"]
        lines += [f"| {g['goal']} | {g['value']} | {'yes' if g['met'] else 'NO'} |"
                  for g in report["goals"]]
    bw = report["parts"].get("bandwidth", {}).get("figures", {})
    if bw.get("rows"):
        lines += ["", "## Bandwidth", "", "| method | size | release s | restore s | release GB/s "
                  "(x pinned D2H) | restore GB/s (x pinned H2D) | pinned D2H / H2D GB/s | intact |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in bw["rows"]:
            lines.append(f"| {r['method']} | {fmt_bytes(r['bytes'])} | {r['release_s']:.3f} | "
                         f"{r['restore_s']:.3f} | {r['release_GBps']:.2f} ({r['release_frac']:.2f}) | "
                         f"{r['restore_GBps']:.2f} ({r['restore_frac']:.2f}) | "
                         f"{r['pinned_d2h_GBps']:.2f} / {r['pinned_h2d_GBps']:.2f} | "
                         f"{'yes' if r['intact'] else 'NO'} |")
        lines += ["", "Fits (seconds = overhead + bytes / bandwidth):", ""]
        for method, f in bw.get("fits", {}).items():
            parts = []
            for d in ("release", "restore"):
                o, g = f[d]["overhead_s"], f[d]["GBps"]
                parts.append(f"{d} {'n/a' if o is None else f'{o * 1e3:.0f} ms'} + "
                             f"{'n/a' if g is None else f'{g:.1f} GB/s'}")
            lines.append(f"- {method}: " + "; ".join(parts))
    for name, p in report["parts"].items():
        lines += ["", f"## {name}: {p['status']}", ""]
        if p.get("reason"):
            lines.append(f"{p['reason']}")
            lines.append("")
        mark = {True: "ok", False: "FAIL", None: "--"}
        lines += [f"- [{mark[c['ok']]}] {c['name']}" + (f": {c['detail']}" if c["detail"] else "")
                  for c in p["checks"]]
        doctor = p["figures"].get("doctor")
        if doctor:
            lines += ["", "```", doctor, "```"]
        if p["figures"].get("summary"):
            lines += ["", f"pytest: `{p['figures']['summary']}`"]
            lines += [f"- `{ln}`" for ln in p["figures"].get("failures", [])[:30]]
        if p["figures"].get("stuck_at"):
            lines += ["", "Stopped at: " + "; ".join(p["figures"]["stuck_at"])[:1500]]
        tb = p["figures"].get("traceback")
        if tb:
            lines += ["", "```", tb.strip()[-1500:], "```"]
    return "\n".join(lines) + "\n"


def machine_info(mode: str, env: dict[str, Any] | None) -> dict[str, Any]:
    figs = (env or {}).get("figures", {})
    nv = figs.get("nvml") or {}
    gpus = "; ".join(f"{g['name']} {fmt_bytes(g['memory_total'])}" for g in nv.get("gpus", []))
    return {"gpus": gpus if mode == "gpu" else (f"simulated ({gpus or 'no GPU here'})"),
            "driver": nv.get("driver"), "cpus": os.cpu_count(), "python": platform.python_version(),
            "host": platform.node(), "versions": figs.get("versions")}


def write(report: dict[str, Any], out: Path) -> tuple[Path, Path]:
    summarize(report)
    errs = validate(report)
    if errs:
        report.setdefault("shape_errors", errs)
    out.mkdir(parents=True, exist_ok=True)
    j, md = out / "gpu-proof.json", out / "gpu-proof.md"
    j.write_text(json.dumps(report, indent=1, default=str))
    md.write_text(markdown(report))
    return j, md


def select_parts(spec: str) -> list[str]:
    if spec in GROUPS:
        return GROUPS[spec]
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [n for n in names if n not in PARTS]
    if bad:
        raise SystemExit(f"unknown part(s): {', '.join(bad)}; parts: {', '.join(PARTS)}, groups: "
                         "all, 1, 2")
    return names


def merge(files: list[str], out: Path) -> int:
    reports = [json.loads(Path(f).read_text()) for f in files]
    merged = {**reports[0], "parts": {}, "seconds": sum(r["seconds"] for r in reports),
              "note": f"merged from {len(reports)} runs"}
    for r in reports:
        for name, p in r["parts"].items():
            old = merged["parts"].get(name)
            if old is None or old["status"] == "skipped":
                merged["parts"][name] = p
    merged["parts"] = {n: merged["parts"][n] for n in PARTS if n in merged["parts"]}
    j, md = write(merged, out)
    print(f"merged report: {j}, {md}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(tempfile.gettempdir(),
                                                                           "gpushare-proof"),
                    help="where gpu-proof.json and gpu-proof.md go (default: $OUT, else "
                         "/tmp/gpushare-proof)")
    ap.add_argument("--part", default="all", help="all | 1 | 2 | a comma-separated list of parts")
    ap.add_argument("--simulated", action="store_true",
                    help="rehearse on the simulated backend (no GPU needed)")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a first look)")
    ap.add_argument("--deadline", type=float, default=None,
                    help=f"seconds for the whole run (default: {DEADLINE_GROUP:.0f} for --part 1 "
                         f"or 2, {DEADLINE_ALL:.0f} for all)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="with --simulated: parts run side by side (default 1; a GPU run is "
                         "always one part at a time)")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="join reports of --part runs")
    ap.add_argument("--run-part", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--state", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.run_part:
        return run_one(args.run_part, args.mode, Path(args.state), args.seconds, args.quick,
                       Path(args.out))
    out = Path(args.out)
    if args.merge:
        return merge(args.merge, out)
    parts = select_parts(args.part)
    t_start = time.monotonic()
    deadline = args.deadline or (DEADLINE_ALL if set(parts) - set(GROUPS["1"]) and
                                 set(parts) - set(GROUPS["2"]) else DEADLINE_GROUP)
    if args.simulated:
        mode, why = "simulated", "rehearsal on the simulated backend"
    else:
        has_gpu, why = detect_gpu()
        mode = "gpu" if has_gpu else "no-gpu"
    print(f"gpushare GPU proof: mode {mode} ({why}); parts {', '.join(parts)}; out {out}", flush=True)
    report: dict[str, Any] = {"schema": SCHEMA, "mode": mode, "started": now_iso(), "why": why,
                              "parts_requested": parts, "parts": {}}
    work = Path(tempfile.mkdtemp(prefix="gpushare-proof-"))
    lock = threading.Lock()

    def one(part: str) -> None:
        left = deadline - (time.monotonic() - t_start)
        box = BUDGET[part] if mode == "gpu" else min(BUDGET[part], 60)
        if mode == "no-gpu" and part != "env":
            rec = skipped(part, f"no GPU here: {why}")
        elif mode == "simulated" and part in NOT_SIMULATED:
            rec = skipped(part, NOT_SIMULATED[part])
        elif left < 15:
            rec = skipped(part, f"no time left ({left:.0f} s of {deadline:.0f} s)")
        else:
            print(f"-- {part}: {WHAT[part]} (time box {min(box, left):.0f} s)", flush=True)
            rec = run_part(part, mode, min(box, left), work, args.quick, out)
            print(f"-- {part}: {rec['status']} in {rec['seconds']} s"
                  + (f" ({rec['reason']})" if rec.get("reason") else ""), flush=True)
        with lock:  # the report so far: a run cut off by the device's limit still leaves one
            report["parts"][part] = rec
            report["parts"] = {n: report["parts"][n] for n in parts if n in report["parts"]}
            report["seconds"] = round(time.monotonic() - t_start, 1)
            report["machine"] = machine_info(mode, report["parts"].get("env"))
            write(dict(report), out)

    # on a GPU one part at a time (timings, memory); the rehearsal may run parts side by side
    jobs = args.jobs if mode == "simulated" else 1
    if jobs > 1:
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            list(pool.map(one, parts))
    else:
        for part in parts:
            one(part)
    report["seconds"] = round(time.monotonic() - t_start, 1)
    report["machine"] = machine_info(mode, report["parts"].get("env"))
    j, md = write(report, out)
    s = report["summary"]
    print(f"report: {j} and {md}")
    print(f"parts: {s['ran']} ran, {s['failed']} failed, {s['skipped']} skipped, {s['timeout']} "
          f"timed out; checks failed: {s['checks_failed']}")
    if report.get("shape_errors"):
        print("report shape errors: " + "; ".join(report["shape_errors"]))
        return 1
    if mode == "no-gpu":
        print(f"no GPU here ({why}): nothing measured; checked imports, the wheelhouse and the "
              "report's shape")
        return 0
    return 1 if s["failed"] or s["timeout"] else 0


if __name__ == "__main__":
    sys.exit(main())
