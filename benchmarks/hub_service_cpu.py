"""CPU and poll time of the gpushare hub service with N user servers (4 kernels each).

The real service (``python -m jupyter_gpushare.hub``, a separate process, measured with
psutil) polls an emulated Hub: one local tornado process (this script with ``--emulate``)
answers the Hub's paginated ``/hub/api/users`` (one ready server per user) and each server's
``/user/NAME/api/gpushare/status`` through the "proxy". The servers sit on nodes of 50, each
node two shared GPUs; each server has 4 kernels there. Every status body is built from the
REST contract (``jupyter_gpushare.server.contract_bodies``: what a body does not name gets
the schema's neutral value, so a field the contract makes required later does not break
this) and validated against it. On each node two servers always have a restore waiting that
nobody can serve (everyone else is busy), so every poll also runs the cross-user make-room.
Spinning real Jupyter servers and kernels would need ~15 GiB per 50 servers here, and
measure them, not the service.

Rows: the service at poll_interval 10 s (its default) and 2 s, over the same window, and the
emulator's own CPU (the baseline: what answering the same requests costs).

    python benchmarks/hub_service_cpu.py [--servers 50] [--window 60] [--quick] [--smoke]

``--smoke``: 3 servers, a 1 s window: the whole path, no figures worth reading.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import psutil

KERNELS_EACH, NODE_SERVERS = 4, 50
GiB = 1 << 30


def bodies(servers: int, kernels_each: int = KERNELS_EACH) -> dict[str, dict[str, Any]]:
    """User name -> the status body its server answers (contract-valid, built from it)."""
    from jupyter_gpushare.server import contract_bodies as cb

    out = {}
    for u in range(servers):
        node, rank = divmod(u, NODE_SERVERS)
        gpus = [cb.gpu(index=i, uuid=f"GPU-bench-n{node}-{i}", name="Emulated",
                       memory_total=80 * GiB, memory_used=79 * GiB, utilization=40.0,
                       released_bytes=GiB) for i in range(2)]
        kernels = []
        for j in range(kernels_each):
            waiting = rank < 2 and j == 0  # two restores per node that nobody can serve
            g = str(j % 2)
            kernels.append(cb.kernel(
                id=f"k-{u}-{j}", name="python3", path=f"nb{j}.ipynb", pids=[1000 + j],
                state="released" if waiting else "active",
                gpu_memory_bytes=0 if waiting else 2 * GiB, released_bytes=4 * GiB if waiting else 0,
                gpus=[j % 2], gpu_bytes={} if waiting else {g: 2 * GiB}, sm_utilization=50.0,
                gpu_utilization={} if waiting else {g: 50.0}, idle_seconds=0.0,
                idle_timeout=600.0, method="simulated", releases=1, restores=1,
                last_restore_seconds=0.5, last_release_seconds=0.4,
                waiting="waiting for memory: needs 4.0 GiB on GPU 0 (1.0 GiB free)" if waiting else None,
                execution_state="idle" if waiting else "busy", host_room_bytes=1 << 34,
                restore_need={"0": 4 * GiB} if waiting else {}))
        out[f"u{u:04d}"] = cb.status(backend="simulated", method="simulated", available=True,
                                     idle_timeout=600.0, restore_mode="eager", gpus=gpus,
                                     kernels=kernels)
    return out


def emulate(port: int, servers: int) -> None:
    """The emulated Hub and its users' servers, on 127.0.0.1:port, until terminated."""
    from tornado import ioloop, web

    raw = {user: json.dumps(body).encode() for user, body in bodies(servers).items()}
    users = [{"name": name, "groups": [], "servers": {"": {"ready": True, "url": f"/user/{name}/"}}}
             for name in raw]

    class Users(web.RequestHandler):
        def get(self) -> None:  # paginated as JupyterHub's
            offset = int(self.get_argument("offset", "0"))
            limit = int(self.get_argument("limit", "200"))
            end = min(offset + limit, len(users))
            nxt = None if end >= len(users) else {
                "offset": end, "limit": limit,
                "url": f"http://127.0.0.1:{port}/hub/api/users?offset={end}&limit={limit}"}
            self.finish({"items": users[offset:end],
                         "_pagination": {"offset": offset, "limit": limit, "total": len(users),
                                         "next": nxt}})

    class Status(web.RequestHandler):
        def get(self, user: str) -> None:
            self.set_header("Content-Type", "application/json")
            self.finish(raw[user])

    web.Application([(r"/hub/api/users", Users),
                     (r"/user/(u\d+)/api/gpushare/status", Status)]).listen(port, "127.0.0.1")
    print("ready", flush=True)
    ioloop.IOLoop.current().start()


