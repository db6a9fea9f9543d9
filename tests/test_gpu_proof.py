"""The GPU proof (benchmarks/gpu/prove.sh, issue 24) rehearsed here, with no GPU.

``prove.sh --simulated`` runs every part that makes sense on the simulated backend through
real servers and kernels and writes the report the GPU run writes; ``prove.sh`` on a machine
without a GPU says so and exits 0. Both must keep working, or the proof breaks on the day a
GPU machine is lent and there is no time to fix it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROVE_SH = REPO / "benchmarks" / "gpu" / "prove.sh"
sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))

import prove  # noqa: E402  (benchmarks/gpu/prove.py: no third-party import at module level)


def run_prove(tmp_path: Path, *args: str, timeout: float = 150) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1"}
    env.pop("OUT", None)
    r = subprocess.run(["bash", str(PROVE_SH), "--out", str(out), *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=timeout)
    report = json.loads((out / "gpu-proof.json").read_text()) if (out / "gpu-proof.json").exists() else {}
    assert (out / "gpu-proof.md").exists() or not report
    return r, report


def nvml_sees_a_gpu() -> bool:
    from jupyter_gpushare.telemetry.nvml import probe

    p = probe()
    return bool(p.ok and p.gpus)


@pytest.mark.timeout(170)
def test_the_rehearsal_runs_every_part_or_says_why_not(tmp_path):
    r, report = run_prove(tmp_path, "--simulated", "--jobs", "3")
    log = r.stdout + r.stderr
    assert r.returncode == 0, log
    assert prove.validate(report) == [], report.get("shape_errors")
    assert report["mode"] == "simulated" and list(report["parts"]) == prove.PARTS
    for name, part in report["parts"].items():
        if name in prove.NOT_SIMULATED:
            assert part["status"] == "skipped" and part["reason"] == prove.NOT_SIMULATED[name]
            continue
        assert part["status"] == "ran", (name, part.get("reason"), part.get("figures"))
        assert part["checks"] and not [c for c in part["checks"] if c["ok"] is False], name
    parts = report["parts"]
    # what each part is there to show, shown by the simulated node
    assert any("within two polls" in c["name"] and c["ok"] for c in parts["nvml"]["checks"])
    assert any("waits" in c["name"] and c["ok"] for c in parts["driver"]["checks"])
    busy = parts["driver"]["figures"]["busy_release_message"]
    assert "busy on the GPU" in busy, busy
    rows = parts["bandwidth"]["figures"]["rows"]
    assert len(rows) == 3 and all(r["intact"] for r in rows)
    assert set(parts["bandwidth"]["figures"]["fits"]) == {"simulated", "copy in kernel"}
    assert [c["ok"] for c in parts["lazy"]["checks"]] == [True, True, True]
    assert report["summary"] == {"ran": 5, "failed": 0, "skipped": 2, "timeout": 0,
                                 "checks_failed": 0}
    md = (tmp_path / "out" / "gpu-proof.md").read_text()
    assert md.startswith("# GPU proof (simulated)") and "| bandwidth | **ran** |" in md
    assert "## Bandwidth" in md and "jupyter-gpushare doctor" in md


@pytest.mark.timeout(90)
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    if nvml_sees_a_gpu():
        pytest.skip("this machine has a GPU")
    r, report = run_prove(tmp_path, "--part", "1", timeout=80)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no GPU here" in r.stdout
    assert prove.validate(report) == [] and report["mode"] == "no-gpu"
    assert report["parts"]["env"]["status"] == "ran"
    assert list(report["parts"]) == prove.GROUPS["1"]
    for name in prove.GROUPS["1"][1:]:
        part = report["parts"][name]
        assert part["status"] == "skipped" and part["reason"].startswith("no GPU here"), name


def test_the_fit_finds_the_overhead_and_the_bandwidth():
    gib = prove.GiB
    f = prove.fit([(n * gib, 0.04 + n * gib / 20e9) for n in (1, 4, 16, 40)])
    assert f["overhead_s"] == pytest.approx(0.04) and f["GBps"] == pytest.approx(20)
    assert prove.fit([(gib, 1.0)]) == {"overhead_s": None, "GBps": None}


def test_a_report_without_reasons_or_with_unknown_parts_is_refused():
    part = {"status": "skipped", "reason": "", "checks": [], "figures": {}, "seconds": 0,
            "budget_s": 1, "what": ""}
    report = {"schema": prove.SCHEMA, "mode": "gpu", "started": "", "seconds": 0, "machine": {},
              "parts": {"nvml": part, "other": {**part, "reason": "x"}}, "summary": {}, "goals": []}
    errs = prove.validate(report)
    assert "nvml: skipped without a reason" in errs and "unknown part other" in errs


def test_two_part_runs_merge_into_one_report(tmp_path):
    def one(parts: dict) -> Path:
        rep = {"schema": prove.SCHEMA, "mode": "gpu", "started": "t", "seconds": 10,
               "machine": {"gpus": "H100", "driver": "580", "cpus": 16, "python": "3.12",
                           "host": "h"}, "parts": parts}
        prove.summarize(rep)
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps(rep))
        return path

    ran = {"status": "ran", "reason": None, "checks": [{"name": "c", "ok": True, "detail": ""}],
           "figures": {}, "seconds": 1, "budget_s": 5, "what": "w"}
    a = one({"env": ran, "nvml": ran})
    b = one({"env": ran, "bandwidth": {**ran, "status": "failed"}})
    assert prove.merge([str(a), str(b)], tmp_path / "merged") == 0
    merged = json.loads((tmp_path / "merged" / "gpu-proof.json").read_text())
    assert list(merged["parts"]) == ["env", "nvml", "bandwidth"] and merged["seconds"] == 20
    assert merged["summary"]["failed"] == 1 and prove.validate(merged) == []
