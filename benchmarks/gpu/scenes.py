"""The proof's scenes that go through a real server and real kernels (bandwidth.py has the
bandwidth scenes). Each scene is a list of steps (``STEPS``: name, title, timeout in seconds)
and a body that runs them in order through ``Scene.step``; a step that needs an earlier one
is skipped when that one did not pass.

On the simulated backend (the CI rehearsal) every scene runs the same steps against the
simulated node, with small sizes; a step that means nothing there is skipped with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cells import CHECKSUM, KINDS, RAW_ALLOC, RAW_FREE
from report import VERSIONS, GiB, MiB, fmt_bytes
from runner import Scene, Skip, Step

if TYPE_CHECKING:
    from _server import Kernel, Server

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
WHEELHOUSE = REPO / ".gpu-wheels"
NOT_SIMULATED = "the simulated node has only the simulated method"


# -- servers and kernels ----------------------------------------------------------------------
def server_config(real: bool, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"poll_interval": 0.5, "idle_timeout": 0, "min_release_bytes": 0,
                           "pressure_free_fraction": 0.0, "lock_timeout": 2.0,
                           # no kernel is released to make room for another's restore here
                           "pressure_idle_timeout": 3600}
    if real:
        cfg.update(backend="nvml")
    else:  # a small node, polled faster: the rehearsal must stay quick
        cfg.update(backend="simulated", simulated_gpus=[512 * MiB, 512 * MiB], poll_interval=0.25,
                   lock_timeout=1.0)
        extra.pop("release_method", None)
    cfg.update(extra)
    return cfg


@contextlib.asynccontextmanager
async def server(sc: Scene, name: str, **extra: Any) -> AsyncIterator[Server]:
    from _server import Server

    srv = Server(name, gpushare=server_config(sc.real, **extra))
    sc.shared["server_log"] = lambda: srv.log_tail(30)
    try:
        await srv.start()
        sc.note_pids([srv.pid])
        yield srv
    finally:
        await srv.stop()


async def start_kernels(sc: Scene, srv: Server, n: int) -> list[Kernel]:
    kernels = await asyncio.gather(*(srv.start_kernel() for _ in range(n)))
    sc.note_pids([p.pid for p in srv.kernel_processes()])
    return list(kernels)


def cell(kind: str, what: str, **kw: Any) -> str:
    return KINDS[kind][what].format(**kw)


def signed(n: int | None) -> str:
    """A change in bytes with its sign: +6.81 GiB, -72 MiB."""
    return "?" if n is None else ("-" if n < 0 else "+") + fmt_bytes(abs(n))


async def view(srv: Server, kid: str) -> dict[str, Any]:
    return await srv.kernel_status(kid)


async def post(srv: Server, path: str) -> tuple[int, dict[str, Any]]:
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


async def wait_polls(srv: Server, n: int = 2) -> None:
    await asyncio.sleep(srv.gpushare["poll_interval"] * n + 0.1)


def nvml_free() -> Callable[[int], int | None]:
    """Free bytes on a GPU as NVML sees them."""
    from jupyter_gpushare.telemetry.nvml import NVMLTelemetry

    tel = NVMLTelemetry()
    tel.open()
    return tel.free_bytes


def installed(mod: str) -> bool:
    """Whether ``mod`` can be found (not imported: jax and cupy take seconds to import)."""
    try:
        return importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        return False


def pick_reason(srv: Server, kid: str, last: int = 1) -> str:
    """Why release_method "auto" picked its method for the kernel: the server's last ``last``
    log lines on it, oldest first (its pick follows each poll's reading, so it can change)."""
    lines = [ln.split("release method", 1)[1].strip() for ln in srv.log_tail(400).splitlines()
             if kid in ln and "release method" in ln]
    return " | then ".join(lines[-last:]) if lines else "(no log line)"


async def wait_pick(st: Step, srv: Server, kid: str, want: str) -> bool:
    """Wait (a few polls: the agent's report of its frameworks' memory comes each poll) until
    the kernel's method is ``want``; check it."""
    try:
        v = await srv.wait_kernel(kid, lambda v: v.get("method") == want, f"method {want}",
                                  timeout=8 * srv.gpushare["poll_interval"] + 2)
    except TimeoutError:
        v = await view(srv, kid)
    ok = v.get("method") == want
    # a wrong pick shows the picks that led to it: one line hides a pick that flips
    return bool(st.check(f"auto picks the {want} method", ok,
                         f"method {v.get('method')}" + (f": {pick_reason(srv, kid)}" if ok else
                         f" (status); the server's last picks: {pick_reason(srv, kid, 4)}")))


async def make_state(st: Step, srv: Server, k: Kernel, kind: str, n: int) -> dict[str, Any]:
    """Build the kernel's state; wait until status shows it; {checksum, bytes, info}."""
    out = await k.value(cell(kind, "STATE", n=n), timeout=240)
    await srv.wait_kernel(k.id, lambda v: (v.get("gpu_memory_bytes") or 0) >= out["bytes"] * 0.9,
                          f"the {kind} kernel to show its memory", timeout=30)
    st.figure(f"{kind}_state", {"bytes": out["bytes"], **out["info"]})
    return out


async def round_trip(st: Step, srv: Server, k: Kernel, label: str, ck: str,
                     free: Callable[[int], int | None] | None, method: str | None = None,
                     state_bytes: int | None = None) -> dict[str, Any]:
    """Release over REST, check the memory is free (NVML on a GPU), restore by the next cell
    (through the gate), compare the checksum. ``state_bytes``: what must come free at least
    (default: all the kernel holds; the framework method leaves the CUDA context)."""
    held = (await view(srv, k.id)).get("gpu_memory_bytes") or 0
    free0 = free(0) if free else None
    code, v = await post(srv, f"kernels/{k.id}/release")
    ok = code == 200 and v.get("state") == "released"
    st.check(f"{label}: release over REST", ok,
             f"HTTP {code}, {v.get('state')}, method {v.get('method')}, "
             f"{fmt_bytes(v.get('released_bytes'))} in {v.get('last_release_seconds')} s"
             + (f"; {v.get('error') or v.get('message')}" if v.get("error") or v.get("message") else ""))
    if method is not None:
        st.check(f"{label}: released by the {method} method", v.get("method") == method,
                 f"method {v.get('method')}")
    if not ok:
        return {"kernel": label, "released": False, "error": v.get("error") or v.get("message")}
    await wait_polls(srv)
    after = await view(srv, k.id)
    freed = (free(0) or 0) - free0 if free and free0 is not None else None
    need = (state_bytes if state_bytes is not None else held) * 0.9
    freed_ok = ((freed is None and (after.get("gpu_memory_bytes") or 0) == 0)
                or (freed is not None and freed >= need))
    st.check(f"{label}: memory free" + (" (NVML)" if free else ""), freed_ok,
             f"kernel shows {fmt_bytes(after.get('gpu_memory_bytes'))}; held {fmt_bytes(held)}"
             + (f"; GPU 0 free {signed(freed)} (needs >= {fmt_bytes(need)})" if free else "")
             # what the release says it moved and left behind: the reader's reason why not
             + ("" if freed_ok else f"; the release moved {fmt_bytes(v.get('released_bytes'))}"
                f" ({after.get('state')}): {after.get('release_detail') or 'no detail'}"))
    t0 = time.monotonic()
    ck2 = await k.value(CHECKSUM, timeout=240)
    cell_s = time.monotonic() - t0
    back = await view(srv, k.id)
    st.check(f"{label}: the next cell restores through the gate, checksum equal",
             ck2 == ck and back.get("state") == "active",
             f"{back.get('state')}, restore {back.get('last_restore_seconds')} s, cell {cell_s:.2f} s"
             + (f", error {back.get('error')!r}" if back.get("error") else "")
             + ("" if ck2 == ck else f"; CHECKSUM DIFFERS: {str(ck2)[:300]!r} where "
                f"{str(ck)[:300]!r} was expected"))
    row = {"kernel": label, "method": v.get("method"), "held_bytes": held, "freed_bytes": freed,
           "release_s": v.get("last_release_seconds"), "restore_s": back.get("last_restore_seconds"),
           "cell_s": round(cell_s, 3), "checksum_equal": ck2 == ck}
    st.figure("round_trip", row)
    return row


# -- env: what machine, what versions ---------------------------------------------------------
ENV_STEPS = {"versions": ("machine, driver, CUDA, versions, wheelhouse, doctor", 45.0)}


def _version(dist: str) -> str | None:
    from importlib import metadata

    if dist == "python":
        return platform.python_version()
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _torch_build_cuda() -> str | None:
    """The CUDA PyTorch was built for, from torch/version.py read as text (importing torch
    takes seconds; a wheel's metadata version, "2.11.0", may lack the "+cu130" tag)."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return None
    m = re.search(r"^cuda\b[^=]*=\s*['\"]([\d.]+)['\"]", text, re.M)
    return m.group(1) if m else None


async def env_scene(sc: Scene) -> None:
    await sc.step("versions", env_versions)


async def env_versions(st: Step) -> None:
    versions = {d: _version(d) for d in VERSIONS}
    torch_v = versions.get("torch") or ""
    m = re.search(r"\+cu(\d+)(\d)$", torch_v)
    torch_cuda = f"{m.group(1)}.{m.group(2)}" if m else _torch_build_cuda()
    needed = ("jupyter_server", "ipykernel", "jupyter_client", "tornado", "psutil")
    missing = [mod for mod in needed if not installed(mod)]
    st.check("Jupyter packages importable", not missing,
             "missing: " + ", ".join(missing) + " (carry the wheelhouse: wheelhouse.sh)" if missing
             else f"jupyter_server {versions.get('jupyter_server')}, ipykernel {versions.get('ipykernel')}")

    wheels = sorted(WHEELHOUSE.rglob("*.whl")) if WHEELHOUSE.is_dir() else []
    info: dict[str, Any] = {"path": str(WHEELHOUSE), "wheels": len(wheels),
                            "bytes": sum(w.stat().st_size for w in wheels)}
    manifest = WHEELHOUSE / "MANIFEST.json"
    if manifest.exists():
        with contextlib.suppress(ValueError):
            info.update(json.loads(manifest.read_text()))
    st.figure("wheelhouse", info)
    if wheels:
        from prove import source_hash

        same = info.get("source_hash") == source_hash()
        st.check("wheelhouse", True if same else None,
                 f"{len(wheels)} wheels, {fmt_bytes(info['bytes'])}; " + (
                     "built from these sources" if same else "built from other sources: the "
                     "repository's code runs (it comes first on PYTHONPATH)"))
    else:
        st.check("wheelhouse", None if not missing else False, f"no wheels in {WHEELHOUSE}")

    from jupyter_gpushare.telemetry.nvml import probe

    p = probe()
    gpus: list[dict[str, Any]] = [{"index": g.index, "name": g.name, "uuid": g.uuid,
                                   "memory_total": g.memory_total, "mig": g.mig} for g in p.gpus]
    cv = p.cuda_driver_version
    st.figure("nvml", {"ok": p.ok, "reason": p.reason, "gpus": gpus})
    if st.real:
        st.check("NVML sees a GPU", bool(p.ok and gpus), f"driver {p.driver_version}: " + "; ".join(
            f"{g['index']}: {g['name']} {fmt_bytes(g['memory_total'])}" for g in gpus))
        from jupyter_gpushare.reclaim.driver import driver_support

        s = driver_support()
        st.check("the driver checkpoint API is usable", s.ok, s.reason)
    else:
        st.check("NVML", None, p.reason or f"driver {p.driver_version} (not used: simulated)")
    host = f"{platform.node()}: {os.cpu_count()} CPUs"
    with contextlib.suppress(ImportError):
        import psutil

        host += (f", {fmt_bytes(psutil.virtual_memory().total)} RAM "
                 f"({fmt_bytes(psutil.virtual_memory().available)} available)")
    host += f", Linux {platform.release()}"
    st.figure("machine", {
        "gpus": "; ".join(f"{g['name']} {fmt_bytes(g['memory_total'])}" for g in gpus)
                or ("simulated" if not st.real else "none"),
        "gpu_count": len(gpus), "driver": p.driver_version,
        "cuda_driver": f"{cv // 1000}.{cv % 1000 // 10}" if cv else None,
        "torch_cuda": torch_cuda, "host": host, "versions": versions})
    try:
        r = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "jupyter_gpushare.doctor", "--backend",
                             "nvml" if st.real else "simulated"],
            capture_output=True, text=True, timeout=40)
        st.figure("doctor", (r.stdout + r.stderr).strip())
        st.check("jupyter gpushare doctor", r.returncode == 0, f"exit {r.returncode}")
    except subprocess.TimeoutExpired:
        st.check("jupyter gpushare doctor", False, "did not answer in 40 s")


# -- stage 1: one PyTorch kernel, both methods, shutdown --------------------------------------
TORCH_STEPS = {
    "start": ("a server (backend=nvml, release_method=auto) and a PyTorch kernel with its CUDA "
              "context", 60.0),
    "attribution": ("a model with Adam state (about 4 GiB): NVML attributes it within two polls",
                    45.0),
    "driver_round_trip": ("driver method through the server: released, NVML shows it freed, the "
                          "next cell restores through the gate, checksums equal", 60.0),
    "framework_round_trip": ("framework method, the same kernel: bitwise equal, id()s kept, an "
                             "optimizer step after the round trip equals one without", 75.0),
    "shutdown_restored": ("shutting down the restored kernel returns, and a fresh CUDA process "
                          "works after it", 50.0),
}


async def torch_scene(sc: Scene) -> None:
    async with contextlib.AsyncExitStack() as stack:
        async def start(st: Step) -> None:
            # context_bytes 1 GiB: what auto's pick leaves out of the kernel's own memory, so
            # the CUDA context alone never tips this kernel to the driver method (stage 2's
            # auto scene keeps the default and says whether it suits this GPU)
            extra: dict[str, Any] = {"context_bytes": GiB} if st.real else {}
            srv = await stack.enter_async_context(server(sc, "torch", release_method="auto",
                                                         **extra))
            (k,) = await start_kernels(sc, srv, 1)
            base = 0
            if st.real:  # the CUDA context first, so the state is what shows up next
                await k.run("import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()",
                            timeout=120)
                await wait_polls(srv, 2)
                base = (await view(srv, k.id)).get("gpu_memory_bytes") or 0
                st.check("the CUDA context shows in status", base > 0,
                         f"{fmt_bytes(base)} (the context_bytes option's default: 512 MiB)")
            st.figure("context_bytes", base)
            sc.shared.update(srv=srv, k=k, base=base, free=nvml_free() if st.real else None)

        await sc.step("start", start)
        await sc.step("attribution", torch_attribution, needs=("start",))
        await sc.step("driver_round_trip", torch_driver, needs=("attribution",))
        await sc.step("framework_round_trip", torch_framework, needs=("attribution",))
        await sc.step("shutdown_restored", shutdown_restored, needs=("start",))


async def torch_attribution(st: Step) -> None:
    sc = st.scene
    srv: Server = sc.shared["srv"]
    k: Kernel = sc.shared["k"]
    base = sc.shared["base"]
    kind, n = ("torch", 4 * GiB) if st.real else ("sim", 48 * MiB)
    poll = srv.gpushare["poll_interval"]
    # status read every 50 ms while the cell builds the state, so the time from the moment the
    # whole state is on the GPU (the cell's t_alloc) to status showing it is measured
    task = asyncio.ensure_future(k.value(cell(kind, "STATE", n=n), timeout=240))
    samples: list[tuple[float, int]] = []
    deadline = None
    while True:
        v = await view(srv, k.id)
        samples.append((time.time(), v.get("gpu_memory_bytes") or 0))
        if task.done():
            out = task.result()
            deadline = deadline or time.time() + 10 * poll + 5
            if samples[-1][1] >= base + out["bytes"] * 0.99 or time.time() > deadline:
                break
        await asyncio.sleep(0.05)
    st.figure("state", {"bytes": out["bytes"], **out["info"]})
    shown = [t for t, b in samples if t >= out["t_alloc"] and b >= base + out["bytes"] * 0.99]
    seen: float | None = shown[0] - out["t_alloc"] if shown else None
    # a loaded CI machine (the rehearsal) gets more slack than the GPU run
    st.check("the kernel's state shows in status within two polls",
             seen is not None and seen <= 2 * poll + (0.3 if st.real else 1.0),
             f"{fmt_bytes(v.get('gpu_memory_bytes'))}, "
             f"{'never' if seen is None else f'{seen:.2f} s'} after the state was on the GPU "
             f"(poll {poll} s)")
    got = (v.get("gpu_memory_bytes") or 0) - base
    # the process holds its tensors, the caching allocator's reserve around them (PyTorch's
    # memory_reserved) and the kernels' code its context loads lazily as cells run (cuBLAS,
    # Adam's kernels: not in the context measured at start): at least the state, at most the
    # reserve plus 1.5 GiB of code and workspaces
    held = max(out.get("reserved") or out["bytes"], out["bytes"])
    st.check("attributed to this kernel: its state, its pids", out["bytes"] * 0.99 <= got
             <= held + (GiB * 3 // 2 if st.real else MiB) and bool(v.get("pids")),
             f"{fmt_bytes(got)} above the context for a state of {fmt_bytes(out['bytes'])} "
             f"(allocator reserve {fmt_bytes(held)}); pids {v.get('pids')}, GPUs {v.get('gpus')}")
    st.figure("attribution", {"state_bytes": out["bytes"], "status_bytes": v.get("gpu_memory_bytes"),
                              "reserved_bytes": out.get("reserved"), "context_bytes": base,
                              "seconds_to_show": seen, "poll_s": poll})
    sc.shared.update(ck=out["checksum"], state_bytes=out["bytes"])


async def torch_driver(st: Step) -> None:
    sc = st.scene
    srv: Server = sc.shared["srv"]
    k: Kernel = sc.shared["k"]
    free = sc.shared["free"]
    if st.real:
        if not installed("cuda.bindings"):
            raise Skip("cuda-bindings is not installed: no raw allocation to steer auto's pick")
        # memory no framework counts: auto must pick the driver method for this kernel now
        await k.run(RAW_ALLOC.format(n=2 * GiB), timeout=60)
    try:
        if st.real:
            await wait_pick(st, srv, k.id, "driver")
        await round_trip(st, srv, k, "driver" if st.real else "simulated", sc.shared["ck"], free,
                         method="driver" if st.real else "simulated")
    finally:
        if st.real:  # the framework step needs the raw buffer gone
            await k.run(RAW_FREE, timeout=60)


async def torch_framework(st: Step) -> None:
    if not st.real:
        raise Skip(NOT_SIMULATED)
    from cells import TORCH_AFTER_ROUND_TRIP, TORCH_REFERENCE_STEP

    sc = st.scene
    srv: Server = sc.shared["srv"]
    k: Kernel = sc.shared["k"]
    free = sc.shared["free"]
    ck = sc.shared["ck"]
    await k.value(TORCH_REFERENCE_STEP.format(), timeout=240)
    if not await wait_pick(st, srv, k.id, "framework"):
        return
    held = (await view(srv, k.id)).get("gpu_memory_bytes") or 0
    free0 = free(0) or 0
    code, v = await post(srv, f"kernels/{k.id}/release")
    st.check("release over REST", code == 200 and v.get("state") == "released",
             f"HTTP {code}, method {v.get('method')}, {fmt_bytes(v.get('released_bytes'))} in "
             f"{v.get('last_release_seconds')} s; {v.get('error') or v.get('message') or ''}")
    st.check("released by the framework method", v.get("method") == "framework",
             f"method {v.get('method')}")
    await wait_polls(srv)
    freed = (free(0) or 0) - free0
    need = sc.shared["state_bytes"] * 0.9
    after = await view(srv, k.id)
    st.check("the state's bytes freed as NVML sees them", freed >= need,
             f"GPU 0 free {signed(freed)} of {fmt_bytes(held)} held (needs >= "
             f"{fmt_bytes(need)}); the kernel still shows "
             f"{fmt_bytes(after.get('gpu_memory_bytes'))} (its CUDA context)"
             + ("" if freed >= need else f"; the release moved {fmt_bytes(v.get('released_bytes'))}"
                f": {after.get('release_detail') or 'no detail'}"))
    res = await k.value(TORCH_AFTER_ROUND_TRIP.format(), timeout=240)
    back = await view(srv, k.id)
    st.check("bitwise equal after the round trip", res["checksum"] == ck,
             f"restore {back.get('last_restore_seconds')} s, state {back.get('state')}"
             + (f", error {back.get('error')!r}" if back.get("error") else "")
             + ("" if res["checksum"] == ck else
                f"; checksum {res['checksum'][:300]!r} where {ck[:300]!r} was expected"))
    st.check("id()s kept (model, optimizer, data, parameters)", res["ids_kept"], "")
    st.check("an optimizer step after the round trip equals one without",
             res["step_equal"] and res["on_cuda"], f"parameters on CUDA: {res['on_cuda']}")
    st.figure("round_trip", {"held_bytes": held, "freed_bytes": freed,
                             "release_s": v.get("last_release_seconds"),
                             "restore_s": back.get("last_restore_seconds")})


async def shutdown_restored(st: Step) -> None:
    """A published driver bug hung a host when a just-restored process was killed: DELETE the
    restored kernel with a bound, then check a fresh CUDA process still works."""
    sc = st.scene
    srv: Server = sc.shared["srv"]
    k: Kernel = sc.shared["k"]
    v = await view(srv, k.id)
    st.figure("before", {"state": v.get("state"), "restores": v.get("restores"),
                         "pids": v.get("pids")})
    t0 = time.monotonic()
    try:
        await srv.api("DELETE", f"/api/kernels/{k.id}", timeout=30)
        srv.kernel_ids.remove(k.id)
        ok, why = True, ""
    except Exception as e:
        ok, why = False, f": {e.__class__.__name__}: {e}"
    gone = time.monotonic() - t0
    st.check("DELETE of a kernel restored earlier returns", ok, f"in {gone:.2f} s{why}")
    if st.real:
        code = "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize(); print('ok')"
        t0 = time.monotonic()
        try:
            r = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", code],
                                        capture_output=True, text=True, timeout=40)
            st.check("a fresh CUDA process works after it", r.returncode == 0,
                     f"exit {r.returncode} in {time.monotonic() - t0:.1f} s {r.stderr[-200:]}")
        except subprocess.TimeoutExpired:
            st.check("a fresh CUDA process works after it", False, "did not end in 40 s")


# -- stage 2: JAX and CuPy through the driver, a restore without room waits -------------------
FRAMEWORKS_STEPS = {
    "start": ("a server (release_method=driver), a CuPy and a JAX kernel", 60.0),
    "cupy_round_trip": ("CuPy (1 GiB) through the driver method: freed, restored, checksum equal",
                        60.0),
    "jax_room_wait": ("JAX that preallocated 75 %: released; with the GPU filled the next cell's "
                      "restore waits (no driver call); room made, restored, checksum equal", 180.0),
}


def _jax_env(real: bool) -> dict[str, str]:
    """JAX preallocates 75 % of the GPU; a checkpoint copies that into host memory, so where the
    host could not hold it (an H200 beside 128 GiB of RAM) take what it can."""
    if not real:
        return {}
    import psutil

    from jupyter_gpushare.telemetry.nvml import probe

    p = probe()
    total = p.gpus[0].memory_total if p.ok and p.gpus else 0
    avail = psutil.virtual_memory().available
    if total and 0.75 * total > 0.6 * avail:
        return {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{0.6 * avail / total:.2f}"}
    return {}


async def frameworks_scene(sc: Scene) -> None:
    async with contextlib.AsyncExitStack() as stack:
        async def start(st: Step) -> None:
            if st.real and not (installed("cupy") and installed("jax")):
                raise Skip(f"needs CuPy and JAX (cupy: {installed('cupy')}, jax: {installed('jax')})")
            if st.real:
                from jupyter_gpushare.reclaim.driver import driver_support

                s = driver_support()
                if not s.ok:
                    raise Skip(f"the driver method is unsupported here: {s.reason}")
            env = _jax_env(st.real)
            st.figure("kernel_env", env)
            srv = await stack.enter_async_context(
                server(sc, "frameworks", release_method="driver", kernel_env=env))
            filler, big = await start_kernels(sc, srv, 2)
            sc.shared.update(srv=srv, filler=filler, big=big, jax_env=env,
                             free=nvml_free() if st.real else None)

        await sc.step("start", start)
        await sc.step("cupy_round_trip", cupy_round_trip, needs=("start",))
        await sc.step("jax_room_wait", jax_room_wait, needs=("start",))


async def cupy_round_trip(st: Step) -> None:
    sc = st.scene
    srv: Server = sc.shared["srv"]
    k: Kernel = sc.shared["filler"]
    free = sc.shared["free"]
    kind, n = ("cupy", GiB) if st.real else ("sim", 32 * MiB)
    out = await make_state(st, srv, k, kind, n)
    await round_trip(st, srv, k, kind, out["checksum"], free,
                     method="driver" if st.real else "simulated")


def _pid_state(pid: int | None) -> tuple[str | None, str]:
    """The driver's checkpoint state of ``pid``, read with cuda-core as the server reads it:
    (state, "") or (None, why it could not be read)."""
    if pid is None:
        return None, "no pid for the kernel"
    try:
        from cuda.bindings import driver as cu
        from cuda.core.checkpoint import Process

        cu.cuInit(0)
        return str(Process(pid).state), ""
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"


def _oom_kills(cgroup: str | None) -> dict[str, int | str | None]:
    """Out-of-memory kills so far: the host's (/proc/vmstat) and, with cgroup v2, in the
    kernel's cgroup, with that cgroup's memory limit (None: unreadable)."""
    out: dict[str, int | str | None] = {"host": None}
    with contextlib.suppress(OSError, ValueError):
        for ln in Path("/proc/vmstat").read_text().splitlines():
            if ln.startswith("oom_kill "):
                out["host"] = int(ln.split()[1])
    if cgroup is not None:
        base = Path("/sys/fs/cgroup") / cgroup.lstrip("/")
        with contextlib.suppress(OSError, ValueError):
            out["cgroup_max"] = (base / "memory.max").read_text().strip()
        with contextlib.suppress(OSError, ValueError):
            for ln in (base / "memory.events").read_text().splitlines():
                if ln.startswith("oom_kill "):
                    out["cgroup"] = int(ln.split()[1])
    return out


def _cgroup(pid: int | None) -> str | None:
    """The process's cgroup v2 path (None: none, or unreadable)."""
    with contextlib.suppress(OSError):
        for ln in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            if ln.startswith("0::"):
                return ln[3:]
    return None


def _process(pid: int | None, cgroup: str | None = None) -> dict[str, Any]:
    """A kernel process as the host sees it: alive or not, its resident memory; the host's
    available memory (a driver checkpoint lives in the checkpointed process's own memory) and
    the out-of-memory kills so far (``cgroup``: the process's, read while it lived)."""
    import psutil

    out: dict[str, Any] = {"pid": pid, "host_available": psutil.virtual_memory().available,
                           "oom_kills": _oom_kills(cgroup)}
    if pid is None:
        return {**out, "status": "no pid"}
    try:
        p = psutil.Process(pid)
        out.update(status=p.status(), rss=p.memory_info().rss)
    except psutil.NoSuchProcess:
        out["status"] = "gone"
    except psutil.Error as e:
        out["status"] = f"unreadable ({type(e).__name__})"
    return out


def _said(p: dict[str, Any]) -> str:
    oom = p.get("oom_kills") or {}
    return (f"process {p['pid']} {p['status']}"
            + (f", RSS {fmt_bytes(p['rss'])}" if p.get("rss") is not None else "")
            + f"; host memory available {fmt_bytes(p['host_available'])}"
            + (f"; OOM kills so far: host {oom['host']}" if oom.get("host") is not None else "")
            + (f", cgroup {oom['cgroup']} (memory.max {oom.get('cgroup_max')})"
               if oom.get("cgroup") is not None else ""))


def _kernel_log(pid: int | None) -> list[str]:
    """The host kernel's lines on an out-of-memory kill, a signal or a GPU fault (Xid) of
    ``pid`` or of any process (dmesg; root on the GPU machine), the last 12."""
    try:
        r = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        return [f"dmesg: {e}"]
    if r.returncode != 0:
        return [f"dmesg: exit {r.returncode}: {r.stderr.strip()[:200]}"]
    keys = ("out of memory", "oom", "killed process", "xid", "nvrm", "segfault", "traps:")
    return [ln for ln in r.stdout.splitlines()
            if any(k in ln.lower() for k in keys) or (pid is not None and f" {pid}" in ln)][-12:]


async def jax_room_wait(st: Step) -> None:
    sc = st.scene
    srv: Server = sc.shared["srv"]
    k: Kernel = sc.shared["big"]
    filler: Kernel = sc.shared["filler"]
    free = sc.shared["free"]
    kind, n, fkind = ("jax", GiB, "cupy") if st.real else ("sim", 64 * MiB, "sim")
    out = await make_state(st, srv, k, kind, n)
    v0 = await view(srv, k.id)
    held = v0.get("gpu_memory_bytes") or 0
    pid = (v0.get("pids") or [None])[0]  # the kernel's process (its tree's root)
    cg = _cgroup(pid)

    def at(moment: str) -> dict[str, Any]:
        host[moment] = _process(pid, cg)
        return host[moment]

    host: dict[str, Any] = {"cgroup": cg}
    at("before release")
    st.figure("kernel_process", host)  # filled in as the step goes
    if st.real:
        total = (await srv.api("GET", "/api/gpushare/status"))["gpus"][0]["memory_total"]
        share = float(sc.shared["jax_env"].get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75))
        st.check("JAX preallocated its share of the GPU", held >= 0.8 * share * total,
                 f"the kernel holds {fmt_bytes(held)} of {fmt_bytes(total)} (share {share})")
    free0 = free(0) if free else None
    code, v = await post(srv, f"kernels/{k.id}/release")
    at("after release")
    st.check(f"{kind}: release over REST", code == 200 and v.get("state") == "released",
             f"HTTP {code}, {v.get('state')}, method {v.get('method')}, "
             f"{fmt_bytes(v.get('released_bytes'))} in {v.get('last_release_seconds')} s; "
             f"{_said(host['after release'])}"
             + (f"; {v.get('error') or v.get('message')}" if v.get("error") or v.get("message") else ""))
    if code != 200:
        return
    await wait_polls(srv)
    if free is not None and free0 is not None:
        freed = (free(0) or 0) - free0
        st.check(f"{kind}: memory free (NVML)", freed >= held * 0.9,
                 f"GPU 0 free {signed(freed)} of {fmt_bytes(held)} held")
        room = free(0) or 0
    else:
        g0 = (await srv.api("GET", "/api/gpushare/status"))["gpus"][0]
        room = g0["memory_total"] - g0["memory_used"]
    fill = int(room - held // 2)
    if fill <= 0:
        st.check("a restore without room waits", None, f"no room to fill ({fmt_bytes(room)} free)")
        return
    await filler.run(cell(fkind, "ALLOC", n=fill), timeout=240)
    st.figure("fill_bytes", fill)
    await wait_polls(srv)
    at("after the fill")
    t0 = time.monotonic()
    pending = asyncio.ensure_future(k.value(CHECKSUM, timeout=240))
    try:
        w = await srv.wait_kernel(k.id, lambda v: bool(v.get("waiting")), "waiting", timeout=30)
        waiting = w.get("waiting")
    except TimeoutError:
        waiting = None
    await asyncio.sleep(2 if st.real else 0.5)  # and still waiting a while later
    mid = await view(srv, k.id)
    at("while waiting")
    if st.real:  # the state the driver holds must be read, and still be checkpointed
        driver_state, unread = _pid_state(pid)
        still_held = driver_state is not None and driver_state.lower().endswith("checkpointed")
    else:
        driver_state, unread, still_held = None, "not read: simulated", True
    st.check("a restore without room waits instead of calling the driver",
             bool(waiting) and mid.get("restores") == 0 and not pending.done() and still_held,
             f"waiting: {waiting!r}; state {mid.get('state')}; restores {mid.get('restores')}; "
             f"the cell {'answered' if pending.done() else 'held'}; "
             f"driver state of pid {pid}: {driver_state or unread}; {_said(host['while waiting'])}; "
             f"the kernel's host room per status {fmt_bytes(mid.get('host_room_bytes'))}")
    await filler.run(cell(fkind, "FREE"), timeout=120)
    try:
        ck2: Any = await asyncio.wait_for(pending, 150)
    except Exception as e:
        ck2 = f"no answer: {type(e).__name__}: {e}"
    waited = time.monotonic() - t0
    st.figure("room_wait_s", round(waited, 2))
    back = await view(srv, k.id)
    at("after")
    equal = ck2 == out["checksum"]
    ok = equal and back.get("state") == "active"
    gone = host["after"]["status"] in ("gone", "zombie")
    dmesg = _kernel_log(pid) if st.real and not ok else []
    if dmesg:
        st.figure("kernel_log", dmesg)
    st.check(f"{kind}: restored once room was made, checksum equal", ok,
             f"after {waited:.1f} s; state {back.get('state')}, restores {back.get('restores')}, "
             f"restore {back.get('last_restore_seconds')} s"
             + (f", error {back.get('error')!r}" if back.get("error") else "")
             + ("; checksum equal" if equal else
                f"; the cell gave {str(ck2)[:400]!r} where {out['checksum']!r} was expected")
             + f"; {_said(host['after'])}"
             + (f" (after the release: {_said(host['after release'])})" if gone else "")
             + (f"; host kernel log: {' | '.join(dmesg)}" if dmesg else ""))


# -- stage 2: memory caps hold through the frameworks --------------------------------------
CAPS_STEPS = {
    "torch_cap": ("%gpushare cap 1GiB, then PyTorch: 512 MiB fits, 1 GiB more fails with "
                  "PyTorch's OutOfMemoryError; the node sees the kernel within its cap", 90.0),
    "jax_cap": ("%gpushare cap 1GiB before JAX starts: 256 MiB fits, 2 GiB fails with XLA's "
                "RESOURCE_EXHAUSTED; the node sees the kernel within its cap; a cap set once "
                "JAX runs is said not to hold", 120.0),
}
#: what a cell of each kind allocates: (the cell's imports, one allocation of {n} bytes)
CAP_CELLS = {
    "torch": ("import torch", "torch.empty({n}, dtype=torch.uint8, device='cuda')"),
    "jax": ("import jax, jax.numpy as jnp",
            "jnp.zeros(({n} // 4,), dtype=jnp.float32).block_until_ready()"),
    "sim": ("from jupyter_gpushare.sim import simgpu\nimport numpy as np",
            "simgpu.array(np.zeros({n}, dtype=np.uint8), copy=False)"),
}
#: what each framework's out-of-memory error is called
CAP_OOM = {"torch": ("OutOfMemoryError",), "jax": ("XlaRuntimeError", "JaxRuntimeError"),
           "sim": ("SimOutOfMemoryError",)}


async def caps_scene(sc: Scene) -> None:
    async with server(sc, "caps") as srv:
        sc.shared["srv"] = srv
        await sc.step("torch_cap", lambda st: cap_holds(st, "torch"))
        await sc.step("jax_cap", lambda st: cap_holds(st, "jax"))


async def cap_holds(st: Step, framework: str) -> None:
    """The cap set in the kernel before the framework's first allocation: an allocation within
    it works, one past it fails with the framework's own error, and the node's reading of the
    kernel (its CUDA context aside) stays under it."""
    sc = st.scene
    srv: Server = sc.shared["srv"]
    if not st.real and framework == "jax":
        raise Skip("the rehearsal caps the simulated GPU in torch_cap; JAX needs a GPU")
    if st.real and not installed(framework):
        raise Skip(f"{framework} is not installed here")
    kind = framework if st.real else "sim"
    cap, fits, past = (GiB, (512 if kind == "torch" else 256) * MiB, 2 * GiB if kind == "jax"
                       else GiB) if st.real else (64 * MiB, 32 * MiB, 48 * MiB)
    (k,) = await start_kernels(sc, srv, 1)
    said = (await k.run(f"%gpushare cap {cap}")).stdout
    st.check("the cap is set", "memory cap:" in said, said.strip()[-300:])
    imports, alloc = CAP_CELLS[kind]
    await k.run(f"{imports}\nfits = {alloc.format(n=fits)}", timeout=120)
    applied = (await k.run("%gpushare cap")).stdout
    st.figure("applied", applied.strip()[-400:])
    name = {"torch": "PyTorch", "jax": "JAX", "sim": "simulated GPU"}[kind]
    st.check(f"{name} is capped", f"{name}: capped at" in applied, applied.strip()[-300:])
    reply = await k.execute(f"past = {alloc.format(n=past)}", timeout=120)
    err = reply.error or {}
    ename, evalue = err.get("ename", ""), str(err.get("evalue", ""))
    own = ename in CAP_OOM[kind] and (kind != "jax" or "RESOURCE_EXHAUSTED" in evalue)
    st.check("past the cap: the framework's own out-of-memory error", reply.status == "error" and own,
             f"{reply.status}: {ename}: {evalue[:200]}")
    flagged = await k.value("import sys, json\nfrom jupyter_gpushare.kernel import caps\n"
                            "print(json.dumps([caps.is_oom(getattr(sys, 'last_value', None)), "
                            "caps.get().oom_line()]))")
    st.check("the cell's error is followed by a line naming the cap",
             flagged[0] is True and "memory cap is" in flagged[1], str(flagged))
    await wait_polls(srv)
    held = (await view(srv, k.id)).get("gpu_memory_bytes") or 0
    context = 1 * GiB if st.real else 0  # the CUDA context, which no framework's limit counts
    st.figure("held_bytes", held)
    st.check("the node sees the kernel within its cap", held <= cap + context,
             f"{fmt_bytes(held)} held, cap {fmt_bytes(cap)}")
    if kind == "jax":
        late = (await k.run("%gpushare cap 512MiB")).stdout
        st.check("a cap set once JAX runs is said not to hold", "cannot be limited any more" in late,
                 late.strip()[-300:])
    await srv.api("DELETE", f"/api/kernels/{k.id}")


# -- stage 2: lazy mode -----------------------------------------------------------------------
LAZY_STEPS = {
    "cpu_cell_then_gpu_cell": ("restore_mode=lazy: a CPU-only cell on a released kernel runs "
                               "without a restore; a GPU cell restores, checksum equal", 90.0),
}


async def lazy_scene(sc: Scene) -> None:
    await sc.step("cpu_cell_then_gpu_cell", lazy_cells)


async def lazy_cells(st: Step) -> None:
    sc = st.scene
    if st.real:
        from jupyter_gpushare.reclaim.driver import driver_support

        s = driver_support()
        if not s.ok:
            raise Skip(f"lazy mode needs the driver method here: {s.reason}")
    kind, n = ("torch", GiB) if st.real else ("sim", 16 * MiB)
    async with server(sc, "lazy", restore_mode="lazy", release_method="driver") as srv:
        (k,) = await start_kernels(sc, srv, 1)
        out = await make_state(st, srv, k, kind, n)
        code, v = await post(srv, f"kernels/{k.id}/release")
        st.check("release", code == 200 and v.get("state") == "released",
                 f"HTTP {code}, method {v.get('method')}")
        t0 = time.monotonic()
        answer = await k.value("print(json.dumps(sum(range(10))))", timeout=120)
        cpu_s = time.monotonic() - t0
        v = await view(srv, k.id)
        st.check("a CPU-only cell runs without a restore",
                 answer == 45 and v.get("state") == "released" and v.get("restores") == 0,
                 f"answer {answer}, state {v.get('state')}, restores {v.get('restores')}, "
                 f"cell {cpu_s:.2f} s")
        t0 = time.monotonic()
        ck2 = await k.value(CHECKSUM, timeout=240)
        gpu_s = time.monotonic() - t0
        v = await view(srv, k.id)
        st.check("a GPU cell restores first, checksum equal",
                 ck2 == out["checksum"] and v.get("state") == "active" and v.get("restores") == 1,
                 f"state {v.get('state')}, restores {v.get('restores')}, cell {gpu_s:.2f} s")
        st.figure("cells", {"cpu_cell_s": round(cpu_s, 3), "gpu_cell_s": round(gpu_s, 3),
                            "restore_s": v.get("last_restore_seconds")})


# -- stage 2: auto's pick per kernel ----------------------------------------------------------
AUTO_STEPS = {
    "start": ("a server (release_method=auto), a PyTorch and a JAX kernel", 60.0),
    "torch_pick": ("a PyTorch-only kernel: auto picks the framework method; it frees the state; "
                   "restored, checksum equal", 60.0),
    "jax_pool_pick": ("a JAX kernel with a preallocated pool (20 %): the method auto picks frees "
                      "what the kernel holds; restored, checksum equal", 90.0),
}
JAX_POOL = "import os\nos.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'] = '.20'\n"


async def auto_scene(sc: Scene) -> None:
    async with contextlib.AsyncExitStack() as stack:
        async def start(st: Step) -> None:
            if not st.real:
                raise Skip(NOT_SIMULATED)
            if not installed("torch"):
                raise Skip("needs PyTorch")
            srv = await stack.enter_async_context(server(sc, "auto", release_method="auto"))
            tk, jk = await start_kernels(sc, srv, 2)
            sc.shared.update(srv=srv, tk=tk, jk=jk, free=nvml_free())

        await sc.step("start", start)
        await sc.step("torch_pick", auto_torch, needs=("start",))
        await sc.step("jax_pool_pick", auto_jax, needs=("start",))


async def auto_torch(st: Step) -> None:
    sc = st.scene
    srv: Server = sc.shared["srv"]
    k: Kernel = sc.shared["tk"]
    free = sc.shared["free"]
    out = await make_state(st, srv, k, "torch", GiB)
    await wait_pick(st, srv, k.id, "framework")
    await round_trip(st, srv, k, "torch", out["checksum"], free, method="framework",
                     state_bytes=out["bytes"])


async def auto_jax(st: Step) -> None:
    if not installed("jax"):
        raise Skip("needs JAX")
    sc = st.scene
    srv: Server = sc.shared["srv"]
    k: Kernel = sc.shared["jk"]
    free = sc.shared["free"]
    out = await k.value(JAX_POOL + cell("jax", "STATE", n=256 * MiB), timeout=240)
    await wait_polls(srv, 4)  # the agent's report of the pool, then the pick
    v = await view(srv, k.id)
    st.figure("pick", {"method": v.get("method"), "why": pick_reason(srv, k.id),
                       "held_bytes": v.get("gpu_memory_bytes")})
    st.check("auto's pick", None, f"{v.get('method')}: {pick_reason(srv, k.id)}")
    # the pool is the kernel's memory: the method picked must free it (the framework method
    # moves arrays, not JAX's pool)
    await round_trip(st, srv, k, f"jax ({v.get('method')})", out["checksum"], free)


# -- stage 2: restore onto another GPU --------------------------------------------------------
MIGRATE_STEPS = {
    "another_gpu": ("restore onto another GPU (cuda-core gpu_mapping, driver >= 580): needs two "
                    "GPUs", 60.0),
}

MIGRATE_CHILD = """
import sys, torch
x = torch.randint(-2**62, 2**62, ((256 << 20) // 8,), dtype=torch.int64, device="cuda:0")
def ck():
    return f"{int((x ^ (x >> 17)).sum())}:{x.device}:{torch.cuda.current_device()}"
print("ready", ck(), flush=True)
for line in sys.stdin:
    print(ck(), flush=True)
"""


async def migrate_scene(sc: Scene) -> None:
    await sc.step("another_gpu", migrate)


async def migrate(st: Step) -> None:
    if not st.real:
        raise Skip("cuda-core's gpu_mapping needs real GPUs")
    from jupyter_gpushare.telemetry.nvml import probe

    p = probe()
    if len(p.gpus) < 2:
        raise Skip(f"{len(p.gpus)} GPU here: restoring onto another GPU needs two (the step "
                   "stays in the plan for a machine that has them)")
    ok, detail = await asyncio.to_thread(_migrate_check)
    st.check("restored onto GPU 1, checksum equal", ok, detail)


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
            assert proc.stdin and proc.stdout
            _word, before = proc.stdout.readline().split()
            p = Process(proc.pid)
            p.lock(10_000)
            p.checkpoint()
            p.restore(gpu_mapping={uu[0]: uu[1], uu[1]: uu[0], **{u: u for u in uu[2:]}})
            p.unlock()  # a restore leaves the process locked
            on1 = [u for u in tel.processes() if u.pid == proc.pid and u.gpu == 1]
            proc.stdin.write("check\n")
            after = proc.stdout.readline().strip()
            same = after.split(":")[0] == before.split(":")[0]
            return same, f"checksum {'equal' if same else 'DIFFERS'}; on GPU 1 per NVML: {bool(on1)}"
        except Exception as e:
            return False, f"{e.__class__.__name__}: {e}"
        finally:
            if proc.stdin:
                proc.stdin.close()
            proc.kill()
            proc.wait(30)
    finally:
        tel.close()


# -- stage 3: SM utilization per kernel, a release while a GPU kernel runs --------------------
BUSY_STEPS = {
    "start": ("a server (release_method=driver) and two PyTorch kernels, 1 GiB each", 60.0),
    "sm_utilization": ("SM utilization follows a matmul loop in one kernel; the other shows none",
                       45.0),
    "release_while_busy": ("a release while one long GPU kernel runs answers why (lock_timeout "
                           "2 s); the kernel runs on, its state intact", 60.0),
}


async def busy_scene(sc: Scene) -> None:
    async with contextlib.AsyncExitStack() as stack:
        async def start(st: Step) -> None:
            if st.real and not installed("torch"):
                raise Skip("needs PyTorch")
            if st.real:
                from jupyter_gpushare.reclaim.driver import driver_support

                if not driver_support().ok:
                    raise Skip(f"the driver method is unsupported here: {driver_support().reason}")
            srv = await stack.enter_async_context(server(sc, "busy", release_method="driver"))
            kind, n = ("torch", GiB) if st.real else ("sim", 16 * MiB)
            busy, idle = await start_kernels(sc, srv, 2)
            out = await make_state(st, srv, busy, kind, n)
            await make_state(st, srv, idle, kind, n)
            sc.shared.update(srv=srv, busy=busy, idle=idle, kind=kind, ck=out["checksum"])

        await sc.step("start", start)
        await sc.step("sm_utilization", sm_utilization, needs=("start",))
        await sc.step("release_while_busy", release_while_busy, needs=("start",))


async def sm_utilization(st: Step) -> None:
    sc = st.scene
    srv: Server = sc.shared["srv"]
    busy: Kernel = sc.shared["busy"]
    idle: Kernel = sc.shared["idle"]
    poll, spin_s = srv.gpushare["poll_interval"], 6 if st.real else 2
    spin = asyncio.ensure_future(busy.run(cell(sc.shared["kind"], "SPIN", s=spin_s), timeout=60))
    series: list[list[Any]] = []
    t0 = time.monotonic()
    while not spin.done() or time.monotonic() - t0 < spin_s + 4 * poll:
        status = await srv.api("GET", "/api/gpushare/status")
        util = {k["id"]: k.get("sm_utilization") for k in status["kernels"]}
        series.append([round(time.monotonic() - t0, 2), util.get(busy.id), util.get(idle.id)])
        await asyncio.sleep(poll)
    await spin
    st.figure("sm_series", series)
    during = [s[1] or 0 for s in series if spin_s * 0.25 <= s[0] <= spin_s - 0.3]
    after = [s[1] or 0 for s in series if s[0] >= spin_s + 3 * poll]
    other = max((s[2] or 0 for s in series), default=0)
    st.check("SM utilization follows the loop",
             bool(during) and max(during) >= 30 and bool(after) and after[-1] <= 10,
             f"busy kernel: max {max(during, default=0)} % during, "
             f"{after[-1] if after else '?'} % after")
    st.check("the idle kernel shows no SM use", other <= 10, f"max {other} %")


async def release_while_busy(st: Step) -> None:
    sc = st.scene
    srv: Server = sc.shared["srv"]
    k: Kernel = sc.shared["busy"]
    kind = sc.shared["kind"]
    spin_s = 12 if st.real else 2
    t_spin = time.monotonic()
    if st.real:  # nothing cached, so the agent's trim has no cudaFree to wait on
        await k.run("torch.cuda.empty_cache()")
    await k.run(cell(kind, "SPIN_BACKGROUND", s=spin_s))
    t_post = time.monotonic()
    code, v = await post(srv, f"kernels/{k.id}/release")
    took = time.monotonic() - t_post
    msg = v.get("message") or v.get("error") or v.get("state")
    st.figure("busy_release_message", msg)
    st.check("a release while a GPU kernel runs says why", code != 200 or v.get("state") != "released",
             f"HTTP {code} after {took:.1f} s: {msg}" + ("" if code != 200 else
                                                          " (the release waited for the GPU kernel)"))
    left = max(spin_s - (time.monotonic() - t_spin), 0) + 0.2
    await k.run(cell(kind, "SYNC", s=left), timeout=60)
    if (await view(srv, k.id)).get("state") == "released":
        await post(srv, f"kernels/{k.id}/restore")
    ck2 = await k.value(CHECKSUM, timeout=120)
    v = await view(srv, k.id)
    st.check("the busy kernel runs on, state intact", ck2 == sc.shared["ck"] and v.get("state") == "active",
             f"state {v.get('state')}")
