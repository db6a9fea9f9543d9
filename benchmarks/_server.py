"""Shared helper of the benchmarks: a real ``jupyter server`` in a subprocess, real kernels.

``Server`` starts ``python -m jupyter_server`` on 127.0.0.1 with a token, a temporary root,
runtime and config directory, the simulated backend and whatever traits a benchmark sets; it
starts kernels over REST and opens websockets to them like JupyterLab does (``Kernel``).
Stopping it shuts the kernels down over REST, stops the server, then kills any process of
its tree still alive, so a benchmark leaves nothing behind even when it fails.

Nothing here is imported from tests/: the benchmarks talk to the server only over its
public REST and websocket API.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import psutil
from jupyter_server.services.kernels.connection.base import (
    deserialize_msg_from_ws_v1,
    serialize_msg_to_ws_v1,
)
from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from tornado.simple_httpclient import HTTPTimeoutError
from tornado.websocket import websocket_connect

from jupyter_gpushare.server.gate import GateConnection

GiB = 1 << 30
V1 = "v1.kernel.websocket.jupyter.org"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quantile(values: list[float], q: float) -> float:
    """The q-quantile (0-1) of ``values``, by linear interpolation."""
    data = sorted(values)
    if len(data) == 1:
        return data[0]
    pos = q * (len(data) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def summary(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "median": statistics.median(values), "p95": quantile(values, 0.95),
            "mean": statistics.fmean(values), "min": min(values)}


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A plain-text table, columns right-aligned except the first."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def machine() -> str:
    return (f"{os.cpu_count()} CPUs, {psutil.virtual_memory().total / GiB:.0f} GiB RAM, "
            f"Python {sys.version.split()[0]}, {datetime.now().strftime('%Y-%m-%d %H:%M')}")


# -- kernel messages -------------------------------------------------------------------------
def make_msg(msg_type: str, content: dict[str, Any], session: str, channel: str = "shell") -> dict[str, Any]:
    return {
        "header": {"msg_id": uuid.uuid4().hex, "msg_type": msg_type, "username": "bench",
                   "session": session, "version": "5.3",
                   "date": datetime.now(timezone.utc).isoformat()},
        "parent_header": {}, "metadata": {}, "buffers": [], "channel": channel, "content": content,
    }


@dataclass
class Reply:
    status: str = ""
    stdout: str = ""
    stderr: str = ""
    error: dict[str, Any] | None = None
    results: list[str] = field(default_factory=list)  # text/plain of execute_result
    sent: float = 0.0  # time.time() when the request was written to the websocket
    started: float | None = None  # when the kernel began handling it (execute_reply metadata)
    finished: float | None = None  # when the kernel sent its idle status (that message's date)

    @property
    def inbound(self) -> float | None:
        """Seconds from our send to the kernel's start: the server's inbound path (and the gate)."""
        return None if self.started is None else self.started - self.sent

    @property
    def in_kernel(self) -> float | None:
        """Seconds the kernel spent on the request, start to idle status (the kernel's clock)."""
        if self.started is None or self.finished is None:
            return None
        return self.finished - self.started

    @property
    def text(self) -> str:
        return self.stdout + "".join(self.results)


def _timestamp(value: Any) -> float | None:
    """Epoch seconds of an ISO 8601 date from a kernel message, None if there is none."""
    if not isinstance(value, str):
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


class Kernel:
    """One kernel and one websocket to it, in the legacy JSON or the v1 binary protocol."""

    def __init__(self, server: Server, kernel_id: str, ws: Any, protocol: str):
        self.server = server
        self.id = kernel_id
        self.ws = ws
        self.protocol = protocol
        self.session = uuid.uuid4().hex

    def _encode(self, msg: dict[str, Any]) -> str | bytes:
        if self.protocol == "json":
            return json.dumps(msg)
        parts = [json.dumps(msg[k]).encode() for k in ("header", "parent_header", "metadata", "content")]
        return serialize_msg_to_ws_v1(parts, msg["channel"])

    def _decode(self, raw: str | bytes) -> dict[str, Any]:
        if isinstance(raw, str):
            return json.loads(raw)
        channel, parts = deserialize_msg_from_ws_v1(raw)
        header, parent, metadata, content = (json.loads(p) for p in parts[:4])
        return {"channel": channel, "header": header, "parent_header": parent,
                "metadata": metadata, "content": content}

    async def execute(self, code: str, timeout: float = 120) -> Reply:
        """Send one execute_request; return when its reply and the idle status after it came."""
        msg = make_msg("execute_request", {
            "code": code, "silent": False, "store_history": True, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": True,
        }, self.session)
        msg_id = msg["header"]["msg_id"]
        data = self._encode(msg)
        reply = Reply(sent=time.time())
        await self.ws.write_message(data, binary=self.protocol != "json")
        deadline = time.monotonic() + timeout
        replied = idle = False
        while not (replied and idle):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"kernel {self.id}: no reply in {timeout} s to {code[:60]!r}")
            raw = await asyncio.wait_for(self.ws.read_message(), left)
            if raw is None:
                raise ConnectionError(f"kernel {self.id}: websocket closed")
            m = self._decode(raw)
            if (m.get("parent_header") or {}).get("msg_id") != msg_id:
                continue
            kind, content = m["header"]["msg_type"], m.get("content") or {}
            if kind == "execute_reply":
                reply.status, replied = content.get("status", ""), True
                reply.started = _timestamp((m.get("metadata") or {}).get("started"))
            elif kind == "status" and content.get("execution_state") == "idle":
                idle = True
                reply.finished = _timestamp(m["header"].get("date"))
            elif kind == "stream" and content.get("name") == "stdout":
                reply.stdout += content.get("text", "")
            elif kind == "stream" and content.get("name") == "stderr":
                reply.stderr += content.get("text", "")
            elif kind == "error":
                reply.error = content
            elif kind == "execute_result":
                reply.results.append((content.get("data") or {}).get("text/plain", ""))
        return reply

    async def run(self, code: str, timeout: float = 120) -> Reply:
        """Execute ``code``; raise if the cell failed."""
        reply = await self.execute(code, timeout)
        if reply.status != "ok":
            err = reply.error or {}
            raise RuntimeError(f"cell failed in kernel {self.id}: {err.get('ename')}: "
                               f"{err.get('evalue')}\n--- code:\n{code}")
        return reply

    async def value(self, expr_code: str, timeout: float = 120) -> Any:
        """Run ``expr_code``, whose last line prints one JSON value; return it."""
        reply = await self.run(expr_code, timeout)
        return json.loads(reply.stdout.strip().splitlines()[-1])

    def close(self) -> None:
        self.ws.close()


