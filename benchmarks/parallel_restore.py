"""A two-GPU kernel's restore, its GPUs moved in parallel vs one after another vs one GPU.

A real server with the simulated backend (two 16 GiB simulated GPUs) and one real kernel.
Per repetition, in the same run and the same kernel process:

- two GPUs, parallel: N MiB of ``simgpu`` arrays on each of GPU 0 and GPU 1 (the simulated
  device moves them at once, as the driver does for one process);
- two GPUs, sequential: the same arrays with ``SimDevice.parallel = False`` (one GPU's copy
  after the other's: the baseline parallel restore replaces);
- one GPU, N MiB: the same bytes per GPU on one GPU (the floor parallel restore aims at);
- one GPU, 2N MiB: the same total bytes on one GPU.

Each GPU's copy runs at ``--rate`` MiB/s (``SimDevice.transfer_rate``, the simulated copy
engine's bandwidth; 0: the time of the host copy only, which two threads share with
whatever else runs on the machine's cores). Measured: the restore's time as the server
reports it (``last_restore_seconds`` in status, released and restored over REST), and from
the kernel's transfer log whether the GPUs' copies overlapped. Every restore is checked:
the arrays' CRC-32 equal those taken before the first release.

Printed: medians, and the ratios to the sequential two-GPU restore and to one GPU's N MiB.

    python benchmarks/parallel_restore.py [--quick] [--mib 512] [--rate 1024] [--repeat 5] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _server import GiB, Kernel, Server, machine, table

MiB = 1 << 20
SETUP = """
import json, numpy as np
from jupyter_gpushare.sim import simgpu, device as _device
_dev = _device.get_device()
_dev.transfer_rate = {rate} or None
def _fill(per_gpu, gpus, chunk=64 * 2**20):
    n = max(1, per_gpu // chunk)
    return [simgpu.array(np.random.default_rng(i).integers(0, 2**32, chunk // 4, dtype=np.uint32),
                         device=gpu, copy=False) for gpu in gpus for i in range(n)]
"""
FILL = "xs = _fill({per_gpu}, {gpus}); sums = [x.checksum() for x in xs]; print(json.dumps(0))"
CHECK = "print(json.dumps([x.checksum() for x in xs] == sums))"
OVERLAP = ("_t = {t['gpu']: t for t in _dev.transfer_log('restore')[-2:]}\n"
           "print(json.dumps(len(_t) == 2 and _t[0]['start'] < _t[1]['end'] "
           "and _t[1]['start'] < _t[0]['end']))")
FREE = "del xs; import gc; gc.collect(); print(json.dumps(simgpu.memory_allocated()))"


async def kernel_view(srv: Server, kid: str) -> dict:
    status = await srv.api("GET", "/api/gpushare/status")
    return next(k for k in status["kernels"] if k["id"] == kid)


async def cycle(srv: Server, kernel: Kernel, nbytes: int) -> float:
    """Release, then restore over REST; the server's restore seconds."""
    await srv.wait_kernel(kernel.id, lambda k: k["gpu_memory_bytes"] == nbytes
                          and k["execution_state"] == "idle", "the kernel idle, holding its state")
    view = await srv.api("POST", f"/api/gpushare/kernels/{kernel.id}/release")
    if view["state"] != "released":
        raise RuntimeError(f"not released: {view}")
    view = await srv.api("POST", f"/api/gpushare/kernels/{kernel.id}/restore")
    while view["state"] not in ("active", "idle"):
        await asyncio.sleep(0.01)
        view = await kernel_view(srv, kernel.id)
    if await kernel.value(CHECK, timeout=600) is not True:
        raise RuntimeError("checksums differ after a restore")
    return float(view["last_restore_seconds"])


async def case(srv: Server, kernel: Kernel, per_gpu: int, gpus: list[int], parallel: bool,
               repeat: int) -> tuple[float, bool]:
    await kernel.value(f"_dev.parallel = {parallel}\n" + FILL.format(per_gpu=per_gpu, gpus=gpus),
                       timeout=600)
    times, overlapped = [], True
    for _ in range(repeat):
        times.append(await cycle(srv, kernel, per_gpu * len(gpus)))
        if len(gpus) > 1:
            overlapped = overlapped and await kernel.value(OVERLAP)
    left = await kernel.value(FREE)
    assert left == 0, left
    return statistics.median(times), overlapped


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="256 MiB per GPU, twice")
    ap.add_argument("--mib", type=int, default=512, help="MiB per GPU")
    ap.add_argument("--rate", type=float, default=1024.0,
                    help="MiB/s each simulated GPU's copy moves (0: host copy time only)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="64 MiB per GPU, once: the path only")
    args = ap.parse_args()
    mib, repeat = (256, 2) if args.quick else (64, 1) if args.smoke else (args.mib, args.repeat)
    per_gpu = mib * MiB
    rates = [args.rate, 0.0] if args.rate else [0.0]
    rates = rates[:1] if args.smoke else rates
    print(f"parallel vs sequential restore of a two-GPU kernel -- {machine()}")
    cfg = {"simulated_gpus": [16 * GiB, 16 * GiB], "poll_interval": 0.5, "idle_timeout": 0,
           "min_release_bytes": 0, "pressure_free_fraction": 0.0}
    rows: list[list[str]] = []
    async with Server("parallel", gpushare=cfg) as srv:
        kernel = await srv.start_kernel()
        for rate in rates:
            await kernel.value(SETUP.format(rate=rate * MiB) + "print(json.dumps(0))", timeout=60)
            label = f"{rate:g} MiB/s per GPU" if rate else "host copy only"
            seq, _ = await case(srv, kernel, per_gpu, [0, 1], False, repeat)
            par, overlapped = await case(srv, kernel, per_gpu, [0, 1], True, repeat)
            one, _ = await case(srv, kernel, per_gpu, [0], True, repeat)
            one2, _ = await case(srv, kernel, 2 * per_gpu, [0], True, repeat)
            rows += [
                [label, f"2 GPUs x {mib} MiB, sequential (baseline)", f"{seq * 1e3:.0f}", "1.00",
                 f"{seq / one:.2f}"],
                [label, f"2 GPUs x {mib} MiB, parallel"
                 + ("" if overlapped else " (copies did NOT overlap)"),
                 f"{par * 1e3:.0f}", f"{par / seq:.2f}", f"{par / one:.2f}"],
                [label, f"1 GPU x {mib} MiB", f"{one * 1e3:.0f}", f"{one / seq:.2f}", "1.00"],
                [label, f"1 GPU x {2 * mib} MiB", f"{one2 * 1e3:.0f}", f"{one2 / seq:.2f}",
                 f"{one2 / one:.2f}"],
            ]
    print(f"\nmedian of {repeat} restores per row (server's restore seconds, released and "
          "restored over REST); one kernel, arrays of 64 MiB")
    print(table(["copy speed", "restore", "median ms", "x sequential", "x 1 GPU same bytes/GPU"],
                rows))


if __name__ == "__main__":
    asyncio.run(main())
