"""The ``pytest`` scene: the repository's own gpu-marked tests (tests/gpu) on the GPU, each
test's outcome a check of the step, recorded as the test ends.

On the first run on a GPU the PyTorch framework method moved nothing, and
tests/gpu/test_offload_cuda.py asserted what would have caught it; the proof never ran them.
Stage 1 runs this scene last, so that its time box is what the other scenes left, and the
files run in the order of what a cut-off would cost (``ORDER``): the framework method's device
paths first, what the other scenes of stage 1 already prove last. Stage 3 runs it again with
its whole timeout. Each test has its own timeout (pytest-timeout markers in tests/gpu), so
one hang costs that test, not the stage; a run stopped by the step's timeout (or a hang
pytest-timeout cannot interrupt) still says which tests ended how, and which one it was in.

On the simulated backend the command only collects the tests (an import error in tests/gpu
fails the rehearsal, as it would fail the GPU run) and the step is skipped, saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from runner import Scene, Skip, Step

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
TESTS = REPO / "tests" / "gpu"
PLUGIN_DIR = HERE / "plugin"  # gpushare_record.py: one JSON line per test as it ends

PYTEST_STEPS = {
    "gpu_tests": ("pytest -m gpu tests/gpu, one check a test: the framework method's device "
                  "paths, honest releases, a real server with backend=nvml, the driver method, "
                  "NVML", 240.0),
}

#: tests/gpu's files in the order they run: the framework method on the device first (what
#: moved nothing on the first run), then the releases fixed after it; what stage 1's other
#: scenes already show (the driver method, NVML attribution) last. Files not named run after.
ORDER = ("test_offload_repoint_gpu.py", "test_offload_cuda.py", "test_release_honest_gpu.py",
         "test_offload_fast_gpu.py", "test_server_gpu.py", "test_driver_gpu.py",
         "test_nvml_gpu.py")
#: seconds for a test without its own timeout marker (pytest-timeout's --timeout)
DEFAULT_TEST_TIMEOUT = 90
#: seconds kept after the tests' run for reading its record and ending the step
MARGIN = 5.0
#: outcomes that fail the step (pytest's "failed" and "error", and a test the run was stopped in)
BAD = ("failed", "error", "stopped")


def test_files(folder: Path = TESTS) -> list[str]:
    """The test files, relative to the repository, in the order they run."""
    present = sorted(p.name for p in folder.glob("test_*.py"))
    ordered = [n for n in ORDER if n in present] + [n for n in present if n not in ORDER]
    paths = [folder / n for n in ordered]
    return [str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p) for p in paths]


def command(files: list[str], *, collect_only: bool = False, timeout: bool = True) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", *files, "-p", "no:randomly",
           "-p", "no:cacheprovider", "-p", "gpushare_record",
           "-o", "addopts=",  # the project's addopts deselect the gpu marker
           "-rs"]
    if timeout:
        cmd += ["--timeout", str(DEFAULT_TEST_TIMEOUT)]
    if collect_only:
        cmd.append("--collect-only")
    return cmd


def environment(record: Path) -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "GPUSHARE_TEST_RECORD": str(record), "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(PLUGIN_DIR), path) if p),
            # JAX in the tests' own process (test_offload_cuda.py) takes what it uses, not 75 %
            # of the GPU for the rest of the run: later tests' kernels need the room (a kernel
            # that wants JAX's pool says so itself: test_release_honest_gpu.py)
            "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def short(nodeid: str) -> str:
    return nodeid.removeprefix("tests/gpu/")


class Results:
    """What the plugin's record says so far: read again as it grows."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.collected: list[str] | None = None
        self.running: str | None = None
        self.ended: list[dict[str, Any]] = []

    def read_new(self) -> list[dict[str, Any]]:
        """Tests that ended since the last call."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        done, sep, _ = data.rpartition(b"\n")  # a line still being written waits for the next call
        self.offset += len(done) + len(sep)
        new = []
        for line in done.decode(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if rec.get("event") == "collected":
                    self.collected = list(rec["tests"])
                elif rec.get("event") == "start":
                    self.running = rec["test"]
                elif rec.get("event") == "end":
                    self.running = None
                    new.append(rec)
        self.ended += new
        return new

    def not_reached(self) -> list[str]:
        seen = {t["test"] for t in self.ended} | {self.running}
        return [t for t in self.collected or [] if t not in seen]


def check_test(st: Step, t: dict[str, Any]) -> None:
    """One test's outcome as a check: passed ok, skipped n.a. with the reason, else failed."""
    outcome, secs = t["outcome"], t.get("seconds")
    detail = outcome + (f" in {secs:.1f} s" if isinstance(secs, (int, float)) else "")
    if t.get("reason"):
        detail += f": {t['reason']}"
    st.check(short(t["test"]), {"passed": True, "skipped": None}.get(outcome, False), detail)
    if outcome in BAD:
        st.figures.setdefault("test_failures", []).append(
            {"test": short(t["test"]), "outcome": outcome, "tail": t.get("tail", "")})


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """The run and what it started (its servers' kernels)."""
    try:
        import psutil

        procs = [*psutil.Process(proc.pid).children(recursive=True)]
    except Exception:
        procs = []
    for p in procs:
        with contextlib.suppress(Exception):
            p.kill()
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    proc.wait()


