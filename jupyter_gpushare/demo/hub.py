"""`jupyter gpushare demo --hub`: a local JupyterHub (127.0.0.1) with three demo users whose
servers share one simulated GPU node, and the gpushare service coordinating them.

Everything lives in one directory (the Hub's database, the users' homes with the demo
notebook, the simulated node); the Hub is configured by the same snippet admins load
(``jupyter_gpushare.hub.SNIPPET``)."""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

from ..sim.node import GiB
from . import NAME, config_dir, lab_config, write_demo

USERS = ("alice", "bob", "carol")
ADMIN = "alice"
PASSWORD = "gpushare"  # the users' (JupyterHub asks 8 characters at least)
GPUS = (6 * GiB, 6 * GiB)  # small enough that three people's demo notebooks crowd GPU 0

CONFIG = """# written by `jupyter gpushare demo --hub`
import json, os
c = get_config()  # noqa
from jupyter_gpushare.hub import SNIPPET
load_subconfig(SNIPPET)
from jupyter_gpushare.demo.hub import quiet_polls
quiet_polls()
S = json.loads({settings!r})
c.JupyterHub.bind_url = f"http://127.0.0.1:{{S['port']}}"
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = S["hub_port"]
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{{S['proxy_api_port']}}"
c.JupyterHub.db_url = "sqlite:///" + os.path.join(S["dir"], "jupyterhub.sqlite")
c.JupyterHub.cookie_secret_file = os.path.join(S["dir"], "jupyterhub_cookie_secret")
c.JupyterHub.authenticator_class = "shared-password"
c.SharedPasswordAuthenticator.user_password = S["password"]
c.SharedPasswordAuthenticator.admin_password = S["admin_password"]
c.Authenticator.allowed_users = set(S["users"])
c.Authenticator.admin_users = {{S["admin"]}}
c.JupyterHub.spawner_class = "simple"
c.Spawner.start_timeout = 180  # s: a busy laptop starts JupyterLab slowly
c.Spawner.http_timeout = 180
c.SimpleLocalProcessSpawner.home_dir_template = os.path.join(S["dir"], "home", "{{username}}")
c.Spawner.default_url = "/lab/tree/" + S["notebook"]
c.Spawner.args = S["server_args"]
c.Spawner.environment.update(S["server_env"])
"""

SERVICE_CONFIG = """# written by `jupyter gpushare demo --hub`
c.GPUShareHub.poll_interval = 5
c.GPUShareHub.pressure_idle_timeout = {pressure}
c.GPUShareHub.over_share_idle_timeout = 15
c.GPUShareHub.min_release_bytes = 0
c.GPUShareHub.shares = {{"carol": "4GiB"}}  # carol is guaranteed 4 GiB per GPU
"""


#: the users' servers load it (the demo's config folder is on their JUPYTER_CONFIG_PATH)
SERVER_CONFIG = """# written by `jupyter gpushare demo --hub`
from jupyter_gpushare.demo.hub import quiet_polls
quiet_polls()
"""

#: the service's name in the Hub (jupyter_gpushare.hub.SNIPPET)
SERVICE = "gpushare"


