"""What checking a server's claims at the node daemon adds to making room, against a service
that measures the node itself.

The hub service's coordinator (the real one) serves a pushed waiting restore, start to answer:
it reads the servers' statuses (answered at once from memory, so the figure is the service's
own work), measures, checks the claims, decides and releases the other user's idle kernel
(the release answered at once too). Two ways to measure, on one shared simulated node:

- **on-node**: the service measures the node itself (``backend = "simulated"``), as on one
  machine;
- **daemon**: the service measures nothing (a Kubernetes hub pod) and asks the node's daemon
  (a real ``jupyter gpushare node-daemon --listen`` subprocess) over TCP with the shared
  secret: connect, both proofs, the measure, the sealed answer.

The kernels are real processes on the node: alice's, whose waiting restore is believed (its
host memory holds the state), and bob's, holding GPU memory, idle: released for her each
round. A make-room measures twice (the push, then the decision on live numbers), so the
difference of the medians is what the daemon's two round trips cost.

    python benchmarks/daemon_check_latency.py [--rounds 200]

``--smoke``: five rounds of each, no figures worth reading.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from jupyter_gpushare.hub.coordinator import Coordinator, Settings, hub_policy
from jupyter_gpushare.hub.daemons import NodeDaemons
from jupyter_gpushare.hub.view import ServerRef
from jupyter_gpushare.node.daemon_service import Unreachable, ask
from jupyter_gpushare.node.measure import open_meter
from jupyter_gpushare.server import contract_bodies
from jupyter_gpushare.sim.shared import SharedSimNode

MiB = 1 << 20
GPU, HELD, NEED = 1024 * MiB, 1000 * MiB, 32 * MiB  # bob holds nearly all; alice needs a little
NODE = "bench-node"
SECRET = "a-secret-for-the-benchmark-only-0123456789"
KERNEL = "import os, sys, time\nballast = bytearray({n})\nsys.stdout.write('up\\n'); sys.stdout.flush()\ntime.sleep(3600)\n"


def kernel_process(user: str, host_bytes: int) -> subprocess.Popen:
    """A stand-in kernel of ``user`` (told apart by JUPYTERHUB_USER, as in a pod) holding
    ``host_bytes`` of host memory."""
    p = subprocess.Popen([sys.executable, "-c", KERNEL.format(n=host_bytes)],
                         env={**os.environ, "JUPYTERHUB_USER": user}, stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline() == b"up\n"
    return p


class InstantAPI:
    """The Hub and the servers, answering at once from memory: only the service's work counts."""

    timeout = 10.0

    def __init__(self, uuid: str, alice: int, bob: int):
        gpu = contract_bodies.gpu(index=0, uuid=uuid, name="Simulated GPU 0", memory_total=GPU,
                                  memory_used=GPU, utilization=0.0)

        def body(kernels: list[dict[str, Any]]) -> dict[str, Any]:
            return contract_bodies.status(backend="simulated", method="simulated", available=True,
                                          idle_timeout=3600.0, restore_mode="eager", gpus=[gpu],
                                          kernels=kernels, node=NODE)

        common = dict(name="python3", path="x.ipynb", gpus=[0], sm_utilization=0.0,
                      idle_timeout=3600.0, method="simulated", execution_state="idle")
        self.bodies = {
            "alice": body([contract_bodies.kernel(
                id="a1", pids=[alice], state="released", released_bytes=NEED, gpu_bytes={},
                restore_need={"0": NEED}, waiting="waiting for memory", idle_seconds=1.0,
                releases=1, **common)]),
            "bob": body([contract_bodies.kernel(
                id="b1", pids=[bob], state="idle", gpu_memory_bytes=HELD, gpu_bytes={"0": HELD},
                gpu_utilization={"0": 0.0}, idle_seconds=3600.0, **common)]),
        }
        self.raw = {u: json.dumps(b).encode() for u, b in self.bodies.items()}
        self.released = 0

    async def ready_servers(self) -> list[ServerRef]:
        return [ServerRef(u, "", f"/user/{u}/") for u in self.bodies]

    async def status(self, ref: ServerRef) -> bytes:
        return self.raw[ref.user]

    async def release(self, ref: ServerRef, kernel_id: str, if_idle_for: float | None) -> tuple[int, dict]:
        self.released += 1
        return 200, {"state": "released"}


def settings() -> Settings:
    return Settings({}, hub_policy(0, 0, 5, 0), claim_grace=1e6, claim_penalty=0)


