"""The simulated node shared by every server on a machine: one ledger in a SQLite file."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jupyter_gpushare import clock
from jupyter_gpushare.sim.node import GiB, SimNode, SimOutOfMemoryError
from jupyter_gpushare.sim.shared import SharedSimNode
from jupyter_gpushare.telemetry.simulated import process_alive

from .helpers import get_json, wait_for
from .scenarios import hold

MiB = 1 << 20


def test_two_openers_see_one_node(tmp_path):
    path = tmp_path / "node.sqlite"
    a = SharedSimNode(path, (2 * GiB, 4 * GiB))
    b = SharedSimNode(path, (8 * GiB,))  # a later opener: the file's sizes win
    assert b.capacities == a.capacities == (2 * GiB, 4 * GiB)
    assert b.node_id == a.node_id and [b.uuid(i) for i in range(2)] == [a.uuid(i) for i in range(2)]
    a.alloc(101, 0, 1536 * MiB)
    assert b.used(0) == 1536 * MiB and b.free(0) == 512 * MiB
    with pytest.raises(SimOutOfMemoryError, match="out of memory on simulated GPU 0"):
        b.alloc(202, 0, 1 * GiB)
    assert a.pids() == {101: {0: 1536 * MiB}}  # the refused allocation changed nothing
    b.release(101, 0, 512 * MiB)
    assert a.held_by(101) == {0: 1 * GiB}
    with pytest.raises(SimOutOfMemoryError):
        b.reserve(303, {0: 512 * MiB, 1: 5 * GiB})  # all or nothing
    assert a.held_by(303) == {}
    b.set_usage(303, {1: 3 * GiB})
    assert a.take_all(303) == {1: 3 * GiB} and b.used(1) == 0
    with pytest.raises(ValueError, match="invalid device 2"):
        a.alloc(101, 2, 1)


def test_two_files_are_two_nodes_with_their_own_gpu_uuids(tmp_path):
    one, two = SharedSimNode(tmp_path / "a.sqlite"), SharedSimNode(tmp_path / "b.sqlite")
    uuids_one = {one.uuid(i) for i in range(len(one.capacities))}
    uuids_two = {two.uuid(i) for i in range(len(two.capacities))}
    assert len(uuids_one) == len(one.capacities) and not uuids_one & uuids_two
    assert SimNode().uuid(0) != SimNode().uuid(0)  # private nodes are nodes of their own too


FILL = """
import sys
from jupyter_gpushare.sim.node import SimOutOfMemoryError
from jupyter_gpushare.sim.shared import SharedSimNode
node, pid, taken = SharedSimNode(sys.argv[1]), int(sys.argv[2]), 0
sys.stdin.readline()  # start together
while True:
    try:
        node.alloc(pid, 0, 16 << 20)
    except SimOutOfMemoryError:
        break
    taken += 16 << 20
print(taken)
"""


def test_processes_racing_for_memory_never_overcommit(tmp_path):
    """Four processes allocate on one GPU until it is full: a check and its allocation are
    one transaction, so together they take exactly the GPU's memory, never more."""
    path = str(tmp_path / "node.sqlite")
    node = SharedSimNode(path, (1 * GiB,))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    procs = [subprocess.Popen([sys.executable, "-c", FILL, path, str(1000 + i)], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE) for i in range(4)]
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    taken = [int(p.communicate(timeout=60)[0]) for p in procs]
    assert sum(taken) == 1 * GiB == node.used(0)
    assert sorted(node.pids()) == [1000 + i for i, n in enumerate(taken) if n]
    assert all(node.held_by(1000 + i).get(0, 0) == n for i, n in enumerate(taken))


def test_a_gone_process_memory_is_dropped_by_any_opener(tmp_path):
    path = tmp_path / "node.sqlite"
    node = SharedSimNode(path, (2 * GiB,))
    code = ("import os, sys; from jupyter_gpushare.sim.shared import SharedSimNode; "
            f"n = SharedSimNode({str(path)!r}); n.alloc(os.getpid(), 0, 1 << 30); "
            "n.busy_begin(os.getpid(), 0); print(os.getpid())")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONPATH": os.getcwd()})
    pid = int(child.stdout)
    assert node.held_by(pid) == {0: 1 * GiB}
    other = SharedSimNode(path)
    assert other.drop_gone(process_alive) == [pid]
    assert node.used(0) == 0 and node.busy_fraction(pid, 0, 0, 1e12) == 0.0


def test_busy_time_is_shared_and_unioned(tmp_path):
    a = SharedSimNode(tmp_path / "node.sqlite", (GiB,))
    b = SharedSimNode(tmp_path / "node.sqlite")
    t = clock.now() - 10.0
    a.busy_begin(1, 0, at=t)
    a.busy_end(1, 0, at=t + 4)
    b.busy_begin(2, 0, at=t + 2)
    b.busy_end(2, 0, at=t + 6)
    b.busy_begin(3, 0, at=t + 8)  # still open: busy until "until"
    assert a.busy_fraction(None, 0, t, t + 10) == pytest.approx(0.8)
    # pid 1 ran alone 2 s, then shared the GPU's time with pid 2 for 2 s (half each)
    assert b.busy_fraction(1, 0, t, t + 10) == pytest.approx(0.3)
    a.end_busy(3)
    assert b.busy_fraction(3, 0, t, t + 100) > 0  # closed at now(): counted to its end


@pytest.fixture
def shared_node_path(tmp_path):
    return str(tmp_path / "shared-node.sqlite")


@pytest.fixture
def gpushare_config(shared_node_path):
    return {"simulated_node": shared_node_path, "simulated_gpus": [2 * GiB]}


async def test_a_server_on_a_shared_node_counts_other_servers_memory(
        jp_fetch, kernels, gpushare_app, shared_node_path):
    """Another server's process holds memory on the node: this server's status shows it as
    used, its GPU has the node's UUID, and its kernels cannot allocate what is taken."""
    neighbour = SharedSimNode(shared_node_path)
    assert neighbour.capacities == (2 * GiB,)
    neighbour.alloc(os.getpid(), 0, 1536 * MiB)  # "another user's kernel": this test process
    k = await kernels.start()
    await k.run(hold(256, name="mine"))
    await gpushare_app.poll_once()
    status = await get_json(jp_fetch, "api", "gpushare", "status")
    gpu = status["gpus"][0]
    assert gpu["uuid"] == neighbour.uuid(0)
    assert gpu["memory_used"] == 1792 * MiB
    ex = await k.run(hold(512, name="more"), ok=False)
    assert "out of memory" in str(ex.error) + ex.stderr
    neighbour.release(os.getpid(), 0, 1536 * MiB)
    await k.run(hold(512, name="more"))
    await wait_for(lambda: neighbour.used(0) == 768 * MiB, what="the node to see the kernel's memory")