class Server:
    """A jupyter server in a subprocess; use as ``async with Server(...) as srv``."""

    def __init__(
        self,
        name: str,
        *,
        extension: bool = True,
        gpushare: dict[str, Any] | None = None,
        server: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        python_config: str = "",
    ):
        self.name = name
        self.env = env or {}  # set in the server's environment (its kernels inherit it)
        #: lines of a Python config file run after the options (for objects JSON cannot
        #: say, e.g. ``c.EventLogger.handlers``)
        self.python_config = python_config
        self.extension = extension
        # placement off unless asked for: the benchmarks and the tests that use this server
        # address GPUs by the node's numbering (device=1 is the node's second GPU)
        self.gpushare = {"backend": "simulated", "placement": "off", **(gpushare or {})}
        self.server_config = server or {}
        self.token = uuid.uuid4().hex
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.tmp = ""
        self.kernels: list[Kernel] = []
        self.kernel_ids: list[str] = []
        self._tree: set[int] = set()  # every pid seen in the server's process tree
        self.unresponsive = False  # a request timed out while stopping: skip the rest, kill
        self._http = AsyncHTTPClient(force_instance=True)

    # -- lifecycle ---------------------------------------------------------------------------
    async def __aenter__(self) -> Server:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    def _config(self) -> dict[str, Any]:
        server_cfg: dict[str, Any] = {
            "jpserver_extensions": {"jupyter_gpushare": self.extension},
            **self.server_config,
        }
        cfg: dict[str, Any] = {"ServerApp": server_cfg}
        if self.extension:
            cfg["GPUShareApp"] = self.gpushare
        return cfg

    async def start(self, timeout: float = 90) -> None:
        self.tmp = tempfile.mkdtemp(prefix=f"gpushare-bench-{self.name}-")
        root = os.path.join(self.tmp, "root")
        runtime = os.path.join(self.tmp, "rt")
        os.makedirs(root)
        os.makedirs(runtime)
        config_file = os.path.join(self.tmp, "jupyter_server_config.json")
        with open(config_file, "w") as f:
            json.dump(self._config(), f)
        if self.python_config:
            options, config_file = config_file, os.path.join(self.tmp, "jupyter_server_config.py")
            with open(config_file, "w") as f:
                f.write(f"import json\nfrom traitlets.config import Config\n"
                        f"c.merge(Config(json.load(open({options!r}))))\n{self.python_config}\n")
        args = [
            sys.executable, "-m", "jupyter_server",
            f"--config={config_file}",
            "--ip=127.0.0.1", f"--port={self.port}", "--port-retries=0",
            f"--ServerApp.token={self.token}", f"--ServerApp.root_dir={root}",
            "--no-browser", "--allow-root",
        ]
        if self.extension:
            args.append(f"--GPUShareApp.backend={self.gpushare['backend']}")
        env = {**os.environ, "JUPYTER_RUNTIME_DIR": runtime, "PYTHONUNBUFFERED": "1", **self.env}
        self.log_path = os.path.join(self.tmp, "server.log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.name} exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                await self.api("GET", "/api/status")
                break
            except (ConnectionError, OSError, HTTPClientError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"server {self.name} did not answer:\n{self.log_tail()}") from None
                await asyncio.sleep(0.2)
        if self.extension:
            status = await self.api("GET", "/api/gpushare/status")
            if status.get("backend") != self.gpushare["backend"]:
                raise RuntimeError(f"server {self.name}: backend is {status.get('backend')}")
        else:
            try:
                await self.api("GET", "/api/gpushare/status")
            except HTTPClientError as e:
                if e.code != 404:
                    raise
            else:
                raise RuntimeError(f"server {self.name}: the extension is on, but should be off")

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def _note_tree(self) -> None:
        try:
            root = psutil.Process(self.pid)
            self._tree.update(p.pid for p in [root, *root.children(recursive=True)])
        except psutil.Error:
            pass

    def kernel_processes(self) -> list[psutil.Process]:
        """The server's descendant processes (the kernels and their children)."""
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return []

    async def stop(self) -> None:
        for k in self.kernels:
            k.close()
        if self.proc is not None and self.proc.poll() is None:
            self._note_tree()
            for kid in self.kernel_ids:
                if self.unresponsive:
                    break
                try:
                    await self.api("DELETE", f"/api/kernels/{kid}", timeout=30)
                except HTTPTimeoutError:  # a server that stopped answering gets killed below
                    self.unresponsive = True
                except Exception:  # the server may be gone already: the kill below cleans up
                    pass
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.to_thread(self.proc.wait), 5 if self.unresponsive else 20)
            except asyncio.TimeoutError:
                pass
        self._kill_leftovers()
        self._http.close()
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = ""

    def _kill_leftovers(self) -> None:
        alive = []
        for pid in self._tree | ({self.proc.pid} if self.proc else set()):
            try:
                p = psutil.Process(pid)
                p.kill()
                alive.append(p)
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=10)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    # -- REST and websockets ---------------------------------------------------------------------
    async def api(self, method: str, path: str, body: Any = None, timeout: float = 600) -> Any:
        req = HTTPRequest(
            self.base + path, method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
            body=json.dumps(body) if body is not None else (b"{}" if method in ("POST", "PUT") else None),
            request_timeout=timeout, connect_timeout=10,
        )
        r = await self._http.fetch(req)
        return json.loads(r.body) if r.body else None

    async def metrics(self) -> str:
        req = HTTPRequest(self.base + "/metrics", headers={"Authorization": f"token {self.token}"})
        r = await self._http.fetch(req)
        return r.body.decode()

    async def start_kernel(self, protocol: str = "json", agent: bool | None = None) -> Kernel:
        """Start a python3 kernel, open a websocket, run one cell; wait for the agent if any."""
        info = await self.api("POST", "/api/kernels", {"name": "python3"})
        kid = info["id"]
        self.kernel_ids.append(kid)
        kernel = await self.connect(kid, protocol)
        await kernel.run("1")
        want_agent = (self.extension and self.gpushare.get("load_agent", True)) if agent is None else agent
        if want_agent:
            await self.wait_kernel(kid, lambda k: k.get("method") is not None, "the agent to connect")
        self._note_tree()
        return kernel

    async def connect(self, kernel_id: str, protocol: str = "json") -> Kernel:
        url = f"ws://127.0.0.1:{self.port}/api/kernels/{kernel_id}/channels"
        # a loaded machine (50 kernels starting on 2 cores) can take longer than tornado's 20 s
        req = HTTPRequest(url, headers={"Authorization": f"token {self.token}"},
                          connect_timeout=60, request_timeout=60)
        ws = await websocket_connect(
            req, subprotocols=[V1] if protocol == "v1" else None, max_message_size=1 << 30,
        )
        if protocol == "v1" and ws.selected_subprotocol != V1:
            raise RuntimeError("the server did not accept the v1 kernel websocket protocol")
        kernel = Kernel(self, kernel_id, ws, protocol)
        self.kernels.append(kernel)
        return kernel

    async def kernel_status(self, kernel_id: str) -> dict[str, Any]:
        status = await self.api("GET", "/api/gpushare/status")
        for k in status["kernels"]:
            if k["id"] == kernel_id:
                return k
        return {}

    async def wait_kernel(self, kernel_id: str, pred: Any, what: str, timeout: float = 60) -> dict[str, Any]:
        """Poll the gpushare status until ``pred(kernel view)`` holds."""
        deadline = time.monotonic() + timeout
        while True:
            k = await self.kernel_status(kernel_id)
            if k and pred(k):
                return k
            if time.monotonic() > deadline:
                raise TimeoutError(f"server {self.name}: timed out waiting for {what}; kernel: {k}")
            await asyncio.sleep(0.05)


