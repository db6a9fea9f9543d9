"""Every benchmark's whole path in seconds, so none of them rots: each script of benchmarks/
run with ``--smoke`` (tiny sizes, one round, no figures worth reading), its time and outcome
printed, and a total. CI runs it (.ci/run, "benchmarks (smoke)").

Every ``*.py`` and ``*.mjs`` in this folder is run (but this runner and the helper
``_server.py``), so a new benchmark is in the smoke run from its first commit and needs a
``--smoke`` mode; the GPU proof (``gpu/prove.sh``) runs its no-GPU path. The panel benchmark
needs Node.js, the browser tests' npm packages and Chromium: where they are missing it is
reported as skipped, with why. Exit status 1 when any failed.

    python benchmarks/smoke.py [--jobs 2] [--timeout 300] [NAME ...]

``--jobs``: scripts run at once (default 2: most of a smoke run is waiting for servers and
kernels to start). CPU is the seconds the script and the processes it waited for used
(``os.wait4``), which a busy machine does not inflate as much as the wall time.

The scripts' Python processes do not load ``rfc3987_syntax``: where it is installed
(jsonschema's ``format-nongpl`` extra, which jupyter-events asks for), importing jsonschema
builds some 25 Earley parsers: 4-5 s of CPU in each of the 30-odd processes that import it
(the scripts, and the jupyter servers, Hubs and services they start), a quarter of the
run's CPU. It only checks the ``iri`` string format, which no schema here uses; jsonschema
leaves that check out when the module cannot be imported. The slowest scripts start first,
so none of them is left running alone at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PLAYWRIGHT = ROOT / "tests" / "ui-tests" / "node_modules" / "@playwright" / "test"
# started first (the longest, by the smoke run's own times); the others follow by name
SLOW_FIRST = ("hub_room_latency", "gate_latency", "idle_cpu", "agent_cell_overhead")
NO_IRI_CHECK = 'raise ImportError("not loaded in the benchmark smoke run (see smoke.py)")\n'


@dataclass
class Result:
    name: str
    outcome: str  # "passed", "FAILED (exit N)", "FAILED (timed out)", "skipped: why"
    wall: float = 0.0
    cpu: float = 0.0
    output: str = ""


def commands(out: Path) -> dict[str, list[str]]:
    """Each benchmark's smoke command, by name."""
    found = {}
    for path in sorted(HERE.glob("*.py")):
        if path.name not in ("smoke.py", "_server.py"):
            found[path.stem] = [sys.executable, str(path), "--smoke"]
    for path in sorted(HERE.glob("*.mjs")):
        found[path.stem] = ["node", str(path), "--smoke"]
    found["gpu/prove.sh"] = ["bash", str(HERE / "gpu" / "prove.sh"), "--stage", "1",
                             "--out", str(out / "gpu-proof")]
    return found


def missing(cmd: list[str]) -> str | None:
    """Why a command cannot run here, or None."""
    if cmd[0] == "node":
        if shutil.which("node") is None:
            return "no Node.js"
        if not PLAYWRIGHT.exists():
            return "no @playwright/test (jlpm install in tests/ui-tests)"
        if not Path(os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")).exists():
            return "no Chromium"
    return None


def stop(pid: int, timed_out: threading.Event) -> None:
    """A script past its time: Ctrl-C first (its ``finally`` stops the servers, hubs and
    kernels it started, some in sessions of their own), then, a minute on, its session."""
    timed_out.set()
    try:
        os.kill(pid, signal.SIGINT)
        for _ in range(600):
            time.sleep(0.1)
            os.kill(pid, 0)
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run(name: str, cmd: list[str], timeout: float, site: Path) -> Result:
    why = missing(cmd)
    if why:
        return Result(name, f"skipped: {why}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(site), str(ROOT), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryFile() as log:
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        timed_out = threading.Event()
        timer = threading.Timer(timeout, stop, (proc.pid, timed_out))
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - start
        try:  # anything the script left behind in its session
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.seek(0)
        output = log.read().decode(errors="replace")
    code = proc.returncode
    outcome = ("FAILED (timed out)" if timed_out.is_set() else "passed" if code == 0
               else f"FAILED (exit {code})")
    return Result(name, outcome, wall, usage.ru_utime + usage.ru_stime, output)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="only these benchmarks (default: all)")
    ap.add_argument("--jobs", type=int, default=2, help="scripts run at once (default 2)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per script (default 300)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpushare-smoke-") as tmp:
        todo = commands(Path(tmp))
        unknown = set(args.names) - set(todo)
        if unknown:
            ap.error(f"no benchmark {', '.join(sorted(unknown))} (there are: {', '.join(todo)})")
        names = args.names or list(todo)
        names.sort(key=lambda n: (n not in SLOW_FIRST, SLOW_FIRST.index(n) if n in SLOW_FIRST else 0))
        site = Path(tmp) / "site"
        site.mkdir()
        (site / "rfc3987_syntax.py").write_text(NO_IRI_CHECK, encoding="utf-8")
        start = time.monotonic()
        results: list[Result] = []
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            for result in pool.map(lambda n: run(n, todo[n], args.timeout, site), names):
                results.append(result)
                print(f"{result.name:<28} {result.wall:6.1f} s  {result.cpu:6.1f} s CPU  "
                      f"{result.outcome}", flush=True)
        total = time.monotonic() - start
    failed = [r for r in results if r.outcome.startswith("FAILED")]
    for r in failed:
        print(f"\n== {r.name}: {r.outcome}; its last output:\n{r.output[-4000:]}")
    skipped = sum(r.outcome.startswith("skipped") for r in results)
    print(f"\nbenchmarks (smoke): {len(results) - len(failed) - skipped} passed, {len(failed)} "
          f"failed, {skipped} skipped in {total:.0f} s ({sum(r.cpu for r in results):.0f} s CPU, "
          f"{args.jobs} at a time)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
