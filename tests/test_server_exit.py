"""A server interrupted without a terminal leaves no agent socket behind.

jupyter_server installs no SIGINT handler when stdin is not a terminal (a service, a
container, `nohup`): Ctrl-C then ends its loop without its cleanup, so no extension is
stopped. The socket file still goes, at the process's exit.
"""

from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys
import urllib.request

from .helpers import wait_for


def answers(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/api", timeout=5)
        return True
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_sigint_without_a_terminal_removes_the_socket(tmp_path):
    runtime = tmp_path / "runtime"
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(runtime),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config")}
    port = free_port()
    server = subprocess.Popen(
        # SIGINT as Python sets it up by default, whatever this process inherited (a shell's
        # background job ignores it)
        [sys.executable, "-c", "import runpy, signal\n"
         "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
         "runpy.run_module('jupyter_server', run_name='__main__')",
         "--no-browser", "--allow-root",
         f"--port={port}", f"--ServerApp.root_dir={tmp_path}",
         # ours only: the others installed here would only slow the start
         "--ServerApp.jpserver_extensions={'jupyter_gpushare': True, 'jupyterlab': False, "
         "'notebook_shim': False, 'jupyter_lsp': False, 'jupyter_server_terminals': False}",
         "--GPUShareApp.backend=simulated"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
        start_new_session=True,
    )
    try:
        path = str(runtime / f"gpushare-{server.pid}.sock")
        await wait_for(lambda: answers(port) or server.poll() is not None, timeout=60,
                       what="the server to answer")  # its loop runs: Ctrl-C ends the loop
        assert server.poll() is None, server.stderr.read().decode() if server.stderr else ""
        assert os.path.exists(path)
        server.send_signal(signal.SIGINT)
        server.wait(60)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)
    log = server.stderr.read().decode() if server.stderr else ""
    assert "Interrupted" in log  # jupyter_server's own exit path, without its cleanup
    assert glob.glob(str(runtime / "gpushare-*.sock")) == [], log
