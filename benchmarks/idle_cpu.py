"""Idle CPU use of the jupyter server with the extension on vs off.

Three real servers run side by side on this machine, each with 2 idle ipykernels and an
open websocket to each (as JupyterLab keeps them):

- on, poll 2 s: the extension with its defaults (simulated backend, poll_interval 2 s),
- on, poll 0.5 s: the same with poll_interval 0.5 s,
- off: the extension disabled (ServerApp.jpserver_extensions jupyter_gpushare = false).

After a settling pause, the CPU time of each server process (user + system, its children
excluded) and, separately, of its kernels is sampled over the same window, in slices, so
the three see the same machine load. Printed: CPU % of one core and the ratio to "off".

    python benchmarks/idle_cpu.py [--quick] [--window 60] [--slices 6] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import psutil

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _server import Server, machine, process_cpu_seconds, table

CONFIGS = [
    ("on, poll 2 s", True, {"poll_interval": 2.0}),
    ("on, poll 0.5 s", True, {"poll_interval": 0.5}),
    ("off", False, {}),
]


def cpu_now(srv: Server) -> tuple[float, float]:
    """(server CPU seconds, CPU seconds of all its kernel processes)."""
    server = process_cpu_seconds(psutil.Process(srv.pid))
    kernels = 0.0
    for p in srv.kernel_processes():
        try:
            kernels += process_cpu_seconds(p)
        except psutil.Error:
            pass
    return server, kernels


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 10 s window")
    ap.add_argument("--window", type=float, default=60.0, help="seconds sampled")
    ap.add_argument("--slices", type=int, default=6, help="the window is cut in this many slices")
    ap.add_argument("--settle", type=float, default=10.0, help="seconds idle before sampling")
    ap.add_argument("--smoke", action="store_true",
                    help="a 1 s window, 1 kernel a server: the path, no figures")
    args = ap.parse_args()
    if args.smoke:
        args.window, args.slices, args.settle = 1.0, 1, 0.0
    window = 10.0 if args.quick else args.window
    settle = 5.0 if args.quick else args.settle

    per_server = 1 if args.smoke else 2
    print(f"idle CPU of the server, extension on vs off -- {machine()}")
    servers = [Server(name.split(",")[0].replace(" ", ""), extension=ext, gpushare=cfg)
               for name, ext, cfg in CONFIGS]
    try:
        await asyncio.gather(*(srv.start() for srv in servers))
        await asyncio.gather(*(srv.start_kernel() for srv in servers for _ in range(per_server)))
        await asyncio.sleep(settle)
        slice_s = window / args.slices
        per_slice: list[list[tuple[float, float]]] = [[] for _ in servers]
        last = [cpu_now(s) for s in servers]
        t_last = time.monotonic()
        for _ in range(args.slices):
            await asyncio.sleep(slice_s)
            now = [cpu_now(s) for s in servers]
            t = time.monotonic()
            for i in range(len(servers)):
                dt = t - t_last
                per_slice[i].append(((now[i][0] - last[i][0]) / dt, (now[i][1] - last[i][1]) / dt))
            last, t_last = now, t
    finally:
        for srv in servers:
            await srv.stop()

    totals = [(statistics.fmean(s for s, _ in sl), statistics.fmean(k for _, k in sl)) for sl in per_slice]
    off_server = totals[-1][0]
    rows = []
    for (name, _, _), sl, (server, kernels) in zip(CONFIGS, per_slice, totals, strict=True):
        slices = " ".join(f"{100 * s:.2f}" for s, _ in sl)
        ratio = f"{server / off_server:.2f}" if off_server > 0 else "n/a"
        rows.append([name, f"{100 * server:.2f}", ratio, f"{100 * kernels:.2f}", slices])
    print(f"\n{window:.0f} s window in {args.slices} slices, after {settle:.0f} s idle; "
          f"{per_server} idle kernel(s) per server, websockets open"
          + ("  (--smoke: no figures)" if args.smoke else ""))
    print(table(["server", "server CPU %", "x off", "kernels CPU %", "server CPU % per slice"], rows))
    print("CPU % = percent of one core; server = the jupyter server process only; kernels = its "
          "kernel processes together")


if __name__ == "__main__":
    asyncio.run(main())
