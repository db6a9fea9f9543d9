"""A "single-user server" that speaks gpushare's REST contract and says whatever its user
wants (for the hub service's trust tests): started by JupyterHub's spawner in place of
jupyterhub-singleuser, as a careless or hostile user could.

It reads what to say from the JSON file in ``GPUSHARE_FAKE`` at every request:
``uuid``, ``total``, ``used`` (its reading of the GPU), ``delay`` (seconds before a status
answer), ``kernels`` (see :func:`kernel`; ``"self"`` in ``pids`` is this process) and
``push`` (kernel ids it tells the service are waiting, every second, with the server's own
token) and ``oom`` (``[{"kernel", "bytes"}]``: cells it tells the service ran out of memory on
GPU ``uuid``, every second). The service's answers to those pushes and out-of-memory requests
are appended to ``GPUSHARE_FAKE`` + ``.answers``.
``GPUSHARE_FAKE_BALLAST_MIB`` MiB of host memory are held from the start (a state it could
claim).
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlparse

from jupyter_gpushare.server import contract_bodies

MiB = 1 << 20
BALLAST = b"\x01" * (int(os.environ.get("GPUSHARE_FAKE_BALLAST_MIB", "0")) * MiB)


def config() -> dict[str, Any]:
    try:
        with open(os.environ["GPUSHARE_FAKE"], encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def kernel(kid: str, pids: list[Any], state: str = "released", gpu_bytes: int = 0,
           need: int = 0, released: int = 0, waiting: str | None = None, idle: float = 600.0) -> dict[str, Any]:
    """One kernel as GET /api/gpushare/status shows it (built from openapi.yaml: what this
    does not name is the schema's neutral value)."""
    on = {"0": gpu_bytes} if gpu_bytes else {}
    return contract_bodies.kernel(
        id=kid, name="python3", path="x.ipynb", pids=[os.getpid() if p == "self" else p for p in pids],
        state=state, gpu_memory_bytes=gpu_bytes, released_bytes=released, gpus=[0], gpu_bytes=on,
        sm_utilization=0.0, gpu_utilization={k: 0.0 for k in on}, idle_seconds=idle,
        idle_timeout=3600.0, method="simulated", releases=1 if released else 0,
        last_release_seconds=0.1 if released else None, waiting=waiting, execution_state="idle",
        restore_need={"0": need} if need and waiting else {})


def status(cfg: dict[str, Any]) -> dict[str, Any]:
    gpus = [contract_bodies.gpu(
        index=0, uuid=cfg.get("uuid", "SIM-none"), name="Simulated GPU 0",
        memory_total=cfg.get("total", 512 * MiB), memory_used=cfg.get("used"), utilization=0.0,
    )] if cfg.get("uuid") else []
    return contract_bodies.status(
        backend="simulated", method="simulated", available=True, idle_timeout=3600.0,
        restore_mode="eager", gpus=gpus, kernels=[kernel(**k) for k in cfg.get("kernels", [])])


class Fake(BaseHTTPRequestHandler):
    def _answer(self, code: int, body: Any) -> None:
        raw = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        if self.path.rstrip("/").endswith("/api/gpushare/status"):
            cfg = config()
            time.sleep(float(cfg.get("delay", 0)))
            return self._answer(200, status(cfg))
        self._answer(200, {})

    def do_POST(self) -> None:
        self._answer(409, {"message": "kernel is busy"})  # never releases anything

    do_PUT = do_POST

    def log_message(self, *args: object) -> None:
        pass


def push_forever() -> None:
    url, token = os.environ.get("JUPYTER_GPUSHARE_HUB_URL", ""), os.environ.get("JUPYTERHUB_API_TOKEN", "")
    while url and token:
        cfg = config()
        kernels = cfg.get("push") or []
        asks = [("api/waiting", {"server": "", "kernels": kernels})] if kernels else []
        asks += [("api/oom", {"server": "", "kernel": o["kernel"], "gpu": cfg.get("uuid", ""),
                              "bytes": o["bytes"]}) for o in cfg.get("oom") or []]
        for path, body in asks:
            req = urllib.request.Request(url + path, method="POST", data=json.dumps(body).encode(),
                                         headers={"Authorization": f"token {token}",
                                                  "Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    answer = r.read().decode()
            except Exception as e:  # the service refusing or down: noted, tried again
                answer = json.dumps({"error": str(e)})
            with open(os.environ["GPUSHARE_FAKE"] + ".answers", "a", encoding="utf-8") as f:
                f.write(answer + "\n")
        time.sleep(1)


if __name__ == "__main__":
    threading.Thread(target=push_forever, daemon=True).start()
    url = urlparse(os.environ["JUPYTERHUB_SERVICE_URL"])
    ThreadingHTTPServer((url.hostname or "127.0.0.1", url.port or 8888), Fake).serve_forever()
