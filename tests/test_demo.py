"""The main job: `jupyter gpushare demo` starts JupyterLab on the simulated node, and its
demo notebook runs cell by cell through a real server."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import nbformat

from jupyter_gpushare.demo import write_demo


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_demo_command_serves_lab_with_the_extension_on_a_simulated_node(tmp_path):
    port = free_port()
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter_gpushare.cli", "demo", "--no-browser", "--port", str(port),
         "--dir", str(tmp_path / "demo")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    try:
        token = None
        deadline = time.monotonic() + 90
        while token is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if m := re.search(r"token=([0-9a-f]+)", line):
                token = m.group(1)
        assert token, "".join(lines)
        assert any("a simulated 2-GPU node" in ln for ln in lines), "".join(lines)
        base = f"http://127.0.0.1:{port}"
        req = urllib.request.Request(f"{base}/api/gpushare/status",
                                     headers={"Authorization": f"token {token}"})
        for _ in range(300):  # the URL is logged a moment before the socket accepts
            try:
                status = json.load(urllib.request.urlopen(req, timeout=30))
                break
            except urllib.error.URLError:
                assert proc.poll() is None, "the demo exited: " + "".join(lines)
                time.sleep(0.1)
        else:
            raise AssertionError(f"the demo never answered on port {port}")
        assert status["backend"] == "simulated" and len(status["gpus"]) == 2
        req = urllib.request.Request(f"{base}/lab/api/extensions",
                                     headers={"Authorization": f"token {token}"})
        extensions = json.load(urllib.request.urlopen(req, timeout=30))
        assert any(e["name"] == "jupyter-gpushare" and e["enabled"] for e in extensions)
        assert (tmp_path / "demo" / "gpushare-demo.ipynb").exists()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


async def test_demo_notebook_runs_through_the_server(tmp_path, kernels, gpushare_app):
    nb = nbformat.read(write_demo(tmp_path, simulated=True), as_version=4)
    k = await kernels.start()
    outputs = []
    for cell in nb.cells:
        if cell.cell_type == "code":
            outputs.append((await k.run(cell.source, timeout=120)).text)
    text = "\n".join(outputs)
    assert "holding 3.0 GiB" in text
    assert "released 3.0 GiB" in text
    assert "restored, checksum matches" in text
    assert "pinned" in text
    assert gpushare_app.controller.states[k.id].pinned
