"""The twin: one workload through the real product and through the simulator, compared.

Reads a trace (docs/trace-format.md), starts a real jupyter server with the extension on a
simulated node of the trace's GPUs, opens one real kernel per session at its time and plays
its cells over the kernel websocket as JupyterLab sends them: each cell allocates its bytes
per GPU on its GPUs with the simulated device, runs its duration's work at its SM % of each
(``SimDevice.compute``: slower while a GPU's shares add up to over 100 %, as the simulator's
cells; CPU-only cells touch nothing) and frees down to ``bytes_after``; closed-loop, a cell is sent
its gap after the previous one ended. A cell's ``active_before`` (s) posts the lab's activity
trigger that long before it. Time runs ``--scale`` times faster than the trace (every option
of time is divided by it) and bytes are ``--byte-scale`` of the trace's (a simulated GPU's
memory is host memory); the device's copy speed follows both, so restores keep their
proportion to think times.

What the product did is recorded from the cell replies (arrival, start, end, out of memory,
the GPUs the kernel saw) and the server's own events (releases, restores and their triggers,
their bytes and seconds). The simulator then runs the same workload with the same settings
and a transfer model fitted to the product's own releases and restores, and the two are
compared (``jupyter_gpushare/simulate/twin.py``): counts within 10 %, delay quantiles within
20 % or 0.2 s, the same OOM cells, >= 90 % of kernels on the same GPUs; the first cells that
differ side by side.

    python benchmarks/twin.py                       # the default workload, scaled
    python benchmarks/twin.py --trace jupyter_gpushare/simulate/example_multigpu.json
    python benchmarks/twin.py --smoke               # the whole path, in seconds (CI)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._server import Kernel, Server  # noqa: E402
from jupyter_gpushare.simulate import twin  # noqa: E402
from jupyter_gpushare.simulate.generator import generate  # noqa: E402
from jupyter_gpushare.simulate.trace import read_trace  # noqa: E402
from jupyter_gpushare.simulate.workload import KernelWork, Workload  # noqa: E402

#: the kernel's side of a cell: its arrays per GPU, growth all or nothing, its work at its SM %
#: of each GPU (the simulated device slows it while a GPU's shares add up to over 100 %)
HELPER = r'''
import json as _json, time as _time
import numpy as _np
from jupyter_gpushare.sim import simgpu as _sg
from jupyter_gpushare.sim.device import get_device as _dev

class _Twin:
    SLICE = {slice!r}

    def __init__(self, gpus):
        self.gpus, self.held, self.allocated, self.arrays = gpus, 0, False, []

    def _hold(self, nbytes):
        grown = [_sg.zeros((max(1, nbytes - self.held),), dtype=_np.uint8, device=d)
                 for d in range(self.gpus)] if nbytes > self.held else []
        self.arrays += grown  # all of them or, out of memory, none (the list is dropped)
        self.held = max(self.held, nbytes)

    def _shrink(self, nbytes):
        self.arrays = []
        self.held = 0
        if nbytes:
            self._hold(nbytes)

    def cell(self, nbytes, first, on, seconds, sm, keeps):
        t0 = _time.time()
        if not self.allocated and on:
            self._hold(max(first, nbytes))
            self.allocated = True
        elif self.allocated and nbytes > self.held:
            self._hold(nbytes)
        if on and self.allocated:
            for a in self.arrays:  # the cell changes what it holds on its GPUs
                if a.device < on:
                    a[0] = 1
        if on and sm > 0:  # slower while others' work asks more than the GPU's whole time
            _dev().compute(seconds, sm, gpus=range(on), check=self.SLICE)
        else:
            _time.sleep(seconds)
        if keeps is not None and self.allocated and keeps < self.held:
            self._shrink(keeps)
        print(_json.dumps({{"t0": t0, "gpus": _dev().visible()[:self.gpus]}}))

_twin = _Twin({gpus})
'''

#: the kernelspec of a kernel of N GPUs (placement reads metadata.gpushare.gpus)
SPEC = "twin-{n}"


@dataclass
class Played:
    """What the driver saw of one session."""

    work: KernelWork
    kernel_id: str = ""
    placed: tuple[int, ...] = ()
    cells: list[twin.CellRun] = field(default_factory=list)


class Clock:
    """Trace seconds from wall seconds: trace 0 is ``t0``, running ``scale`` times faster."""

    def __init__(self, scale: float, t0: float):
        self.scale, self.t0 = scale, t0

    def trace(self, wall: float) -> float:
        return (wall - self.t0) * self.scale

    def wall(self, trace: float) -> float:
        return self.t0 + trace / self.scale

    async def until(self, trace: float) -> None:
        delay = self.wall(trace) - time.time()
        if delay > 0:
            await asyncio.sleep(delay)


def kernelspecs(data: Path, widths: set[int]) -> None:
    for n in widths:
        spec = data / "kernels" / SPEC.format(n=n)
        spec.mkdir(parents=True, exist_ok=True)
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": f"twin {n} GPU", "language": "python",
            "metadata": {"gpushare": {"gpus": n}},
        }))


def events_config(events: Path) -> str:
    """Config lines that send the server's events to ``events`` (JSON lines)."""
    return ("import logging\n"
            f"c.EventLogger.handlers = [logging.FileHandler({str(events)!r})]")


