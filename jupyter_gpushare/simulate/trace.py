"""Read a workload trace in the documented format (docs/trace-format.md): JSON or CSV.

An admin writes it from any source (a scheduler's logs, a notebook server's history): one
record per notebook session (a kernel: who, when it started and stopped, on how many GPUs)
and per cell (when it started, how long it ran, on how many GPUs, the bytes per GPU its
kernel held while it ran, its SM %). Times are seconds from the trace's start.

Bad input stops the read with a :class:`TraceError` that names the file, the line and the
field, and says what was expected. How a trace becomes a workload: a session is a kernel;
its cells are replayed closed-loop (the gap between a cell's start and the end of the one
before it is kept, so a cell that waits pushes the later ones back); the kernel holds, from
its first cell, that cell's ``bytes_per_gpu`` on each of its GPUs and grows to what later
cells need (``bytes_after`` lets a cell free).
"""

from __future__ import annotations

import bisect
import csv
import json
import json.decoder
import json.scanner
import math
from pathlib import Path
from typing import Any

from .workload import Cell, KernelWork, Session, Workload

CSV_COLUMNS = ("session", "user", "session_start", "session_stop", "start", "duration", "gpus",
               "bytes_per_gpu", "sm")
CSV_OPTIONAL = ("bytes_after",)
SESSION_FIELDS = ("id", "user", "start", "stop", "cells")
CELL_FIELDS = ("start", "duration", "gpus", "bytes_per_gpu", "sm")


class TraceError(ValueError):
    """Bad input: ``str()`` names the file, line and field."""

    def __init__(self, path: str, line: int | None, field: str | None, problem: str):
        where = f"{path}:{line}" if line else path
        what = f"field '{field}': " if field else ""
        super().__init__(f"{where}: {what}{problem}")
        self.line, self.field = line, field


class _Located(dict):
    """A JSON object that knows where it was in the text."""

    span: tuple[int, int] = (0, 0)


def _load_located(text: str) -> Any:
    """``json.loads``, with every object a :class:`_Located` carrying its span."""
    decoder: Any = json.JSONDecoder()
    json_object: Any = getattr(json.decoder, "JSONObject")  # noqa: B009 (not in typeshed)
    py_scanner: Any = getattr(json.scanner, "py_make_scanner")  # noqa: B009

    def parse_object(s_and_end: tuple[str, int], *args: Any) -> tuple[Any, int]:
        obj, end = json_object(s_and_end, *args)
        located = _Located(obj)
        located.span = (s_and_end[1] - 1, end)
        return located, end

    # the pure-Python scanner calls ``parse_object`` with the position; the C one would not
    decoder.parse_object = parse_object
    decoder.scan_once = py_scanner(decoder)
    return decoder.decode(text)


