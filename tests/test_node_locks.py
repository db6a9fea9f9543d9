"""Restores on different Jupyter servers take turns on a GPU they share.

Two real servers (subprocesses) on one shared simulated node, each with a released kernel;
their states do not both fit. Both restores are asked for at the same moment: one restores,
the other waits for memory (and restores once memory frees), and neither fails with out of
memory mid-way (on a real GPU that can leave the process locked for good). Also the lock
files themselves: one holder at a time across processes, a holder that dies frees the lock,
a lock held too long is not waited for.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

from tornado.httpclient import AsyncHTTPClient, HTTPRequest

from benchmarks._server import Server
from jupyter_gpushare.node.node_locks import NodeLocks
from jupyter_gpushare.sim.node import GiB
from jupyter_gpushare.sim.shared import SharedSimNode

MiB = 1 << 20


def hold_one(mib: int, name: str) -> str:
    """A cell that holds one array of ``mib`` MiB named ``name``, with its sum."""
    return (
        "from jupyter_gpushare.sim import simgpu\nimport numpy as np\n"
        f"{name} = simgpu.array(np.arange({mib * MiB // 4}, dtype=np.uint32), copy=False)\n"
        f"{name}_sum = int(np.asarray({name}.get(), dtype=np.uint64).sum())"
    )


async def released_on(servers: tuple[Server, ...], mib: int) -> list:
    """A kernel on each server holding ``mib`` MiB (arrays x, y, ...), released over REST."""
    kernels = [await srv.start_kernel() for srv in servers]
    for k, name in zip(kernels, "xyzw", strict=False):
        await k.run(hold_one(mib, name))
    for srv, k in zip(servers, kernels, strict=True):
        await srv.wait_kernel(k.id, lambda v: v["gpu_memory_bytes"] >= mib * MiB, "memory seen")
        await srv.api("POST", f"/api/gpushare/kernels/{k.id}/release")
    return kernels


async def post(srv: Server, path: str) -> tuple[int, dict]:
    """(status, JSON body) of a POST to one of the servers, 4xx included."""
    req = HTTPRequest(srv.base + path, method="POST", body=b"{}", request_timeout=120,
                      headers={"Authorization": f"token {srv.token}"})
    r = await AsyncHTTPClient(force_instance=True).fetch(req, raise_error=False)
    return r.code, json.loads(r.body) if r.body else {}


async def test_restores_on_two_servers_that_do_not_both_fit_take_turns(tmp_path):
    node_path = str(tmp_path / "node.sqlite")
    SharedSimNode(node_path, (2 * GiB,)).close()
    config = {"simulated_node": node_path, "node_lock_dir": str(tmp_path / "locks"),
              "idle_timeout": 0, "pressure_idle_timeout": 3600, "poll_interval": 0.5}
    async with Server("lock-a", gpushare=config) as a, Server("lock-b", gpushare=config) as b:
        ka, kb = await released_on((a, b), 768)
        neighbour = SharedSimNode(node_path)  # another user's process takes 1 GiB: one state fits
        neighbour.alloc(os.getpid(), 0, 1 * GiB)
        try:
            answers = await asyncio.gather(
                post(a, f"/api/gpushare/kernels/{ka.id}/restore"),
                post(b, f"/api/gpushare/kernels/{kb.id}/restore"),
            )
            codes = sorted(code for code, _ in answers)
            assert codes == [200, 202], answers  # one restored, one waits; no 409 out of memory
            views = [await a.kernel_status(ka.id), await b.kernel_status(kb.id)]
            assert [v["error"] for v in views] == [None, None], views
            waiting = [v for v in views if v["state"] == "released"]
            assert len(waiting) == 1 and "waiting for memory" in (waiting[0]["waiting"] or "")
        finally:
            neighbour.release(os.getpid(), 0, 1 * GiB)
            neighbour.close()
        for srv, k in ((a, ka), (b, kb)):  # memory freed: the waiting one restores by itself
            await srv.wait_kernel(k.id, lambda v: v["state"] in ("active", "idle"), "restored")
        for k, name in ((ka, "x"), (kb, "y")):  # every byte came back
            same = f"import json\nprint(json.dumps(int(np.asarray({name}.get(), dtype=np.uint64).sum()) == {name}_sum))"
            assert await k.value(same) is True


_HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


async def test_a_lock_held_by_another_process_is_waited_for_and_a_dead_holder_frees_it(tmp_path):
    locks = NodeLocks(str(tmp_path / "locks"), timeout=30)
    grant = await locks.acquire(["GPU-1"])  # creates the directory and the file
    grant.release()
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, locks._path("GPU-1"), "60"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        waiter = asyncio.ensure_future(locks.acquire(["GPU-1"]))
        await asyncio.sleep(0.5)
        assert not waiter.done()  # the other process holds it
        holder.kill()  # a server that dies: the kernel drops its lock
        grant = await asyncio.wait_for(waiter, 10)
        assert grant._fds  # taken, not skipped
        grant.release()
    finally:
        holder.kill()
        holder.wait()
    # created private: only this user's servers take turns there (a node's shared directory
    # is an admin's, root-owned: see test_node_lock_trust.py)
    assert oct(os.stat(tmp_path / "locks").st_mode & 0o7777) == "0o700"
    assert oct(os.stat(locks._path("GPU-1")).st_mode & 0o777) == "0o600"


async def test_a_lock_held_too_long_is_not_waited_for_and_a_cancel_leaves_nothing_held(tmp_path):
    locks = NodeLocks(str(tmp_path / "locks"), timeout=0.5)
    first = await locks.acquire(["GPU-1", "GPU-2"])
    second = await locks.acquire(["GPU-2"])  # gives up after 0.5 s: goes on without the lock
    assert second._fds == [] and "GPU-2" in second.unguarded
    waiter = asyncio.ensure_future(NodeLocks(locks.directory, timeout=30).acquire(["GPU-1"]))
    await asyncio.sleep(0.2)
    waiter.cancel()  # a restore stopped while it waits for its turn
    await asyncio.gather(waiter, return_exceptions=True)
    first.release()
    again = await NodeLocks(locks.directory, timeout=1).acquire(["GPU-1", "GPU-2"])
    assert len(again._fds) == 2  # nothing was left held by the cancelled waiter
    again.release()