async def start_kernel(srv: Server, width: int, turn: asyncio.Lock) -> tuple[Kernel, str]:
    async with turn:  # placed in the order of the sessions' starts, as the simulator does
        info = await srv.api("POST", "/api/kernels", {"name": SPEC.format(n=width)})
    kid = info["id"]
    srv.kernel_ids.append(kid)
    k = await srv.connect(kid)
    await k.run("1")
    await srv.wait_kernel(kid, lambda v: v.get("method") is not None, "the agent to connect")
    return k, kid


def cell_code(s: twin.TwinSettings, w: KernelWork, c: Any) -> str:
    return (f"_twin.cell({s.device_bytes(c.nbytes or 0)}, {s.device_bytes(w.gpu_bytes)}, "
            f"{c.n_gpus}, {s.wall(c.duration)!r}, {c.utilization!r}, "
            f"{None if c.keeps is None else s.device_bytes(c.keeps)})")


async def play(srv: Server, s: twin.TwinSettings, clock: Clock, p: Played,
               leads: dict[tuple[str, int], float], lead_wall: float, end: float,
               turn: asyncio.Lock) -> None:
    """One session: its kernel opened at its start (``lead_wall`` s early, for the kernel's
    own start-up), its cells closed-loop, the activity before those that say so, shut down
    at its stop."""
    w = p.work
    session = w.sessions[0]
    await asyncio.sleep(max(0.0, clock.wall(session.start) - lead_wall - time.time()))
    k, p.kernel_id = await start_kernel(srv, w.gpus, turn)
    setup = await k.run(HELPER.format(slice=max(0.02, s.wall(s.poll_interval) / 2), gpus=w.gpus)
                        + "\nimport os\nprint(os.environ.get('CUDA_VISIBLE_DEVICES', ''))")
    visible = setup.stdout.strip().splitlines()[-1] if setup.stdout.strip() else ""
    p.placed = tuple(int(g) for g in visible.split(",") if g.strip().isdigit())
    t = session.start
    index = 0
    for sess in w.sessions:
        t = max(t, sess.start)
        for c in sess.cells:
            at = t + c.gap
            if at > end:
                return
            lead = leads.get((w.kernel_id, index))
            activity = None
            if lead is not None and index > 0:
                activity = asyncio.create_task(_activity(srv, clock, p.kernel_id,
                                                         max(at - lead, t)))
            await clock.until(at)
            arrival = clock.trace(time.time())
            reply = await k.execute(cell_code(s, w, c), timeout=max(120.0, 20 * s.wall(c.duration)))
            if activity is not None:
                activity.cancel()
            done = clock.trace(reply.finished or time.time())
            rec = twin.CellRun(w.kernel_id, index, arrival, nominal=c.duration, gpus=c.n_gpus)
            if reply.status == "ok":
                out = json.loads(reply.stdout.strip().splitlines()[-1])
                rec.start, rec.end = clock.trace(out["t0"]), done
                rec.ran_on = tuple(out["gpus"])
            elif "OutOfMemory" in str((reply.error or {}).get("ename", "")):
                rec.oom = True
            else:
                err = reply.error or {}
                raise RuntimeError(f"cell {w.kernel_id}#{index} failed: {err.get('ename')}: "
                                   f"{err.get('evalue')}")
            p.cells.append(rec)
            t = done
            index += 1
    if w.shutdown_at is not None and w.shutdown_at < end:
        await clock.until(w.shutdown_at)
        await srv.api("DELETE", f"/api/kernels/{p.kernel_id}")


