"""The hub service's room on a GPU counts each kernel's bytes once.

A restoring kernel's landed bytes are in its GPU's used memory; a server's status also lists
its whole held state among the GPU's released bytes, and a waiting restore's need names the
same bytes again. The service counted all of them, so a node with a restore under way ranked
below one with less room, and a server under the service took the smaller, wrong room for its
own placement. Servers now say what their kernels will still bring onto each GPU, each kernel
once (``returning_bytes``). Real servers (the simulated node) answer the status the service's
coordinator reads; the Hub's API is faked, the second node's status built from the contract.
Kernels placed and not using their GPU yet count too, by their servers' ``placed_bytes``.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from jupyter_gpushare.hub.snapshot import parse_status
from jupyter_gpushare.hub.view import GpuIds, NodeView, ServerRef
from jupyter_gpushare.server import contract_bodies

from .helpers import wait_for
from .scenarios import MiB, hold, intact, rest
from .test_hub_view import FakeAPI, GiB, coordinator, gpu, kernel, status
from .test_restore_reservation import stall_restore_until

#: a restore held with a's 512 MiB landed on the server's only GPU (2 GiB): its room is 1.5 GiB
RESTORING = {"simulated_gpus": [2048 * MiB], "poll_interval": 3600}
#: a's 512 MiB cannot come back: b holds 768 of the GPU's 1 GiB
WAITING = {"simulated_gpus": [1024 * MiB], "poll_interval": 3600}


def other_node(free: int) -> bytes:
    """A server on another machine: one 2 GiB GPU with ``free`` bytes free, nothing held."""
    g = contract_bodies.gpu(index=0, uuid="GPU-other", name="GPU 0", memory_total=2048 * MiB,
                            memory_used=2048 * MiB - free, utilization=0.0, released_bytes=0,
                            returning_bytes=0)
    return json.dumps(contract_bodies.status(
        backend="simulated", method="simulated", available=True, idle_timeout=600.0,
        restore_mode="eager", node="node-b", gpus=[g], kernels=[])).encode()


async def server_status(jp_fetch) -> bytes:
    return (await jp_fetch("api", "gpushare", "status")).body


@pytest.mark.parametrize("gpushare_config", [RESTORING])
async def test_a_node_with_a_restore_under_way_ranks_by_its_room_counted_once(
    jp_fetch, kernels, gpushare_app, tmp_path, monkeypatch
):
    monkeypatch.setenv("JUPYTER_GPUSHARE_NODE", "node-z")  # after node-b by name: no tie helps
    app, go = gpushare_app, tmp_path / "go"
    a = await kernels.start()
    await a.run(hold(512, name="a") + "\n" + stall_restore_until(str(go)))
    await app.poll_once()
    assert (await rest(jp_fetch, a.id, "release"))[0] == 200
    restore = asyncio.ensure_future(rest(jp_fetch, a.id, "restore"))
    try:
        await wait_for(lambda: app.node.used(0) == 512 * MiB, what="a's restore to take its memory")
        assert app.controller.states[a.id].state == "restoring"
        # before the server measures the landed bytes (reserved, not used yet) and after (used)
        for measured in (False, True):
            if measured:
                await app.poll_once()
                assert app.tracker.kernels[a.id].gpu_bytes == {0: 512 * MiB}
            body = await server_status(jp_fetch)
            (g,) = json.loads(body)["gpus"]
            assert g["released_bytes"] == 512 * MiB  # the held state, as before
            assert g["memory_used"] + g["returning_bytes"] == 512 * MiB  # its bytes once
            assert app.controller.states[a.id].state == "restoring"
            # node-b has 1.25 GiB free; node-z 1.5 GiB of room, a's bytes once (1 GiB when
            # counted again): a server expecting 1400 MiB fits on node-z only
            api = FakeAPI({"alice": body, "bob": other_node(1280 * MiB)}, {})
            coord = coordinator(api)
            await coord.poll_once()
            ranked = await coord.rank_nodes("carol", memory=1400 * MiB)
            assert [(n["node"], n["fits"], n["room"]) for n in ranked] == [
                ("node-z", True, 1536 * MiB), ("node-b", False, 1280 * MiB)], measured
            rooms = await coord.rooms("carol", [g["uuid"]])
            assert rooms[g["uuid"]]["room"] == 1536 * MiB
    finally:
        go.touch()
    code, body = await restore
    assert code == 200 and body["state"] == "active", body


@pytest.mark.parametrize("gpushare_config", [WAITING])
async def test_a_waiting_restores_need_and_its_held_state_are_the_same_bytes(
    jp_fetch, kernels, gpushare_app
):
    app = gpushare_app
    a, b = await kernels.start(), await kernels.start()
    await a.run(hold(512, name="a"))
    await app.poll_once()
    assert (await rest(jp_fetch, a.id, "release"))[0] == 200
    await b.run(hold(768, name="b"))  # just used: never released to make room
    await app.poll_once()
    code, body = await rest(jp_fetch, a.id, "restore")
    assert code == 202 and body["waiting"], body
    server = json.loads(await server_status(jp_fetch))
    (g,) = server["gpus"]
    (need,) = next(k["restore_need"] for k in server["kernels"] if k["id"] == a.id).values()
    assert need >= 512 * MiB and g["released_bytes"] == 512 * MiB
    assert g["returning_bytes"] == need  # once: not its held state and its need
    api = FakeAPI({"alice": json.dumps(server).encode()}, {})
    coord = coordinator(api)
    await coord.poll_once()
    rooms = await coord.rooms("carol", [g["uuid"]])
    assert rooms[g["uuid"]]["room"] == g["memory_total"] - g["memory_used"] - need
    # without the released state (what a kernel starting now may allocate)
    assert rooms[g["uuid"]]["room_now"] == g["memory_total"] - g["memory_used"]
    assert (await rest(jp_fetch, b.id, "release"))[0] == 200  # room: a comes back, whole
    await wait_for(lambda: app.controller.states[a.id].state in ("active", "idle"),
                   what="a's restore once b is released")
    assert (await a.run(intact("a"))).stdout == "intact\n"


def test_a_server_before_returning_bytes_is_counted_as_it_says():
    """An older server does not say returning_bytes: its released bytes and its waiting
    restores' needs count, as they did (too much during a restore, never too little)."""
    older = json.loads(status([gpu(0, "GPU-a", released=2 * GiB)], [kernel(
        "a1", "released", need={0: 2 * GiB}, waiting="waiting for memory", released_bytes=2 * GiB)]))
    assert "returning_bytes" not in older["gpus"][0]
    newer = status([gpu(0, "GPU-a", released=1 * GiB) | {"returning_bytes": 3 * GiB}], [])
    ids = GpuIds()
    view = NodeView([(ServerRef("alice", "", "/user/alice/"),
                      parse_status(json.dumps(older).encode(), 1.0)),
                     (ServerRef("bob", "", "/user/bob/"), parse_status(newer, 1.0))], ids, now=2.0)
    assert view.gpus[ids("GPU-a")].returning == 4 * GiB + 3 * GiB