class _Reader:
    def __init__(self, path: Path, text: str):
        self.path = str(path)
        self.text = text
        self.newlines = [i for i, ch in enumerate(text) if ch == "\n"]

    def line_of(self, pos: int) -> int:
        return bisect.bisect_left(self.newlines, pos) + 1

    def field_line(self, obj: Any, field: str | None) -> int | None:
        """The line of ``field`` in JSON object ``obj`` (of the object where it is missing)."""
        if not isinstance(obj, _Located):
            return getattr(obj, "line", None)
        start, end = obj.span
        if field is not None:
            at = self.text.find(json.dumps(field), start, end)
            if at >= 0:
                return self.line_of(at)
        return self.line_of(start)

    def fail(self, obj: Any, field: str | None, problem: str) -> TraceError:
        return TraceError(self.path, self.field_line(obj, field), field, problem)

    # -- values -----------------------------------------------------------------------------
    def number(self, obj: Any, field: str, minimum: float = 0.0, maximum: float | None = None,
               optional: bool = False) -> float | None:
        if field not in obj or obj[field] is None or obj[field] == "":
            if optional:
                return None
            raise self.fail(obj, field, "missing (a number is required)")
        raw = obj[field]
        try:
            if isinstance(raw, bool):
                raise ValueError
            value = float(raw)
        except (TypeError, ValueError):
            raise self.fail(obj, field, f"not a number: {raw!r}") from None
        if not math.isfinite(value) or value < minimum or (maximum is not None and value > maximum):
            bound = f">= {minimum:g}" + ("" if maximum is None else f" and <= {maximum:g}")
            raise self.fail(obj, field, f"{raw!r} out of range (must be {bound})")
        return value

    def integer(self, obj: Any, field: str, optional: bool = False) -> int | None:
        value = self.number(obj, field, optional=optional)
        if value is None:
            return None
        if value != int(value):
            raise self.fail(obj, field, f"not a whole number: {obj[field]!r}")
        return int(value)

    def text_field(self, obj: Any, field: str) -> str:
        raw = obj.get(field)
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            raise self.fail(obj, field, "missing (a non-empty string is required)")
        if not isinstance(raw, (str, int)) or isinstance(raw, bool):
            raise self.fail(obj, field, f"not a string: {raw!r}")
        return str(raw)

    # -- records ----------------------------------------------------------------------------
    def cell(self, obj: Any, session_gpus: int | None) -> tuple[float, Cell]:
        start = self.number(obj, "start")
        duration = self.number(obj, "duration")
        gpus = self.integer(obj, "gpus")
        nbytes = self.integer(obj, "bytes_per_gpu")
        sm = self.number(obj, "sm", maximum=100.0)
        after = self.integer(obj, "bytes_after", optional=True)
        assert start is not None and duration is not None and gpus is not None
        assert nbytes is not None and sm is not None
        if session_gpus is not None and gpus > session_gpus:
            raise self.fail(obj, "gpus", f"{gpus} GPUs, more than its session's {session_gpus}")
        if gpus == 0 and sm > 0:
            raise self.fail(obj, "sm", f"{sm:g} % on a cell of 0 GPUs (CPU-only: sm must be 0)")
        if after is not None and after > nbytes:
            raise self.fail(obj, "bytes_after", f"{after} is more than bytes_per_gpu {nbytes}")
        return start, Cell(0.0, duration, sm, gpus=gpus, nbytes=nbytes, keeps=after)

    def session(self, obj: Any, sid: str, user: str, start: float, stop: float | None,
                gpus: int | None, cells: list[tuple[Any, float, Cell]]) -> KernelWork:
        width = gpus if gpus is not None else max([1] + [c.n_gpus for _, _, c in cells])
        if width < 1:
            raise self.fail(obj, "gpus", "a session runs on at least 1 GPU")
        out: list[Cell] = []
        end = start
        for where, at, c in cells:
            if at < end - 1e-6:
                before = "its session's start" if not out else "the previous cell's end"
                raise self.fail(where, "start", f"{at:g} is before {before} ({end:g}): a "
                                                "notebook runs one cell at a time")
            out.append(Cell(at - end, c.duration, c.utilization, c.gpus, c.nbytes, c.keeps))
            end = at + c.duration
        if stop is not None and stop < end - 1e-6:
            raise self.fail(obj, "stop", f"{stop:g} is before its last cell ends ({end:g})")
        first = out[0].nbytes or 0
        return KernelWork(sid, user, first, (Session(start, tuple(out), "trace"),), stop, width)


def _dict_with_line(row: dict[str, str], line: int) -> Any:
    class Row(dict):
        pass

    r = Row(row)
    r.line = line  # type: ignore[attr-defined]
    return r


