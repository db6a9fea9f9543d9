"""The GPU proof's record: JSON lines written as each step ends, and a Markdown summary
rendered from them. Standard library only, so a machine without the Jupyter packages (or
without a GPU) still writes a report.

A stage's file ``stageN.jsonl`` holds one JSON object a line, each with ``kind``:

- ``run``: ``schema``, ``stage``, ``mode`` (gpu / simulated / no-gpu), ``started``, ``why``,
  ``deadline_s``, ``host``;
- ``plan``: ``steps``, each ``{scene, step, title, timeout_s}``: what the stage means to run,
  so a stage cut off by the device's limit shows what it did not reach;
- ``step``: ``scene``, ``step``, ``title``, ``status`` (passed / failed / skipped / timeout),
  ``reason``, ``seconds``, ``timeout_s``, ``at``, ``checks`` [{name, ok: true / false / null =
  not applicable, detail}], ``figures``;
- ``end``: ``seconds``, ``summary`` (a count per status, and ``not_run``).

``stageN.md`` says the same for people: the sections in ``SECTIONS``, always all of them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

SCHEMA = "jupyter-gpushare/gpu-proof/2"
MODES = ("gpu", "simulated", "no-gpu")
STATUSES = ("passed", "failed", "skipped", "timeout")
KINDS = ("run", "plan", "step", "end")
#: the Markdown summary's sections, in order (each is always there)
SECTIONS = ("Machine", "Steps", "Goals", "Bandwidth", "Failures", "Not run", "Doctor")
#: the versions the summary names (distribution names)
VERSIONS = ("python", "torch", "jax", "jaxlib", "cupy-cuda13x", "cuda-core", "cuda-bindings",
            "nvidia-ml-py", "nvidia-cuda-runtime", "jupyter_server", "ipykernel", "jupyter-gpushare",
            "pytest", "pytest-timeout", "pytest-jupyter")
STEP_FIELDS = ("scene", "step", "title", "status", "reason", "seconds", "timeout_s", "at",
               "checks", "figures")
MiB, GiB = 1 << 20, 1 << 30


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "?"
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.0f} MiB"


# -- writing ----------------------------------------------------------------------------------
def append(path: Path, record: dict[str, Any]) -> None:
    """Add one line to ``path`` and render the Markdown beside it, at once (a run cut off
    still leaves both). One writer at a time (the rehearsal runs scenes side by side)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, default=str) + "\n"
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
            render_file(path)
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON lines file; a line cut off half-way is left out."""
    out = []
    for ln in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(ln))
    return out


def render_file(path: Path) -> Path:
    md = path.with_suffix(".md")
    tmp = md.with_suffix(".md.tmp")
    tmp.write_text(markdown(read(path)))
    tmp.replace(md)
    return md


# -- reading a stage's records ----------------------------------------------------------------
def steps_of(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The step records, the last one per (scene, step) (a scene's process and its parent
    may both report a step stopped by the time box)."""
    seen: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        if r.get("kind") == "step":
            key = (r["scene"], r["step"])
            if key not in seen or seen[key]["status"] != "timeout" or r["status"] == "timeout":
                seen[key] = r
    order = {(p["scene"], p["step"]): i for i, p in enumerate(
        p for r in records if r.get("kind") == "plan" for p in r["steps"])}
    return sorted(seen.values(), key=lambda r: order.get((r["scene"], r["step"]), len(order)))


