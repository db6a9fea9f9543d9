"""The hub service's make-room counts other restores that will still land on the GPU.

Room for a restore waiting on one server is the GPU's free memory less what other restores
will still put there without free memory showing it yet: another server's restore in flight
(its bytes reserved, not landed or not measured yet: the server says them per GPU as
``restoring_bytes``), and a restore the service has just made room for that has not started.
Counted free, that room was promised twice: the service released nothing (or too little) for
the second restore, which waited for its next push.

alice's server is real (the shared simulated node, a restore held in flight); bob's and
carol's statuses are built from the contract, reading the same GPU at the same moment; the
Hub's API is faked (what the service releases is recorded).
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from jupyter_gpushare.hub.snapshot import parse_status
from jupyter_gpushare.hub.view import GpuIds, NodeView, ServerRef
from jupyter_gpushare.server import contract_bodies
from jupyter_gpushare.sim.shared import SharedSimNode

from .helpers import wait_for
from .scenarios import MiB, hold, rest
from .test_hub_view import FakeAPI, coordinator, kernel
from .test_restore_reservation import stall_restore_until

STATE = 384 * MiB  # each restore's state; the GPU has 1 GiB


@pytest.fixture
def gpushare_config(tmp_path):
    node = str(tmp_path / "node.sqlite")
    SharedSimNode(node, (1024 * MiB,)).close()
    # the server measures only when the test says (a poll lands between its readings)
    return {"simulated_node": node, "node_lock_dir": str(tmp_path / "locks"), "poll_interval": 3600}


def gpu_row(uuid: str, used: int, **more) -> dict:
    return contract_bodies.gpu(index=0, uuid=uuid, name="GPU 0", memory_total=1024 * MiB,
                               memory_used=used, utilization=0.0, **more)


def status(gpus: list[dict], kernels: list[dict]) -> bytes:
    return json.dumps(contract_bodies.status(
        backend="simulated", method="simulated", available=True, idle_timeout=600.0,
        restore_mode="eager", gpus=gpus, kernels=kernels)).encode()


def waits(kid: str, uuid: str, used: int) -> bytes:
    """A server whose kernel's restore of 384 MiB waits for memory on the GPU."""
    return status([gpu_row(uuid, used, released_bytes=STATE, returning_bytes=STATE, restoring_bytes=0)],
                  [kernel(kid, "released", need={0: STATE}, waiting="waiting for memory: needs 384 MiB",
                          released_bytes=STATE)])


def carol_idle(uuid: str, used: int, kernels: dict[str, float] | None = None) -> bytes:
    """carol's server: idle kernels of 384 MiB each (id -> idle seconds)."""
    return status([gpu_row(uuid, used, released_bytes=0, returning_bytes=0, restoring_bytes=0)],
                  [kernel(k, gpu_bytes={0: STATE}, idle=idle) for k, idle in (kernels or {"c1": 100.0}).items()])


async def test_another_servers_restore_in_flight_is_counted_when_room_is_made(
    jp_fetch, kernels, gpushare_app, tmp_path
):
    app, go = gpushare_app, tmp_path / "go"
    node = SharedSimNode(app.simulated_node)
    node.alloc(os.getpid(), 0, STATE)  # carol's kernel's 384 MiB, on the node as NVML sees it
    a = await kernels.start()
    await a.run(hold(384, name="a", chunk=128) + "\n" + stall_restore_until(str(go)))
    await app.poll_once()
    assert (await rest(jp_fetch, a.id, "release"))[0] == 200
    await app.poll_once()
    restore = asyncio.ensure_future(rest(jp_fetch, a.id, "restore"))
    try:
        await wait_for(lambda: node.used(0) == 2 * STATE, what="alice's restore to take its memory")
        assert app.controller.states[a.id].state == "restoring"
        # 256 MiB are free; bob's 384 MiB need carol's idle kernel released. Before alice's
        # server measures the landed bytes (its memory_used 384 MiB: 640 MiB look free) and after
        for measured in (False, True):
            if measured:
                await app.poll_once()
            body = json.loads((await jp_fetch("api", "gpushare", "status")).body)
            (g,) = body["gpus"]
            assert g["memory_used"] + g["restoring_bytes"] == 2 * STATE, (measured, g)
            assert g["restoring_bytes"] == (0 if measured else STATE)
            uuid, used = g["uuid"], g["memory_used"]  # every server read the GPU at that moment
            api = FakeAPI({"alice": json.dumps(body).encode(), "bob": waits("b1", uuid, used),
                           "carol": carol_idle(uuid, used)}, {})
            coord = coordinator(api)
            await coord.poll_once()  # a first poll serves no wait: the push does
            answer = await coord.on_push("bob", "", ["b1"])
            assert api.released == [("carol", "c1")], (measured, answer)
            assert answer["released"] and "b1" not in answer["waits"], answer
            assert app.controller.states[a.id].state == "restoring"  # alice's, untouched
    finally:
        go.touch()
        node.release(os.getpid(), 0, STATE)
    code, body = await restore
    assert code == 200 and body["state"] == "active", body