async def _activity(srv: Server, clock: Clock, kernel_id: str, at: float) -> None:
    """The lab's activity trigger: the person works in the notebook (a restore ahead)."""
    await clock.until(at)
    with contextlib.suppress(Exception):  # a kernel resident or on its way: nothing to do
        await srv.api("POST", f"/api/gpushare/kernels/{kernel_id}/restore",
                      {"trigger": "activity"})


def read_events(path: Path) -> list[dict[str, Any]]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def product_run(played: list[Played], events: list[dict[str, Any]], s: twin.TwinSettings,
                clock: Clock) -> tuple[twin.Run, list[tuple[int, float]], list[tuple[int, float]]]:
    """The product's record, and its releases' and restores' (trace bytes per GPU, trace s)."""
    run = twin.Run("product")
    by_id = {p.kernel_id: p for p in played if p.kernel_id}
    releases: list[tuple[int, float]] = []
    restores: list[tuple[int, float]] = []
    moved: dict[str, list[float]] = {}  # session -> trace times of its moved events
    for p in played:
        kr = run.kernel(p.work.kernel_id)
        kr.placed = p.placed
        run.cells += p.cells
    for e in events:
        seen = by_id.get(e.get("kernel_id", ""))
        if seen is None or "jupyter_gpushare" not in str(e.get("__schema__", "")):
            continue
        p = seen
        kr = run.kernel(p.work.kernel_id)
        said = ", ".join(str(e[key]) for key in ("reason", "trigger") if e.get(key))
        run.timeline.append((clock.trace(stamp(e)), p.work.kernel_id,
                             f"{e.get('action')}" + (f" ({said})" if said else "")))
        per_gpu = int(e.get("bytes", 0) / s.byte_scale / max(1, p.work.gpus))
        seconds = float(e.get("seconds", 0.0)) * s.scale
        if e.get("action") == "released":
            kr.releases += 1
            releases.append((copied_per_gpu(e, s, p.work.gpus), seconds))
        elif e.get("action") == "restored":
            trigger = str(e.get("reason", ""))
            kr.restored("cell" if trigger in ("gate", "agent") else trigger)
            restores.append((per_gpu, seconds))
        elif e.get("action") == "moved":  # a rebalance: moved off a contended GPU
            moved.setdefault(p.work.kernel_id, []).append(clock.trace(stamp(e)))
    for p in played:
        run.kernel(p.work.kernel_id).moves = moves_of(p.cells, moved.get(p.work.kernel_id, []))
    held = restore_holds(run, events, by_id, clock)
    path = sorted(d for c in run.cells if (d := c.delay) is not None and id(c) not in held)
    for c in run.cells:
        if c.start is not None:
            c.began, c.start = c.start, c.arrival + held.get(id(c), 0.0)
    if path:
        run.notes.append(
            "product: a cell's delay is from its arrival to the end of the restore that held "
            "it (the server's restored event); Jupyter's own path from sending a cell to its "
            "start, which the simulator does not model, is left out: over the "
            f"{len(path)} cells no restore held it was median {path[len(path) // 2]:.2f} s, "
            f"p99 {twin.quantile(path, 0.99):.2f} s, max {path[-1]:.2f} s")
    run.cells.sort(key=lambda c: (c.kernel, c.index))
    return run, releases, restores


