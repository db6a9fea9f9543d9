"""The GPU proof, in stages sized to a 15-minute device lease: each stage one command.

    bash benchmarks/gpu/prove.sh --stage 1|2|3 [--out DIR] [--scenes A,B] [--simulated] [--jobs N]
    python benchmarks/gpu/prove.py --summary DIR1/stage1.jsonl DIR2/stage2.jsonl --out DIR

Stage 1 (it stops itself at 280 s, so 5 minutes with the wheelhouse's install): what matters
most. A real server (backend=nvml) and a PyTorch kernel holding a model with Adam state
(4 GiB): NVML attributes it within two polls;
the driver method releases it (NVML shows it freed) and the next cell restores it through the
gate, checksums equal; the framework method on the same kernel: bitwise equal, id()s kept, an
optimizer step after the round trip equals one without; a DELETE of the restored kernel
returns; both methods' GB/s at 64 MiB, 1 and 8 GiB against pinned copies, the fixed overhead;
then, with what is left of the 280 s, ``pytest -m gpu tests/gpu`` (gpu_tests.py: one check a
test, the framework method's tests first).

Stage 2 (about 5 minutes, 7 at most): JAX (75 % preallocated) and CuPy through the driver method; a
restore without room waits instead of calling the driver; lazy mode; auto's pick per kernel;
restore onto another GPU (skipped, with the reason, on one GPU); the device fingerprint that
trusts a kept PyTorch host copy; writes the version counters miss (.data, DLPack) after a kept
copy or a pre-copy come back; incremental releases per check (benchmarks/incremental_release.py
on the GPU); 16 and 40 GiB bandwidth.

Stage 3 (5 minutes at most), when device time is left: SM utilization per kernel, a release
while a GPU kernel runs, ``pytest -m gpu tests/gpu`` with its whole timeout.

Each scene runs in its own process, time-boxed; each step in it has its own timeout and the
scene goes on after a failure. Every step's result is a JSON line in ``stageN.jsonl`` under
``--out`` (default: $OUT, else /tmp/gpushare-proof) the moment it ends, and ``stageN.md`` is
rendered again beside it, so a stage cut off still returns what finished. Without a GPU it
says so and exits 0 at once; ``--simulated`` rehearses both stages on the simulated backend
(tests/test_gpu_proof.py). Exit status: 0 when no step failed or timed out, else 1.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import ctypes
import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: _server
sys.path.insert(0, str(HERE))  # cells, report, runner, scenes, bandwidth

import report  # noqa: E402  (the standard library only)

#: scenes of each stage, in order: what matters most first
STAGES = {
    # the gpu-marked tests last: a cut-off costs the tests the other scenes already prove
    "1": ["env", "torch", "bandwidth", "pytest"],
    "2": ["env", "frameworks", "caps", "lazy", "auto", "migrate", "bandwidth_large"],
    "3": ["env", "busy", "pytest"],  # when device time is left (pytest with its whole timeout)
}
#: seconds a stage may take on a GPU (the device command's timeout_s leaves the wheelhouse's
#: install and a margin on top: README.md)
DEADLINE = {"1": 280.0, "2": 400.0, "3": 300.0}
#: seconds beyond its steps' timeouts a scene's process may take (its start, server stop)
SCENE_SLACK = 25.0
#: the rehearsal's timeouts and deadlines are this many times the GPU's: a CI machine with two
#: loaded cores starts servers and kernels slower than the GPU machine's 16 cores
SIM_SCALE = 3.0


def scene_table() -> dict[str, tuple[dict[str, tuple[str, float]], Callable[[Any], Coroutine[Any, Any, Any]]]]:
    """Scene name -> (its steps: name -> (title, timeout_s), its body)."""
    import bandwidth
    import gpu_tests
    import scenes

    return {
        "env": (scenes.ENV_STEPS, scenes.env_scene),
        "torch": (scenes.TORCH_STEPS, scenes.torch_scene),
        "bandwidth": (bandwidth.BANDWIDTH_STEPS, bandwidth.bandwidth_scene),
        "frameworks": (scenes.FRAMEWORKS_STEPS, scenes.frameworks_scene),
        "caps": (scenes.CAPS_STEPS, scenes.caps_scene),
        "lazy": (scenes.LAZY_STEPS, scenes.lazy_scene),
        "auto": (scenes.AUTO_STEPS, scenes.auto_scene),
        "migrate": (scenes.MIGRATE_STEPS, scenes.migrate_scene),
        "bandwidth_large": (bandwidth.BANDWIDTH_LARGE_STEPS, bandwidth.bandwidth_large_scene),
        "busy": (scenes.BUSY_STEPS, scenes.busy_scene),
        "pytest": (gpu_tests.PYTEST_STEPS, gpu_tests.pytest_scene),
    }


def source_hash() -> str:
    """A hash of the package's Python sources (the wheelhouse records the one it was built from)."""
    h = hashlib.sha256()
    for p in sorted((REPO / "jupyter_gpushare").rglob("*.py")):
        if "labextension" in p.parts:
            continue
        h.update(str(p.relative_to(REPO)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def find_gpu() -> tuple[int, str]:
    """(number of GPUs, what was found) through NVML's C library, importing nothing else: the
    no-GPU answer must come at once, also where the Jupyter packages are missing."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as e:
        return 0, f"no NVIDIA driver library ({e})"
    try:
        rc = lib.nvmlInit_v2()
        if rc != 0:
            return 0, f"NVML did not start (nvmlInit_v2 returned {rc})"
        count = ctypes.c_uint(0)
        rc = lib.nvmlDeviceGetCount_v2(ctypes.byref(count))
        version = ctypes.create_string_buffer(96)
        lib.nvmlSystemGetDriverVersion(version, 96)
        lib.nvmlShutdown()
    except AttributeError as e:
        return 0, f"NVML lacks a call ({e})"
    if rc != 0 or count.value == 0:
        return 0, "NVML works but lists no GPU"
    return count.value, f"{count.value} GPU(s), driver {version.value.decode(errors='replace')}"


# -- the parent: a stage's scenes, one after another, each in a time-boxed process ------------
def plan_of(stage: str, names: list[str]) -> list[dict[str, Any]]:
    table = scene_table()
    return [{"scene": s, "step": step, "title": title, "timeout_s": t}
            for s in names for step, (title, t) in table[s][0].items()]


def run_scene(name: str, stage: str, mode: str, out: Path, box: float, work: Path) -> None:
    """One scene in its own process; stopped (its servers and kernels killed) when its box
    runs out, the step it was in recorded as a timeout."""
    state = work / f"{name}.state.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--scene", name, "--stage", stage,
           "--mode", mode, "--out", str(out), "--state", str(state), "--seconds", f"{box:.1f}",
           "--scale", str(SIM_SCALE if mode == "simulated" else 1.0)]
    proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True)
    stopped = False
    try:
        proc.wait(timeout=box + 5)
    except subprocess.TimeoutExpired:
        stopped = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # the scene records the step it was in
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    try:
        st = json.loads(state.read_text())
    except (OSError, ValueError):
        st = {}
    _kill(st.get("pids", []))
    record_unfinished(out / f"stage{stage}.jsonl", name, st, stopped, proc.returncode, box)


def record_unfinished(jsonl: Path, name: str, state: dict[str, Any], stopped: bool,
                      returncode: int | None, box: float) -> None:
    """The step a scene's process was in when it was stopped (or died), where the process
    could not record it itself."""
    current = state.get("current")
    if not current or any(r.get("kind") == "step" and r["scene"] == name and r["step"] == current
                          for r in report.read(jsonl)):
        return
    title, timeout_s = scene_table()[name][0][current]
    report.append(jsonl, {
        "kind": "step", "scene": name, "step": current, "title": title,
        "status": "timeout" if stopped else "failed",
        "reason": (f"the scene's process was stopped (time box {box:.0f} s)" if stopped else
                   f"the scene's process died during this step (exit {returncode})"),
        "seconds": round(time.time() - state.get("started", 0), 1),
        "timeout_s": timeout_s, "at": report.now_iso(), "checks": [], "figures": {}})


def _kill(pids: list[list[float]]) -> None:
    """Kill what a stopped scene left (pid + start time, so a reused pid is spared)."""
    try:
        import psutil
    except ImportError:
        return
    procs = []
    for pid, created in pids:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(int(pid))
            if abs(p.create_time() - created) <= 1:
                procs += [*p.children(recursive=True), p]
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    with contextlib.suppress(Exception):
        psutil.wait_procs(procs, timeout=10)


def run_stage(stage: str, names: list[str], mode: str, why: str, out: Path, jobs: int,
              deadline: float) -> dict[str, int]:
    jsonl = out / f"stage{stage}.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    jsonl.unlink(missing_ok=True)  # a fresh record per run
    t_start = time.monotonic()
    report.append(jsonl, {"kind": "run", "schema": report.SCHEMA, "stage": stage, "mode": mode,
                          "started": report.now_iso(), "why": why, "deadline_s": deadline,
                          "host": platform.node(), "scenes": names})
    report.append(jsonl, {"kind": "plan", "steps": plan_of(stage, names)})
    if mode != "no-gpu":
        table = scene_table()
        work = Path(tempfile.mkdtemp(prefix="gpushare-proof-"))

        def one(name: str) -> None:
            left = deadline - (time.monotonic() - t_start)
            scale = SIM_SCALE if mode == "simulated" else 1.0
            box = min((sum(t for _, t in table[name][0].values()) + SCENE_SLACK) * scale, left)
            if box < 10:
                print(f"== {name}: not run, {left:.0f} s left of the stage's {deadline:.0f} s",
                      flush=True)
                return
            print(f"== scene {name} (time box {box:.0f} s)", flush=True)
            run_scene(name, stage, mode, out, box, work)

        if jobs > 1:  # the rehearsal only: on a GPU scenes run one at a time (timings, memory)
            with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
                list(pool.map(one, names))
        else:
            for name in names:
                one(name)
    records = report.read(jsonl)
    s = report.summary(records)
    report.append(jsonl, {"kind": "end", "seconds": round(time.monotonic() - t_start, 1),
                          "summary": s})
    errs = report.validate(report.read(jsonl))
    if errs:
        print("report shape errors: " + "; ".join(errs), flush=True)
        s["shape_errors"] = len(errs)
    return s


def main(argv: list[str] | None = None) -> int:
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=doc.split("\n\n", 1)[1])
    ap.add_argument("--stage", choices=sorted(STAGES), default="1",
                    help="the stage to run (default 1)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(tempfile.gettempdir(),
                                                                           "gpushare-proof"),
                    help="where stageN.jsonl and stageN.md go (default: $OUT, else "
                         "/tmp/gpushare-proof)")
    ap.add_argument("--scenes", help="only these scenes of the stage (comma-separated)")
    ap.add_argument("--simulated", action="store_true",
                    help="rehearse on the simulated backend (no GPU needed)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="with --simulated: scenes side by side (default 1)")
    ap.add_argument("--deadline", type=float, help="seconds for the stage (default: the stage's)")
    ap.add_argument("--summary", nargs="+", metavar="JSONL",
                    help="one Markdown summary (gpu-proof.md under --out) of stages' JSON lines")
    ap.add_argument("--scene", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--state", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--scale", type=float, default=1.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = Path(args.out)

    if args.scene:  # a scene's own process
        from runner import Scene
        from runner import run_scene as run_in_process

        steps, body = scene_table()[args.scene]
        sc = Scene(args.scene, args.mode, out / f"stage{args.stage}.jsonl", Path(args.state),
                   args.seconds, steps, args.scale)
        return run_in_process(sc, body)
    if args.summary:
        md = report.summarize([Path(f) for f in args.summary], out)
        print(f"summary: {md}")
        return 0
    names = STAGES[args.stage]
    if args.scenes:
        wanted = [s.strip() for s in args.scenes.split(",") if s.strip()]
        bad = [s for s in wanted if s not in names]
        if bad:
            ap.error(f"not scenes of stage {args.stage}: {', '.join(bad)} (it has {', '.join(names)})")
        names = [s for s in names if s in wanted]
    if args.simulated:
        mode, why = "simulated", "rehearsal on the simulated backend"
    else:
        count, why = find_gpu()
        mode = "gpu" if count else "no-gpu"
    deadline = args.deadline or DEADLINE[args.stage] * (SIM_SCALE if args.simulated else 1.0)
    print(f"gpushare GPU proof, stage {args.stage}: mode {mode} ({why}); scenes "
          f"{', '.join(names)}; out {out}", flush=True)
    if mode == "no-gpu":
        run_stage(args.stage, names, mode, why, out, 1, deadline)
        print(f"no GPU found ({why}): nothing to prove here; wrote {out}/stage{args.stage}.md")
        return 0
    s = run_stage(args.stage, names, mode, why, out, args.jobs if args.simulated else 1, deadline)
    print(f"stage {args.stage}: {s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped, "
          f"{s['timeout']} timed out, {s['not_run']} not run; {s['checks_failed']} check(s) "
          f"failed; report {out}/stage{args.stage}.md")
    return 1 if s["failed"] or s["timeout"] or s.get("shape_errors") else 0


if __name__ == "__main__":
    sys.exit(main())
