"""The service's one view of every node: servers' statuses (as the REST contract shapes them)
merged by GPU UUID, and what it refuses to read."""

from __future__ import annotations

import json

import pytest

from jupyter_gpushare import contract
from jupyter_gpushare.fairshare import parse_table
from jupyter_gpushare.hub.snapshot import parse_status
from jupyter_gpushare.hub.view import GpuIds, NodeView, ServerRef

MiB = 1 << 20
GiB = 1 << 30


def gpu(index, uuid, used=0, released=0):
    return {"index": index, "uuid": uuid, "name": f"GPU {index}", "memory_total": 16 * GiB,
            "memory_used": used, "utilization": 0.0, "released_bytes": released, "mig": False}


def kernel(kid, state="idle", gpu_bytes=None, idle=100.0, need=None, waiting=None, **kw):
    k = {"id": kid, "name": "python3", "path": "", "pids": [1], "state": state, "pinned": False,
         "gpu_memory_bytes": sum((gpu_bytes or {}).values()), "released_bytes": 0,
         "gpus": [int(g) for g in (gpu_bytes or {})],
         "gpu_bytes": {str(g): n for g, n in (gpu_bytes or {}).items()},
         "sm_utilization": 0.0, "gpu_utilization": {str(g): 0.0 for g in (gpu_bytes or {})},
         "idle_seconds": idle, "release_in_seconds": None,
         "idle_timeout": 600.0, "method": "simulated", "releases": 0, "restores": 0,
         "last_restore_seconds": None, "last_release_seconds": None, "error": None,
         "waiting": waiting, "execution_state": "idle", "release_blocked": None,
         "host_room_bytes": None, "restore_need": {str(g): n for g, n in (need or {}).items()}}
    k.update(kw)
    return k


def status(gpus, kernels):
    body = {"backend": "simulated", "method": "simulated", "available": True, "reason": "",
            "idle_timeout": 600.0, "restore_mode": "eager", "gpus": gpus, "kernels": kernels,
            "hub": None}
    contract.validate_response("/status", "GET", 200, body)  # what a real server sends
    return json.dumps(body).encode()


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
