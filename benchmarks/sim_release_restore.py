"""Release and restore time of simulated GPU states of 1, 4 and 12 GiB.

A real server with the simulated backend (two 16 GiB simulated GPUs) and one real kernel.
For each size the kernel holds that many 1 GiB ``simgpu`` arrays on GPU 0; then, per
repetition, in the same run:

- baseline: a plain numpy copy of the same bytes inside the kernel (``SimArray.get()`` of
  every array, one at a time: one fresh allocation + one memcpy per GiB, which is what the
  simulated checkpoint does per array), timed in the kernel;
- release: ``POST /api/gpushare/kernels/{id}/release``, timed by the client (and the
  server's own ``last_release_seconds``);
- restore: ``POST .../restore``, likewise; then the CRC-32 of every array is compared
  with the one taken before the release.

Printed: seconds, GB/s (1e9 bytes/s) and the ratios release/copy and restore/copy.
Host memory: the state plus one array in flight (13 GiB at 12 GiB); a size that does not
fit in the available memory is skipped with a note.

    python benchmarks/sim_release_restore.py [--quick] [--sizes 1 4 12] [--repeat 3]

``--smoke``: one array of 16 MiB, once (the whole path, checksums checked; no figures).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import psutil

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _server import GiB, Kernel, Server, machine, table

SETUP = """
import gc, json, time, numpy as np
from jupyter_gpushare.sim import simgpu
xs = []
"""

FILL = """
xs = [simgpu.array(np.random.default_rng({seed} + i).integers(0, 2**32, {n}, dtype=np.uint32),
                   device=0, copy=False) for i in range({count})]
print(json.dumps(sum(x.nbytes for x in xs)))
"""

CHECKSUMS = "print(json.dumps([x.checksum() for x in xs]))"

COPY = """
_t = time.perf_counter()
for _x in xs:
    _y = _x.get()  # device -> fresh host array: one allocation and one memcpy per array
    del _y
del _x  # the loop variable would keep the last array alive
print(json.dumps(time.perf_counter() - _t))
"""

FREE = "del xs; xs = []; gc.collect(); print(json.dumps(simgpu.memory_allocated()))"


async def settle(srv: Server, kernel: Kernel, nbytes: int) -> None:
    """Wait until the server sees the kernel idle and holding ``nbytes``."""
    await srv.wait_kernel(
        kernel.id,
        lambda k: k["gpu_memory_bytes"] == nbytes and k["execution_state"] == "idle"
        and k["state"] in ("active", "untracked"),
        f"the kernel to show {nbytes} bytes, idle",
    )


async def one_size(srv: Server, kernel: Kernel, gib: int, repeat: int,
                   array: int = GiB) -> list[list[str]]:
    """``gib`` arrays of ``array`` bytes (1 GiB: the size is in GiB)."""
    nbytes = await kernel.value(FILL.format(seed=gib * 100, n=array // 4, count=gib), timeout=600)
    assert nbytes == gib * array, nbytes
    size = f"{nbytes / GiB:g} GiB" if nbytes >= GiB else f"{nbytes >> 20} MiB"
    before = await kernel.value(CHECKSUMS, timeout=600)
    times: dict[str, list[float]] = {"copy": [], "release": [], "restore": [],
                                     "release_srv": [], "restore_srv": []}
    # warm-up: the first touch of fresh host pages can be far slower on a VM; let the copy,
    # the release and the restore all start from the same warm allocator
    await kernel.value(COPY, timeout=600)
    for _ in range(repeat):
        await settle(srv, kernel, nbytes)
        times["copy"].append(await kernel.value(COPY, timeout=600))
        await settle(srv, kernel, nbytes)
        t = time.perf_counter()
        view = await srv.api("POST", f"/api/gpushare/kernels/{kernel.id}/release")
        times["release"].append(time.perf_counter() - t)
        if view["state"] != "released" or view["released_bytes"] != nbytes:
            raise RuntimeError(f"release did not release {nbytes} bytes: {view}")
        times["release_srv"].append(view["last_release_seconds"])
        t = time.perf_counter()
        view = await srv.api("POST", f"/api/gpushare/kernels/{kernel.id}/restore")
        times["restore"].append(time.perf_counter() - t)
        if view["state"] != "active":
            raise RuntimeError(f"restore did not finish: {view}")
        times["restore_srv"].append(view["last_restore_seconds"])
        after = await kernel.value(CHECKSUMS, timeout=600)
        if after != before:
            raise RuntimeError(f"{size}: checksums differ after the restore")
    left = await kernel.value(FREE)
    assert left == 0, left
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    rows = []
    for key, label in (("copy", "baseline: numpy copy in kernel"), ("release", "release (REST)"),
                       ("restore", "restore (REST)")):
        srv_s = f"{med[key + '_srv']:.3f}" if key != "copy" else ""
        rows.append([f"{size:>6}  {label}", f"{med[key]:.3f}", f"{best[key]:.3f}", srv_s,
                     f"{nbytes / med[key] / 1e9:.2f}", f"{med[key] / med['copy']:.2f}",
                     f"{best[key] / best['copy']:.2f}"])
    rows.append([f"{size:>6}  checksums after {repeat} restore(s)", "", "", "", "", "equal", ""])
    return rows


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 and 4 GiB, once each")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 12], help="GiB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="16 MiB, once: the path, no figures")
    args = ap.parse_args()
    sizes, repeat = ([1, 4], 1) if args.quick else ([1], 1) if args.smoke else (args.sizes, args.repeat)
    array = 16 << 20 if args.smoke else GiB

    print(f"simulated release / restore through REST -- {machine()}")
    cfg = {"simulated_gpus": [16 * GiB, 16 * GiB], "poll_interval": 0.5, "idle_timeout": 0,
           "min_release_bytes": 0, "pressure_free_fraction": 0.0}
    rows: list[list[str]] = []
    notes = []
    async with Server("simrr", gpushare=cfg) as srv:
        kernel = await srv.start_kernel()
        await kernel.run(SETUP)
        for gib in sizes:
            room = psutil.virtual_memory().available / GiB
            if room < gib + 2:
                notes.append(f"{gib} GiB skipped: {room:.1f} GiB of host memory available")
                continue
            rows += await one_size(srv, kernel, gib, repeat, array)
    print(f"\nmedian of {repeat} per size; one kernel, arrays of {array >> 20} MiB on simulated GPU 0"
          + ("  (--smoke: no figures)" if args.smoke else ""))
    print(table(["size  measure", "median s", "best s", "server s", "GB/s (median)", "x copy (median)",
                 "x copy (best)"], rows))
    for note in notes:
        print(note)


if __name__ == "__main__":
    asyncio.run(main())