async def test_room_made_for_a_restore_that_has_not_started_is_not_made_again():
    """alice's and bob's restores both wait; the service releases carol's c1 for alice's. Until
    alice's server starts it, that room is alice's: bob's push releases c2, not nothing."""
    uuid = "GPU-one"
    api = FakeAPI({"alice": waits("a1", uuid, 2 * STATE), "bob": waits("b1", uuid, 2 * STATE),
                   "carol": carol_idle(uuid, 2 * STATE, {"c1": 200.0, "c2": 100.0})}, {})
    coord = coordinator(api)
    await coord.poll_once()  # a first poll serves no wait: the pushes do
    first = await coord.on_push("alice", "", ["a1"])
    assert api.released == [("carol", "c1")] and first["released"], first
    # carol's server says c1 is released (640 MiB free); alice's restore has not started yet
    api.bodies = {"alice": waits("a1", uuid, STATE), "bob": waits("b1", uuid, STATE),
                  "carol": status([gpu_row(uuid, STATE, released_bytes=STATE, returning_bytes=STATE,
                                           restoring_bytes=0)],
                                  [kernel("c1", "released", released_bytes=STATE),
                                   kernel("c2", gpu_bytes={0: STATE}, idle=100.0)])}
    second = await coord.on_push("bob", "", ["b1"])
    assert api.released == [("carol", "c1"), ("carol", "c2")], second
    # once alice's restore runs, its bytes count as reserved there, not as room made
    api.bodies["alice"] = status(
        [gpu_row(uuid, STATE, released_bytes=STATE, returning_bytes=STATE, restoring_bytes=STATE)],
        [kernel("a1", "restoring", released_bytes=STATE)])
    await coord.poll_once()
    bob = coord.view.find("bob", "", "b1")
    assert bob is not None and coord._landing(bob) == {coord.ids(uuid): STATE}  # once


def test_a_server_before_restoring_bytes_adds_nothing_in_flight():
    """An older server does not say restoring_bytes: the service counts none for it, as before
    (its returning_bytes or released bytes still count for placement)."""
    older = json.loads(status([gpu_row("GPU-a", 0, released_bytes=STATE)], []))
    assert "restoring_bytes" not in older["gpus"][0]
    newer = status([gpu_row("GPU-a", 0, released_bytes=0, returning_bytes=STATE, restoring_bytes=STATE)], [])
    ids = GpuIds()
    view = NodeView([(ServerRef("alice", "", "/user/alice/"), parse_status(json.dumps(older).encode(), 1.0)),
                     (ServerRef("bob", "", "/user/bob/"), parse_status(newer, 1.0))], ids, now=2.0)
    g = view.gpus[ids("GPU-a")]
    assert g.restoring == STATE and g.returning == 2 * STATE


def test_make_room_counts_what_will_land_as_taken():
    """The rule, pure: 2 GiB free, 1 GiB of it another restore's (landing): a restore of
    2 GiB is 1 GiB short and bob's idle kernel goes; without landing nothing would."""
    from jupyter_gpushare.policy import crossuser

    from .test_fairshare import CFG, GiB, k, ledger, usage_of

    held = [k("bob", "b1", 1 * GiB, idle=600)]
    book = ledger(usage_of(held), {})
    assert crossuser.make_room("alice", {0: 2 * GiB}, {0: 2 * GiB}, held, book, CFG) == \
        crossuser.Plan([], True)
    plan = crossuser.make_room("alice", {0: 2 * GiB}, {0: 2 * GiB}, held, book, CFG,
                               landing={0: 1 * GiB})
    assert plan.enough and [v.kernel_id for v in plan.victims] == ["b1"]
    short = crossuser.make_room("alice", {0: 2 * GiB}, {0: 2 * GiB}, held, book, CFG,
                                {0: "GPU 0"}, landing={0: 2 * GiB})
    assert not short.enough and short.why_not.startswith("GPU 0 is full")
