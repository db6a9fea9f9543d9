"""Servers of one node share their placed kernels through the node daemon: the daemon's
``placed`` op on a real Unix socket (a real daemon subprocess on a shared simulated node), and
two real Jupyter servers placing kernels started back to back, before either allocates."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import pytest

from benchmarks._server import Server
from jupyter_gpushare.node.daemon_client import NodeDaemonTurns
from jupyter_gpushare.node.placed_claims import MAX_BYTES, ClaimError, PlacedClaims
from jupyter_gpushare.sim.node import GiB
from jupyter_gpushare.sim.shared import SharedSimNode

from .test_node_daemon import Client, Daemon, _same, two_gpu_node, uuids_of
from .test_node_locks import hold_one

MiB = 1 << 20
PROBE = "import os\nprint(os.environ.get('CUDA_VISIBLE_DEVICES'))"
ALLOC = ("from jupyter_gpushare.sim import simgpu\n"
         "y = simgpu.zeros(({mib} * 2**18,), dtype='float32', device=0)")


@pytest.fixture
def daemon(tmp_path):
    """A daemon whose claims live 2 s, on a node of two GPUs (their UUIDs: ``uuids``)."""
    path = two_gpu_node(tmp_path)
    d = Daemon(path, "--claim-ttl", "2").start()
    d.uuids = uuids_of(path)  # type: ignore[attr-defined]
    yield d
    d.stop()


def claim(uuid: str, n: int, k: int = 1) -> dict:
    return {"op": "placed", "gpus": {uuid: {"bytes": n, "kernels": k}}}


async def test_a_servers_claim_is_told_to_the_others_not_back_to_itself(daemon):
    g0, g1 = daemon.uuids
    # the daemon keys claims by the peer's pid: this process is one server, a subprocess another
    me = NodeDaemonTurns(daemon.socket)
    assert await me.placed({g0: (512 * MiB, 1, 64 * MiB)}) == {}  # nobody else placed anything
    # a second process of the node (another server): sees this one's claim
    answer = await _from_another_process(daemon.socket, claim(g1, 256 * MiB, 2))
    assert answer["ok"] is True and answer["ttl"] == 2, answer
    assert answer["others"] == {g0: {"bytes": 512 * MiB, "kernels": 1, "returning": 64 * MiB}}, answer
    # and this one sees its claim, not its own
    assert await me.placed({g0: (512 * MiB, 1, 0)}) == {g1: (256 * MiB, 2, 0)}
    assert await me.placed({}) == {g1: (256 * MiB, 2, 0)}  # withdrawn: nothing of its own
    answer = await _from_another_process(daemon.socket, claim(g1, 256 * MiB, 2))
    assert answer["others"] == {g1: {"bytes": 256 * MiB, "kernels": 2, "returning": 0}}, answer
    time.sleep(2.5)  # the other process's claim was not renewed within the ttl
    assert await me.placed({}) == {}


async def _from_another_process(path: str, msg: dict) -> dict:
    """One request from a process of its own (its pid is another server's)."""
    code = ("import json, socket, sys\ns = socket.socket(socket.AF_UNIX)\ns.connect(sys.argv[1])\n"
            "s.sendall(sys.argv[2].encode() + b'\\n')\nbuf = b''\n"
            "while not buf.endswith(b'\\n'):\n    buf += s.recv(65536)\nprint(buf.decode())")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, path, json.dumps(msg),
                                                stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    return json.loads(out)


@pytest.mark.parametrize("bad, why", [
    ({"op": "placed"}, '"gpus" must be an object'),
    ({"op": "placed", "gpus": ["x"]}, '"gpus" must be an object'),
    ({"op": "placed", "gpus": {"G": 5}}, "must be {"),
    ({"op": "placed", "gpus": {"G": {"bytes": -1}}}, '"bytes" of GPU'),
    ({"op": "placed", "gpus": {"G": {"bytes": True}}}, '"bytes" of GPU'),
    ({"op": "placed", "gpus": {"G": {"bytes": MAX_BYTES + 1}}}, '"bytes" of GPU'),
    ({"op": "placed", "gpus": {"G": {"kernels": 1.5}}}, '"kernels" of GPU'),
    ({"op": "placed", "gpus": {"G": {"returning": "1G"}}}, '"returning" of GPU'),
    ({"op": "placed", "gpus": {"G": {"bytes": 1, "owner": "x"}}}, "must be {"),
    ({"op": "placed", "gpus": {"GPU-not-here": {"bytes": 1}}}, "not a GPU of this node"),
    ({"op": "placed", "gpus": {"bad uuid!": {"bytes": 1}}}, "keyed by GPU UUIDs"),
])
async def test_a_bad_claim_is_refused_and_changes_nothing(daemon, bad, why):
    g0, _ = daemon.uuids
    bad = {**bad}
    if isinstance(bad.get("gpus"), dict) and "G" in bad["gpus"]:
        bad["gpus"] = {g0: bad["gpus"]["G"]}
    c = await Client.open(daemon.socket)
    try:
        assert (await c.ask(claim(g0, 100)))["ok"] is True  # a claim of 100 bytes
        reply = await c.ask({**bad, "id": 3})
        assert reply["ok"] is False and reply["op"] == "placed" and reply["id"] == 3, reply
        assert why in reply["error"], reply
        seen = await _from_another_process(daemon.socket, {"op": "placed", "gpus": {}})
        assert seen["others"] == {g0: {"bytes": 100, "kernels": 1, "returning": 0}}, seen
    finally:
        c.close()


def test_one_user_holds_a_bounded_number_of_claims():
    clock = [0.0]
    book = PlacedClaims(ttl=10, now=lambda: clock[0])
    for pid in range(64):
        book.put((1000, pid, ""), {"G": (1, 1, 2)})
    with pytest.raises(ClaimError, match="64 claims already"):
        book.put((1000, 99, ""), {"G": (1, 1, 0)})
    book.put((1000, 5, ""), {"G": (7, 1, 0)})  # a server renews its own
    other = (1001, 100, "")
    book.put(other, {"G": (1, 1, 0)})  # another user is not held back
    assert book.others(other) == {"G": (64 - 1 + 7, 64, 2 * 63)}
    clock[0] = 11.0
    book.put((1000, 99, ""), {"G": (1, 1, 0)})  # the old ones expired
    assert book.others(other) == {"G": (1, 1, 0)}
    pods = PlacedClaims(per_user=256)  # a DaemonSet's: every pod one uid, more connections
    for n in range(100):
        pods.put((1000, 0, f"t{n}"), {"G": (1, 1, 0)})
    assert pods.others((1000, 0, "t0")) == {"G": (99, 99, 0)}


async def test_servers_the_daemon_sees_as_one_pid_are_told_apart_by_their_tokens(daemon):
    """A daemon in another pid namespace (a Kubernetes DaemonSet) sees pid 0 for every pod's
    server, and every pod runs as one uid: two servers of one process here stand for them,
    each with its own token."""
    g0, g1 = daemon.uuids
    a, b = NodeDaemonTurns(daemon.socket), NodeDaemonTurns(daemon.socket)
    assert a.server_token != b.server_token
    assert await a.placed({g0: (100, 1, 0)}) == {}
    assert await b.placed({g1: (200, 1, 0)}) == {g0: (100, 1, 0)}
    assert await a.placed({g0: (100, 1, 0)}) == {g1: (200, 1, 0)}  # not replaced by b's
    c = await Client.open(daemon.socket)
    try:
        reply = await c.ask({**claim(g0, 1), "server": "not a token!"})
        assert reply["ok"] is False and '"server" must be a token' in reply["error"], reply
    finally:
        c.close()
    assert await b.placed({g1: (200, 1, 0)}) == {g0: (100, 1, 0)}  # nothing changed


async def _gpu_of(kernel) -> str:
    return (await kernel.run(PROBE)).text.strip()


async def test_two_servers_place_kernels_started_back_to_back_on_different_gpus(tmp_path):
    """Server A places a kernel that has not allocated yet; server B, another user's on the
    node, places its next kernel elsewhere, though A's GPU has more room to the byte and no
    load yet."""
    node_path = str(tmp_path / "node.sqlite")
    SharedSimNode(node_path, (2 * GiB, 2 * GiB)).close()
    node = SharedSimNode(node_path)
    d = Daemon(node_path).start()
    config = {"simulated_node": node_path, "node_daemon_socket": d.socket, "placement": "room",
              "poll_interval": 0.5}
    node.alloc(os.getpid(), 0, 16 * MiB)  # another process on GPU 0: GPU 1 has more room
    try:
        async with Server("placed-a", gpushare=config) as a, Server("placed-b", gpushare=config) as b:
            ka = await a.start_kernel()
            assert await _gpu_of(ka) == "1"
            kb = await b.start_kernel()  # before ka allocates anything
            assert await _gpu_of(kb) == "0", b.log_tail()
            with open(b.log_path, errors="replace") as f:
                text = f.read()
            assert "did not share the node's placements" not in text, text[-3000:]
    finally:
        node.release(os.getpid(), 0, 16 * MiB)
        node.close()
        d.stop()


async def test_another_servers_released_kernel_keeps_its_room_from_a_new_placement(tmp_path):
    """Server A's kernel holds 768 MiB on GPU 1 and is released: GPU 1 looks emptier than GPU
    0 (16 MiB of another process there), but A's state comes back to GPU 1 at its restore.
    Server B, told by the node daemon, places its next kernel on GPU 0; A's state comes back
    whole to GPU 1."""
    node_path = str(tmp_path / "node.sqlite")
    SharedSimNode(node_path, (2 * GiB, 2 * GiB)).close()
    node = SharedSimNode(node_path)
    d = Daemon(node_path).start()
    config = {"simulated_node": node_path, "node_daemon_socket": d.socket, "placement": "room",
              "poll_interval": 0.5, "idle_timeout": 0, "pressure_idle_timeout": 3600}
    node.alloc(os.getpid(), 0, 16 * MiB)
    try:
        async with Server("back-a", gpushare=config) as a, Server("back-b", gpushare=config) as b:
            ka = await a.start_kernel()
            assert await _gpu_of(ka) == "1"
            await ka.run(hold_one(768, "x"))
            await a.wait_kernel(ka.id, lambda v: v["gpu_memory_bytes"] >= 768 * MiB, "memory seen")
            await a.api("POST", f"/api/gpushare/kernels/{ka.id}/release")
            await a.wait_kernel(ka.id, lambda v: v["state"] == "released", "released")
            await asyncio.sleep(1.5)  # A's next polls tell the daemon what comes back
            kb = await b.start_kernel()
            assert await _gpu_of(kb) == "0", b.log_tail()
            assert await ka.value(_same("x")) is True  # restored by its cell, every byte
    finally:
        node.release(os.getpid(), 0, 16 * MiB)
        node.close()
        d.stop()


async def test_a_cell_out_of_memory_has_another_servers_idle_kernel_make_way(tmp_path):
    """Bob's kernel holds 640 MiB of the node's one 1 GiB GPU, idle; alice's kernel, which holds
    32 MiB there already, runs a cell that asks for 512 MiB and fails. Her server cannot release bob's kernel, but the node daemon tells bob's
    server what her kernel wants there, and its memory pressure rule releases its idle kernel
    (37.5 % of the GPU was free: not under pressure before); her next try fits, and bob's data
    comes back intact at his next cell."""
    node_path = str(tmp_path / "node.sqlite")
    SharedSimNode(node_path, (1 * GiB,)).close()
    d = Daemon(node_path).start()
    config = {"simulated_node": node_path, "node_daemon_socket": d.socket, "placement": "room",
              "poll_interval": 0.5, "release_policy": "needs", "idle_timeout": 3600,
              "pressure_idle_timeout": 1}
    try:
        async with Server("owed-bob", gpushare=config) as bob, \
                Server("owed-alice", gpushare=config) as alice:
            kb = await bob.start_kernel()
            await kb.run(hold_one(640, "x"))
            await bob.wait_kernel(kb.id, lambda v: v["gpu_memory_bytes"] >= 640 * MiB, "memory seen")
            ka = await alice.start_kernel()
            await ka.run(ALLOC.format(mib=32).replace("y =", "z ="))  # it has used the GPU:
            await alice.wait_kernel(ka.id, lambda v: v["gpu_memory_bytes"] >= 32 * MiB,
                                    "memory seen")  # its placement is no longer wanted memory
            await asyncio.sleep(2.5)  # idle past pressure_idle_timeout over several polls
            assert (await bob.kernel_status(kb.id))["state"] in ("active", "idle")  # kept
            failed = await ka.execute(ALLOC.format(mib=512))
            assert failed.error is not None and failed.error["ename"] == "SimOutOfMemoryError"
            assert ("the node's other gpushare servers were told that this kernel wants 512.0 "
                    "MiB more there") in failed.stderr, failed.stderr
            await bob.wait_kernel(kb.id, lambda v: v["state"] == "released",
                                  "bob's idle kernel released for alice's next try", timeout=30)
            with open(bob.log_path, errors="replace") as f:
                assert "memory pressure on GPU 0" in f.read()
            await ka.run(ALLOC.format(mib=512) + "\ndel y")  # her next try fits
            assert await kb.value(_same("x")) is True  # restored by his cell, every byte
    finally:
        d.stop()
