"""The bandwidth scenes: release and restore of a process holding n bytes by each method,
against pinned host<->device copies of the same bytes measured in the same run.

- driver: ``DriverMethod`` in this process (initialised once, as the server holds it), on a
  child that holds n bytes of random int64 on GPU 0; the in-process API pays no start-up per
  call, unlike the cuda-checkpoint binary (``cold_start`` measures what that start-up is);
- framework: ``TorchAdapter`` offload/reload inside a child holding the same tensor (the first
  cycle pins the buffers, later ones reuse them: both are recorded).

Each size's row: seconds (median), GB/s, the fraction of the pinned copy, whether the child's
data came back intact. The report fits seconds = fixed overhead + bytes / bandwidth per method.
On the simulated node the rows come from the simulated GPU's own checkpoint in this process,
so the rehearsal checks the same shape without a server.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from report import GiB, MiB, fmt_bytes
from runner import Scene, Skip, Step

SMALL = [64 * MiB, GiB, 8 * GiB]  # stage 1 (64 MiB: the fixed overhead, nearly alone)
LARGE = [16 * GiB, 40 * GiB]  # stage 2
SIM_SMALL = [4 * MiB, 16 * MiB, 32 * MiB]
SIM_LARGE = [48 * MiB, 96 * MiB]
CHUNK = GiB  # pinned host memory is taken in chunks (PyTorch rounds one block up to 2^k)

BANDWIDTH_STEPS = {
    "cold_start": ("a fresh process's import + cuInit: what each run of the cuda-checkpoint "
                   "binary pays and the in-process API does not", 30.0),
    "sizes": ("release/restore by each method at 64 MiB, 1 and 8 GiB against pinned copies: "
              "GB/s, fraction of pinned, fixed overhead", 150.0),
}
BANDWIDTH_LARGE_STEPS = {
    "sizes": ("release/restore by each method at 16 and 40 GiB against pinned copies", 240.0),
    "fingerprint": ("the framework method's device fingerprint of a storage (what a release "
                    "reads to trust a kept host copy) against a pinned copy of it, 1 and 8 GiB; "
                    "a one-word change is seen", 60.0),
    "kept_copies": ("kept PyTorch host copies under the default check: a write through .data "
                    "or DLPack after a restore's kept copy or a pre-copy is not lost; then "
                    "benchmarks/incremental_release.py on GPU 0 (4 GiB): unchanged and 10 % "
                    "changed releases as a share of a full one per check, the fingerprints "
                    "alone", 90.0),
}
FINGERPRINT_SIZES = [GiB, 8 * GiB]
SIM_FINGERPRINT_SIZES = [16 * MiB]  # on CPU memory: the code path, not a figure
KEPT_GIB = 4.0  # the state: a release of 4 GiB unchanged against a full one
UNSEEN_WRITE_BYTES, SIM_UNSEEN_WRITE_BYTES = 512 * MiB, 2 * MiB
INCREMENTAL = Path(__file__).resolve().parent.parent / "incremental_release.py"


async def bandwidth_scene(sc: Scene) -> None:
    await sc.step("cold_start", cold_start)
    await sc.step("sizes", lambda st: sizes(st, SMALL if st.real else SIM_SMALL))


async def bandwidth_large_scene(sc: Scene) -> None:
    # the short steps first: the sizes step skips what its time left cannot hold (40 GiB
    # first), so a stage that ran late loses the least; and the children of the first two
    # have the GPU to themselves (this process has no CUDA context before the sizes step)
    await sc.step("fingerprint", fingerprint_step)
    await sc.step("kept_copies", kept_copies_step)
    await sc.step("sizes", lambda st: sizes(st, LARGE if st.real else SIM_LARGE))


#: a child process (its own CUDA context, nothing else on the GPU): n bytes of random int64,
#: the median of 5 fingerprints (queued and read, as a release reads them) against 5 copies
#: into pinned host memory; then one word changed, and whether the fingerprint moved
FINGERPRINT_CHILD = """
import json, statistics, sys, time, torch
from jupyter_gpushare.kernel.offload.torch_adapter import _read_fingerprints, fingerprint
n, device = int(sys.argv[1]), sys.argv[2]
cuda = device.startswith("cuda")
x = torch.randint(-2**62, 2**62, (n // 8,), dtype=torch.int64, device=device)
host = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
s = x.untyped_storage()
def sync():
    if cuda:
        torch.cuda.synchronize()
def fp():
    return _read_fingerprints([fingerprint(s)])[0]
def copy():
    host.copy_(x.view(torch.uint8), non_blocking=cuda)
    sync()
def median(f):
    f()
    times = []
    for _ in range(5):
        sync()
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times)
fp_s, copy_s = median(fp), median(copy)
before = fp()
x[n // 16] += 1
print(json.dumps({"fingerprint_s": fp_s, "copy_s": copy_s, "seen": fp() != before}))
"""


async def fingerprint_step(st: Step) -> None:
    rows: list[dict[str, Any]] = []
    st.figure("fingerprint_rows", rows)
    device = "cuda:0" if st.real else "cpu"
    for n in FINGERPRINT_SIZES if st.real else SIM_FINGERPRINT_SIZES:
        if st.left() < 10 + n * 2e-9:
            st.check(f"{fmt_bytes(n)}", None, f"skipped: {st.left():.0f} s left in the step")
            continue
        out = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-c", FINGERPRINT_CHILD, str(n), device],
            capture_output=True, text=True, timeout=max(st.left(), 10))
        if out.returncode != 0:
            st.check(f"{fmt_bytes(n)}", False, out.stderr[-400:])
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r = {"bytes": n, **r, "fraction_of_copy": r["fingerprint_s"] / r["copy_s"]}
        rows.append(r)
        st.check(f"{fmt_bytes(n)}: a one-word change is seen", r["seen"],
                 f"fingerprint {r['fingerprint_s'] * 1000:.1f} ms, pinned copy "
                 f"{r['copy_s'] * 1000:.1f} ms ({r['fraction_of_copy']:.1%} of it)"
                 + ("" if st.real else "; CPU memory, not a GPU figure"))


#: a child process: a write that PyTorch's version counters do not see (through ``.data``, and
#: through DLPack) after the release-restore cycle kept a host copy, and after a pre-copy made
#: one, must come back from the next release; under the default check (the environment's
#: choice is removed). On CUDA the cells' stream is kept busy (``_sleep``) just before each
#: release, so that a fingerprint read without waiting for the copy stream reads early and the
#: write is lost: the fault fixed in the release once. Two cycles first, so that the copy
#: stream's blocks hold fingerprints already. On CPU: the adapter's logic, no streams.
UNSEEN_WRITES_CHILD = """
import json, sys, torch
from jupyter_gpushare.kernel.offload.base import kept_check
from jupyter_gpushare.kernel.offload.pinned import PinnedPool
from jupyter_gpushare.kernel.offload.torch_adapter import StreamCopies, TorchAdapter, kept_copies
n, device = int(sys.argv[1]), sys.argv[2]
cuda = device.startswith("cuda")
where = {}
def alloc_host(nbytes):
    host = torch.UntypedStorage(nbytes)
    where.pop(host._cdata, None)
    return host
def alloc_device(nbytes, dev):
    new = torch.UntypedStorage(nbytes)
    where[new._cdata] = dev
    return new
def adapter():
    if cuda:
        return TorchAdapter()
    copies = StreamCopies(pool=PinnedPool(alloc_host, limit=0), alloc_device=alloc_device,
                          copy=lambda dst, src, dev: dst.copy_(src), sync=lambda dev: None)
    return TorchAdapter(is_device=lambda t: t.untyped_storage()._cdata in where,
                        device_of=lambda s: where[s._cdata], copies=copies)
def on_device(t):
    if cuda:
        return t.to(device)
    where[t.untyped_storage()._cdata] = "gpu0"
    return t
ns = {"a": on_device(torch.zeros(n // 8)), "b": on_device(torch.zeros(n // 8))}
def release_restore():
    if cuda:
        torch.cuda._sleep(100_000_000)  # about 50-100 ms of the cells' stream
    a = adapter()
    copied = a.offload(ns).copied
    a.reload()
    return copied
release_restore()
release_restore()
cases, k = [], 0
def case(name, tensor, index, write, precopy=False):
    global k
    k += 1
    if precopy:
        ns[tensor][0] += 1  # seen by the counters: the pre-copy copies this storage
        adapter().precopy(ns)
    kept = kept_copies()["current"]
    versions = [t._version for t in ns.values()]
    write(ns[tensor], index, float(k))
    moved = [t._version for t in ns.values()] != versions
    copied = release_restore()
    value = float(ns[tensor][index])
    cases.append({"name": name, "kept_bytes": kept, "counters_moved": moved, "copied": copied,
                  "value": value, "expected": float(k), "intact": value == float(k)})
def through_data(t, i, v):
    t.data[i] = v
def through_dlpack(t, i, v):
    torch.from_dlpack(t.__dlpack__())[i] = v
case("through .data after a restore's kept copy", "a", 7, through_data)
case("through DLPack after a restore's kept copy", "b", 11, through_dlpack)
case("through .data after a pre-copy", "a", 13, through_data, precopy=True)
case("through DLPack after a pre-copy", "b", 17, through_dlpack, precopy=True)
print(json.dumps({"check": kept_check(), "storage_bytes": n // 2, "cases": cases}))
"""


def _child_env() -> dict[str, str]:
    """The environment of a child that must run with the kept copies' defaults."""
    from jupyter_gpushare.kernel.offload.base import KEEP_HOST_COPY_ENV, KEPT_CHECK_ENV

    env = dict(os.environ)
    env.pop(KEPT_CHECK_ENV, None)
    env.pop(KEEP_HOST_COPY_ENV, None)
    return env


async def kept_copies_step(st: Step) -> None:
    if importlib.util.find_spec("torch") is None:
        raise Skip("needs PyTorch")
    device = "cuda:0" if st.real else "cpu"
    env = _child_env()
    n = UNSEEN_WRITE_BYTES if st.real else SIM_UNSEEN_WRITE_BYTES
    out = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", UNSEEN_WRITES_CHILD, str(n), device],
        capture_output=True, text=True, timeout=max(st.left(), 10), env=env)
    if out.returncode != 0:
        st.check("writes the version counters do not see", False, out.stderr[-600:])
    else:
        r = json.loads(out.stdout.strip().splitlines()[-1])
        st.figure("unseen_writes", r)
        st.check("the default check is 'full'", r["check"] == "full", r["check"])
        for c in r["cases"]:
            ok = c["intact"] and c["kept_bytes"] > 0 and not c["counters_moved"]
            st.check(f"a write {c['name']} is kept", ok,
                     ("" if c["intact"] else f"THE WRITE WAS LOST: {c['value']} where "
                      f"{c['expected']} was written; ")
                     + f"the release copied {fmt_bytes(c['copied'])} of "
                     f"{fmt_bytes(2 * r['storage_bytes'])}; kept copies current by the counters "
                     f"{fmt_bytes(c['kept_bytes'])}"
                     + ("; the counters moved: not a write they miss" if c["counters_moved"] else "")
                     + ("; no kept copy was current before the write, so the case tests nothing"
                        if not c["kept_bytes"] else ""))
    # the figures: the same benchmark as on CPU storages, on the GPU (rehearsal: its smoke size)
    cmd = [sys.executable, str(INCREMENTAL), "--json"]
    cmd += ["--device", "cuda", "--gib", str(KEPT_GIB)] if st.real else ["--device", "cpu", "--smoke"]
    if st.left() < 15:
        st.check("incremental releases", None, f"skipped: {st.left():.0f} s left in the step")
        return
    out = await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True,
                                  timeout=max(st.left(), 10), env=env)
    st.figure("incremental_release_log", out.stdout[-4000:])
    if out.returncode != 0:
        st.check("incremental releases", False, out.stderr[-600:])
        return
    result = json.loads(out.stdout.strip().splitlines()[-1])
    rows = [r for r in result["rows"] if r["backend"].startswith("pytorch") and "skipped" not in r]
    st.figure("kept_copy_rows", rows)
    st.figure("kept_copy_state_bytes", result["state_bytes"])
    if not rows:
        st.check("incremental releases", False, "the benchmark ran no PyTorch release")
        return
    unchanged = [r for r in rows if r["what"].startswith("unchanged")]
    changed = [r for r in rows if r["what"].startswith("10 % changed")]
    st.check("an unchanged release copies nothing, under each check",
             bool(unchanged) and all(r["copied"] == 0 for r in unchanged),
             ", ".join(f"{r['what']}: {fmt_bytes(r['copied'])}" for r in unchanged))
    st.check("a 10 % change copies 10 %, under each check",
             bool(changed) and all(abs(r["share_bytes"] - 0.1) < 0.01 for r in changed),
             ", ".join(f"{r['what']}: {r['share_bytes']:.1%}" for r in changed))
    full = next(r for r in rows if r["what"] == "full")
    st.check(f"{fmt_bytes(result['state_bytes'])}: times as a share of the full release "
             f"({full['seconds'] * 1000:.1f} ms)", None,
             "; ".join(f"{r['what']} {r['seconds'] * 1000:.1f} ms ({r['share_time']:.1%})"
                       + (f", {r['host_allocations']} host buffers allocated"
                          if r.get("host_allocations") else "")
                       for r in rows if r is not full)
             + ("" if st.real else "; CPU storages, not a GPU figure"))


async def cold_start(st: Step) -> None:
    if not st.real:
        raise Skip("no CUDA here (simulated)")
    code = ("import time; t = time.perf_counter(); from cuda.bindings import driver as cu; "
            "cu.cuInit(0); print(time.perf_counter() - t)")
    r = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", code], capture_output=True,
                                text=True, timeout=25)
    cold = float(r.stdout.strip()) if r.returncode == 0 and r.stdout.strip() else None
    st.figure("fresh_process_cuInit_s", cold)
    st.check("import cuda.bindings + cuInit in a fresh process", None if cold is not None else False,
             f"{cold:.3f} s" if cold is not None else r.stderr[-300:])


async def sizes(st: Step, sizes: list[int]) -> None:
    rows: list[dict[str, Any]] = []
    st.figure("bandwidth_rows", rows)  # filled in place: a step stopped by its timeout keeps them
    await asyncio.to_thread(_measure_real if st.real else _measure_sim, st, sizes, rows)
    for r in rows:
        st.check(f"{r['method']} {fmt_bytes(r['bytes'])}: state intact", r["intact"],
                 f"release {r['release_s']:.3f} s ({r['release_frac']:.0%} of pinned D2H), "
                 f"restore {r['restore_s']:.3f} s ({r['restore_frac']:.0%} of pinned H2D)")


def _row(method: str, n: int, rel: list[float], rst: list[float], base: dict[str, float],
         intact: bool) -> dict[str, Any]:
    r, s = statistics.median(rel), statistics.median(rst)
    return {"method": method, "bytes": n, "release_s": r, "restore_s": s,
            "release_first_s": rel[0], "restore_first_s": rst[0], "repeat": len(rel),
            "d2h_pinned_s": base["d2h_pinned"], "h2d_pinned_s": base["h2d_pinned"],
            "d2h_pageable_s": base.get("d2h_pageable"), "h2d_pageable_s": base.get("h2d_pageable"),
            "release_GBps": n / max(r, 1e-9) / 1e9, "restore_GBps": n / max(s, 1e-9) / 1e9,
            "pinned_d2h_GBps": n / base["d2h_pinned"] / 1e9,
            "pinned_h2d_GBps": n / base["h2d_pinned"] / 1e9,
            "release_frac": base["d2h_pinned"] / max(r, 1e-9),
            "restore_frac": base["h2d_pinned"] / max(s, 1e-9),
            "intact": intact}


# -- on a GPU ---------------------------------------------------------------------------------
def copy_baseline(torch: Any, n: int, repeat: int, pageable: bool) -> dict[str, float]:
    """Best-of-``repeat`` seconds for device->host and host->device copies of ``n`` bytes
    through pinned host chunks (and pageable memory, for the smaller sizes)."""
    dev = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    out: dict[str, float] = {}
    kinds = [("pinned", True)] + ([("pageable", False)] if pageable else [])
    for kind, pinned in kinds:
        chunks = [torch.empty(min(CHUNK, n - i), dtype=torch.uint8, pin_memory=pinned)
                  for i in range(0, n, CHUNK)]
        for c in chunks:
            c.fill_(1)  # touch the pages so the first copy does not pay for faulting them in
        for direction in ("h2d", "d2h"):
            times = []
            for _ in range(repeat):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for i, c in enumerate(chunks):
                    part = dev[i * CHUNK:i * CHUNK + c.numel()]
                    if direction == "h2d":
                        part.copy_(c, non_blocking=pinned)
                    else:
                        c.copy_(part, non_blocking=pinned)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            out[f"{direction}_{kind}"] = min(times)
        del chunks
    del dev
    torch.cuda.empty_cache()
    host_empty = getattr(torch._C, "_host_emptyCache", None)
    if host_empty is not None:  # PyTorch caches pinned blocks: give them back to the host now
        host_empty()
    out["host_cache_freed"] = float(host_empty is not None)
    return out


#: The children's state: ``n`` bytes of random int64 on GPU 0 and a checksum read by chunks
#: (``before``), so a round trip is judged bit for bit without a temporary of size n.
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
    if not off.bytes:  # nothing moved: say why instead of timing nothing
        break
print(json.dumps({"release": rel, "restore": rst, "intact": all(out), "bytes": off.bytes,
                  "skipped": off.skipped, "copied": off.copied}))
"""

DRIVER_CHILD = """
import sys, torch
n = int(sys.argv[1])
""" + TENSOR_AND_CHECKSUM + """torch.cuda.empty_cache()  # the checksum's temporaries: not part of the state
print("ready", flush=True)
for line in sys.stdin:
    print("intact" if ck() == before else "CHANGED", flush=True)
    torch.cuda.empty_cache()
"""


def _measure_real(st: Step, sizes: list[int], rows: list[dict[str, Any]]) -> None:
    import psutil
    import torch

    from jupyter_gpushare.reclaim.base import KernelTarget
    from jupyter_gpushare.reclaim.driver import DriverMethod, driver_support
    from jupyter_gpushare.telemetry.nvml import NVMLTelemetry

    methods = ["driver", "framework"]
    s = driver_support()
    if not s.ok:
        methods.remove("driver")
        st.check("driver method", None, f"unsupported here: {s.reason}")
    torch.zeros(1, device="cuda")  # this process's context: cuInit for the driver's restore
    nvml = NVMLTelemetry()
    nvml.open()
    driver = DriverMethod(nvml.free_bytes)
    per_byte = {m: 1 / 2e9 for m in methods}  # seconds a byte, both ways: a cautious first guess
    try:
        for n in sizes:
            free, avail = nvml.free_bytes(0) or 0, psutil.virtual_memory().available
            if n > free * 0.85 or 1.3 * n > avail:
                st.check(f"{fmt_bytes(n)}", None, f"skipped: GPU 0 has {fmt_bytes(free)} free, the "
                         f"host {fmt_bytes(avail)} available")
                continue
            repeat = 3 if n <= GiB else 2 if n <= 8 * GiB else 1
            if st.left() < 15 + n * 1.5e-10 * repeat:
                st.check(f"{fmt_bytes(n)}", None, f"skipped: {st.left():.0f} s left in the step")
                continue
            base = copy_baseline(torch, n, repeat, pageable=n <= 8 * GiB)
            for method in methods:
                avail = psutil.virtual_memory().available
                if 1.2 * n > avail:  # a released state lives in host memory
                    st.check(f"{method} {fmt_bytes(n)}", None, f"skipped: the host has "
                             f"{fmt_bytes(avail)} available")
                    continue
                est = 10 + repeat * n * per_byte[method]
                if st.left() < est:
                    st.check(f"{method} {fmt_bytes(n)}", None,
                             f"skipped: about {est:.0f} s needed, {st.left():.0f} s left")
                    continue
                t0 = time.monotonic()
                if method == "driver":
                    rel, rst, intact = _driver_round_trips(n, repeat, nvml, driver, KernelTarget)
                else:
                    out = subprocess.run([sys.executable, "-c", FRAMEWORK_CHILD, str(n), str(repeat)],
                                         capture_output=True, text=True, timeout=max(st.left(), 20))
                    if out.returncode != 0:
                        st.check(f"framework {fmt_bytes(n)}", False, out.stderr[-400:])
                        continue
                    fr = json.loads(out.stdout.strip().splitlines()[-1])
                    if fr["bytes"] != n:  # the adapter left (part of) the tensor on the GPU
                        st.check(f"framework {fmt_bytes(n)}: the whole tensor moves", False,
                                 f"moved {fr['bytes']} of {n} bytes; skipped: {fr['skipped']}")
                        continue
                    rel, rst, intact = fr["release"], fr["restore"], fr["intact"]
                rows.append(_row(method, n, rel, rst, base, intact))
                per_byte[method] = max(time.monotonic() - t0 - 5, 1) / (repeat * n)
    finally:
        nvml.close()


def _driver_round_trips(n: int, repeat: int, nvml: Any, method: Any,
                        target_cls: Any) -> tuple[list[float], list[float], bool]:
    """Release and restore seconds of a child holding ``n`` bytes, each of ``repeat`` times,
    and whether its data came back intact every time."""
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
        target = target_cls("proof", pids=[proc.pid], gpu_bytes={0: held})
        rel, rst, intact = [], [], True
        for _ in range(repeat):
            rel.append(asyncio.run(method.release(target)).seconds)
            rst.append(asyncio.run(method.restore(target)).seconds)
            proc.stdin.write("check\n")
            intact = intact and line() == "intact"
        return rel, rst, intact
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


# -- on the simulated node --------------------------------------------------------------------
def _measure_sim(st: Step, sizes: list[int], rows: list[dict[str, Any]]) -> None:
    """The simulated GPU's own lock/checkpoint/restore/unlock in this process (a private
    simulated node), against its arrays' plain copies: the rows' shape, not figures."""
    import numpy as np

    from jupyter_gpushare.sim import device, simgpu

    dev = device.get_device()
    for n in sizes:
        x = simgpu.array(np.random.default_rng(0).integers(0, 2**32, n // 4, dtype=np.uint32),
                         device=0)
        before = x.checksum()
        t0 = time.perf_counter()
        y = x.get()
        d2h = time.perf_counter() - t0
        t0 = time.perf_counter()
        z = simgpu.array(y, device=0)
        h2d = time.perf_counter() - t0
        del y, z
        t0 = time.perf_counter()
        dev.lock()
        dev.checkpoint()
        rel = time.perf_counter() - t0
        t0 = time.perf_counter()
        dev.restore()
        dev.unlock()
        rst = time.perf_counter() - t0
        rows.append(_row("simulated", n, [rel], [rst], {"d2h_pinned": d2h, "h2d_pinned": h2d},
                         x.checksum() == before))
        del x
