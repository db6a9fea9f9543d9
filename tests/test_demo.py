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
from pathlib import Path

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
        # no "get notified about Jupyter news?" prompt over the demo's notifications
        req = urllib.request.Request(
            f"{base}/lab/api/settings/@jupyterlab/apputils-extension:notification",
            headers={"Authorization": f"token {token}"})
        settings = json.load(urllib.request.urlopen(req, timeout=30))
        # the demo's default (the schema's, as served: a person's own setting would still win)
        assert settings["schema"]["properties"]["fetchNews"]["default"] == "false"
        assert "fetchNews" not in settings["settings"]
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


def test_hub_demo_starts_a_hub_with_three_users_and_the_service(tmp_path):
    from .hubharness import can_run

    if can_run():
        import pytest

        pytest.skip(can_run())
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter_gpushare.cli", "demo", "--hub", "--port", str(port),
         "--dir", str(tmp_path / "hub")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))},
    )
    lines: list[str] = []
    try:
        while not lines or "Ctrl-C stops" not in lines[-1]:
            lines.append(proc.stdout.readline())
            assert lines[-1], "the demo exited: " + "".join(lines)
        text = "".join(lines)
        assert lines[0] == f"jupyter-gpushare demo: its files are in {tmp_path / 'hub'} (--dir puts them elsewhere)\n"
        assert f"JupyterHub at http://127.0.0.1:{port}" in text
        admin = (tmp_path / "hub" / "admin_password").read_text().strip()
        assert "log in as bob or carol with the password 'gpushare', or as alice (an admin) with" in text
        assert repr(admin) in text
        assert f"http://127.0.0.1:{port}/services/gpushare/" in text
        for user in ("alice", "bob", "carol"):
            assert (tmp_path / "hub" / "home" / user / "gpushare-demo.ipynb").exists()
        login = None
        for _ in range(600):  # the Hub, its proxy and the service start
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/hub/api", timeout=5)
                req = urllib.request.Request(f"http://127.0.0.1:{port}/services/gpushare/")
                login = urllib.request.urlopen(req, timeout=5).geturl()  # redirected to log in
                break
            except urllib.error.URLError:
                assert proc.poll() is None, "the demo exited: " + "".join(lines) + proc.stdout.read()
                time.sleep(0.1)
        assert login is not None and "/hub/login" in login, login
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def test_hub_demo_config_logs_in_the_current_way_and_quiets_the_service_polls(tmp_path):
    """The Hub's config the demo writes, loaded as JupyterHub loads it: its authenticator
    (JupyterHub's shared-password one, not the deprecated DummyAuthenticator.password) lets
    bob and carol in with 'gpushare' and alice, the admin, with her own password only; and
    the gpushare service's routine requests (every few seconds) leave no access-log line."""
    import asyncio
    import logging

    import pytest

    pytest.importorskip("jupyterhub")
    from jupyterhub.authenticators.shared import SharedPasswordAuthenticator
    from traitlets.config.loader import PyFileConfigLoader

    from jupyter_gpushare.demo import hub

    access = logging.getLogger("tornado.access")
    filters = list(access.filters)
    try:
        config_file, _ = hub.prepare(tmp_path, free_port(), 120)
        config = PyFileConfigLoader(config_file.name, str(config_file.parent)).load_config()
        assert config.JupyterHub.authenticator_class == "shared-password"
        assert "DummyAuthenticator" not in config
        auth = SharedPasswordAuthenticator(config=config)
        admin = (tmp_path / "admin_password").read_text().strip()
        assert len(admin) >= 32 and (tmp_path / "admin_password").stat().st_mode & 0o077 == 0

        def login(user: str, password: str):
            return asyncio.run(auth.authenticate(None, {"username": user, "password": password}))

        assert login("bob", "gpushare") == {"name": "bob", "admin": False, "groups": []}
        assert login("alice", admin)["admin"] is True
        assert login("alice", "gpushare") is None and login("bob", admin) is None

        def logged(level: int, message: str) -> bool:
            return access.filter(logging.LogRecord("tornado.access", level, "", 0, message, None, None))

        assert not logged(logging.INFO, "200 GET /hub/api/users?state=[secret] (gpushare@127.0.0.1) 5.20ms")
        assert logged(logging.INFO, "302 POST /hub/login?next= -> /hub/spawn (bob@127.0.0.1) 50.00ms")
        assert logged(logging.WARNING, "403 GET /hub/api/users (gpushare@127.0.0.1) 3.00ms")

        # the users' servers load the same filter: the demo's config folder is on their path
        env = config.Spawner.environment.get_value({})  # what the Hub gives every server
        server_config = Path(env["JUPYTER_CONFIG_PATH"].split(os.pathsep)[0]) / "jupyter_server_config.py"
        access.filters[:] = filters
        exec(compile(server_config.read_text(), str(server_config), "exec"), {})
        assert not logged(logging.INFO, "200 GET /user/bob/api/gpushare/status (gpushare@127.0.0.1) 2.00ms")
    finally:
        access.filters[:] = filters
