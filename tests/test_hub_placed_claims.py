"""What the hub service tells a server of other servers' placed kernels, and what the server
keeps of it. The service sums, per GPU of the asking server's node, the bytes the *other*
servers say their placed, not-yet-allocated kernels are expected to take (``placed_bytes``),
counting a server only where it lists such a kernel, each claim at most the GPU's memory; the
server keeps byte counts on GPUs it knows, for three refresh intervals without an answer.
(tests/test_hub_placed_elsewhere.py runs the whole path with a real JupyterHub.)"""

from __future__ import annotations

from types import SimpleNamespace

from jupyter_gpushare import clock
from jupyter_gpushare.hub.snapshot import parse_status
from jupyter_gpushare.hub.view import GpuIds, NodeView, ServerRef
from jupyter_gpushare.node.hub_link import GPUShareHubLink, HubLink

from .test_hub_view import FakeAPI, GiB, coordinator, gpu, kernel, status

PLACED = dict(state="untracked", gpus=[0], gpu_bytes={}, gpu_memory_bytes=0, gpu_utilization={})


def placed(kid: str) -> dict:
    return kernel(kid) | PLACED


def test_a_server_is_told_the_others_placed_bytes_on_its_nodes_gpus_only():
    bodies = {
        # alice placed a kernel on GPU-a (her GPU 0) and says it expects 3 GiB there
        "alice": status([gpu(0, "GPU-a") | {"placed_bytes": 3 * GiB}, gpu(1, "GPU-b")], [placed("a1")]),
        # bob, on the same machine, holds memory on GPU-a and placed nothing
        "bob": status([gpu(0, "GPU-b"), gpu(1, "GPU-a", used=4 * GiB)],
                      [kernel("b1", gpu_bytes={1: 4 * GiB})]),
        # carol claims bytes on GPU-b without a placed kernel there: nothing counts
        "carol": status([gpu(0, "GPU-b") | {"placed_bytes": 5 * GiB}], [kernel("c1", gpu_bytes={0: GiB})]),
        # dan, on the same GPU-a, claims more than the GPU has: at most its memory counts
        "dan": status([gpu(0, "GPU-a") | {"placed_bytes": 99 * GiB}], [placed("d1")]),
        # erin's machine is another one
        "erin": status([gpu(0, "GPU-z") | {"placed_bytes": 2 * GiB}], [placed("e1")]),
    }
    refs = [ServerRef(u, "", f"/user/{u}/") for u in bodies]
    view = NodeView([(r, parse_status(bodies[r.user], 1.0)) for r in refs], GpuIds(), 2.0)
    assert view.placed_elsewhere(("bob", "")) == {"GPU-a": 3 * GiB + 16 * GiB}
    assert view.placed_elsewhere(("alice", "")) == {"GPU-a": 16 * GiB}  # never its own
    assert view.placed_elsewhere(("erin", "")) == {}  # other machines' placements are not its
    assert view.placed_elsewhere(("nobody", "")) == {}


def test_a_server_before_placed_bytes_claims_nothing():
    older = gpu(0, "GPU-a")
    assert "placed_bytes" not in older
    snap = parse_status(status([older], [placed("a1")]), 1.0)
    assert snap.gpus[0].placed_bytes is None
    view = NodeView([(ServerRef("alice", "", "/user/alice/"), snap)], GpuIds(), 2.0)
    assert view.placed_elsewhere(("bob", "")) == {}


async def test_the_answer_to_a_server_carries_it_and_a_users_own_answer_does_not():
    api = FakeAPI({"alice": status([gpu(0, "GPU-a") | {"placed_bytes": 3 * GiB}], [placed("a1")]),
                   "bob": status([gpu(0, "GPU-a")], [])}, {})
    hub = coordinator(api)
    await hub.poll_once()
    assert hub.me("bob", server="")["placed_elsewhere"] == {"GPU-a": 3 * GiB}
    assert hub.me("alice", server="")["placed_elsewhere"] == {}
    assert "placed_elsewhere" not in hub.me("bob")  # the admin page's, a browser's


def link(refresh: float = 2.0) -> HubLink:
    gpus = {i: SimpleNamespace(info=SimpleNamespace(index=i, uuid=u))
            for i, u in enumerate(["GPU-a", "GPU-b"])}
    controller = SimpleNamespace(tracker=SimpleNamespace(gpus=gpus))
    options = GPUShareHubLink(url="http://127.0.0.1:1/services/gpushare/", refresh_interval=refresh)
    return HubLink(options, "token", "bob", "", controller, refresh=None)  # type: ignore[arg-type]


def test_the_server_keeps_byte_counts_on_its_own_gpus_for_three_refreshes():
    hub = link(refresh=20.0)
    assert hub.placed_elsewhere() == {}  # no answer yet
    hub._take_me({"placed_elsewhere": {"GPU-a": 3 * GiB, "GPU-b": -1, "GPU-x": GiB,
                                       "GPU-c": True, "GPU-d": "1"}})
    assert hub.placed_elsewhere() == {0: 3 * GiB}  # by index; the rest is not a count it knows
    clock.advance(50.0)  # (real time runs too: well inside 60 s)
    assert hub.placed_elsewhere() == {0: 3 * GiB}
    clock.advance(10.0)  # the service has not answered for three refresh intervals
    assert hub.placed_elsewhere() == {}
    hub._take_me({"placed_elsewhere": "garbage"})
    assert hub.placed_elsewhere() == {}
    hub._take_me({"placed_elsewhere": {"GPU-b": GiB}})
    assert hub.placed_elsewhere() == {1: GiB}
    hub._take_me({})  # an older service says nothing: nothing counts
    assert hub.placed_elsewhere() == {}
