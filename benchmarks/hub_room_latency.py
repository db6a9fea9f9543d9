"""Time from a waiting restore to room made by another user's release, through a real JupyterHub.

The Hub of ``jupyter gpushare demo --hub`` (configurable-http-proxy, SimpleLocalProcessSpawner,
the gpushare service from the shipped snippet, one shared simulated node), with a 1 GiB GPU:
each round, one user's kernel holding 640 MiB is released, another user's kernel takes
640 MiB and goes idle, then the first user runs a cell. Its restore waits for memory; the
service makes room by releasing the other kernel; the restore proceeds.

Measured from the client, on the cell's own output: from the "waiting for memory" line to the
"restoring" line (the restore started: room was made and seen). Also the service's own
``gpushare_hub_room_seconds`` (its wait's first sight to the release done) and the other
kernel's release time. Rows: the push (bob's idle kernel makes room for alice; alice's
server tells the service at once) and the baseline, the service's poll alone (carol's
server cannot reach the service; poll_interval 10 s, the default).

    python benchmarks/hub_room_latency.py [--quick]

``--smoke``: one round of each, 80 MiB states on a 128 MiB GPU, the service polling every
second and releasing a kernel idle 0.5 s: the whole path, no figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from tornado.websocket import websocket_connect

from jupyter_gpushare.demo import hub as demo_hub
from jupyter_gpushare.sim.shared import SharedSimNode

MiB = 1 << 20
SIZE, GPU = 640, 1024  # MiB per kernel, MiB of the GPU: two kernels do not fit (--smoke: 80, 128)
IDLE = 1.0  # s: the service's pressure_idle_timeout (--smoke: 0.5)

EXTRA = """
c.JupyterHub.services.append({{"name": "bench", "api_token": {token!r}}})
c.JupyterHub.load_roles.append({{"name": "bench", "services": ["bench"], "scopes": [
    "admin:users", "admin:servers", "tokens", "access:servers", "read:metrics",
    "access:services"]}})
def _no_push_for_carol(spawner):
    if spawner.user.name == "carol":
        spawner.environment["JUPYTER_GPUSHARE_HUB_URL"] = "http://127.0.0.1:9/unreachable/"