#: a kernel placed on the server's only GPU (2 GiB) is expected to need 512 MiB there
PLACED = {"simulated_gpus": [2048 * MiB], "poll_interval": 3600, "placement": "room",
          "context_bytes": 512 * MiB}


@pytest.mark.parametrize("gpushare_config", [PLACED])
async def test_a_placed_kernels_expected_bytes_are_not_offered_to_another(
    jp_fetch, kernels, gpushare_app, monkeypatch
):
    """A kernel placed and not using its GPU yet leaves its expected need out of the room the
    service offers others, on this node and across nodes (before: the whole free memory)."""
    monkeypatch.setenv("JUPYTER_GPUSHARE_NODE", "node-z")
    a = await kernels.start()  # placed on GPU 0; nothing allocated yet
    await gpushare_app.poll_once()
    body = await server_status(jp_fetch)
    (g,) = json.loads(body)["gpus"]
    (k,) = json.loads(body)["kernels"]
    assert k["id"] == a.id and k["gpu_memory_bytes"] == 0, k
    assert g["placed_bytes"] == 512 * MiB and g["memory_used"] == 0, g
    api = FakeAPI({"alice": body, "bob": other_node(1792 * MiB)}, {})
    coord = coordinator(api)
    await coord.poll_once()
    rooms = await coord.rooms("carol", [g["uuid"]])
    assert rooms[g["uuid"]]["room"] == 1536 * MiB
    # a server expecting 1600 MiB fits node-b (1.75 GiB free), not node-z (2 GiB less a's 512 MiB)
    ranked = await coord.rank_nodes("carol", memory=1600 * MiB)
    assert [(n["node"], n["fits"], n["room"]) for n in ranked] == [
        ("node-b", True, 1792 * MiB), ("node-z", False, 1536 * MiB)]
    # a claim larger than the GPU counts as the GPU's memory at most: no room, never negative
    claim = json.loads(body)
    claim["gpus"][0]["placed_bytes"] = 99 * GiB
    api.bodies["alice"] = json.dumps(claim).encode()
    await coord.poll_once()
    assert (await coord.rooms("carol", [g["uuid"]]))[g["uuid"]]["room"] == 0