def tail(log: Any) -> str:
    """What a service logged (warnings and errors: it runs at --log-level=WARN)."""
    log.seek(0)
    return "\n" + log.read().decode(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/services/gpushare/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=50, help="user servers (default 50)")
    parser.add_argument("--quick", action="store_true", help="20 s windows instead of 60 s")
    parser.add_argument("--window", type=float, default=60.0, help="seconds measured (default 60)")
    parser.add_argument("--smoke", action="store_true", help="3 servers, 1 s: the path only")
    parser.add_argument("--emulate", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.emulate:
        return emulate(args.emulate, args.servers)
    servers = 3 if args.smoke else args.servers
    window = 1.0 if args.smoke else 20.0 if args.quick else args.window
    nodes = -(-servers // NODE_SERVERS)
    emu_port = free_port()
    env = {**os.environ, "JUPYTERHUB_CLIENT_ID": "service-gpushare", "PYTHONUNBUFFERED": "1"}
    emulator = subprocess.Popen([sys.executable, __file__, "--emulate", str(emu_port),
                                 "--servers", str(servers)], stdout=subprocess.PIPE, text=True, env=env)
    services = []
    logs: list[Any] = []
    try:
        assert emulator.stdout is not None and emulator.stdout.readline().strip() == "ready", \
            "the emulator did not start"
        for poll in (10.0, 2.0):
            # its log to a file: a pipe nobody reads would stall it once full
            logs.append(tempfile.TemporaryFile())
            port = free_port()
            services.append((poll, port, subprocess.Popen(
                [sys.executable, "-m", "jupyter_gpushare.hub", f"--GPUShareHub.poll_interval={poll}",
                 f"--GPUShareHub.api_url=http://127.0.0.1:{emu_port}/hub/api",
                 f"--GPUShareHub.proxy_url=http://127.0.0.1:{emu_port}", "--GPUShareHub.api_token=bench",
                 f"--GPUShareHub.service_url=http://127.0.0.1:{port}", "--GPUShareHub.metrics_public=True",
                 "--GPUShareHub.config_file=", "--log-level=WARN"],
                env=env, stdout=subprocess.DEVNULL, stderr=logs[-1])))
        for _, port, proc in services:
            # up, and every server's status read (none refused as off-contract): each node's
            # two waiting restores show (a poll reads what answers within its deadline, the
            # rest at the next)
            deadline, waits = time.monotonic() + 300, -1.0
            while waits != 2 * nodes:
                try:
                    if metric(port, "gpushare_hub_poll_seconds_count") >= 1:
                        waits = metric(port, "gpushare_hub_waiting_restores")
                except OSError:
                    assert proc.poll() is None, tail(logs[len(services) - 1])
                assert time.monotonic() < deadline, \
                    f"in 300 s the service saw {waits:g} waiting restores, not {2 * nodes}"
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
    warnings = [tail(log).count("\n[W ") + tail(log).count("\n[E ") for log in logs]
    for log in logs:
        log.close()

    def cpu(i: int) -> float:
        used = (after[i].user - before[i].user) + (after[i].system - before[i].system)
        return 100 * used / window

    base = cpu(2)
    print(f"hub service CPU, {servers} servers x {KERNELS_EACH} kernels = {servers * KERNELS_EACH} kernels "
          f"on {nodes} node(s) of 2 GPUs, {window:.0f} s window" + ("  (--smoke: no figures)" if args.smoke else ""))
    print(f"{'row':<38}{'CPU % of a core':>16}{'vs emulator':>12}{'polls':>7}{'mean poll':>11}{'RSS':>9}")
    for i, (poll, _, _) in enumerate(services):
        mean = sums[i] / polls[i] * 1000 if polls[i] else float("nan")
        print(f"{f'service, poll_interval {poll:g} s':<38}{cpu(i):>16.2f}{cpu(i) / base if base else 0:>11.1f}x"
              f"{polls[i]:>7.0f}{mean:>9.0f} ms{rss[i] / 2**20:>6.0f} MiB")
    print(f"{f'emulated Hub + {servers} servers (baseline)':<38}{base:>16.2f}{'1.0':>11}x{'':>7}{'':>11}"
          f"{rss[2] / 2**20:>6.0f} MiB")
    print(f"warnings and errors the services logged: {warnings[0]} (poll 10 s), {warnings[1]} (poll 2 s)")


if __name__ == "__main__":
    main()