class QuietPolls(logging.Filter):
    """Drops the access-log line of each request of the gpushare service that went well: it
    asks the Hub and every server every few seconds, and the demo's log is there to show
    what people do (a failed request of the service is still logged)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO or f"({SERVICE}@" not in record.getMessage()


def quiet_polls() -> None:
    """Quiet the service's routine requests in this process's access log (the Hub's, or a
    single-user server's; both log each request that went well at INFO)."""
    access = logging.getLogger("tornado.access")
    if not any(isinstance(f, QuietPolls) for f in access.filters):
        access.addFilter(QuietPolls())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def missing() -> str:
    """What the hub demo needs and this machine lacks ("" = nothing)."""
    try:
        import jupyterhub  # noqa: F401
    except ImportError:
        return ("JupyterHub is not installed: pip install jupyterhub (in a checkout of "
                "jupyter-gpushare, `bash .ci/run --demo --hub` installs it)")
    if shutil.which("configurable-http-proxy") is None:
        return ("configurable-http-proxy is not installed: npm install -g configurable-http-proxy "
                "(in a checkout of jupyter-gpushare, `bash .ci/run --demo --hub` installs it)")
    return ""


def admin_password(directory: Path) -> str:
    """The admin's password: made once per demo directory (JupyterHub asks 32 characters at
    least of an admin's shared password), kept there readable by this OS user only."""
    path = directory / "admin_password"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(secrets.token_urlsafe(24) + "\n")  # 32 characters
    return path.read_text(encoding="utf-8").strip()


def prepare(directory: Path, port: int, idle_timeout: float) -> tuple[Path, dict[str, str]]:
    """Write the Hub's and the service's configuration, the users' notebooks and the node;
    return the Hub's config file and the environment to start it with."""
    from ..sim.shared import SharedSimNode

    directory.mkdir(parents=True, exist_ok=True)
    node = directory / "simulated-node.sqlite"
    SharedSimNode(node, GPUS).close()
    for user in USERS:
        write_demo(directory / "home" / user, simulated=True)
    args = ["--GPUShareApp.backend=simulated", "--GPUShareApp.poll_interval=1",
            f"--GPUShareApp.idle_timeout={idle_timeout}", "--GPUShareApp.min_release_bytes=0",
            # releases at idle_timeout, to be seen in a minute or two (the default, "needs",
            # would wait for memory pressure or long_idle)
            "--GPUShareApp.release_policy=proactive",
            f"--GPUShareApp.pressure_idle_timeout={min(idle_timeout, 30)}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        args.append("--ServerApp.allow_root=True")  # every demo server runs as this OS user
    settings = {
        "port": port, "hub_port": free_port(), "proxy_api_port": free_port(),
        "dir": str(directory), "password": PASSWORD, "admin_password": admin_password(directory),
        "users": list(USERS), "admin": ADMIN, "notebook": NAME, "server_args": args,
        "server_env": {"JUPYTER_GPUSHARE_SIMULATED_NODE": str(node),
                       "JUPYTER_CONFIG_PATH": lab_config(directory)},
    }
    (config_dir(directory) / "jupyter_server_config.py").write_text(SERVER_CONFIG, encoding="utf-8")
    config = directory / "jupyterhub_config.py"
    config.write_text(CONFIG.format(settings=json.dumps(settings)), encoding="utf-8")
    (directory / "gpushare_hub_config.py").write_text(
        f"c.GPUShareHub.simulated_node = {str(node)!r}\n"  # the service measures the node itself
        + SERVICE_CONFIG.format(pressure=min(idle_timeout, 30)), encoding="utf-8")
    env = {**os.environ, "JUPYTER_GPUSHARE_SERVICE_PORT": str(free_port()),
           "JUPYTER_GPUSHARE_PROXY_URL": f"http://127.0.0.1:{port}"}
    return config, env


def instructions(port: int, directory: Path) -> str:
    url = f"http://127.0.0.1:{port}"
    others = " or ".join(u for u in USERS if u != ADMIN)
    return (
        f"jupyter-gpushare hub demo: JupyterHub at {url}\n"
        f"  log in as {others} with the password {PASSWORD!r}, or as {ADMIN} (an admin) with\n"
        f"  {admin_password(directory)!r} (kept in {directory / 'admin_password'})\n"
        f"  (use a private window per user, or log out in between)\n"
        f"  each server opens {NAME} on one shared simulated node of 2 GPUs x 6 GiB\n"
        f"  the admin page: {url}/services/gpushare/ (log in as {ADMIN})\n"
        f"  carol is guaranteed 4 GiB per GPU; alice and bob have no share\n"
        "  Ctrl-C stops the Hub and every server"
    )


def run(directory: Path, port: int, idle_timeout: float) -> int:
    why = missing()
    if why:
        print(f"jupyter gpushare demo --hub: {why}", file=sys.stderr)
        return 2
    config, env = prepare(directory, port, idle_timeout)
    print(instructions(port, directory), flush=True)
    hub = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", str(config)], cwd=directory, env=env)

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)  # `kill` stops the Hub and its servers too, as Ctrl-C does
    try:
        return hub.wait()
    except KeyboardInterrupt:
        hub.terminate()
        return hub.wait()