def _children(pid: int) -> list[int]:
    try:
        import psutil

        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except Exception:
        return []


async def run_tests(st: Step, *, collect_only: bool = False, folder: Path = TESTS) -> Results:
    """Run the tests' command within the step's time, a check for each test as it ends. The
    run's log tail is the figure ``log_tail`` when it did not pass."""
    sc: Scene = st.scene
    work = Path(tempfile.mkdtemp(prefix="gpushare-gpu-tests-"))
    res = Results(work / "tests.jsonl")
    timeout = importlib_ok("pytest_timeout")
    if not timeout:
        st.check("per-test timeouts (pytest-timeout)", None,
                 "pytest-timeout is not installed: only the step's timeout holds")
    files = test_files(folder)
    st.figure("files", [Path(f).name for f in files])
    log = work / "pytest.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(command(files, collect_only=collect_only, timeout=timeout),
                                cwd=REPO, env=environment(res.path), stdout=out,
                                stderr=subprocess.STDOUT)
    sc.note_pids([proc.pid])
    stopped = False
    known: set[int] = set()
    while proc.poll() is None:
        if st.left() < MARGIN:
            stopped = True
            _kill_tree(proc)
            break
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(proc.wait, 0.5)
        kids = set(_children(proc.pid)) - known  # so a stopped scene's kill reaches them too
        if kids:
            known |= kids
            sc.note_pids(sorted(kids))
        for t in res.read_new():
            check_test(st, t)
    for t in res.read_new():
        check_test(st, t)
    code = proc.returncode
    text = log.read_text(errors="replace")
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    summary = next((ln for ln in reversed(lines) if " in " in ln and any(
        w in ln for w in ("passed", "failed", "skipped", "error", "selected", "collected"))),
        lines[-1] if lines else "")
    st.figure("summary", summary.strip("= "))
    st.figure("exit", code)
    st.figure("tests", [{k: t.get(k) for k in ("test", "outcome", "seconds", "reason")}
                        for t in res.ended])
    if res.running:
        check_test(st, {"test": res.running, "outcome": "stopped",
                        "reason": ("the step's time ran out in this test" if stopped else
                                   f"the tests' process died in this test (exit {code})"),
                        "tail": "\n".join(lines[-25:])})
    why = "the step's time ran out" if stopped else f"the run ended before it (exit {code})"
    for nodeid in [] if collect_only else res.not_reached():
        st.check(short(nodeid), None, f"not reached: {why}")
    if stopped or code != 0:
        st.figure("log_tail", "\n".join(lines[-60:]))
    if not stopped and not res.running and (code not in (0, 1) or res.collected is None):
        # beyond tests that failed: a collection error, pytest's own error, nothing collected
        st.check("pytest ran the gpu-marked tests", False, f"exit {code}: {summary.strip('= ')}")
    if stopped:
        raise asyncio.TimeoutError(
            f"the step's time ran out after {len(res.ended)} of {len(res.collected or [])} tests"
            f"{f' (in {short(res.running)})' if res.running else ''}")
    return res


def importlib_ok(mod: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        return False


async def pytest_scene(sc: Scene) -> None:
    await sc.step("gpu_tests", gpu_tests)


async def gpu_tests(st: Step) -> None:
    if not importlib_ok("pytest_jupyter"):
        raise Skip("pytest-jupyter is not installed (the wheelhouse carries it)")
    if not st.real:  # the same command, collecting only: tests/gpu imports and is found
        res = await run_tests(st, collect_only=True)
        n = len(res.collected or [])
        if any(c["ok"] is False for c in st.checks):
            return  # the step fails: what would fail on the GPU too
        st.figure("collected", [short(t) for t in res.collected or []])
        raise Skip(f"the gpu-marked tests need a real GPU (NVML, CUDA); here the same command "
                   f"collected {n} tests, in the order a GPU run takes them")
    await run_tests(st)