def moves_of(cells: list[twin.CellRun], moved: list[float]) -> int:
    """A kernel's moves: its rebalances (each a moved event, before, between or after its
    cells), and its restores onto other GPUs (a restore moved after restore_move_after has
    no event of its own: the GPUs its cells ran on changed with no rebalance between)."""
    n = len(moved)
    ran = [c for c in cells if c.ran_on]
    for a, b in itertools.pairwise(ran):
        after = a.end if a.end is not None else a.arrival
        before = b.start if b.start is not None else b.arrival
        if a.ran_on != b.ran_on and not any(after <= t <= before for t in moved):
            n += 1
    return n


def make_room_waits(events: list[dict[str, Any]], by_id: dict[str, Played],
                    s: twin.TwinSettings, clock: Clock) -> list[tuple[int, float]]:
    """A release to make room as the waiting restore sees it: from the restore's wait to the
    start of its bytes' move (the server's steps around the release included), as (bytes per
    GPU its copy moved, trace s) points for the fitted release line; the simulator's
    make-room is the release's time alone. Where the release began more than two polls after
    the wait, its kernel was not yet idle long enough to be released (the simulator waits for
    that itself): from the release's start instead."""
    out = []
    waiting: dict[str, float] = {}
    released: list[tuple[float, int]] = []  # (start, trace bytes per GPU) of make-room releases
    for e in sorted(events, key=stamp):
        p = by_id.get(e.get("kernel_id", ""))
        if p is None:
            continue
        t = clock.trace(stamp(e))
        seconds = float(e.get("seconds", 0.0)) * s.scale
        if e.get("action") == "restore_waiting":
            waiting.setdefault(p.work.kernel_id, t)
        elif e.get("action") == "released" and str(e.get("reason", "")).startswith("making room"):
            released.append((t - seconds, copied_per_gpu(e, s, p.work.gpus)))
        elif e.get("action") == "restored" and p.work.kernel_id in waiting:
            since = waiting.pop(p.work.kernel_id)
            moved = [(at, b) for at, b in released if since - s.poll_interval <= at <= t]
            if moved:
                first = min(at for at, _ in moved)
                if first - since > 2 * s.poll_interval:
                    since = first
                out.append((max(b for _, b in moved), t - seconds - since))
    return out


_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
_COPIED = re.compile(r"copied ([0-9.]+) (B|KiB|MiB|GiB) of ")


def copied_per_gpu(e: dict[str, Any], s: twin.TwinSettings, gpus: int) -> int:
    """Trace bytes per GPU a release event's copy moved: the simulated method copies only
    what changed since the kernel's host copy and says so in the event's detail ("copied
    12.0 MiB of 64.0 MiB"); without that, everything it released (to a tenth of its unit)."""
    found = _COPIED.search(str(e.get("detail", "")))
    nbytes = float(found[1]) * _UNITS[found[2]] if found else float(e.get("bytes", 0))
    return int(nbytes / s.byte_scale / max(1, gpus))


def restore_holds(run: twin.Run, events: list[dict[str, Any]], by_id: dict[str, Played],
                  clock: Clock) -> dict[int, float]:
    """id(cell) -> trace s from its arrival to the end of the restore that held it at the
    gate (a restored event of its kernel between its arrival and its start)."""
    restored: dict[str, list[float]] = {}
    for e in events:
        p = by_id.get(e.get("kernel_id", ""))
        if p is not None and e.get("action") == "restored":
            restored.setdefault(p.work.kernel_id, []).append(clock.trace(stamp(e)))
    out = {}
    for c in run.cells:
        if c.start is None:
            continue
        ends = [t for t in restored.get(c.kernel, ()) if c.arrival - 1e-3 <= t <= c.start + 1e-3]
        if ends:
            out[id(c)] = max(ends) - c.arrival
    return out


def stamp(e: dict[str, Any]) -> float:
    """An event's time (epoch seconds)."""
    from datetime import datetime

    value = str(e.get("__timestamp__", "")).removesuffix("Z")
    if "+" not in value[10:]:
        value += "+00:00"
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return 0.0