def read_trace(path: str | Path, duration: float | None = None) -> tuple[Workload, dict[str, Any]]:
    """The workload of a trace file, and its ``node`` (from a JSON trace; {} for CSV)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise TraceError(str(path), None, None, f"cannot read it: {e.strerror}") from None
    r = _Reader(path, text)
    node: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    if path.suffix.lower() == ".csv":
        kernels = _from_csv(r)
    else:
        kernels, node, meta = _from_json(r)
    if not kernels:
        raise TraceError(str(path), None, None, "no sessions with cells")
    ends = [max(k.shutdown_at or 0.0, _last_end(k)) for k in kernels]
    total = duration or meta.get("duration") or max(ends)
    description = meta.get("description") or f"trace {path.name}"
    users = tuple(dict.fromkeys(k.user for k in kernels))
    return Workload(float(total), tuple(kernels), str(description), users), node


def _last_end(k: KernelWork) -> float:
    t = k.first_start
    for s in k.sessions:
        t = max(t, s.start)
        for c in s.cells:
            t += c.gap + c.duration
    return t


def _from_json(r: _Reader) -> tuple[list[KernelWork], dict[str, Any], dict[str, Any]]:
    try:
        doc = _load_located(r.text)
    except json.JSONDecodeError as e:
        raise TraceError(r.path, e.lineno, None, f"not JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(doc, dict):
        raise TraceError(r.path, 1, None, "not a JSON object with \"sessions\"")
    sessions = doc.get("sessions")
    if not isinstance(sessions, list):
        raise r.fail(doc, "sessions", "missing (a list of sessions is required)")
    meta: dict[str, Any] = {"description": doc.get("description")}
    if doc.get("duration") is not None:
        meta["duration"] = r.number(doc, "duration")
    node = doc.get("node") or {}
    if not isinstance(node, dict):
        raise r.fail(doc, "node", "not an object like {\"gpus\": 8, \"gpu_gib\": 80}")
    if "gpus" in node:
        r.integer(node, "gpus")
    if "gpu_gib" in node:
        r.number(node, "gpu_gib")
    kernels, seen = [], set()
    for s in sessions:
        if not isinstance(s, dict):
            raise r.fail(doc, "sessions", f"an entry is not an object: {s!r}")
        sid, user = r.text_field(s, "id"), r.text_field(s, "user")
        if sid in seen:
            raise r.fail(s, "id", f"session {sid!r} appears twice")
        seen.add(sid)
        start = r.number(s, "start")
        stop = r.number(s, "stop", optional=True)
        gpus = r.integer(s, "gpus", optional=True)
        assert start is not None
        if stop is not None and stop < start:
            raise r.fail(s, "stop", f"{stop:g} is before its start {start:g}")
        cells = s.get("cells")
        if not isinstance(cells, list) or not cells:
            raise r.fail(s, "cells", "missing (a non-empty list of cells is required)")
        parsed = []
        for c in cells:
            if not isinstance(c, dict):
                raise r.fail(s, "cells", f"an entry is not an object: {c!r}")
            at, cell = r.cell(c, gpus)
            parsed.append((c, at, cell))
        kernels.append(r.session(s, sid, user, start, stop, gpus, parsed))
    return kernels, dict(node), meta


def _from_csv(r: _Reader) -> list[KernelWork]:
    lines = r.text.splitlines()
    rows = csv.DictReader(lines)
    header = rows.fieldnames or []
    missing = [c for c in CSV_COLUMNS if c not in header]
    if missing:
        raise TraceError(r.path, 1, missing[0], f"missing column (the header needs "
                                                f"{', '.join(CSV_COLUMNS)})")
    unknown = [c for c in header if c not in CSV_COLUMNS + CSV_OPTIONAL]
    if unknown:
        raise TraceError(r.path, 1, unknown[0], "unknown column")
    order: list[str] = []
    sessions: dict[str, dict[str, Any]] = {}
    for row in rows:
        line = rows.line_num
        obj = _dict_with_line(row, line)
        if None in row:
            raise TraceError(r.path, line, None, "more values than columns")
        sid, user = r.text_field(obj, "session"), r.text_field(obj, "user")
        start = r.number(obj, "session_start")
        stop = r.number(obj, "session_stop", optional=True)
        s = sessions.get(sid)
        if s is None:
            s = sessions[sid] = {"user": user, "start": start, "stop": stop, "row": obj, "cells": []}
            order.append(sid)
            if stop is not None and start is not None and stop < start:
                raise r.fail(obj, "session_stop", f"{stop:g} is before session_start {start:g}")
        else:
            for field, value in (("user", user), ("session_start", start), ("session_stop", stop)):
                key = {"session_start": "start", "session_stop": "stop"}.get(field, field)
                if value != s[key]:
                    raise r.fail(obj, field, f"{value!r} differs from session {sid!r}'s first "
                                             f"row (line {s['row'].line}): {s[key]!r}")
        at, cell = r.cell(obj, None)
        s["cells"].append((obj, at, cell))
    kernels = []
    for sid in order:
        s = sessions[sid]
        stop_obj = _dict_with_line({}, s["row"].line)
        try:
            kernels.append(r.session(s["row"], sid, s["user"], s["start"], s["stop"], None,
                                     s["cells"]))
        except TraceError as e:
            if e.field == "stop":  # the CSV's name for it
                raise r.fail(stop_obj, "session_stop", str(e).split("'stop': ", 1)[1]) from None
            raise
    return kernels
