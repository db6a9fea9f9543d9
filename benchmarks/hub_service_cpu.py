"""CPU of the gpushare hub service with 50 user servers and 200 kernels.

The real service (``python -m jupyter_gpushare.hub``, a separate process, measured with
psutil) polls an emulated Hub: one local tornado process answers the Hub's paginated
``/hub/api/users`` (50 users, one ready server each) and each server's
``/user/NAME/api/gpushare/status`` through the "proxy" (4 kernels per server on 2 shared
GPUs, as a real server's status: every body is checked against the REST contract first).
Two servers always have a restore waiting that nobody can serve (everyone else is busy), so
every poll also runs the cross-user make-room. Spinning 50 real Jupyter servers and 200
kernels would need ~15 GiB here, and measure them, not the service.

Rows: the service at poll_interval 10 s (its default) and 2 s, over the same window, and the
emulator's own CPU (the baseline: what answering the same requests costs).

    python benchmarks/hub_service_cpu.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import urllib.request

import psutil

SERVERS, KERNELS_EACH = 50, 4
GiB = 1 << 30

EMULATOR = r'''
import json, sys
from tornado import ioloop, web
from jupyter_gpushare.server import contract
N, K = int(sys.argv[2]), int(sys.argv[3])
GPUS = [{"index": i, "uuid": f"GPU-bench-{i}", "name": "Emulated", "memory_total": 80 << 30,
         "memory_used": 79 << 30, "utilization": 40.0, "released_bytes": 1 << 30, "mig": False}
        for i in range(2)]
def kernel(user, j):
    waiting = user < 2 and j == 0
    k = {"id": f"k-{user}-{j}", "name": "python3", "path": f"nb{j}.ipynb", "pids": [1000 + j],
         "state": "released" if waiting else "active", "pinned": False,
         "gpu_memory_bytes": 0 if waiting else 2 << 30, "released_bytes": (4 << 30) if waiting else 0,
         "gpus": [j % 2], "gpu_bytes": {} if waiting else {str(j % 2): 2 << 30},
         "sm_utilization": 50.0, "gpu_utilization": {} if waiting else {str(j % 2): 50.0},
         "idle_seconds": 0.0, "release_in_seconds": None,
         "idle_timeout": 600.0, "method": "simulated", "releases": 1, "restores": 1,
         "last_restore_seconds": 0.5, "last_release_seconds": 0.4, "error": None,
         "waiting": "waiting for memory: needs 4.0 GiB on GPU 0 (1.0 GiB free)" if waiting else None,
         "execution_state": "idle" if waiting else "busy", "release_blocked": None, "release_detail": None,
         "host_room_bytes": 1 << 34, "restore_need": {"0": 4 << 30} if waiting else {}}
    return k
BODIES = {}
for u in range(N):
    body = {"backend": "simulated", "method": "simulated", "available": True, "reason": "",
            "idle_timeout": 600.0, "restore_mode": "eager", "gpus": GPUS,
            "kernels": [kernel(u, j) for j in range(K)], "hub": None}
    contract.validate_response("/status", "GET", 200, body)
    BODIES[f"u{u:02d}"] = json.dumps(body).encode()
USERS = [{"name": f"u{u:02d}", "groups": [], "servers": {"": {"ready": True, "url": f"/user/u{u:02d}/"}}}
         for u in range(N)]
class Users(web.RequestHandler):
    def get(self):
        self.finish({"items": USERS, "_pagination": {"offset": 0, "limit": 200, "total": N, "next": None}})
class Status(web.RequestHandler):
    def get(self, user):
        self.set_header("Content-Type", "application/json")
        self.finish(BODIES[user])
web.Application([(r"/hub/api/users", Users),
                 (r"/user/(u\d+)/api/gpushare/status", Status)]).listen(int(sys.argv[1]), "127.0.0.1")
print("ready", flush=True)
ioloop.IOLoop.current().start()
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/services/gpushare/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 s windows instead of 60 s")
    window = 20.0 if parser.parse_args().quick else 60.0
    emu_port = free_port()
    env = {**os.environ, "JUPYTERHUB_CLIENT_ID": "service-gpushare", "PYTHONUNBUFFERED": "1"}
    emulator = subprocess.Popen([sys.executable, "-c", EMULATOR, str(emu_port), str(SERVERS), str(KERNELS_EACH)],
                                stdout=subprocess.PIPE, text=True, env=env)
    services = []
    try:
        assert emulator.stdout is not None and emulator.stdout.readline().strip() == "ready"
        for poll in (10.0, 2.0):
            port = free_port()
            services.append((poll, port, subprocess.Popen(
                [sys.executable, "-m", "jupyter_gpushare.hub", f"--GPUShareHub.poll_interval={poll}",
                 f"--GPUShareHub.api_url=http://127.0.0.1:{emu_port}/hub/api",
                 f"--GPUShareHub.proxy_url=http://127.0.0.1:{emu_port}", "--GPUShareHub.api_token=bench",
                 f"--GPUShareHub.service_url=http://127.0.0.1:{port}", "--GPUShareHub.metrics_public=True",
                 "--GPUShareHub.config_file=", "--log-level=WARN"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
        for _, port, proc in services:  # up, and through its first poll
            for _ in range(300):
                try:
                    if metric(port, "gpushare_hub_poll_seconds_count") >= 1:
                        break
                except OSError:
                    assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
                time.sleep(0.1)
        procs = [psutil.Process(p.pid) for _, _, p in services] + [psutil.Process(emulator.pid)]
        before = [p.cpu_times() for p in procs]
        polls_before = [metric(port, "gpushare_hub_poll_seconds_count") for _, port, _ in services]
        sums_before = [metric(port, "gpushare_hub_poll_seconds_sum") for _, port, _ in services]
        time.sleep(window)
        after = [p.cpu_times() for p in procs]
        rss = [p.memory_info().rss for p in procs]
        polls = [metric(port, "gpushare_hub_poll_seconds_count") - b for (_, port, _), b in zip(services, polls_before, strict=True)]
        sums = [metric(port, "gpushare_hub_poll_seconds_sum") - b for (_, port, _), b in zip(services, sums_before, strict=True)]
    finally:
        for _, _, p in services:
            p.terminate()
        emulator.terminate()
        for _, _, p in services:
            p.wait(10)
        emulator.wait(10)

    def cpu(i: int) -> float:
        used = (after[i].user - before[i].user) + (after[i].system - before[i].system)
        return 100 * used / window

    base = cpu(2)
    print(f"hub service CPU, {SERVERS} servers x {KERNELS_EACH} kernels = {SERVERS * KERNELS_EACH} kernels, "
          f"{window:.0f} s window")
    print(f"{'row':<34}{'CPU % of a core':>16}{'vs emulator':>12}{'polls':>7}{'mean poll':>11}{'RSS':>9}")
    for i, (poll, _, _) in enumerate(services):
        mean = sums[i] / polls[i] * 1000 if polls[i] else float("nan")
        print(f"{f'service, poll_interval {poll:g} s':<34}{cpu(i):>16.2f}{cpu(i) / base if base else 0:>11.1f}x"
              f"{polls[i]:>7.0f}{mean:>9.0f} ms{rss[i] / 2**20:>6.0f} MiB")
    print(f"{'emulated Hub + 50 servers (baseline)':<34}{base:>16.2f}{'1.0':>11}x{'':>7}{'':>11}{rss[2] / 2**20:>6.0f} MiB")


if __name__ == "__main__":
    main()
