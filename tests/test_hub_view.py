"""The service's one view of every node: servers' statuses (as the REST contract shapes them)
merged by GPU UUID, and what it refuses to read."""

from __future__ import annotations

import asyncio
import json

import pytest

from jupyter_gpushare.hub.snapshot import parse_status
from jupyter_gpushare.hub.view import GpuIds, NodeView, ServerRef
from jupyter_gpushare.policy.fairshare import parse_table
from jupyter_gpushare.server import contract_bodies

MiB = 1 << 20
GiB = 1 << 30


def gpu(index, uuid, used=0, released=0):
    return contract_bodies.gpu(index=index, uuid=uuid, name=f"GPU {index}", memory_total=16 * GiB,
                               memory_used=used, utilization=0.0, released_bytes=released)


def kernel(kid, state="idle", gpu_bytes=None, idle=100.0, need=None, waiting=None, **kw):
    on = {str(g): n for g, n in (gpu_bytes or {}).items()}
    fields = dict(id=kid, name="python3", pids=[1], state=state,
                  gpu_memory_bytes=sum(on.values()), gpus=[int(g) for g in on], gpu_bytes=on,
                  sm_utilization=0.0, gpu_utilization={g: 0.0 for g in on}, idle_seconds=idle,
                  idle_timeout=600.0, method="simulated", waiting=waiting, execution_state="idle",
                  restore_need={str(g): n for g, n in (need or {}).items()})
    return contract_bodies.kernel(**(fields | kw))


def status(gpus, kernels):
    # what a real server sends (built from the contract, and validated there)
    return json.dumps(contract_bodies.status(
        backend="simulated", method="simulated", available=True, idle_timeout=600.0,
        restore_mode="eager", gpus=gpus, kernels=kernels)).encode()


def test_servers_on_one_machine_are_one_node_keyed_by_uuid():
    # alice's server sees both GPUs; bob's sees them in the other order (CUDA_VISIBLE_DEVICES)
    alice = parse_status(status([gpu(0, "GPU-a", used=4 * GiB), gpu(1, "GPU-b")],
                                [kernel("a1", "released", need={0: 2 * GiB}, waiting="waiting for memory")]), 10.0)
    bob = parse_status(status([gpu(0, "GPU-b"), gpu(1, "GPU-a", used=4 * GiB)],
                              [kernel("b1", gpu_bytes={1: 3 * GiB}), kernel("b2", gpu_bytes={0: 1 * GiB})]), 11.0)
    carol = parse_status(status([gpu(0, "GPU-z")], [kernel("c1", gpu_bytes={0: 5 * GiB})]), 11.0)
    refs = [ServerRef("alice", "", "/user/alice/"), ServerRef("bob", "", "/user/bob/"),
            ServerRef("carol", "", "/user/carol/")]
    ids = GpuIds()
    view = NodeView(list(zip(refs, [alice, bob, carol], strict=True)), ids, now=12.0)
    a, b, z = ids("GPU-a"), ids("GPU-b"), ids("GPU-z")
    assert set(view.gpus) == {a, b, z}
    assert view.gpus[a].by_user == {"bob": 3 * GiB} and view.gpus[b].by_user == {"bob": 1 * GiB}
    assert view.gpus[a].index == {("alice", ""): 0, ("bob", ""): 1}
    assert view.gpus[a].node == view.gpus[b].node != view.gpus[z].node  # another machine
    waiting = view.waiting()
    assert [(p.ref.user, p.kernel.id, p.need) for p in waiting] == [("alice", "a1", {a: 2 * GiB})]
    assert view.servers_on({a}) == {("alice", ""), ("bob", "")}
    holdings = {h.candidate.kernel_id: h for h in view.holdings()}
    assert holdings["b1"].candidate.gpu_bytes == {a: 3 * GiB}
    assert holdings["b1"].candidate.idle_seconds == pytest.approx(101.0)  # counted to now
    ledger = view.ledger(parse_table({"bob": "1GiB per node"}), {})
    assert ledger.over("bob", a) and ledger.node_used("bob", view.gpus[a].node) == 4 * GiB


