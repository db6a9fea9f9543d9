"""Write the example trace that ``jupyter gpushare simulate`` replays by default.

There is no real user data this project may ship, so the example is synthetic, written in
exactly the shapes an installation exports (docs/api.md): per user's server a
``NAME.history.json.gz`` (the body of ``GET /api/gpushare/history``) and a
``NAME.events.jsonl.gz`` (the jupyter_events log of the kernel/v1 schema, lines as a
``logging.FileHandler`` writes them). What it records: 6 synthetic users (the simulator's
generator, seed 11) for one Monday on a node of 2 GPUs of 80 GiB, under the gpushare policy
with the product's defaults and the ``h100`` transfer model, sampled every 10 s the way the
tracker samples (memory held at the sample; SM % averaged over the interval). Kernel ids are
random UUIDs and no notebook paths are written, as an anonymized export would have it.

It also writes the small multi-GPU example in the documented trace format
(docs/trace-format.md), ``jupyter_gpushare/simulate/example_multigpu.json``: 8 synthetic users
for one weekday on a node of 8 GPUs of 80 GiB, shaped like the production interactive-GPU
notebook traces that have been published: sessions of 1, 2, 4 or 8 GPUs (about 40 % of them
4 or 8), living for hours and idle most of it; cells of minutes; about a third of cells use
no GPU; median SM use under 10 %, with a few heavy runs; bytes per GPU that vary from cell
to cell within a session, some cells freeing what they allocated.

    python benchmarks/make_example_trace.py [--out jupyter_gpushare/simulate/example_trace]
        [--multi-gpu jupyter_gpushare/simulate/example_multigpu.json] [--smoke]

The history bodies and events are built from the REST contract and the event schema
(``jupyter_gpushare.server.contract_bodies``), so they are what a server exports.
``--smoke``: 2 users, both written to a temporary directory and read back by the simulator's replay
and trace readers (the whole path, nothing written in the checkout).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import math
import random
import tempfile
import uuid
from datetime import datetime, timezone
from pathlib import Path

from jupyter_gpushare.policy import PolicyConfig
from jupyter_gpushare.server import contract_bodies
from jupyter_gpushare.simulate.engine import Kernel, Simulation
from jupyter_gpushare.simulate.generator import Profile, generate
from jupyter_gpushare.simulate.policies import GPUShare
from jupyter_gpushare.simulate.replay import read_replay
from jupyter_gpushare.simulate.trace import read_trace
from jupyter_gpushare.simulate.transfer import PRESETS
from jupyter_gpushare.simulate.workload import HOUR, GiB

USERS, SEED, GPUS, GPU_GIB, INTERVAL = 6, 11, 2, 80, 10.0
EPOCH = datetime(2026, 1, 5, tzinfo=timezone.utc).timestamp()  # a Monday, 00:00 UTC
EXPORT_FROM, EXPORT_TO = 6 * HOUR, 22 * HOUR  # the day as exported: 06:00-22:00


class Recorder:
    """Collects what the engine reports per kernel: memory changes, cells, events."""

    def __init__(self) -> None:
        self.memory: dict[str, list[tuple[float, int]]] = {}
        self.cells: dict[str, list[tuple[float, float, float]]] = {}
        self.events: dict[str, list[dict]] = {}
        self.user_of: dict[str, str] = {}
        self.gpu_of: dict[str, int] = {}
        self.ended: dict[str, float] = {}

    def __call__(self, t: float, k: Kernel, what: str, data: dict) -> None:
        self.user_of[k.id], self.gpu_of[k.id] = k.work.user, k.gpu
        if what == "ended":
            self.ended[k.id] = t
        elif what == "memory":
            self.memory.setdefault(k.id, []).append((t, data["nbytes"]))
        elif what == "cell":
            if data["utilization"] > 0:
                self.cells.setdefault(k.id, []).append((data["start"], data["end"], data["utilization"]))
        elif what in contract_bodies.event_actions():  # what the server's event log shows
            event: dict = {"kernel_id": k.id, "action": what, "method": "driver"}
            if what == "released":
                event.update(bytes=k.nbytes, seconds=round(data["seconds"], 3), reason=data["reason"])
            elif what == "restored":
                event.update(bytes=k.nbytes, seconds=round(data["seconds"], 3), reason="gate")
            elif what == "restore_waiting":
                event.update(bytes=k.nbytes, reason=(
                    f"waiting for memory: needs {k.nbytes / GiB:.1f} GiB on GPU {k.gpu} "
                    f"({data['free'] / GiB:.1f} GiB free)"))
            self.events.setdefault(k.work.user, []).append({"t": t, **event})


def held_at(changes: list[tuple[float, int]], t: float) -> int:
    held = 0
    for at, nbytes in changes:
        if at > t:
            break
        held = nbytes
    return held


def busy_share(cells: list[tuple[float, float, float]], t0: float, t1: float) -> float:
    """SM % over (t0, t1]: each cell's SM % weighted by how much of the interval it covers."""
    total = sum(u * max(0.0, min(e, t1) - max(s, t0)) for s, e, u in cells)
    return min(100.0, total / (t1 - t0))


