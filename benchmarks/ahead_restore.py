"""Restore ahead of the next cell vs a cold restore by the cell, on the simulated node.

A real server with the simulated backend (two 16 GiB simulated GPUs) and one real kernel
holding N GiB of ``simgpu`` arrays on GPU 0 (1 GiB each). Per size and repetition, in the
same run:

- cold: release over REST, then send a cell (``pass``): the time from sending it to its
  reply includes the whole restore, as for a person who runs a cell on a released kernel
  without the lab extension;
- ahead: release, then ``POST .../restore`` with ``{"trigger": "activity"}`` (what the lab
  extension sends when the notebook is focused or a cell edited): the time until that
  request is answered, and until status shows the kernel resident (polled every 5 ms);
  then the same cell, whose time is what the person waits once the state is back;
- baseline: the same cell on a resident kernel that was never released.

Printed: medians, and the ratios ahead-to-resident / cold cell and warm cell / cold cell.
Every restore is checked: the arrays' CRC-32 equal those taken before the first release.

    python benchmarks/ahead_restore.py [--quick] [--sizes 1 4] [--repeat 5] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _server import GiB, Kernel, Server, machine, table

FILL = """
import json, numpy as np
from jupyter_gpushare.sim import simgpu
xs = [simgpu.array(np.random.default_rng({seed} + i).integers(0, 2**32, {n}, dtype=np.uint32),
                   device=0, copy=False) for i in range({count})]
print(json.dumps(sum(x.nbytes for x in xs)))
"""
CHECKSUMS = "print(json.dumps([x.checksum() for x in xs]))"
FREE = "del xs; import gc; gc.collect(); print(json.dumps(simgpu.memory_allocated()))"


async def kernel_view(srv: Server, kid: str) -> dict:
    status = await srv.api("GET", "/api/gpushare/status")
    return next(k for k in status["kernels"] if k["id"] == kid)


async def release(srv: Server, kernel: Kernel, nbytes: int) -> None:
    await srv.wait_kernel(kernel.id, lambda k: k["gpu_memory_bytes"] == nbytes
                          and k["execution_state"] == "idle", "the kernel idle, holding its state")
    view = await srv.api("POST", f"/api/gpushare/kernels/{kernel.id}/release")
    if view["state"] != "released":
        raise RuntimeError(f"not released: {view}")


async def cell(kernel: Kernel) -> float:
    t = time.perf_counter()
    await kernel.run("pass")
    return time.perf_counter() - t


async def one_size(srv: Server, kernel: Kernel, gib: int, repeat: int,
                   array: int = GiB) -> list[list[str]]:
    """``gib`` arrays of ``array`` bytes (1 GiB: the size is in GiB)."""
    nbytes = await kernel.value(FILL.format(seed=gib * 7, n=array // 4, count=gib), timeout=600)
    size = f"{nbytes / GiB:g} GiB" if nbytes >= GiB else f"{nbytes >> 20} MiB"
    before = await kernel.value(CHECKSUMS, timeout=600)
    t: dict[str, list[float]] = {"base": [], "cold": [], "answer": [], "resident": [], "warm": [],
                                 "srv_cold": [], "srv_ahead": []}
    for _ in range(repeat):
        t["base"].append(await cell(kernel))
        # cold: the cell restores
        await release(srv, kernel, nbytes)
        t["cold"].append(await cell(kernel))
        view = await kernel_view(srv, kernel.id)
        t["srv_cold"].append(view["last_restore_seconds"])
        if await kernel.value(CHECKSUMS, timeout=600) != before:
            raise RuntimeError("checksums differ after a cold restore")
        # ahead: the activity request restores, then the cell
        await release(srv, kernel, nbytes)
        start = time.perf_counter()
        view = await srv.api("POST", f"/api/gpushare/kernels/{kernel.id}/restore",
                             {"trigger": "activity"})
        t["answer"].append(time.perf_counter() - start)
        while view["state"] not in ("active", "idle"):
            await asyncio.sleep(0.005)
            view = await kernel_view(srv, kernel.id)
        t["resident"].append(time.perf_counter() - start)
        t["srv_ahead"].append(view["last_restore_seconds"])
        t["warm"].append(await cell(kernel))
        if await kernel.value(CHECKSUMS, timeout=600) != before:
            raise RuntimeError("checksums differ after an ahead restore")
    left = await kernel.value(FREE)
    assert left == 0, left
    med = {k: statistics.median(v) for k, v in t.items()}
    cold = med["cold"]
    return [
        [size, "cell on a resident kernel (baseline)", f"{med['base'] * 1e3:.1f}", ""],
        [size, "cold: cell on a released kernel, sent to reply",
         f"{cold * 1e3:.1f}", f"1.00 (server restore {med['srv_cold'] * 1e3:.0f} ms)"],
        [size, "ahead: activity request answered (202)", f"{med['answer'] * 1e3:.1f}",
         f"{med['answer'] / cold:.3f}"],
        [size, "ahead: activity request to resident", f"{med['resident'] * 1e3:.1f}",
         f"{med['resident'] / cold:.2f} (server restore {med['srv_ahead'] * 1e3:.0f} ms)"],
        [size, "ahead: the cell after it, sent to reply", f"{med['warm'] * 1e3:.1f}",
         f"{med['warm'] / cold:.3f}"],
    ]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 GiB, twice")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4], help="GiB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="16 MiB, once: the path, no figures")
    args = ap.parse_args()
    sizes, repeat = ([1], 2) if args.quick else ([1], 1) if args.smoke else (args.sizes, args.repeat)
    array = 16 << 20 if args.smoke else GiB
    print(f"restore ahead (trigger activity) vs cold restore by a cell -- {machine()}")
    cfg = {"simulated_gpus": [16 * GiB, 16 * GiB], "poll_interval": 0.5, "idle_timeout": 0,
           "min_release_bytes": 0, "pressure_free_fraction": 0.0}
    rows: list[list[str]] = []
    async with Server("ahead", gpushare=cfg) as srv:
        kernel = await srv.start_kernel()
        for gib in sizes:
            rows += await one_size(srv, kernel, gib, repeat, array)
    print(f"\nmedian of {repeat} per size; one kernel, arrays of {array >> 20} MiB on simulated GPU 0"
          + ("  (--smoke: no figures)" if args.smoke else ""))
    print(table(["size", "measure", "median ms", "x cold cell"], rows))


if __name__ == "__main__":
    asyncio.run(main())