async def run_product(workload: Workload, s: twin.TwinSettings,
                      leads: dict[tuple[str, int], float], lead_wall: float = 0.0,
                      log: Any = print, keep: Path | None = None) -> tuple[twin.Run, twin.TransferModel]:
    """Play ``workload`` through a real server; its record and the transfer model fitted to
    its releases and restores."""
    with tempfile.TemporaryDirectory(prefix="gpushare-twin-") as tmp:
        data = Path(tmp) / "data"
        kernelspecs(data, {k.gpus for k in workload.kernels})
        events = Path(tmp) / "events.jsonl"
        env = {"JUPYTER_PATH": str(data),
               "JUPYTER_GPUSHARE_SIM_TRANSFER_RATE": str(s.device_rate())}
        async with Server("twin", gpushare=s.product_options(), env=env,
                          python_config=events_config(events)) as srv:
            clock = Clock(s.scale, time.time() + lead_wall + 1.0)
            played = [Played(k) for k in workload.kernels]
            end = workload.duration
            log(f"twin: {len(played)} sessions, {workload.duration:.0f} s of trace at "
                f"{s.scale:g}x: about {s.wall(workload.duration):.0f} s")
            turn = asyncio.Lock()
            tasks = [asyncio.create_task(play(srv, s, clock, p, leads, lead_wall, end, turn))
                     for p in sorted(played, key=lambda p: p.work.first_start)]
            try:
                await asyncio.wait_for(asyncio.gather(*tasks),
                                       max(0.0, clock.wall(end) - time.time()) + 120)
            finally:
                for t in tasks:
                    t.cancel()
            # to the trace's end, as the simulator runs: releases after the last cell count too
            await clock.until(end)
            seen = read_events(events)
            run, releases, restores = product_run(played, seen, s, clock)
            by_id = {p.kernel_id: p for p in played if p.kernel_id}
            make_room = make_room_waits(
                [e for e in seen if "jupyter_gpushare" in str(e.get("__schema__", ""))],
                by_id, s, clock)
            if keep is not None:
                keep.mkdir(parents=True, exist_ok=True)
                (keep / "server.log").write_text(Path(srv.log_path).read_text(errors="replace"))
                if events.exists():
                    (keep / "events.jsonl").write_text(events.read_text())
    return run, twin.fit_with_make_room(releases, restores, make_room, s)


def settings_for(node: dict[str, Any], args: argparse.Namespace) -> twin.TwinSettings:
    s = twin.TwinSettings(gpus=int(node.get("gpus", 2)), gpu_gib=float(node.get("gpu_gib", 80)),
                          scale=args.scale, byte_scale=args.byte_scale)
    if args.no_rebalance:
        s = replace(s, rebalance=False)
    if args.move_before_cell:
        s = replace(s, rebalance_before_cell=True)
    return s


async def main_async(args: argparse.Namespace) -> int:
    if args.trace:
        trace = Path(args.trace)
        workload, node = read_trace(trace)
        raw = json.loads(trace.read_text()) if trace.suffix != ".csv" else {}
        leads = twin.leads_of(raw)
    else:  # the simulator's default workload: 24 users on 8 GPUs of 80 GiB, over the days
        # the window reaches (its fourth day's afternoon holds the week's most memory)
        days = max(1, math.ceil((args.start + (args.hours or 24.0)) / 24.0))
        workload, node, leads = (generate(24, days=days, seed=args.seed),
                                 {"gpus": 8, "gpu_gib": 80}, {})
    if args.hours:
        workload = window(workload, args.start * 3600.0, args.hours * 3600.0)
    if args.gpus:
        node = {**node, "gpus": args.gpus}
    s = settings_for(node, args)
    print(f"twin: {workload.source}; {s.gpus} GPUs of {s.gpu_gib:g} GiB; the product at "
          f"{s.scale:g}x, bytes x {s.byte_scale:g}")
    product, transfer = await run_product(workload, s, leads,
                                          keep=Path(args.keep) if args.keep else None)
    firsts = {c.kernel: c.arrival for c in product.cells if c.index == 0}
    simulated = twin.simulate(twin.with_first_arrivals(workload, firsts), s, transfer, leads)
    comparison = twin.compare(product, simulated)
    print(twin.report(product, simulated, comparison))
    if args.keep:
        Path(args.keep, "runs.json").write_text(json.dumps(
            {"product": asdict(product), "simulator": asdict(simulated), "firsts": firsts},
            indent=1, default=str))
    return 0 if comparison.ok or not args.check else 1


