"""Read a history exported from a running installation into a workload to replay.

What an admin exports, per user's server (under JupyterHub, one server per user):

- ``NAME.history.json``: the body of ``GET /api/gpushare/history?seconds=N`` (docs/api.md):
  per kernel, samples every ``interval`` s of the GPU memory it holds and its SM %.
  Several exports of one server (``NAME.history.json``, ``NAME.history.2.json``, ...) are
  merged by kernel id, so an hourly export covers a week with a short ``history_seconds``.
  A kernel missing from the latest export had exited by then.
- ``NAME.events.jsonl`` (optional): that server's jupyter_events log of
  ``https://events.jupyter.org/jupyter_gpushare/kernel/v1`` (``c.EventLogger.handlers``), one
  JSON object a line: releases (with the bytes moved) and restores (with their trigger).

``.gz`` versions of both are read too. An optional ``trace.json`` in the directory says what
the trace is and which node it ran on (``{"description": ..., "node": {"gpus": 2,
"gpu_gib": 80}}``); the command line's node options win over it.

How the workload is rebuilt, and what it cannot see:

- a kernel holds, from the first sample where it holds memory, the most it was ever seen
  holding or moving (samples and released/restored events);
- its GPU cells are the runs of consecutive samples with SM % above 0, each as long as its
  samples and as busy as their mean (SM-time is kept); a restore triggered by a cell
  (``gate``, ``agent``) adds a cell at that moment if no GPU run starts there;
- every replayed cell is marked as one that uses the GPU (so lazy restore mode changes
  nothing here); cells that do not touch the GPU are not in the history: the replayed kernels look idler
  than they were, so the replay is optimistic about idle time (the events' real release and
  restore counts are printed next to the simulated ones, to compare);
- a kernel is replayed closed-loop: the gaps between its cells are kept, so a cell that waits
  pushes the later ones back.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .engine import reason_kind
from .workload import DAY, Cell, KernelWork, Session, Workload

SCHEMA = "https://events.jupyter.org/jupyter_gpushare/kernel/v1"
CELL_TRIGGERS = ("gate", "agent")  # restores that a cell asked for


@dataclass
class Replay:
    workload: Workload
    node: dict[str, Any] = field(default_factory=dict)  # from trace.json, if any
    recorded: dict[str, Any] = field(default_factory=dict)  # what the events say happened


def _open(path: Path) -> Any:
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")


def _load_json(path: Path) -> Any:
    with _open(path) as f:
        return json.load(f)


def parse_timestamp(value: str) -> float:
    """jupyter_events' ``__timestamp__`` (it writes ``...+00:00Z``) as epoch seconds."""
    text = value.strip()
    if text.endswith("Z"):
        text = text[:-1] if re.search(r"[+-]\d\d:\d\d$", text[:-1]) else text[:-1] + "+00:00"
    t = datetime.fromisoformat(text)
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return t.timestamp()


def read_events(path: Path) -> Iterator[dict[str, Any]]:
    """The gpushare events of a jupyter_events log (other schemas and bad lines skipped)."""
    with _open(path) as f:
        for line in f:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if not isinstance(event, dict) or "kernel_id" not in event or "action" not in event:
                continue
            if event.get("__schema__", SCHEMA) != SCHEMA or "__timestamp__" not in event:
                continue
            event["t"] = parse_timestamp(event["__timestamp__"])
            yield event


def _user_files(directory: Path) -> dict[str, dict[str, list[Path]]]:
    users: dict[str, dict[str, list[Path]]] = {}
    for p in sorted(directory.iterdir()):
        m = re.match(r"(.+?)\.(history|events)\b", p.name)
        if m and p.is_file():
            kind = "history" if m.group(2) == "history" else "events"
            users.setdefault(m.group(1), {"history": [], "events": []})[kind].append(p)
    return users


def _merge(histories: list[dict[str, Any]]) -> tuple[dict[str, dict[float, tuple[int, float]]], float]:
    """kernel id -> {t: (bytes, SM %)} over every export; and the interval."""
    kernels: dict[str, dict[float, tuple[int, float]]] = {}
    interval = 0.0
    for h in histories:
        interval = max(interval, float(h.get("interval") or 0))
        for kid, series in (h.get("kernels") or {}).items():
            rows = kernels.setdefault(kid, {})
            for t, b, u in zip(series["t"], series["gpu_memory_bytes"], series["sm_utilization"], strict=True):
                rows[float(t)] = (int(b or 0), float(u or 0.0))
    return kernels, interval or 2.0


