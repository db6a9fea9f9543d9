"""With the hub service, a kernel another user's server placed on a GPU and that has not
allocated yet counts as wanted memory on every server of the node, not only its own: an idle
kernel of another user makes way before the new kernel's first allocation fails.

A real JupyterHub and the gpushare service; alice's and bob's servers share one simulated GPU
of 1 GiB. bob's idle kernel holds 640 MiB (384 MiB, 37 %, stay free: no pressure). alice starts
a kernel whose kernelspec expects 320 MiB: her server places it and says so in its status; the
service tells bob's server, whose free memory as its release policy weighs it drops to 64 MiB
(6 %, under pressure_free_fraction): bob's kernel is released before alice's allocates, and
comes back whole afterwards.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from .hubharness import MiB, UserKernel, can_run, running_hub
from .scenarios import hold, intact
from .test_hub import holding_kernel, idle_for, shut

pytestmark = pytest.mark.skipif(bool(can_run()), reason=can_run() or "")

SERVICE_CONFIG = """
c.GPUShareHub.poll_interval = 1
"""
NEED = 320  # MiB alice's kernelspec expects


@pytest.fixture(scope="module")
def hub():
    directory = Path(tempfile.mkdtemp(prefix="gp-", dir="/tmp"))  # short: AF_UNIX paths fit
    share = directory / "alice-share"
    spec = share / "kernels" / "big"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "big", "language": "python",
        "metadata": {"gpushare": {"memory": f"{NEED}MiB"}}}))
    with running_hub(directory, ["alice", "bob"], ["admin"], SERVICE_CONFIG, ["alice", "bob"],
                     server_args=["--GPUShareApp.placement=room", "--GPUShareApp.release_policy=needs",
                                  "--GPUShareApp.pressure_free_fraction=0.1",
                                  "--GPUShareApp.pressure_idle_timeout=2",
                                  "--GPUShareApp.context_bytes=16777216",  # no context to hold
                                  "--GPUShareApp.turnless_restore_after=5"],  # s: keep it lean
                     user_env={"alice": {"JUPYTER_PATH": str(share)}},
                     gpus=(1024 * MiB,)) as running:
        yield running


async def kernel_of_spec(hub, user: str, name: str) -> UserKernel:
    """A kernel of kernelspec ``name`` on ``user``'s server, its agent connected."""
    token = await hub.token_for(user)
    _, model = await hub.request(f"/user/{user}/api/kernels", token=token, method="POST",
                                 body={"name": name})
    ws = await websocket_connect(HTTPRequest(
        f"ws://127.0.0.1:{hub.port}/user/{user}/api/kernels/{model['id']}/channels",
        headers={"Authorization": f"token {token}"}))
    k = UserKernel(hub, user, model["id"], ws)
    await k.run("1", timeout=120)
    return k


async def test_another_users_placed_need_has_an_idle_kernel_make_way_before_it_allocates(hub):
    bob = await holding_kernel(hub, "bob", 640, "b")
    await idle_for(hub, "bob", bob, 3)  # past pressure_idle_timeout: it may go, for a need
    _, status = await hub.gpushare("bob", "status")
    assert next(k for k in status["kernels"] if k["id"] == bob.id)["releases"] == 0  # no pressure

    alice = await kernel_of_spec(hub, "alice", "big")  # placed on GPU 0, nothing allocated
    try:
        placed = await hub.wait_kernel("alice", alice.id, lambda s: s["gpus"] == [0], "alice's placement")
        assert placed["state"] == "untracked" and placed["gpu_memory_bytes"] == 0, placed
        _, status = await hub.gpushare("alice", "status")
        assert status["gpus"][0]["placed_bytes"] == NEED * MiB

        released = await hub.wait_kernel("bob", bob.id, lambda s: s["state"] == "released",
                                         "bob's idle kernel to make way for alice's placed need")
        assert released["releases"] == 1, released
        _, status = await hub.gpushare("alice", "status")
        assert next(k for k in status["kernels"] if k["id"] == alice.id)["gpu_memory_bytes"] == 0

        await alice.run(hold(NEED, name="a", chunk=NEED))  # its first allocation finds room
        # bob's restore (it waits for its turn, then for room) brings every byte back
        assert (await bob.run(intact("b"), timeout=120))["text"].endswith("intact\n")
    finally:
        await shut(alice, bob)