def test_a_gpu_is_named_by_the_index_most_of_its_servers_give_it():
    # the admin page names GPUs as people do ("GPU 1"): two servers of three see GPU-b as 1
    views = [[gpu(0, "GPU-a"), gpu(1, "GPU-b")], [gpu(0, "GPU-a"), gpu(1, "GPU-b")],
             [gpu(0, "GPU-b")]]  # CUDA_VISIBLE_DEVICES=1
    refs = [ServerRef(u, "", f"/user/{u}/") for u in ("alice", "bob", "carol")]
    ids = GpuIds()
    view = NodeView([(r, parse_status(status(g, []), 1.0)) for r, g in zip(refs, views, strict=True)],
                    ids, now=2.0)
    assert view.gpus[ids("GPU-b")].local_index == 1 and view.gpus[ids("GPU-a")].local_index == 0
    tie = NodeView([(refs[0], parse_status(status([gpu(3, "GPU-c")], []), 1.0)),
                    (refs[1], parse_status(status([gpu(2, "GPU-c")], []), 1.0))], ids, now=2.0)
    assert tie.gpus[ids("GPU-c")].local_index == 2  # of a tie, the lowest


@pytest.mark.parametrize("raw, why", [
    (b"\x00{not json", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (json.dumps({"backend": "x", "idle_timeout": 1, "gpus": [], "kernels": [{"id": 3}]}).encode(),
     "id has the wrong type"),
    (json.dumps({"backend": "x", "idle_timeout": 1, "gpus": [], "kernels": [
        kernel("k", gpu_bytes={0: 1}) | {"gpu_bytes": {"0": -5}}]}).encode(), "gpu_bytes[0]"),
    (json.dumps({"backend": "x", "idle_timeout": True, "gpus": [], "kernels": []}).encode(),
     "idle_timeout must not be a boolean"),
    (b"[" * 100_000, "not JSON"),
])
def test_garbage_is_refused_with_the_reason(raw, why):
    with pytest.raises(ValueError, match=why.replace("[", r"\[")):
        parse_status(raw, 0.0)


def test_unknown_fields_are_ignored():
    body = json.loads(status([gpu(0, "GPU-a")], [kernel("k")]))
    body["something_new"] = {"x": 1}
    body["kernels"][0]["another"] = 2
    snap = parse_status(json.dumps(body).encode(), 0.0)
    assert [k.id for k in snap.kernels] == ["k"] and snap.uuid_of(0) == "GPU-a"


# -- what the service measures wins over what servers claim ---------------------------------------
def measured(used, pids, procs, context=0):
    from jupyter_gpushare.node.measure import Measured, Proc

    return Measured(0.0, "simulated", {"GPU-a": (16 * GiB, used)}, pids,
                    {p: Proc(*v) for p, v in procs.items()}, context)


def test_a_servers_claims_are_checked_against_the_services_measurement():
    from jupyter_gpushare.hub.claims import check

    need = {0: 2 * GiB}
    waits = dict(state="released", need=need, waiting="waiting for memory", released_bytes=2 * GiB)
    snap = parse_status(status([gpu(0, "GPU-a", used=0)], [  # "the GPU is empty"
        kernel("ok", pids=[10], **waits),
        kernel("twice", pids=[10], **waits),  # the same process again
        kernel("small", pids=[11], **waits),  # holds 1 GiB of host memory
        kernel("bobs", pids=[20], **waits),
        kernel("gone", pids=[30], **waits),
        kernel("huge", pids=[12], **(waits | {"restore_need": {"0": 17 * GiB}})),
        kernel("idle", pids=[13], gpu_bytes={0: 1}),  # claims 1 byte, holds 5 GiB
    ]), 1.0)
    m = measured(9 * GiB, {13: {"GPU-a": 5 * GiB}, 20: {"GPU-a": 4 * GiB}},
                 {10: ("mallory", 3 * GiB), 11: ("mallory", 1 * GiB), 12: ("mallory", 20 * GiB),
                  13: ("mallory", 1 * GiB), 20: ("bob", 5 * GiB), 30: (None, None)})
    checked, refused = check("mallory", snap, m, set())
    assert refused == {
        "twice": "its processes are counted for another of its server's kernels",
        "small": "it needs 2.0 GiB on GPU 0, but its processes hold only 1.0 GiB in host memory",
        "bobs": "the processes its server names are not mallory's",
        "gone": "none of the processes its server names runs on this node",
        "huge": "it needs 17.0 GiB, more than GPU 0 has",
    }
    by_id = {k.id: k for k in checked.kernels}
    assert by_id["ok"].restore_need == need and by_id["twice"].restore_need == {}
    assert by_id["idle"].gpu_bytes == {0: 5 * GiB} and by_id["bobs"].pids == []
    # a CUDA context (NVML) may be missing from the host copy; nothing more
    assert "small" not in check("mallory", snap, measured(0, {}, {11: ("mallory", GiB)}, GiB), set())[1]
    view = NodeView([(ServerRef("mallory", "", "/user/mallory/"), checked)], GpuIds(), 2.0, m)
    (g,) = view.gpus.values()
    assert g.measured and g.free == 7 * GiB  # the service's reading, not "empty"
    assert g.by_user == {"mallory": 5 * GiB, "bob": 4 * GiB}  # what their processes hold
    assert [p.kernel.id for p in view.waiting()] == ["ok"]


def test_without_a_measurement_one_late_reading_does_not_outvote_the_others():
    snaps = [parse_status(status([gpu(0, "GPU-a", used=u)], []), at) for u, at in
             ((10 * GiB, 1.0), (11 * GiB, 1.5), (0, 2.0))]  # the last, freshest, says "empty"
    refs = [ServerRef(u, "", f"/user/{u}/") for u in ("alice", "bob", "mallory")]
    (g,) = NodeView(list(zip(refs, snaps, strict=True)), GpuIds(), 3.0).gpus.values()
    assert not g.measured and g.used == 10 * GiB


def test_a_process_belongs_to_the_user_its_account_or_environment_names(monkeypatch):
    from jupyter_gpushare.node import measure

    facts = {1: (1001, 5, "bob"), 2: (0, 7, "bob"), 3: (None, None, None)}
    monkeypatch.setattr(measure, "_status_fields", lambda pid: facts[pid][:2])
    monkeypatch.setattr(measure, "_hub_user_in_environment", lambda pid: facts[pid][2])
    monkeypatch.setattr(measure, "_account", lambda uid: {1001: "jupyter-alice", 0: "root"}[uid])
    meter = measure.Meter(None, "simulated", "jupyter-{username}")
    accounts = {"jupyter-alice": "alice", "jupyter-bob": "bob"}
    # alice's account decides, whatever her process's environment says
    assert meter.proc(1, accounts) == measure.Proc("alice", 5)
    assert meter.proc(2, accounts) == measure.Proc("bob", 7)  # a shared account: the Hub's env
    assert meter.proc(3, accounts) == measure.Proc(None, None)  # gone


# -- the coordinator with servers that answer slowly or lie (no Hub: its API faked) -------------------
class FakeAPI:
    timeout = 10.0

    def __init__(self, bodies, delays):
        self.bodies, self.delays, self.released = bodies, delays, []

    async def ready_servers(self):
        return [ServerRef(u, "", f"/user/{u}/") for u in self.bodies]

    async def status(self, ref):
        await asyncio.sleep(self.delays.get(ref.user, 0))
        return self.bodies[ref.user]

    async def release(self, ref, kernel_id, if_idle_for):
        self.released.append((ref.user, kernel_id))
        return 200, {"state": "released"}


def coordinator(api, **settings):
    from jupyter_gpushare.hub.coordinator import Coordinator, Settings, hub_policy

    return Coordinator(api, Settings({}, hub_policy(2, 1, 5, 0), **settings), poll_interval=1)


class SlowSam(FakeAPI):
    """sam's server answers its first status slower than the read deadline, then not at all
    until ``sam_answers`` is set."""

    def __init__(self, bodies):
        super().__init__(bodies, {})
        self.sam_answers = asyncio.Event()
        self.sam_asked = 0

    async def status(self, ref):
        if ref.user == "sam":
            self.sam_asked += 1
            if self.sam_asked == 1:
                await asyncio.sleep(0.6)  # past read_deadline 0.5: slow
            else:
                await self.sam_answers.wait()
        return self.bodies[ref.user]


async def test_a_slow_server_costs_only_its_own_users():
    waits = dict(state="released", need={0: 2 * GiB}, waiting="waiting for memory")
    api = SlowSam({
        "alice": status([gpu(0, "GPU-a", used=15 * GiB)], [kernel("a1", **waits)]),
        "bob": status([gpu(0, "GPU-a", used=15 * GiB)], [kernel("b1", gpu_bytes={0: 4 * GiB})]),
        # idle longest, so first in line, but its server is slow
        "sam": status([gpu(0, "GPU-a", used=15 * GiB)], [kernel("s1", gpu_bytes={0: 4 * GiB}, idle=1e4)]),
    })
    coord = coordinator(api, read_deadline=0.5)
    await coord.poll_once()  # sam's first answer is waited for; it is slow
    try:
        # answered while sam's server answers nothing: the push did not wait for it
        answer = await asyncio.wait_for(coord.on_push("alice", "", ["a1"]), 60)
        assert api.released == [("bob", "b1")]  # the prompt server's kernel made the room
        assert answer["released"] == [{"what": "another user's idle kernel", "bytes": 4 * GiB}]
        # no prompt server's kernel can: then the slow server's, by its last status
        api.bodies["bob"] = status([gpu(0, "GPU-a", used=15 * GiB)], [])
        await asyncio.wait_for(coord.on_push("alice", "", ["a1"]), 60)
        assert api.released[-1] == ("sam", "s1")
    finally:
        api.sam_answers.set()


async def test_room_made_and_not_used_pauses_that_users_claims_only():
    from jupyter_gpushare import clock

    waits = dict(state="released", need={0: 2 * GiB}, waiting="waiting for memory")
    api = FakeAPI({
        "mallory": status([gpu(0, "GPU-a", used=15 * GiB)], [kernel("m1", **waits)]),
        "bob": status([gpu(0, "GPU-a", used=15 * GiB)], [kernel("b1", gpu_bytes={0: 4 * GiB})]),
    }, {})
    coord = coordinator(api, claim_grace=60, claim_penalty=600)
    await coord.poll_once()
    assert (await coord.on_push("mallory", "", ["m1"]))["released"]  # believed: not measured here
    try:
        clock.advance(61)  # and mallory's restore never lands
        await coord.poll_once()
        assert 590 < coord.paused("mallory") <= 600 and coord.paused("bob") == 0
        answer = await coord.on_push("mallory", "", ["m1"])
        assert answer["released"] == [] and "was not used" in answer["waits"]["m1"]
        assert api.released == [("bob", "b1")]  # once, not cycle after cycle
        assert coord.admin_view()["recent"][0]["action"] == "claim unused"
    finally:
        clock.reset()


def test_the_service_reads_the_shared_simulated_node_itself(tmp_path):
    import os

    from jupyter_gpushare.node.measure import open_meter
    from jupyter_gpushare.sim.shared import SharedSimNode

    path = str(tmp_path / "node.sqlite")
    node = SharedSimNode(path, (4 * GiB,))
    node.alloc(os.getpid(), 0, 1 * GiB)
    meter, said = open_meter("auto", path, "{username}", None)
    assert meter is not None and said == f"the simulated node {path}"
    try:
        m = meter.read([os.getpid()], ["alice"])
    finally:
        meter.close()
        node.close()
    assert m.gpus == {node.uuid(0): (4 * GiB, 1 * GiB)} and m.context_bytes == 0
    assert m.pids == {os.getpid(): {node.uuid(0): 1 * GiB}}
    assert m.procs[os.getpid()].host_bytes > 0  # resident memory, read in /proc