def history(rec: Recorder, user: str, ids: dict[str, str]) -> dict:
    ticks = [EXPORT_FROM + i * INTERVAL for i in range(int((EXPORT_TO - EXPORT_FROM) / INTERVAL) + 1)]
    kernels, gpus = {}, {}
    for kid in sorted(k for k, u in rec.user_of.items() if u == user and k in rec.memory):
        changes = rec.memory[kid]
        first, ended = changes[0][0], rec.ended.get(kid, float("inf"))
        rows_t, rows_b, rows_u = [], [], []
        for t in ticks:
            if t < first or t > ended:  # the tracker knows a kernel from start to exit
                continue
            held = held_at(changes, t)
            rows_t.append(round(EPOCH + t, 3))
            rows_b.append(held)
            rows_u.append(round(busy_share(rec.cells.get(kid, []), t - INTERVAL, t), 1) if held else None)
        if rows_t:
            gpu = str(rec.gpu_of[kid])
            kernels[ids[kid]] = contract_bodies.build(
                "KernelHistory", t=rows_t, gpu_memory_bytes=rows_b, sm_utilization=rows_u,
                gpu={gpu: rows_b}, gpu_utilization={gpu: rows_u})
            gpus.setdefault(gpu, None)
    for gpu in list(gpus):  # the node-level series: what this server's GPUs showed
        gpus[gpu] = contract_bodies.build("GPUHistory", t=[round(EPOCH + t, 3) for t in ticks],
                                          memory_used=[], utilization=[])
    return contract_bodies.build("History", now=round(EPOCH + EXPORT_TO, 3), interval=INTERVAL,
                                 gpus=gpus, kernels=kernels)


def gzipped(path: Path) -> io.TextIOWrapper:
    """A text file written gzipped, byte for byte the same on every run (no time stamp)."""
    raw = gzip.GzipFile(filename="", mode="wb", fileobj=path.open("wb"), mtime=0)
    return io.TextIOWrapper(raw, encoding="utf-8")


def timestamp(t: float) -> str:
    # as jupyter_events writes it (an isoformat with an offset, then "Z")
    return datetime.fromtimestamp(EPOCH + t, timezone.utc).isoformat() + "Z"


MULTI_USERS, MULTI_SEED, MULTI_GPUS = 8, 21, 8


def multi_gpu_trace(seed: int = MULTI_SEED) -> dict:
    """The multi-GPU example, as a trace document (docs/trace-format.md)."""
    rng = random.Random(seed)
    sessions = []
    for u in range(MULTI_USERS):
        user = f"user{u + 1:02d}"
        t = 8 * HOUR + rng.uniform(0, 2.5 * HOUR)  # arrives
        leave = t + rng.uniform(6, 9.5) * HOUR
        n = 0
        while t < leave - HOUR:
            n += 1
            gpus = rng.choices([1, 2, 4, 8], weights=[35, 25, 25, 15])[0]
            base = rng.uniform(2, 24) * GiB  # what its model and data take per GPU
            stop = min(leave, t + rng.uniform(2, 7) * HOUR)
            cells, at, held = [], t + rng.uniform(30, 300), 0
            while True:
                cpu = rng.random() < 1 / 3
                heavy = not cpu and rng.random() < 0.08
                duration = (rng.uniform(8, 30) * 60 if heavy
                            else min(45 * 60, rng.lognormvariate(math.log(90), 1.0)))
                if at + duration > stop - 60:
                    break
                if cpu:
                    cell = {"start": round(at, 1), "duration": round(duration, 1), "gpus": 0,
                            "bytes_per_gpu": held, "sm": 0}
                else:
                    need = int(base * rng.uniform(0.3, 1.0 if not heavy else 1.4))
                    sm = rng.uniform(50, 95) if heavy else min(100.0, rng.lognormvariate(math.log(7), 0.9))
                    width = gpus if rng.random() < 0.8 else 1
                    cell = {"start": round(at, 1), "duration": round(duration, 1), "gpus": width,
                            "bytes_per_gpu": need, "sm": round(sm, 1)}
                    held = max(held, need)
                    if rng.random() < 0.1:  # frees what it allocated (del, empty_cache)
                        held = int(base * 0.3)
                        cell["bytes_after"] = min(held, need)
                        held = cell["bytes_after"]
                cells.append(cell)
                at += duration + rng.lognormvariate(math.log(4 * 60), 1.1)  # think time
            if cells:
                sessions.append({"id": f"{user}-s{n}", "user": user, "start": round(t, 1),
                                 "stop": None if rng.random() < 0.25 else round(stop, 1),
                                 "gpus": gpus, "cells": cells})
            t = stop + rng.uniform(5, 60) * 60
    return {"format": "jupyter-gpushare-trace", "version": 1,
            "description": (f"multi-GPU example: {MULTI_USERS} synthetic users, one weekday, "
                            "sessions of 1-8 GPUs (benchmarks/make_example_trace.py)"),
            "duration": 24 * HOUR, "node": {"gpus": MULTI_GPUS, "gpu_gib": GPU_GIB},
            "sessions": sessions}


