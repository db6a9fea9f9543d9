"""Two users' restores onto one GPU at once, with a real JupyterHub and the gpushare service:
the GPU (1 GiB, a shared simulated node) has room for one 384 MiB state, not both; carol's
idle kernel holds the rest. Each server keeps the default node_lock_dir (in its user's runtime
directory), which serializes that user's servers only: the two restores take no turn with each
other. Other processes are on the GPU (carol's kernel), so each server treats its turn as none
and asks for room for twice its state. alice's restore, once it runs, is held in flight (its
memory taken) until bob's restore has started or waits. Neither may run out of memory: the
one without room waits (status says why), carol's idle kernel is released for them, and both
states come back whole.

(With a shared node_lock_dir, as the admin guide sets it up, the restores take turns instead;
tests/test_node_locks.py covers that on one node without a Hub.)
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from .hubharness import MiB, can_run, running_hub
from .scenarios import intact
from .test_hub import admin_view, holding_kernel, idle_for, released_kernel, shut, until
from .test_restore_reservation import stall_restore_until

pytestmark = pytest.mark.skipif(bool(can_run()), reason=can_run() or "")

SERVICE_CONFIG = """
c.GPUShareHub.poll_interval = 1
c.GPUShareHub.pressure_idle_timeout = 2
c.GPUShareHub.min_release_bytes = 0
"""
STATE = 384  # MiB


@pytest.fixture(scope="module")
def hub():
    directory = Path(tempfile.mkdtemp(prefix="gi-", dir="/tmp"))  # short: AF_UNIX paths fit
    with running_hub(directory, ["alice", "bob", "carol"], ["admin"], SERVICE_CONFIG,
                     ["alice", "bob", "carol"],
                     server_args=["--GPUShareApp.turnless_restore_after=5"],  # s: keep it lean
                     gpus=(1024 * MiB,)) as running:
        yield running


async def test_two_restores_at_once_get_room_from_an_idle_kernel_and_come_back_whole(hub):
    go = hub.dir / "go"
    alice = await holding_kernel(hub, "alice", STATE, "a")
    await alice.run(stall_restore_until(str(go)))  # its next restore waits in flight
    code, body = await hub.gpushare("alice", f"kernels/{alice.id}/release", "POST",
                                    token=await hub.token_for("alice"))
    assert code == 200 and body["state"] == "released", body
    bob = await released_kernel(hub, "bob", STATE, "b")
    carol = await holding_kernel(hub, "carol", STATE, "c")
    try:
        await idle_for(hub, "carol", carol, 2.5)  # past pressure_idle_timeout: it may go
        cell_a, cell_b = alice.send(intact("a")), bob.send(intact("b"))
        # alice's restore, if it went first, holds its GPU's turn until it lands: let it land
        # once bob's has started (it then waits for the turn, or for memory) or is done
        first = await until(lambda: hub.kernel_status("bob", bob.id),
                            lambda s: s["waiting"] or s["state"] != "released",
                            "bob's restore under way")
        # carol's kernel is on the GPU, and no turn covers both users: room for twice is asked
        assert first["state"] != "released" or "twice that without a restore turn" in \
            first["waiting"], first
        go.touch()
        out_a = await alice.wait(cell_a, timeout=90)
        out_b = await bob.wait(cell_b, timeout=90)
        for out in (out_a, out_b):
            assert out["status"] == "ok" and "intact" in out["text"], out
            assert "out of memory" not in out["text"].lower(), out
        view = await until(lambda: admin_view(hub),
                           lambda v: any(r["kernel"] == carol.id for r in v["recent"]),
                           "the service's release of carol's kernel")
        (action,) = [r for r in view["recent"] if r["kernel"] == carol.id]
        assert action["action"] == "release" and action["for"] in ("alice", "bob"), action
        for user, k in (("alice", alice), ("bob", bob)):
            status = await hub.kernel_status(user, k.id)
            assert status is not None and status["state"] in ("active", "idle"), status
        assert (await hub.kernel_status("carol", carol.id))["state"] == "released"
    finally:
        go.touch()
        await shut(alice, bob, carol)
