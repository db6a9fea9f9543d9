"""Placement and restores that move, with the hub service: a new kernel goes, and a waiting
restore moves, where the room is as the service sees the node, other users' released kernels
included (a server alone sees only its own).

A real JupyterHub, one shared simulated node of two 512 MiB GPUs, servers with placement on.
alice's released kernel will take 320 MiB back on GPU 0, which reads as empty; bob's server
knows nothing of it, the service does. dave's server cannot reach the service: his kernels are
placed by his server's own view, at once.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest

from .hubharness import Hub, MiB, UserKernel, can_run, running_hub
from .scenarios import hold, intact
from .test_hub import BIG, admin_view, shut, until

pytestmark = pytest.mark.skipif(bool(can_run()), reason=can_run() or "")

SERVICE_CONFIG = """
c.GPUShareHub.poll_interval = 1
c.GPUShareHub.min_release_bytes = 0
"""


@pytest.fixture(scope="module")
def hub():
    directory = Path(tempfile.mkdtemp(prefix="gp-", dir="/tmp"))  # short: AF_UNIX paths fit
    with running_hub(directory, ["alice", "bob", "dave"], ["admin"], SERVICE_CONFIG, ["alice", "bob", "dave"],
                     server_args=["--GPUShareApp.placement=room",
                                  "--GPUShareApp.restore_move_after=1"],
                     user_env={"dave": {"JUPYTER_GPUSHARE_HUB_URL": "http://127.0.0.1:9/nowhere/"}},
                     gpus=(512 * MiB, 512 * MiB)) as hub:
        yield hub


async def visible(k) -> str:
    out = await k.run("import os; print('visible=' + os.environ.get('CUDA_VISIBLE_DEVICES', '-'))")
    return out["text"].split("visible=")[-1].strip()


def kernels_of(view: dict, user: str) -> list[dict]:
    return next((u["kernels"] for u in view["users"] if u["name"] == user), [])


async def test_a_new_kernel_avoids_the_gpu_another_users_released_kernel_comes_back_to(hub):
    await no_kernels_left(hub)
    alice = await hub.kernel("alice")
    assert await visible(alice) == "0"  # both GPUs empty: the first
    await alice.run(hold(BIG, chunk=BIG))
    await hub.wait_kernel("alice", alice.id, lambda s: s["gpu_memory_bytes"] == BIG << 20, "held")
    code, body = await hub.gpushare("alice", f"kernels/{alice.id}/release", "POST",
                                    token=await hub.token_for("alice"))
    assert code == 200 and body["state"] == "released", body
    # the service has read alice's server since the release
    await until(lambda: admin_view(hub),
                lambda v: any(k.get("state") == "released" for k in kernels_of(v, "alice")),
                "the service sees alice's released kernel")
    bob = await hub.kernel("bob")
    # GPU 0 reads as empty, as GPU 1 does; only the service knows alice's 320 MiB comes back there
    assert await visible(bob) == "1"
    out = await alice.run(intact())  # and alice's state comes back, whole, where it was
    assert "intact" in out["text"]
    status = await hub.kernel_status("alice", alice.id)
    assert status is not None and status["state"] in ("active", "idle"), status
    await shut(alice, bob)


async def test_a_new_kernel_avoids_the_gpu_another_users_kernel_was_just_placed_on(hub):
    """alice's kernel is placed on GPU 0 and has not used it yet: bob's server cannot see it
    (nothing is allocated), the service can (its pending), so bob's kernel goes to GPU 1."""
    await no_kernels_left(hub)
    alice = await hub.kernel("alice")
    assert await visible(alice) == "0"  # both GPUs empty: the first
    await until(lambda: admin_view(hub),
                lambda v: any(k.get("id") == alice.id for k in kernels_of(v, "alice")),
                "the service sees alice's new kernel")
    bob = await hub.kernel("bob")
    assert await visible(bob) == "1"
    await shut(alice, bob)


async def test_a_server_that_cannot_reach_the_service_places_by_its_own_view(hub):
    dave = await hub.kernel("dave")  # the service's address answers nothing: placed anyway
    assert await visible(dave) in ("0", "1")
    log = (hub.dir / "hub.log").read_text(errors="replace")
    assert "with the hub service's view" not in "\n".join(
        line for line in log.splitlines() if dave.id in line)
    await shut(dave)


async def released_where_placed(hub: Hub, user: str, mib: int, gpu: str) -> UserKernel:
    k = await hub.kernel(user)
    assert await visible(k) == gpu
    await k.run(hold(mib, chunk=mib))
    await hub.wait_kernel(user, k.id, lambda s: s["gpu_memory_bytes"] == mib << 20, "held")
    code, body = await hub.gpushare(user, f"kernels/{k.id}/release", "POST",
                                    token=await hub.token_for(user))
    assert code == 200 and body["state"] == "released", body
    return k


async def no_kernels_left(hub: Hub) -> None:
    """Until the service sees none of the earlier tests' kernels: a kernel placed and shut
    down before its server was read again still counts where it was placed (pending)."""
    await until(lambda: admin_view(hub),
                lambda v: not any(kernels_of(v, u) for u in ("alice", "bob", "dave")),
                "the service sees the earlier tests' kernels gone")


async def test_a_waiting_restore_does_not_move_onto_room_another_users_released_kernel_needs(hub):
    await no_kernels_left(hub)
    alice = await released_where_placed(hub, "alice", BIG, "0")
    await until(lambda: admin_view(hub),
                lambda v: any(k.get("state") == "released" for k in kernels_of(v, "alice")),
                "the service sees alice's released kernel")
    bob = await released_where_placed(hub, "bob", BIG, "1")  # GPU 0's room is alice's
    await until(lambda: admin_view(hub),
                lambda v: any(k.get("state") == "released" for k in kernels_of(v, "bob")),
                "the service sees bob's released kernel")
    # dave (no service) fills GPU 0, where alice's state belongs, and keeps it
    dave = await hub.kernel("dave")
    assert await visible(dave) == "0"
    await dave.run(hold(400, name="d", chunk=400))
    await hub.wait_kernel("dave", dave.id, lambda s: s["gpu_memory_bytes"] == 400 << 20, "dave's")
    await hub.gpushare("dave", f"kernels/{dave.id}/pin", "PUT", body={"pinned": True})

    cell = alice.send(intact())  # needs 320 MiB on GPU 0, which has 112 free
    await hub.wait_kernel("alice", alice.id, lambda s: bool(s["waiting"]), "alice's restore waits")
    # GPU 1 reads 512 MiB free, but bob's state comes back there: moving alice would leave
    # bob without room. Well past restore_move_after (1 s), she still waits, unmoved.
    await asyncio.sleep(4)
    status = await hub.kernel_status("alice", alice.id)
    assert status is not None and status["state"] == "released" and status["waiting"], status
    assert status["restored_onto"] is None, status
    # dave is done: alice comes back home, bob onto his own GPU, both whole
    await dave.shutdown()
    out = await alice.wait(cell, timeout=60)
    assert "intact" in out["text"], out
    assert "intact" in (await bob.run(intact()))["text"]
    status = await hub.kernel_status("alice", alice.id)
    assert status is not None and status["restored_onto"] is None, status
    await shut(alice, bob)