def _cells(samples: list[tuple[float, int, float]], interval: float,
           cell_restores: list[float], start: float) -> list[tuple[float, float, float]]:
    """(start, duration, SM %) of the kernel's cells, in time order."""
    runs: list[tuple[float, float, float]] = []
    run: list[tuple[float, float]] = []  # (t, util) of the current run of busy samples

    def close() -> None:
        if run:
            t0 = run[0][0] - interval
            runs.append((t0, run[-1][0] - t0, sum(u for _, u in run) / len(run)))
            run.clear()

    last_t = None
    for t, _, u in samples:
        if u > 0 and (not run or last_t is None or t - last_t <= 1.5 * interval):
            run.append((t, u))
        else:
            close()
            if u > 0:
                run.append((t, u))
        last_t = t
    close()
    # a cell that triggered a restore ran at that moment, on the GPU or not
    for at in cell_restores:
        if not any(abs(r[0] - at) <= 2 * interval for r in runs):
            runs.append((at, 1.0, 0.0))
    if not runs or runs[0][0] > start:  # the kernel took its memory: its first cell
        runs.append((start, 1.0, 0.0))
    runs.sort()
    return runs


def _kernel(kid: str, user: str, rows: dict[float, tuple[int, float]], events: list[dict[str, Any]],
            interval: float, origin: float, ended_before: float | None) -> KernelWork | None:
    samples = sorted((t, b, u) for t, (b, u) in rows.items())
    moved = [int(e.get("bytes") or 0) for e in events if e["action"] in ("released", "restored")]
    nbytes = max([b for _, b, _ in samples] + moved + [0])
    if nbytes <= 0:
        return None  # never held GPU memory: nothing to share
    held = [t for t, b, _ in samples if b > 0] + [e["t"] for e in events if e["action"] == "released"]
    start = min(held) - interval
    restores = [e["t"] - float(e.get("seconds") or 0) for e in events
                if e["action"] == "restored" and e.get("reason") in CELL_TRIGGERS]
    cells: list[Cell] = []
    end = start
    for c0, duration, util in _cells([s for s in samples if s[0] >= start], interval, restores, start):
        c0 = max(c0, end)
        # every cell the history shows used the GPU (CPU-only cells leave no trace in it)
        cells.append(Cell(c0 - end if cells else 0.0, duration, util, gpus=1))
        end = c0 + duration
    shutdown = None
    if ended_before is not None and samples and samples[-1][0] < ended_before:
        shutdown = samples[-1][0] + interval - origin
    return KernelWork(kid, user, nbytes, (Session(start - origin, tuple(cells), "replay"),), shutdown)


def read_replay(path: str | Path) -> Replay:
    """The workload of an exported trace: a directory, or one ``NAME.history.json``."""
    path = Path(path)
    manifest: dict[str, Any] = {}
    if path.is_dir():
        users = _user_files(path)
        if (path / "trace.json").exists():
            manifest = _load_json(path / "trace.json")
    else:
        users = _user_files(path.parent)
        name = re.match(r"(.+?)\.history\b", path.name)
        users = {k: v for k, v in users.items() if name and k == name.group(1)}
    users = {u: f for u, f in users.items() if f["history"]}
    if not users:
        raise ValueError(f"{path}: no NAME.history.json found (the body of GET /api/gpushare/history)")
    loaded = {u: [_load_json(p) for p in f["history"]] for u, f in users.items()}
    events = {u: [e for p in f["events"] for e in read_events(p)] for u, f in users.items()}
    starts = [float(s["t"][0]) for hs in loaded.values() for h in hs
              for s in (h.get("kernels") or {}).values() if s["t"]]
    if not starts:
        raise ValueError(f"{path}: the history has no samples")
    first = min(starts)
    origin = first - first % DAY  # midnight (UTC) of the first day: hours of the day stay readable
    last = max(float(h.get("now") or 0) for hs in loaded.values() for h in hs)
    kernels: list[KernelWork] = []
    recorded: dict[str, Any] = {"releases": 0, "restores": 0, "restore_waiting": 0, "release_reasons": {}}
    for user in sorted(loaded):
        rows, interval = _merge(loaded[user])
        newest = max(float(h.get("now") or 0) for h in loaded[user])
        by_kernel: dict[str, list[dict[str, Any]]] = {}
        for e in events[user]:
            by_kernel.setdefault(e["kernel_id"], []).append(e)
            _count(recorded, e)
        for kid in sorted(rows):
            work = _kernel(kid, user, rows[kid], by_kernel.get(kid, []), interval, origin,
                           newest - 2 * interval)
            if work is not None:
                kernels.append(work)
    description = manifest.get("description") or f"replay of {path}"
    workload = Workload(last - origin, tuple(kernels), description, tuple(sorted(loaded)))
    return Replay(workload, dict(manifest.get("node") or {}), recorded)


def _count(recorded: dict[str, Any], e: dict[str, Any]) -> None:
    if e["action"] == "released":
        recorded["releases"] += 1
        kind = reason_kind(str(e.get("reason", "")))
        recorded["release_reasons"][kind] = recorded["release_reasons"].get(kind, 0) + 1
    elif e["action"] == "restored":
        recorded["restores"] += 1
    elif e["action"] == "restore_waiting":
        recorded["restore_waiting"] += 1
