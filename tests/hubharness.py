"""A real JupyterHub on 127.0.0.1 for the tests and the benchmark: configurable-http-proxy,
SimpleLocalProcessSpawner (every user's server on this machine, as this OS user), the dummy
authenticator with a known password, the gpushare service from the shipped deployment
snippet (jupyter_gpushare/hub/jupyterhub_gpushare.py, loaded as it is), and one shared
simulated node.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from tornado.websocket import websocket_connect

from jupyter_gpushare.demo.hub import free_port
from jupyter_gpushare.demo.hub import missing as can_run  # noqa: F401  (the tests' name)
from jupyter_gpushare.sim.shared import SharedSimNode

ROOT = Path(__file__).resolve().parents[1]
SNIPPET = ROOT / "jupyter_gpushare" / "hub" / "jupyterhub_gpushare.py"  # as shipped
PASSWORD = "gpushare-test"
MiB = 1 << 20


CONFIG = """
import json, os, sys
c = get_config()  # noqa
load_subconfig({snippet!r})
S = json.loads({settings!r})
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = S["port"]
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = S["hub_port"]
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{{S['proxy_api_port']}}"
c.JupyterHub.db_url = "sqlite:///" + os.path.join(S["dir"], "hub.sqlite")
c.JupyterHub.cookie_secret_file = os.path.join(S["dir"], "cookie_secret")
c.JupyterHub.pid_file = os.path.join(S["dir"], "hub.pid")
c.ConfigurableHTTPProxy.pid_file = os.path.join(S["dir"], "proxy.pid")
c.JupyterHub.authenticator_class = "dummy"
c.DummyAuthenticator.password = S["password"]
c.Authenticator.allowed_users = set(S["users"])
c.Authenticator.admin_users = set(S["admins"])
c.JupyterHub.spawner_class = "simple"
c.SimpleLocalProcessSpawner.home_dir_template = os.path.join(S["dir"], "home", "{{username}}")
c.Spawner.default_url = "/lab"
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 120
c.Spawner.args = ["--ServerApp.allow_root=True"] + S["server_args"]
c.Spawner.environment.update(S["server_env"])
c.JupyterHub.last_activity_interval = 300
c.JupyterHub.services.append({{"name": "pytest", "api_token": S["admin_token"]}})
c.JupyterHub.load_roles.append({{"name": "pytest", "services": ["pytest"],
    "scopes": ["admin:users", "admin:servers", "tokens", "access:servers", "read:metrics",
               "access:services", "admin:groups"]}})
def per_user(spawner):
    extra = S["user_env"].get(spawner.user.name)
    if extra:
        spawner.environment.update(extra)
    if spawner.user.name in S["user_cmd"]:
        spawner.cmd = S["user_cmd"][spawner.user.name]
        spawner.args = []
