"""Steps inside one scene's process: each step has its own timeout, its result is one JSON
line written when it ends, and the scene goes on after a failure.

A scene is a group of steps that share a process (and usually a server and its kernels); its
process is time-boxed by the parent (prove.py). On SIGTERM (the box ran out) the step that was
running is recorded as ``timeout`` with where it was, before the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import report


class Skip(Exception):
    """This step cannot run here; the message says why (a skip is never a failure)."""


class Step:
    """What one step records: checks and figures."""

    def __init__(self, scene: Scene, name: str, title: str, timeout_s: float):
        self.scene = scene
        self.name = name
        self.title = title
        self.timeout_s = timeout_s
        self.checks: list[dict[str, Any]] = []
        self.figures: dict[str, Any] = {}
        self.deadline = time.monotonic() + timeout_s  # set again when the step starts

    @property
    def real(self) -> bool:
        return self.scene.real

    def left(self) -> float:
        """Seconds before this step's timeout."""
        return self.deadline - time.monotonic()

    def check(self, name: str, ok: bool | None, detail: str = "") -> bool | None:
        """ok: True passed, False failed, None = not applicable here (detail says why)."""
        ok = None if ok is None else bool(ok)
        self.checks.append({"name": name, "ok": ok, "detail": detail})
        mark = {True: "ok", False: "FAIL", None: "--"}[ok]
        print(f"  [{mark:>4}] {self.scene.name}.{self.name}: {name}: {detail}", flush=True)
        return ok

    def figure(self, key: str, value: Any) -> None:
        self.figures[key] = value

    def record(self, status: str, reason: str | None, seconds: float) -> dict[str, Any]:
        return {"kind": "step", "scene": self.scene.name, "step": self.name, "title": self.title,
                "status": status, "reason": reason, "seconds": round(seconds, 2),
                "timeout_s": self.timeout_s, "at": report.now_iso(), "checks": self.checks,
                "figures": self.figures}


StepFn = Callable[[Step], Awaitable[Any]]


class Scene:
    """One scene's steps, run in order in this process."""

    def __init__(self, name: str, mode: str, out: Path, state: Path, seconds: float,
                 plan: dict[str, tuple[str, float]], scale: float = 1.0):
        self.name = name
        self.mode = mode  # "gpu" | "simulated"
        self.out = out  # the stage's JSON lines file
        self.state = state  # where the parent learns the running step and the pids to kill
        self.deadline = time.monotonic() + seconds
        self.plan = plan  # step -> (title, timeout_s)
        self.scale = scale  # timeouts x scale (the rehearsal on a loaded CI machine)
        self.current: Step | None = None
        self.started = 0.0
        self.pids: list[list[float]] = []  # [pid, create_time] of processes to kill if stopped
        self.failed: dict[str, str] = {}  # steps that did not pass -> why (later ones may need them)
        self.shared: dict[str, Any] = {}  # what one step leaves for the next (a kernel, a checksum)

    @property
    def real(self) -> bool:
        return self.mode == "gpu"

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def note_pids(self, pids: list[int]) -> None:
        """Processes the parent kills if this scene is stopped (servers, kernels, children)."""
        import psutil

        for pid in pids:
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                entry = [p.pid, p.create_time()]
                if entry not in self.pids:
                    self.pids.append(entry)
        self._write_state()

    def _write_state(self) -> None:
        data = {"current": self.current.name if self.current else None,
                "pids": self.pids, "started": self.started}
        tmp = self.state.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self.state)

    async def step(self, name: str, fn: StepFn, needs: tuple[str, ...] = ()) -> bool:
        """Run one step within its timeout; True when it passed."""
        title, timeout_s = self.plan[name]
        timeout_s *= self.scale
        st = Step(self, name, title, timeout_s)
        print(f"-- {self.name}.{name}: {title} (timeout {timeout_s:.0f} s)", flush=True)
        t0 = time.monotonic()
        status, reason = "passed", None
        blocked = [n for n in needs if n in self.failed]
        if blocked:
            status, reason = "skipped", "; ".join(f"needs {n}: {self.failed[n]}" for n in blocked)
        elif self.left() < 3:
            status, reason = "skipped", "no time left in the scene's time box"
        else:
            self.current, self.started = st, time.time()
            self._write_state()
            limit = min(timeout_s, self.left())
            st.deadline = time.monotonic() + limit
            try:
                await asyncio.wait_for(fn(st), limit)
            except Skip as e:
                status, reason = "skipped", str(e)
            except asyncio.TimeoutError as e:  # the step's own stop says what it stopped
                status, reason = "timeout", str(e) or f"did not end within {limit:.0f} s"
                st.figure("traceback", traceback.format_exc()[-2000:])
            except Exception as e:
                status, reason = "failed", f"{e.__class__.__name__}: {e}"[:1000]
                st.figure("traceback", traceback.format_exc()[-3000:])
            if status == "passed" and any(c["ok"] is False for c in st.checks):
                status = "failed"
            log = self.shared.get("server_log")  # what the server said, for a step that failed
            if status in ("failed", "timeout") and callable(log):
                with contextlib.suppress(Exception):
                    st.figure("server_log", log())
            self.current = None
            self._write_state()
        if status != "passed":
            self.failed[name] = f"{status} ({reason})" if reason else status
        print(f"-- {self.name}.{name}: {status} in {time.monotonic() - t0:.1f} s"
              + (f" ({reason})" if reason else ""), flush=True)
        report.append(self.out, st.record(status, reason, time.monotonic() - t0))
        return status == "passed"

    def on_sigterm(self) -> None:
        """The time box ran out: record the running step as a timeout, with where it was."""
        st = self.current
        if st is None:
            return
        with contextlib.suppress(Exception):
            stacks = []
            for task in asyncio.all_tasks(asyncio.get_running_loop()):
                frames = task.get_stack()
                stacks.append(" <- ".join(f"{f.f_code.co_name}:{f.f_lineno}" for f in reversed(frames)))
            st.figure("stuck_at", stacks)
        report.append(self.out, st.record("timeout", "stopped when the scene's time box ran out",
                                          time.time() - self.started))


def run_scene(scene: Scene, body: Callable[[Scene], Coroutine[Any, Any, Any]]) -> int:
    """The scene's process: run ``body`` (which calls ``scene.step`` for each step), record a
    stop by SIGTERM, and exit without waiting for threads a timed-out step left behind."""

    def stop(*_: Any) -> None:
        scene.on_sigterm()
        os._exit(143)

    signal.signal(signal.SIGTERM, stop)
    try:
        asyncio.run(body(scene))
    except BaseException:  # a step's failure is recorded by the step; this is the scene's own
        traceback.print_exc()
    os._exit(0)
