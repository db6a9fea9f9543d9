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

    python benchmarks/make_example_trace.py [--out jupyter_gpushare/simulate/example_trace]
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import random
import uuid
from datetime import datetime, timezone
from pathlib import Path

from jupyter_gpushare.policy import PolicyConfig
from jupyter_gpushare.simulate.engine import Kernel, Simulation
from jupyter_gpushare.simulate.generator import generate
from jupyter_gpushare.simulate.policies import GPUShare
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
        else:
            event = {"kernel_id": k.id, "action": what, "method": "driver"}
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
            kernels[ids[kid]] = {"t": rows_t, "gpu_memory_bytes": rows_b, "sm_utilization": rows_u,
                                 "gpu": {gpu: rows_b}}
            gpus.setdefault(gpu, None)
    for gpu in list(gpus):  # the node-level series: what this server's GPUs showed
        gpus[gpu] = {"t": [round(EPOCH + t, 3) for t in ticks], "memory_used": [], "utilization": []}
    return {"now": round(EPOCH + EXPORT_TO, 3), "interval": INTERVAL, "gpus": gpus, "kernels": kernels}


def gzipped(path: Path) -> io.TextIOWrapper:
    """A text file written gzipped, byte for byte the same on every run (no time stamp)."""
    raw = gzip.GzipFile(filename="", mode="wb", fileobj=path.open("wb"), mtime=0)
    return io.TextIOWrapper(raw, encoding="utf-8")


def timestamp(t: float) -> str:
    # as jupyter_events writes it (an isoformat with an offset, then "Z")
    return datetime.fromtimestamp(EPOCH + t, timezone.utc).isoformat() + "Z"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).parent.parent / "jupyter_gpushare" / "simulate" / "example_trace"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workload = generate(USERS, days=1, seed=SEED, gpu_gib=GPU_GIB)
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
                        **{k: (ids[v] if k == "kernel_id" else v) for k, v in e.items() if k != "t"}}
                f.write(json.dumps(line) + "\n")
    manifest = {
        "description": (f"example replay: {USERS} synthetic users, one Monday 06:00-22:00, "
                        f"exported every {INTERVAL:g} s (benchmarks/make_example_trace.py)"),
        "node": {"gpus": GPUS, "gpu_gib": GPU_GIB},
    }
    (out / "trace.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