def not_run(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    done = {(s["scene"], s["step"]) for s in steps_of(records)}
    return [p for r in records if r.get("kind") == "plan" for p in r["steps"]
            if (p["scene"], p["step"]) not in done]


def summary(records: list[dict[str, Any]]) -> dict[str, int]:
    steps = steps_of(records)
    out = {s: sum(1 for r in steps if r["status"] == s) for s in STATUSES}
    out["not_run"] = len(not_run(records))
    out["checks_failed"] = sum(1 for r in steps for c in r["checks"] if c["ok"] is False)
    return out


def figures(records: list[dict[str, Any]], scene: str, step: str) -> dict[str, Any]:
    for r in steps_of(records):
        if r["scene"] == scene and r["step"] == step:
            return r["figures"]
    return {}


def machine(records: list[dict[str, Any]]) -> dict[str, Any]:
    """What the env step found (the first one, when several stages are summarized)."""
    for r in steps_of(records):
        if r["scene"] == "env" and r["figures"].get("machine"):
            return r["figures"]["machine"]
    return {}


def bandwidth_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [row for r in steps_of(records) for row in r["figures"].get("bandwidth_rows", [])]


def fit(points: list[tuple[float, float]]) -> dict[str, float | None]:
    """seconds = overhead + bytes / bandwidth, least squares; GB/s = 1e9 bytes/s."""
    if len(points) < 2:
        return {"overhead_s": None, "GBps": None}
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return {"overhead_s": None, "GBps": None}
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return {"overhead_s": my - slope * mx, "GBps": (1 / slope / 1e9) if slope > 0 else None}


def fits(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per method, and for the pinned copies measured beside it, the fit per direction."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for method in sorted({r["method"] for r in rows}):
        mine = [r for r in rows if r["method"] == method]
        out[method] = {"release": fit([(r["bytes"], r["release_s"]) for r in mine]),
                       "restore": fit([(r["bytes"], r["restore_s"]) for r in mine])}
    seen: dict[int, dict[str, Any]] = {}
    for r in rows:
        seen.setdefault(r["bytes"], r)
    base = list(seen.values())
    if base:
        out["pinned copy"] = {"release": fit([(r["bytes"], r["d2h_pinned_s"]) for r in base]),
                              "restore": fit([(r["bytes"], r["h2d_pinned_s"]) for r in base])}
    return out


def overhead_measured(rows: list[dict[str, Any]], method: str) -> bool:
    """Whether the fit's intercept is a fixed overhead: only with a size of 1 GiB or less
    among its points (from 16 and 40 GiB alone it is an extrapolation, negative on an H200)."""
    sizes = [r["bytes"] for r in rows if method == "pinned copy" or r["method"] == method]
    return bool(sizes) and min(sizes) <= GiB


def goals(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's goals, where the records have the figures."""
    out: list[dict[str, Any]] = []
    rows = bandwidth_rows(records)
    for r in rows:
        if r["bytes"] >= GiB:
            for d in ("release", "restore"):
                out.append({"goal": f"{r['method']} {d} {fmt_bytes(r['bytes'])} >= 70 % of pinned",
                            "value": round(r[f"{d}_frac"], 3), "met": r[f"{d}_frac"] >= 0.7})
    for method, f in fits(rows).items():
        if method == "pinned copy" or not overhead_measured(rows, method):
            continue
        for d in ("release", "restore"):
            o = f[d]["overhead_s"]
            if o is not None:
                out.append({"goal": f"{method} {d} fixed overhead <= 50 ms",
                            "value": round(o, 4), "met": o <= 0.05})
    for r in steps_of(records):
        for c in r["checks"]:
            if "within two polls" in c["name"]:
                out.append({"goal": c["name"], "value": c["detail"], "met": c["ok"]})
    for r in steps_of(records):  # a release that copies nothing: <= 5 % of a full one
        for row in r["figures"].get("kept_copy_rows", []):
            if row["what"].startswith("unchanged"):
                out.append({"goal": f"{row['backend']}, {row['what']}: release <= 5 % of a "
                                    f"full one", "value": round(row["share_time"], 3),
                            "met": row["share_time"] <= 0.05})
    return out


# -- checking the shape (the CI rehearsal, and every write) -----------------------------------
def validate(records: list[dict[str, Any]]) -> list[str]:
    """What is wrong with a stage's records ([] = nothing)."""
    errs: list[str] = []
    kinds = [r.get("kind") for r in records]
    if not kinds or kinds[0] != "run":
        errs.append("the first record is not kind 'run'")
    for i, r in enumerate(records):
        kind = r.get("kind")
        if kind not in KINDS:
            errs.append(f"line {i + 1}: kind {kind!r}")
        elif kind == "run":
            for k in ("schema", "stage", "mode", "started", "why", "deadline_s", "host"):
                if k not in r:
                    errs.append(f"run: missing {k}")
            if r.get("schema") != SCHEMA:
                errs.append(f"run: schema {r.get('schema')!r}")
            if r.get("mode") not in MODES:
                errs.append(f"run: mode {r.get('mode')!r}")
        elif kind == "plan":
            for p in r.get("steps", []):
                if set(p) != {"scene", "step", "title", "timeout_s"}:
                    errs.append(f"plan: bad step {p}")
        elif kind == "step":
            name = f"{r.get('scene')}.{r.get('step')}"
            missing = [k for k in STEP_FIELDS if k not in r]
            if missing:
                errs.append(f"{name}: missing {', '.join(missing)}")
            if r.get("status") not in STATUSES:
                errs.append(f"{name}: status {r.get('status')!r}")
            if r.get("status") in ("skipped", "timeout", "failed") and not r.get("reason") \
                    and not any(c.get("ok") is False for c in r.get("checks", [])):
                errs.append(f"{name}: {r.get('status')} without a reason")
            for c in r.get("checks", []):
                if set(c) != {"name", "ok", "detail"} or c["ok"] not in (True, False, None):
                    errs.append(f"{name}: bad check {c}")
        elif kind == "end":
            for k in ("seconds", "summary"):
                if k not in r:
                    errs.append(f"end: missing {k}")
    return errs


# -- the Markdown summary ---------------------------------------------------------------------
def _cell(text: Any) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def markdown(records: list[dict[str, Any]]) -> str:
    runs = [r for r in records if r.get("kind") == "run"]
    ends = [r for r in records if r.get("kind") == "end"]
    stages = ", ".join(str(r.get("stage")) for r in runs) or "?"
    mode = runs[0].get("mode") if runs else "?"
    started = runs[0].get("started") if runs else "?"
    lines = [f"# GPU proof, stage {stages} ({mode}): {started}", ""]
    for r in runs:
        lines.append(f"Stage {r.get('stage')}: {r.get('why')}; time box {r.get('deadline_s')} s.")
    if ends:
        lines.append("Ran " + ", ".join(f"{e['seconds']:.0f} s" for e in ends) + ".")
    else:
        lines.append("Still running, or cut off before its end (the lines below are what finished).")
    s = summary(records)
    lines += ["", f"Steps: {s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped, "
              f"{s['timeout']} timed out, {s['not_run']} not run; {s['checks_failed']} check(s) failed."]

    m = machine(records)
    lines += ["", "## Machine", ""]
    if m:
        lines.append(f"- GPUs: {m.get('gpus') or 'none'}")
        lines.append(f"- driver {m.get('driver') or '-'}, CUDA (driver) {m.get('cuda_driver') or '-'}, "
                     f"CUDA (PyTorch build) {m.get('torch_cuda') or '-'}")
        lines.append(f"- host: {m.get('host') or '-'}")
        versions = m.get("versions") or {}
        lines.append("- versions: " + ", ".join(f"{k} {versions.get(k) or '-'}" for k in VERSIONS))
    else:
        lines.append("No environment step recorded.")

    lines += ["", "## Steps", "", "| step | status | s (cap) | checks ok / failed / n.a. | what / why |",
              "|---|---|---|---|---|"]
    for r in steps_of(records):
        cs = r["checks"]
        counts = (f"{sum(c['ok'] is True for c in cs)} / {sum(c['ok'] is False for c in cs)} / "
                  f"{sum(c['ok'] is None for c in cs)}")
        why = r["title"] + (f" -- {r['reason']}" if r.get("reason") else "")
        lines.append(f"| {r['scene']}.{r['step']} | **{r['status']}** | {r['seconds']:.0f} "
                     f"({r['timeout_s']:.0f}) | {counts} | {_cell(why)} |")
    mark = {True: "ok", False: "FAIL", None: "--"}
    for r in steps_of(records):
        if r["checks"]:
            lines += ["", f"{r['scene']}.{r['step']}:"]
            lines += [f"- [{mark[c['ok']]}] {c['name']}" + (f": {c['detail']}" if c["detail"] else "")
                      for c in r["checks"]]

    lines += ["", "## Goals", ""]
    gs = goals(records)
    if gs:
        lines += ["| goal | value | met |", "|---|---|---|"]
        lines += [f"| {_cell(g['goal'])} | {_cell(g['value'])} | {'yes' if g['met'] else 'NO'} |"
                  for g in gs]
    else:
        lines.append("No figures for the goals yet.")

    lines += ["", "## Bandwidth", ""]
    rows = bandwidth_rows(records)
    if rows:
        lines += ["| method | size | release s | restore s | release GB/s (x pinned D2H) | "
                  "restore GB/s (x pinned H2D) | pinned D2H / H2D GB/s | intact |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['method']} | {fmt_bytes(r['bytes'])} | {r['release_s']:.3f} | "
                         f"{r['restore_s']:.3f} | {r['release_GBps']:.2f} ({r['release_frac']:.2f}) | "
                         f"{r['restore_GBps']:.2f} ({r['restore_frac']:.2f}) | "
                         f"{r['pinned_d2h_GBps']:.2f} / {r['pinned_h2d_GBps']:.2f} | "
                         f"{'yes' if r['intact'] else 'NO'} |")
        lines += ["", "Fits (seconds = fixed overhead + bytes / bandwidth):", ""]
        for method, f in fits(rows).items():
            parts = []
            for d in ("release", "restore"):
                o, g = f[d]["overhead_s"], f[d]["GBps"]
                parts.append(f"{d} {'n/a' if o is None else f'{o * 1e3:.0f} ms'} + "
                             f"{'n/a' if g is None else f'{g:.1f} GB/s'}")
            lines.append(f"- {method}: " + "; ".join(parts) + (
                "" if overhead_measured(rows, method) else
                " (no size of 1 GiB or less: the intercept is extrapolated, not a fixed overhead)"))
        cold = [r["figures"]["fresh_process_cuInit_s"] for r in steps_of(records)
                if r["figures"].get("fresh_process_cuInit_s") is not None]
        if cold:
            lines.append(f"- a fresh process's import + cuInit (what each run of the cuda-checkpoint "
                         f"binary pays): {cold[0]:.3f} s")
    else:
        lines.append("No bandwidth measured yet.")

    lines += ["", "## Failures", ""]
    bad = [r for r in steps_of(records) if r["status"] in ("failed", "timeout")]
    for r in bad:
        lines.append(f"### {r['scene']}.{r['step']}: {r['status']}")
        lines.append("")
        if r.get("reason"):
            lines += [_cell(r["reason"]), ""]
        lines += [f"- FAIL {c['name']}: {c['detail']}" for c in r["checks"] if c["ok"] is False]
        if r["figures"].get("stuck_at"):
            lines += ["", "Stopped at: " + "; ".join(r["figures"]["stuck_at"])[:1500]]
        for key in ("traceback", "server_log"):
            if r["figures"].get(key):
                lines += ["", "```", str(r["figures"][key]).strip()[-2000:], "```"]
        for t in r["figures"].get("test_failures") or []:  # the pytest scene: each test's end
            lines += ["", f"`{t.get('test')}`: {t.get('outcome')}", "", "```",
                      str(t.get("tail") or "(no report)").strip()[-2000:], "```"]
        lines.append("")
    if not bad:
        lines.append("None.")

    lines += ["", "## Not run", ""]
    missing = not_run(records)
    lines += [f"- {p['scene']}.{p['step']}: {p['title']}" for p in missing] or ["Nothing: every "
                                                                              "planned step ran."]
    lines += ["", "## Doctor", ""]
    doctors = [r["figures"]["doctor"] for r in steps_of(records) if r["figures"].get("doctor")]
    lines += ["```", doctors[0], "```"] if doctors else ["Not run."]
    return "\n".join(lines) + "\n"


def summarize(files: list[Path], out: Path) -> Path:
    """One Markdown summary of several stages' JSON lines (``prove.py --summary``)."""
    records = [r for f in files for r in read(f)]
    out.mkdir(parents=True, exist_ok=True)
    md = out / "gpu-proof.md"
    md.write_text(markdown(records))
    return md
