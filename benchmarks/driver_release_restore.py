"""How fast the driver method releases and restores, against what the hardware can copy.

Needs a GPU machine with driver >= 570, PyTorch and cuda-core. For each size it starts a
PyTorch process that holds that many bytes of random data on GPU 0, then measures in the same
run:

- baseline: a plain device->host and host->device copy of the same bytes from this process
  (pinned host memory, and pageable), with torch;
- release: ``DriverMethod.release`` (lock + checkpoint) of the child;
- restore: ``DriverMethod.restore`` (restore + unlock) of the child, then checks that the
  child's data is intact (checksum computed on the GPU before and after).

Figures are printed as ratios to the baseline of the same run (restore / pinned H->D copy of the
same bytes, release / pinned D->H copy), plus effective GB/s; absolute times depend on the box.

    python benchmarks/driver_release_restore.py [--sizes-gib 1 4 16] [--repeat 3] [--json out.json]

``--smoke``: 64 MiB once (the whole path, no figures worth reading); without a GPU it says
so and exits 0, as every run does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import select
import statistics
import subprocess
import sys
import textwrap
import time

CHILD = textwrap.dedent(
    """
    import sys, torch
    n = int(sys.argv[1])
    torch.manual_seed(7)
    x = torch.randint(-2**62, 2**62, (n // 8,), dtype=torch.int64, device="cuda:0")
    def checksum():
        return f"{int((x ^ (x >> 17)).sum())}:{int(x[::4099].sum())}"
    print("ready", checksum(), flush=True)
    for line in sys.stdin:
        if line.strip() == "check":
            print(checksum(), flush=True)
    """
)


def readline(proc: subprocess.Popen, timeout: float = 300) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise TimeoutError("child did not answer")
    return proc.stdout.readline().strip()


def copy_baseline(torch, nbytes: int, repeat: int) -> dict[str, float]:
    """Best-of-``repeat`` seconds for D->H and H->D copies of ``nbytes``, pinned and pageable."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    out: dict[str, float] = {}
    for kind, pinned in (("pinned", True), ("pageable", False)):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        host.fill_(1)  # touch the pages so the first copy does not pay for faulting them in
        for direction in ("h2d", "d2h"):
            times = []
            for _ in range(repeat):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if direction == "h2d":
                    dev.copy_(host, non_blocking=pinned)
                else:
                    host.copy_(dev, non_blocking=pinned)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            out[f"{direction}_{kind}"] = min(times)
        del host
    del dev
    torch.cuda.empty_cache()
    return out


def measure(size_gib: float, repeat: int, nvml, DriverMethod, KernelTarget) -> dict:
    nbytes = int(size_gib * (1 << 30))
    free0 = nvml.free_bytes(0)
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(nbytes)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
    )
    try:
        word, checksum = readline(proc).split()
        assert word == "ready"
        held = free0 - nvml.free_bytes(0)
        method = DriverMethod(nvml.free_bytes)
        target = KernelTarget("bench", pids=[proc.pid], gpu_bytes={0: held})
        releases, restores, freed = [], [], []
        for _ in range(repeat):
            r = asyncio.run(method.release(target))
            freed.append(nvml.free_bytes(0))
            releases.append(r.seconds)
            r = asyncio.run(method.restore(target))
            restores.append(r.seconds)
            proc.stdin.write("check\n")
            intact = readline(proc) == checksum
            if not intact:
                raise AssertionError(f"checksum changed after restore at {size_gib} GiB")
        free_resident = nvml.free_bytes(0)
        return {
            "size_gib": size_gib,
            "held_bytes": held,
            "freed_bytes": int(statistics.median(freed)) - free_resident,
            "release_s": statistics.median(releases),
            "restore_s": statistics.median(restores),
            "intact": True,
        }
    finally:
        proc.stdin.close()
        proc.wait(timeout=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-gib", type=float, nargs="+", default=[1, 4, 16])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--smoke", action="store_true", help="64 MiB, once: the path only")
    args = ap.parse_args(argv)
    if args.smoke:
        args.sizes_gib, args.repeat = [1 / 16], 1

    try:
        import torch
    except ImportError:
        print("needs PyTorch with CUDA; nothing measured")
        return 0
    if not torch.cuda.is_available():
        print("no CUDA GPU here; nothing measured")
        return 0
    from jupyter_gpushare.reclaim.base import KernelTarget
    from jupyter_gpushare.reclaim.driver import DriverMethod, driver_support
    from jupyter_gpushare.telemetry.nvml import NVMLTelemetry

    support = driver_support()
    if not support.ok:
        print(f"driver method unsupported here: {support.reason}; nothing measured")
        return 0
    torch.cuda.init()  # also the cuInit that restore needs in the calling process
    nvml = NVMLTelemetry()
    nvml.open()
    gpu = nvml.devices()[0]
    driver = nvml.driver_version()
    print(f"GPU 0: {gpu.name}, driver {driver}, {support.reason}")
    rows = []
    try:
        for size in args.sizes_gib:
            base = copy_baseline(torch, int(size * (1 << 30)), args.repeat)
            row = measure(size, args.repeat, nvml, DriverMethod, KernelTarget)
            row.update(base)
            gb = row["held_bytes"] / 1e9
            row["release_vs_d2h_pinned"] = row["release_s"] / base["d2h_pinned"]
            row["restore_vs_h2d_pinned"] = row["restore_s"] / base["h2d_pinned"]
            row["restore_vs_h2d_pageable"] = row["restore_s"] / base["h2d_pageable"]
            row["release_GBps"] = gb / row["release_s"]
            row["restore_GBps"] = gb / row["restore_s"]
            row["h2d_pinned_GBps"] = size * (1 << 30) / 1e9 / base["h2d_pinned"]
            rows.append(row)
    finally:
        nvml.close()

    print(f"{'size':>6} {'held':>8} {'freed':>8} {'release':>9} {'restore':>9} "
          f"{'rel/D2H':>8} {'rst/H2D':>8} {'rst/H2Dpg':>9} {'rst GB/s':>8} {'H2D GB/s':>8} ok")
    for r in rows:
        print(f"{r['size_gib']:>5g}G {r['held_bytes'] / 2**30:>7.2f}G {r['freed_bytes'] / 2**30:>7.2f}G "
              f"{r['release_s'] * 1e3:>7.0f}ms {r['restore_s'] * 1e3:>7.0f}ms "
              f"{r['release_vs_d2h_pinned']:>7.2f}x {r['restore_vs_h2d_pinned']:>7.2f}x "
              f"{r['restore_vs_h2d_pageable']:>8.2f}x {r['restore_GBps']:>8.1f} "
              f"{r['h2d_pinned_GBps']:>8.1f} {'yes' if r['intact'] else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu.name, "driver": driver, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