def timed_measure(coord: Coordinator) -> list[float]:
    """The coordinator's measuring (its own reading, or the daemon's) timed: seconds per call."""
    spent: list[float] = []
    inner = coord._measure

    async def measure() -> None:
        started = time.perf_counter()
        try:
            await inner()
        finally:
            spent.append(time.perf_counter() - started)

    coord._measure = measure  # type: ignore[method-assign]
    return spent


async def rounds(coord: Coordinator, api: InstantAPI, n: int, measuring: list[float] | None = None,
                 spent: list[float] | None = None) -> list[float]:
    await coord.poll_once()
    out = []
    for _ in range(n):
        before = api.released
        at = len(spent) if spent is not None else 0
        started = time.perf_counter()
        answer = await coord.on_push("alice", "", ["a1"])
        out.append(time.perf_counter() - started)
        if spent is not None and measuring is not None:
            measuring.append(sum(spent[at:]))
        if api.released != before + 1:
            raise SystemExit(f"no room was made: {answer} (claims refused: "
                             f"{coord.entries[('alice', '')].refused})")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def daemon_up(port: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            await ask("127.0.0.1", port, SECRET.encode(), NODE, {"op": "measure"})
            return
        except Unreachable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


def figures(name: str, times: list[float]) -> tuple[float, float]:
    ms = sorted(t * 1000 for t in times)
    p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
    median = statistics.median(ms)
    print(f"{name:<18} {median:8.2f} {p95:8.2f}   ({len(ms)} make-rooms)")
    return median, p95


async def main(n: int) -> None:
    with tempfile.TemporaryDirectory(prefix="gpushare-check-") as tmp:
        path = str(Path(tmp) / "node.sqlite")
        node = SharedSimNode(path, (GPU,))
        uuid = node.uuid(0)
        secret = Path(tmp) / "secret"
        secret.write_text(SECRET)
        secret.chmod(0o400)
        alice, bob = kernel_process("alice", 4 * NEED), kernel_process("bob", 0)
        port = free_port()
        daemon = subprocess.Popen(
            [sys.executable, "-m", "jupyter_gpushare.node.daemon", "--socket", str(Path(tmp) / "d.sock"),
             "--backend", "simulated", "--simulated-node", path, "--node", NODE, "--unix-user", "",
             "--listen", f"127.0.0.1:{port}", "--secret-file", str(secret), "--log-level", "WARNING"])
        try:
            node.alloc(bob.pid, 0, HELD)
            await daemon_up(port)
            meter, _ = open_meter("simulated", path, "", None)
            assert meter is not None
            api = InstantAPI(uuid, alice.pid, bob.pid)
            here = Coordinator(api, settings(), meter=meter, measuring="the simulated node")  # type: ignore[arg-type]
            api_d = InstantAPI(uuid, alice.pid, bob.pid)
            off = Coordinator(api_d, settings(), measuring="off",  # type: ignore[arg-type]
                              daemons=NodeDaemons({NODE: f"127.0.0.1:{port}"}, str(secret), 5.0))
            spent = {"on-node": timed_measure(here), "daemon": timed_measure(off)}
            for coord, a in ((here, api), (off, api_d)):  # warm up: imports, first connections
                await rounds(coord, a, 3)
            times: dict[str, list[float]] = {"on-node": [], "daemon": []}
            measuring: dict[str, list[float]] = {"on-node": [], "daemon": []}
            for _ in range(n):  # interleaved: a busy moment costs both the same
                times["on-node"] += await rounds(here, api, 1, measuring["on-node"], spent["on-node"])
                times["daemon"] += await rounds(off, api_d, 1, measuring["daemon"], spent["daemon"])
            print(f"make-room for a pushed restore, the service's own work (ms); {os.cpu_count()} CPUs; "
                  f"load average {os.getloadavg()[0]:.1f}")
            print(f"{'':<18} {'median':>8} {'p95':>8}")
            m0, p0 = figures("on-node", times["on-node"])
            m1, p1 = figures("daemon", times["daemon"])
            print(f"{'added':<18} {m1 - m0:8.2f} {p1 - p0:8.2f}   (difference of the two rows)")
            print("of which measuring (two per make-room):")
            figures("  on-node: itself", measuring["on-node"])
            figures("  daemon: asked", measuring["daemon"])
            added = [d - h for d, h in zip(measuring["daemon"], measuring["on-node"], strict=True)]
            figures("  added, paired", added)
            meter.close()
        finally:
            node.close()
            for p in (daemon, alice, bob):
                p.terminate()
                p.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--smoke", action="store_true", help="five rounds: the path only")
    args = parser.parse_args()
    asyncio.run(main(5 if args.smoke else args.rounds))