async def pass_cells(kernel: Kernel, n: int, measure: str) -> list[tuple[float, float]]:
    """(round trip, ``measure``) seconds of ``n`` cells ``pass``; ``measure`` is a Reply
    property: "inbound" (send -> kernel start) or "in_kernel" (the kernel's own span)."""
    out = []
    for _ in range(n):
        t = time.perf_counter()
        reply = await kernel.execute("pass")
        rtt = time.perf_counter() - t
        value = getattr(reply, measure)
        if reply.status != "ok" or value is None:
            raise RuntimeError(f"cell failed or no {measure} time: {reply}")
        out.append((rtt, value))
    return out


def process_cpu_seconds(p: psutil.Process) -> float:
    """User + system CPU seconds of ``p`` itself (its children excluded)."""
    t = p.cpu_times()
    return t.user + t.system



class StockConnection(ZMQChannelsWebsocketConnection):
    """The stock kernel websocket connection, unchanged: naming it keeps the gate off.

    The extension replaces exactly ZMQChannelsWebsocketConnection with its gate; any other
    class is left alone (gate_latency.py's baseline).
    """


class NoDelayConnection(ZMQChannelsWebsocketConnection):
    """The stock connection with TCP_NODELAY on the websocket (gate_latency.py).

    jupyter_server leaves Nagle's algorithm on for kernel websockets; a reply made of several
    small frames then waits for the client's delayed ACK (about 40 ms on Linux).
    """

    async def connect(self) -> Any:
        result = await super().connect()
        self.websocket_handler.set_nodelay(True)
        return result


class GateNoDelayConnection(GateConnection):
    """The gate with TCP_NODELAY: compares with NoDelayConnection without the 40 ms stall."""

    async def connect(self) -> Any:
        result = await super().connect()
        self.websocket_handler.set_nodelay(True)
        return result