def window(w: Workload, start: float, seconds: float) -> Workload:
    """The sessions of ``w`` that start within ``seconds`` from ``start``, moved to start at
    0 (a kernel shut down after the window runs on to its end)."""
    kernels = []
    for k in w.kernels:
        sessions = tuple(replace(x, start=x.start - start) for x in k.sessions
                         if start <= x.start < start + seconds)
        if sessions:
            stop = None if k.shutdown_at is None else k.shutdown_at - start
            kernels.append(replace(k, sessions=sessions,
                                   shutdown_at=stop if stop is not None and stop < seconds else None))
    return Workload(seconds, tuple(kernels), f"{w.source}, {start / 3600:g} h + {seconds / 3600:g} h")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", help="a trace (JSON, docs/trace-format.md; tests/twin_scenario.json "
                                    "is the CI test's); default: the simulator's default "
                                    "workload (24 users, 8 GPUs of 80 GiB), over the days "
                                    "the window reaches")
    ap.add_argument("--seed", type=int, default=0, help="of the default workload (default 0)")
    ap.add_argument("--scale", type=float, default=20.0,
                    help="the product runs this many times faster than the trace (default 20)")
    ap.add_argument("--byte-scale", type=float, default=1 / 256,
                    help="the product's bytes per trace byte (default 1/256)")
    ap.add_argument("--start", type=float, default=8.0,
                    help="with --hours: the window's start, hours from the trace's start "
                         "(default 8: the morning)")
    ap.add_argument("--hours", type=float, default=None,
                    help="only the sessions that start in a window of this many hours "
                         "(default: 4 for the default workload, all of a trace)")
    ap.add_argument("--gpus", type=int, default=None,
                    help="the node's GPUs instead of the trace's (the default workload's 8): "
                         "fewer GPUs for the same people, so that memory runs short and "
                         "releases, restores and moves are what is compared")
    ap.add_argument("--no-rebalance", action="store_true")
    ap.add_argument("--move-before-cell", action="store_true",
                    help="rebalance_before_cell on, in the product and the simulator")
    ap.add_argument("--keep", metavar="DIR", help="keep the server's log and events here")
    ap.add_argument("--check", action="store_true", help="exit 1 when a tolerance is not met")
    ap.add_argument("--smoke", action="store_true", help="the whole path, in seconds (CI)")
    return ap


def smoke_trace() -> dict[str, Any]:
    """Two kernels on a GPU of 10 GiB: one fills it, is released under memory pressure and
    restored by its next cell; one runs a CPU-only cell meanwhile (the first cells come 300 s
    after their kernels start: a kernel takes seconds to start on a busy machine)."""
    gib = 1 << 30
    full = 19 * gib // 2
    return {"node": {"gpus": 1, "gpu_gib": 10}, "duration": 2000, "sessions": [
        {"id": "a", "user": "u", "start": 0, "cells": [
            {"start": 300, "duration": 10, "gpus": 1, "bytes_per_gpu": full, "sm": 50},
            {"start": 480, "duration": 10, "gpus": 1, "bytes_per_gpu": full, "sm": 50}]},
        {"id": "b", "user": "u", "start": 10, "cells": [
            {"start": 320, "duration": 10, "gpus": 0, "bytes_per_gpu": 0, "sm": 0}]},
    ]}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    if args.hours is None:
        args.hours = 0.0 if args.trace or args.smoke else 4.0
    if not args.smoke:
        return asyncio.run(main_async(args))
    with tempfile.TemporaryDirectory(prefix="gpushare-twin-smoke-") as tmp:
        args.trace = str(Path(tmp) / "smoke.json")
        Path(args.trace).write_text(json.dumps(smoke_trace()))
        args.scale = 30.0
        return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