c.Spawner.pre_spawn_hook = _no_push_for_carol
"""
SERVICE = """
c.GPUShareHub.poll_interval = {poll}
c.GPUShareHub.pressure_idle_timeout = {idle}
c.GPUShareHub.min_release_bytes = 0
"""
HOLD = ("from jupyter_gpushare.sim import simgpu\nimport numpy as np\n"
        "x = simgpu.array(np.arange({nbytes} // 4, dtype=np.uint32), copy=False)\n"
        "x_sum = x.checksum()")


class Hub:
    def __init__(self, url: str, token: str):
        self.url, self.token, self.tokens = url, token, {}

    async def call(self, path: str, method: str = "GET", body: Any = None, token: str | None = None) -> Any:
        req = HTTPRequest(self.url + path, method=method, request_timeout=120, allow_nonstandard_methods=True,
                          body=None if method == "GET" else json.dumps(body or {}).encode(),
                          headers={"Authorization": f"token {token or self.token}"})
        r = await AsyncHTTPClient().fetch(req)
        return json.loads(r.body) if r.body and r.headers.get("Content-Type", "").startswith("application/json") else r.body.decode()

    async def user_token(self, user: str) -> str:
        if user not in self.tokens:
            self.tokens[user] = (await self.call(f"/hub/api/users/{user}/tokens", "POST", {"expires_in": 3600}))["token"]
        return self.tokens[user]

    async def start(self, user: str) -> None:
        try:
            await self.call(f"/hub/api/users/{user}/server", "POST")
        except Exception:
            pass
        while not ((await self.call(f"/hub/api/users/{user}")).get("servers", {}).get("") or {}).get("ready"):
            await asyncio.sleep(0.2)

    async def status(self, user: str, kid: str) -> dict[str, Any]:
        """The kernel in its server's status, once the server's poll has seen it."""
        while True:
            body = await self.call(f"/user/{user}/api/gpushare/status")
            found = [k for k in body["kernels"] if k["id"] == kid]
            if found:
                return found[0]
            await asyncio.sleep(0.1)

    async def metric(self, name: str) -> float:
        text = await self.call("/services/gpushare/metrics")
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


class Kernel:
    def __init__(self, hub: Hub, user: str):
        self.hub, self.user = hub, user

    async def start(self) -> Kernel:
        token = await self.hub.user_token(self.user)
        model = await self.hub.call(f"/user/{self.user}/api/kernels", "POST", {"name": "python3"}, token=token)
        self.id = model["id"]
        self.ws = await websocket_connect(HTTPRequest(
            f"{self.hub.url.replace('http', 'ws')}/user/{self.user}/api/kernels/{self.id}/channels",
            headers={"Authorization": f"token {token}"}))
        await self.run("1")
        return self

    async def run(self, code: str) -> dict[str, float]:
        """Run a cell; the time each kind of output line first arrived."""
        msg_id = uuid.uuid4().hex
        self.ws.write_message(json.dumps({
            "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": self.user,
                       "session": "bench", "version": "5.3", "date": datetime.now(timezone.utc).isoformat()},
            "parent_header": {}, "metadata": {}, "buffers": [], "channel": "shell",
            "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True}}))
        seen: dict[str, float] = {}
        while "reply" not in seen:
            msg = json.loads(await asyncio.wait_for(self.ws.read_message(), 300))
            if (msg.get("parent_header") or {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["header"]["msg_type"], msg.get("content", {})
            text = str((content.get("data") or {}).get("text/plain", "")) + str(content.get("text", ""))
            for key in ("waiting for memory", "restoring"):
                if key in text and key not in seen:
                    seen[key] = time.monotonic()
            if kind == "execute_reply":
                if content.get("status") != "ok":
                    raise RuntimeError(f"cell failed: {content}")
                seen["reply"] = time.monotonic()
        return seen

    async def stop(self) -> None:
        self.ws.close()
        token = await self.hub.user_token(self.user)
        await self.hub.call(f"/user/{self.user}/api/kernels/{self.id}", "DELETE", token=token)


async def round_(hub: Hub, waiter: str, owner: str) -> tuple[float, float]:
    a = await Kernel(hub, waiter).start()
    await a.run(HOLD.format(nbytes=SIZE * MiB))
    while (await hub.status(waiter, a.id))["gpu_memory_bytes"] < SIZE * MiB:
        await asyncio.sleep(0.1)  # a poll of its server counts the memory
    await hub.call(f"/user/{waiter}/api/gpushare/kernels/{a.id}/release", "POST")
    b = await Kernel(hub, owner).start()
    await b.run(HOLD.format(nbytes=SIZE * MiB))
    while (await hub.status(owner, b.id))["idle_seconds"] < 1.5 * IDLE:
        await asyncio.sleep(0.1)
    seen = await a.run("assert x.checksum() == x_sum")
    if "waiting for memory" not in seen or "restoring" not in seen:
        raise RuntimeError(f"the restore did not wait: {seen}")
    release = (await hub.status(owner, b.id))["last_release_seconds"] or 0.0
    await a.stop()
    await b.stop()
    return seen["restoring"] - seen["waiting for memory"], release


def summary(values: list[float]) -> str:
    values = sorted(values)
    p95 = values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]
    return f"median {statistics.median(values):6.2f} s  p95 {p95:6.2f} s  (n={len(values)})"


async def bench(hub: Hub, rounds: int, baseline_rounds: int) -> None:
    await asyncio.gather(*(hub.start(u) for u in ("alice", "bob", "carol")))
    rows = {}
    for label, waiter, n in (("push (alice)", "alice", rounds), ("poll only (carol)", "carol", baseline_rounds)):
        before_n = await hub.metric("gpushare_hub_room_seconds_count")
        before_s = await hub.metric("gpushare_hub_room_seconds_sum")
        results = [await round_(hub, waiter, "bob") for _ in range(n)]
        service = ((await hub.metric("gpushare_hub_room_seconds_sum")) - before_s) / max(
            1, (await hub.metric("gpushare_hub_room_seconds_count")) - before_n)
        rows[label] = ([r[0] for r in results], [r[1] for r in results], service)
    push_median = statistics.median(rows["push (alice)"][0])
    print(f"waiting restore -> room made by another user's release ({SIZE} MiB states, {GPU} MiB GPU)")
    for label, (latency, release, service) in rows.items():
        overhead = [t - r for t, r in zip(latency, release, strict=True)]
        print(f"  {label:<18} {summary(latency)}  {statistics.median(latency) / push_median:5.1f}x push")
        print(f"  {'':<18} of which the other kernel's release: median {statistics.median(release):.2f} s;"
              f" the rest (telling, deciding, noticing): median {statistics.median(overhead):.2f} s,"
              f" max {max(overhead):.2f} s; the service's own count {service:.2f} s mean")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 + 2 rounds instead of 20 + 5")
    parser.add_argument("--smoke", action="store_true",
                        help="1 + 1 rounds of 80 MiB on 128 MiB, polls every second")
    args = parser.parse_args()
    rounds = (1, 1) if args.smoke else (5, 2) if args.quick else (20, 5)
    if args.smoke:
        global SIZE, GPU, IDLE
        SIZE, GPU, IDLE = 80, 128, 0.5
    why = demo_hub.missing()
    if why:
        sys.exit(why)
    directory = Path(tempfile.mkdtemp(prefix="ghb-", dir="/tmp"))
    port = demo_hub.free_port()
    token = secrets.token_hex(16)
    SharedSimNode(directory / "simulated-node.sqlite", (GPU * MiB,)).close()  # before the demo's
    config, env = demo_hub.prepare(directory, port, idle_timeout=3600)
    with config.open("a", encoding="utf-8") as f:
        f.write(EXTRA.format(token=token))
    (directory / "gpushare_hub_config.py").write_text(
        SERVICE.format(poll=1 if args.smoke else 10, idle=IDLE), encoding="utf-8")
    log = (directory / "hub.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", str(config)], cwd=directory,
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    hub = Hub(f"http://127.0.0.1:{port}", token)
    try:
        for _ in range(600):
            try:
                asyncio.run(hub.call("/hub/api/"))
                break
            except Exception:
                if proc.poll() is not None:
                    sys.exit(f"the Hub exited; see {directory / 'hub.log'}")
                time.sleep(0.2)
        asyncio.run(bench(hub, *rounds))
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
