"""`jupyter gpushare ...` as a new user meets it: real help for every command, options that
work through `jupyter gpushare`, unknown options refused, and a demo that keeps the
user's notebook."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from jupyter_gpushare import cli
from jupyter_gpushare.demo import NAME, write_demo


def run_cli(*args: str, env: dict | None = None, timeout: float = 120,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jupyter", "gpushare", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})}, cwd=cwd)


@pytest.mark.parametrize("argv, words", [
    (["--help"], ["demo", "doctor", "COMMAND --help"]),
    (["demo", "--help"], ["--reset", "--idle-timeout SECONDS", "--Class.option=value", "examples:",
                          "in Jupyter's data directory", "configurable-http-proxy"]),
    (["doctor", "--help"], ["--json", "--backend {auto,nvml,simulated}", "--release-method",
                            "JUPYTER_GPUSHARE_BACKEND", "examples:"]),
])
def test_every_command_has_real_help(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 0
    out = capsys.readouterr().out
    for word in words:
        assert word in out, out


@pytest.mark.parametrize("argv, words", [
    (["doctor", "--bogus"], "unrecognized arguments: --bogus"),
    (["doctor", "--backend", "NVML"], "invalid choice: 'NVML'"),
    (["demo", "--bogus"], "unrecognized argument: --bogus"),
    (["demo", "--ServerApp.port=1", "stray"], "unrecognized argument: stray"),
    (["nonsense"], "invalid choice: 'nonsense'"),
    ([], "the following arguments are required: COMMAND"),
])
def test_unknown_options_are_refused(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_doctor_json_and_backend_through_jupyter_gpushare():
    out = run_cli("doctor", "--json", "--backend", "nvml")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert (report["configured_backend"], report["backend"]) == ("nvml", "nvml")
    assert report["backend_reason"].startswith("configured")
    checks = {c["name"]: c for c in report["checks"]}
    backend = checks["telemetry backend"]
    assert backend["detail"].startswith("nvml: configured") and backend["ok"] in (True, False)
    assert checks["release method"]["detail"].startswith("auto -> ")
    assert checks["release method"]["detail"] == f"auto -> {report['method']}: {report['method_reason']}"


def test_doctor_refuses_a_bad_backend_environment_variable(capsys, monkeypatch):
    monkeypatch.setenv("JUPYTER_GPUSHARE_BACKEND", "gpu")
    with pytest.raises(SystemExit) as e:
        cli.main(["doctor"])
    assert e.value.code == 2
    assert "JUPYTER_GPUSHARE_BACKEND must be one of" in capsys.readouterr().err


def test_the_demo_keeps_an_edited_notebook_and_reset_writes_a_fresh_one(tmp_path):
    """The demo writes its notebook before JupyterLab starts; a JupyterLab option it cannot
    take then stops the start at once, so this runs the real command quickly."""
    edited = write_demo(tmp_path, simulated=True)
    nb = nbformat.read(edited, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("print('my own cell')"))
    nbformat.write(nb, edited)
    mine = edited.read_text()
    lab_fails = ["--ServerApp.port=not-a-port"]
    env = {"JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config")}

    out = run_cli("demo", "--backend", "simulated", "--dir", str(tmp_path), "--no-browser",
                  *lab_fails, env=env)
    assert out.returncode != 0 and "not-a-port" in out.stderr  # JupyterLab's own refusal
    assert "(yours, kept as it is; --reset writes a fresh one)" in out.stdout
    assert edited.read_text() == mine

    out = run_cli("demo", "--backend", "simulated", "--dir", str(tmp_path), "--no-browser",
                  "--reset", *lab_fails, env=env)
    assert "kept" not in out.stdout
    fresh = nbformat.read(tmp_path / NAME, as_version=4)
    assert "my own cell" not in "".join(c.source for c in fresh.cells)


def test_the_demo_keeps_its_files_in_jupyters_data_directory_and_says_so_first(tmp_path):
    """Not in the current directory (a checkout, where they would show in `git status`): in
    Jupyter's data directory, said on the demo's first line."""
    data, here = tmp_path / "data", tmp_path / "checkout"
    here.mkdir()
    env = {"JUPYTER_DATA_DIR": str(data), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config")}
    out = run_cli("demo", "--backend", "simulated", "--no-browser", "--ServerApp.port=not-a-port",
                  env=env, cwd=here)
    assert out.returncode != 0 and "not-a-port" in out.stderr  # stopped by JupyterLab at once
    demo = data / "gpushare-demo"
    assert out.stdout.splitlines()[0] == (f"jupyter-gpushare demo: its files are in {demo} "
                                          "(--dir puts them elsewhere)")
    assert (demo / NAME).exists()
    overrides = demo / ".jupyter-config" / "labconfig" / "default_setting_overrides.json"
    assert json.loads(overrides.read_text()) == {
        "@jupyterlab/apputils-extension:notification": {"fetchNews": "false"}}
    assert list(here.iterdir()) == []
