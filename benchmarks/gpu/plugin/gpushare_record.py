"""A pytest plugin for the GPU proof's ``pytest`` scene (benchmarks/gpu/gpu_tests.py): one JSON
line per test, appended to the file ``$GPUSHARE_TEST_RECORD`` names the moment the test ends,
so a run stopped by its time box (or killed by a hang in the driver) still says which tests
passed, failed or were skipped, and which one it was in.

    {"event": "collected", "tests": [nodeid, ...]}
    {"event": "start", "test": nodeid}
    {"event": "end", "test": nodeid, "outcome": "passed"|"failed"|"error"|"skipped",
     "seconds": s, "reason": skip reason or the failure's last line, "tail": its last lines}

Loaded with ``-p gpushare_record`` (this folder on PYTHONPATH: nothing else is in it, so the
tests' kernels, which inherit PYTHONPATH, import nothing new). Standard library and pytest only.
"""

from __future__ import annotations

import json
import os
from typing import Any

#: lines of a failure's report kept (its end: the assertion, the timeout's "Failed: Timeout")
TAIL_LINES = 25

_phases: dict[str, list[Any]] = {}


def _write(record: dict[str, Any]) -> None:
    path = os.environ.get("GPUSHARE_TEST_RECORD")
    if not path:
        return
    with open(path, "a", encoding="utf-8") as f:  # one write a line: a kill loses no half line
        f.write(json.dumps(record) + "\n")


def pytest_collection_finish(session: Any) -> None:
    _write({"event": "collected", "tests": [item.nodeid for item in session.items]})


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _phases[nodeid] = []
    _write({"event": "start", "test": nodeid})


def pytest_runtest_logreport(report: Any) -> None:
    _phases.setdefault(report.nodeid, []).append(report)


def _skip_reason(report: Any) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: why")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr or "")


def outcome_of(reports: list[Any]) -> dict[str, Any]:
    """One test's outcome from its setup, call and teardown reports: a failed call is
    ``failed``, a failed setup or teardown ``error`` (pytest's words), else a skip, else passed."""
    seconds = round(sum(float(getattr(r, "duration", 0.0)) for r in reports), 2)
    for r in reports:
        if r.failed:
            text = (getattr(r, "longreprtext", "") or str(r.longrepr or "")).rstrip()
            lines = [ln for ln in text.splitlines() if ln.strip()]
            said = [ln.removeprefix("E").strip() for ln in lines if ln.startswith("E ")]
            reason = " | ".join(said[:2]) if said else (lines[-1] if lines else "")
            return {"outcome": "failed" if r.when == "call" else "error", "seconds": seconds,
                    "when": r.when, "reason": reason[:500],
                    "tail": "\n".join(lines[-TAIL_LINES:])}
    for r in reports:
        if r.skipped:
            return {"outcome": "skipped", "seconds": seconds, "reason": _skip_reason(r)[:500]}
    return {"outcome": "passed", "seconds": seconds}


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    _write({"event": "end", "test": nodeid, **outcome_of(_phases.pop(nodeid, []))})