c.Spawner.pre_spawn_hook = per_user
"""


@dataclass
class Hub:
    dir: Path
    port: int
    service_port: int
    admin_token: str
    process: subprocess.Popen
    node_path: str
    hub_port: int = 0  # the Hub's own API port: every process it started has it in its environment
    tokens: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- HTTP --------------------------------------------------------------------------------
    async def request(self, path: str, token: str | None = None, method: str = "GET",
                      body: Any = None, ok: bool = True, **kw: Any) -> tuple[int, Any]:
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        if data is None and method in ("POST", "PUT", "DELETE", "PATCH"):
            data = b""
        headers = {"Authorization": f"token {token or self.admin_token}", **kw.pop("headers", {})}
        req = HTTPRequest(self.url + path, method=method, body=data, headers=headers,
                          request_timeout=120, allow_nonstandard_methods=True, follow_redirects=False, **kw)
        r = await AsyncHTTPClient().fetch(req, raise_error=False)
        if r.code == 599:
            raise HTTPClientError(599, str(r.error))
        try:
            parsed = json.loads(r.body) if r.body else None
        except ValueError:
            parsed = r.body.decode("utf-8", "replace")
        if ok and r.code >= 400:
            raise AssertionError(f"{method} {path}: {r.code} {parsed}")
        return r.code, parsed

    async def api(self, path: str, method: str = "GET", body: Any = None, **kw: Any) -> Any:
        return (await self.request("/hub/api" + path, method=method, body=body, **kw))[1]

    async def token_for(self, user: str) -> str:
        if user not in self.tokens:
            body = await self.api(f"/users/{user}/tokens", "POST", {"note": "gpushare tests", "expires_in": 3600})
            self.tokens[user] = body["token"]
        return self.tokens[user]

    async def start_server(self, user: str) -> None:
        code, _ = await self.request(f"/hub/api/users/{user}/server", method="POST", ok=False)
        assert code in (201, 202, 400), code  # 400: already running
        await self.wait_ready(user)

    async def wait_ready(self, user: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while True:
            model = await self.api(f"/users/{user}")
            server = (model.get("servers") or {}).get("")
            if server and server.get("ready"):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{user}'s server did not start: {model}")
            await asyncio.sleep(0.2)

    async def stop_server(self, user: str) -> None:
        await self.request(f"/hub/api/users/{user}/server", method="DELETE", ok=False)
        deadline = time.monotonic() + 60
        while (await self.api(f"/users/{user}")).get("servers"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{user}'s server did not stop")
            await asyncio.sleep(0.2)

    async def gpushare(self, user: str, path: str, method: str = "GET", token: str | None = None,
                       ok: bool = True, **kw: Any) -> tuple[int, Any]:
        """A user server's /api/gpushare/PATH through the proxy (admin token by default)."""
        return await self.request(f"/user/{user}/api/gpushare/{path}", token=token, method=method,
                                  ok=ok, **kw)

    async def service(self, path: str, method: str = "GET", token: str | None = None,
                      ok: bool = True, **kw: Any) -> tuple[int, Any]:
        return await self.request(f"/services/gpushare/{path}", token=token, method=method, ok=ok, **kw)

    async def kernel(self, user: str) -> UserKernel:
        token = await self.token_for(user)
        _, model = await self.request(f"/user/{user}/api/kernels", token=token, method="POST",
                                      body={"name": "python3"})
        ws = await websocket_connect(HTTPRequest(
            f"ws://127.0.0.1:{self.port}/user/{user}/api/kernels/{model['id']}/channels",
            headers={"Authorization": f"token {token}"}))
        k = UserKernel(self, user, model["id"], ws)
        await k.run("1", timeout=120)
        await self.wait_kernel(user, k.id, lambda s: True, "the kernel in status")
        return k

    async def kernel_status(self, user: str, kernel_id: str) -> dict[str, Any] | None:
        _, status = await self.gpushare(user, "status")
        return next((k for k in status["kernels"] if k["id"] == kernel_id), None)

    def kernel_status_now(self, user: str, kernel_id: str) -> dict[str, Any]:
        """The same, synchronously (where another event loop runs)."""
        import urllib.request

        req = urllib.request.Request(f"{self.url}/user/{user}/api/gpushare/status",
                                     headers={"Authorization": f"token {self.admin_token}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            status = json.loads(r.read())
        return next(k for k in status["kernels"] if k["id"] == kernel_id)

    async def wait_kernel(self, user: str, kernel_id: str, check: Any, what: str,
                          timeout: float = 120) -> dict[str, Any]:
        """Until ``check`` holds for the kernel in its server's status; ``timeout``: a bound
        for a loaded 2-core machine, not a timing."""
        deadline = time.monotonic() + timeout
        while True:
            k = await self.kernel_status(user, kernel_id)
            if k is not None and check(k):
                return k
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: {k}")
            await asyncio.sleep(0.1)

    async def metric(self, name: str, labels: str = "") -> float:
        _, text = await self.service("metrics")
        total = 0.0
        for line in str(text).splitlines():
            if (line.startswith(name + ("{" if labels else "")) and labels in line) or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        # the Hub stops its servers, proxy and service on SIGTERM, unless that took too long
        # or it died: what it started runs in sessions of its own, so find it by its environment
        left = self._started_processes()
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = [pid for pid in left if _alive(pid)]
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def _started_processes(self) -> list[int]:
        """Processes the Hub started (servers, their kernels, the service, the proxy)."""
        marks = [f"127.0.0.1:{self.hub_port}/".encode(), f"--port\0{self.port}\0".encode()]
        out = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                seen = (entry / "environ").read_bytes() + b"\0" + (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if self.hub_port and any(m in seen for m in marks):
                out.append(int(entry.name))
        return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0:1]
    except OSError:
        return False
    return state != ["Z"]  # a zombie is gone, only not yet reaped


@dataclass
class UserKernel:
    hub: Hub
    user: str
    id: str
    ws: Any
    session: str = field(default_factory=lambda: uuid.uuid4().hex)

    def send(self, code: str, msg_type: str = "execute_request", channel: str = "shell") -> str:
        msg_id = uuid.uuid4().hex
        self.ws.write_message(json.dumps({
            "header": {"msg_id": msg_id, "msg_type": msg_type, "username": self.user,
                       "session": self.session, "version": "5.3",
                       "date": datetime.now(timezone.utc).isoformat()},
            "parent_header": {}, "metadata": {}, "buffers": [], "channel": channel,
            "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True} if channel == "shell" else {},
        }))
        return msg_id

    async def wait(self, msg_id: str, timeout: float = 60) -> dict[str, Any]:
        """The reply and output of one cell."""
        out: dict[str, Any] = {"status": None, "text": "", "error": None}
        idle = False
        deadline = time.monotonic() + timeout
        while out["status"] is None or not idle:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no reply in {timeout} s: {out}")
            raw = await asyncio.wait_for(self.ws.read_message(), left)
            if raw is None:
                raise ConnectionError("websocket closed")
            msg = json.loads(raw)
            if (msg.get("parent_header") or {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["header"]["msg_type"], msg.get("content", {})
            if kind == "execute_reply":
                out["status"] = content.get("status")
            elif kind == "status" and content.get("execution_state") == "idle":
                idle = True
            elif kind == "stream":
                out["text"] += content.get("text", "")
            elif kind in ("display_data", "update_display_data", "execute_result"):
                out["text"] += (content.get("data") or {}).get("text/plain", "") + "\n"
            elif kind == "error":
                out["error"] = content
        return out

    async def run(self, code: str, timeout: float = 60, ok: bool = True) -> dict[str, Any]:
        out = await self.wait(self.send(code), timeout)
        if ok and out["status"] != "ok":
            raise AssertionError(f"cell failed: {out}\n--- code:\n{code}")
        return out

    async def shutdown(self) -> None:
        self.ws.close()
        token = await self.hub.token_for(self.user)
        await self.hub.request(f"/user/{self.user}/api/kernels/{quote(self.id)}", token=token,
                               method="DELETE", ok=False)


def login_page(browser: Any, hub: Hub, user: str, next_path: str = "/services/gpushare/") -> Any:
    """A Playwright page of a new browser context, logged in to ``hub`` as ``user`` (the
    dummy authenticator's password) and sent on to ``next_path``."""
    page = browser.new_context().new_page()
    page.goto(f"{hub.url}/hub/login?next={next_path}")
    page.fill("#username_input", user)
    page.fill("#password_input", PASSWORD)
    page.click("#login_submit")
    page.wait_for_load_state("load")
    return page


@contextlib.contextmanager
def running_hub(directory: Path, users: list[str], admins: list[str], service_config: str,
                servers: list[str], **options: Any) -> Iterator[Hub]:
    """:func:`start_hub` with the named users' servers started; stopped and ``directory``
    removed afterwards (kept with ``GPUSHARE_KEEP_HUB_DIR=1``, to read ``hub.log``)."""
    hub = start_hub(directory, users, admins, service_config, **options)
    try:
        asyncio.run(_start_servers(hub, servers))
        yield hub
    finally:
        hub.stop()
        if not os.environ.get("GPUSHARE_KEEP_HUB_DIR"):
            shutil.rmtree(directory, ignore_errors=True)


async def _start_servers(hub: Hub, users: list[str]) -> None:
    await asyncio.gather(*(hub.start_server(u) for u in users))


def start_hub(directory: Path, users: list[str], admins: list[str], service_config: str,
              server_args: list[str] | None = None, user_env: dict[str, dict[str, str]] | None = None,
              user_cmd: dict[str, list[str]] | None = None,
              gpus: tuple[int, ...] = (2048 * MiB,)) -> Hub:
    """Start JupyterHub in ``directory``; returns once its API answers."""
    directory.mkdir(parents=True, exist_ok=True)
    port, service_port = free_port(), free_port()
    node_path = str(directory / "simulated-node.sqlite")
    SharedSimNode(node_path, gpus).close()  # the node every user's server opens
    admin_token = secrets.token_hex(16)
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    hub_port = free_port()
    settings = {
        "port": port, "hub_port": hub_port, "proxy_api_port": free_port(), "dir": str(directory),
        "password": PASSWORD, "users": users + admins, "admins": admins, "admin_token": admin_token,
        "server_args": [
            # a default a test names itself is left out: the same option twice is refused
            *(a for a in ("--GPUShareApp.backend=simulated", "--GPUShareApp.poll_interval=0.2",
                          "--GPUShareApp.min_release_bytes=0", "--GPUShareApp.idle_timeout=3600",
                          "--GPUShareApp.pressure_free_fraction=0",
                          "--GPUShareHubLink.refresh_interval=1",
                          "--GPUShareHubLink.push_interval=1", "--GPUShareApp.placement=off")
              if not any(b.startswith(a.split("=")[0] + "=") for b in server_args or [])),
            *(server_args or []),
        ],
        "server_env": {"PYTHONPATH": pythonpath, "JUPYTER_GPUSHARE_SIMULATED_NODE": node_path,
                       "PYTHONUNBUFFERED": "1"},
        "user_env": user_env or {},
        "user_cmd": user_cmd or {},
    }
    (directory / "jupyterhub_config.py").write_text(
        CONFIG.format(snippet=str(SNIPPET), settings=json.dumps(settings)), encoding="utf-8")
    # the service measures the node itself (the shared simulated node, as NVML on a real one)
    (directory / "gpushare_hub_config.py").write_text(
        f"c.GPUShareHub.simulated_node = {node_path!r}\n" + service_config, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": pythonpath, "JUPYTER_GPUSHARE_SERVICE_PORT": str(service_port),
           "JUPYTER_GPUSHARE_PROXY_URL": f"http://127.0.0.1:{port}", "PYTHONUNBUFFERED": "1"}
    log = open(directory / "hub.log", "wb")
    process = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", "jupyterhub_config.py"],
                               cwd=directory, env=env, stdout=log, stderr=subprocess.STDOUT)
    hub = Hub(directory, port, service_port, admin_token, process, node_path, hub_port)
    # the Hub answering is the event; its exit the failure. Not a fixed 90 s: at a load of 11
    # on 2 cores a Hub was still creating its services then (the test's timeout bounds this)
    deadline = time.monotonic() + 280
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                pass
            code = subprocess.run(
                [sys.executable, "-c", f"import urllib.request as u; u.urlopen('{hub.url}/hub/api', timeout=2)"],
                capture_output=True).returncode
            if code == 0:
                break
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            hub.stop()
            raise RuntimeError(f"JupyterHub did not start; see {directory / 'hub.log'}:\n"
                               + (directory / "hub.log").read_text(errors="replace")[-3000:])
        time.sleep(0.3)
    return hub