def write_trace(doc: dict, path: Path) -> None:
    """The document with one cell a line, so that an error's line number points at it."""
    head = {k: v for k, v in doc.items() if k != "sessions"}
    lines = ["{"] + [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    lines.append('  "sessions": [')
    for i, s in enumerate(doc["sessions"]):
        meta = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in s.items() if k != "cells")
        lines.append(f"    {{{meta}, \"cells\": [")
        lines += [f"      {json.dumps(c)}{',' if j < len(s['cells']) - 1 else ''}"
                  for j, c in enumerate(s["cells"])]
        lines.append("    ]}" + ("," if i < len(doc["sessions"]) - 1 else ""))
    lines += ["  ]", "}"]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = Path(__file__).parent.parent / "jupyter_gpushare" / "simulate"
    ap.add_argument("--out", default=str(here / "example_trace"))
    ap.add_argument("--multi-gpu", default=str(here / "example_multigpu.json"))
    ap.add_argument("--smoke", action="store_true",
                    help="2 users, written to a temporary directory and read back (the whole path)")
    args = ap.parse_args()
    args.users = 2 if args.smoke else USERS
    if args.smoke:
        with tempfile.TemporaryDirectory(prefix="gpushare-example-smoke-") as tmp:
            args.out, args.multi_gpu = f"{tmp}/example_trace", f"{tmp}/example_multigpu.json"
            write(args)
            replay = read_replay(args.out)
            workload, _ = read_trace(args.multi_gpu)
            assert replay.workload.kernels, replay.recorded
            assert workload.kernels
            print(f"read back: {len(replay.workload.kernels)} kernels replayed "
                  f"({replay.recorded['releases']} releases recorded), "
                  f"{len(workload.kernels)} in the multi-GPU trace")
        return
    write(args)


def write(args: argparse.Namespace) -> None:
    write_trace(multi_gpu_trace(), Path(args.multi_gpu))
    print(f"wrote {args.multi_gpu}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # the profile the shipped example was recorded with (before CPU-only cells were a third
    # and kernels grew): the same files on every run
    profile = Profile(cpu_cell_share=0.4, start_fraction=1.0)
    workload = generate(args.users, days=1, seed=SEED, profile=profile, gpu_gib=GPU_GIB)
    rec = Recorder()
    Simulation(workload, GPUShare(PolicyConfig(), seed=SEED), GPU_GIB * GiB, GPUS, PRESETS["h100"],
               observer=rec).run()
    rng = random.Random(SEED)
    ids = {kid: str(uuid.UUID(int=rng.getrandbits(128), version=4)) for kid in sorted(rec.user_of)}
    names = {u: f"user{i + 1:02d}" for i, u in enumerate(workload.users)}
    for user, name in names.items():
        with gzipped(out / f"{name}.history.json.gz") as f:
            json.dump(history(rec, user, ids), f, separators=(",", ":"))
        with gzipped(out / f"{name}.events.jsonl.gz") as f:
            for e in rec.events.get(user, []):
                if not EXPORT_FROM <= e["t"] <= EXPORT_TO:
                    continue
                line = {"__timestamp__": timestamp(e["t"]),
                        "__schema__": "https://events.jupyter.org/jupyter_gpushare/kernel/v1",
                        "__schema_version__": "1", "__metadata_version__": 1,
                        **contract_bodies.event(**{k: (ids[v] if k == "kernel_id" else v)
                                                   for k, v in e.items() if k != "t"})}
                f.write(json.dumps(line) + "\n")
    manifest = {
        "description": (f"example replay: {args.users} synthetic users, one Monday 06:00-22:00, "
                        f"exported every {INTERVAL:g} s (benchmarks/make_example_trace.py)"),
        "node": {"gpus": GPUS, "gpu_gib": GPU_GIB},
    }
    (out / "trace.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
