"""Placement at kernel start: the provisioner sets CUDA_VISIBLE_DEVICES to the GPU(s) with the
most room, and the simulated node numbers a kernel's GPUs as CUDA does (device 0 is its first
visible GPU). Real server, real kernels."""

from __future__ import annotations

import json
import os
import sys
from collections import deque
from typing import Any

import numpy as np
import pytest
from tornado.httpclient import HTTPClientError

from jupyter_gpushare import clock
from jupyter_gpushare.core.tracker import GPURecord, KernelRecord, Tracker
from jupyter_gpushare.node.gpu_load import OWED_GRACE, GpuLoad
from jupyter_gpushare.node.placement import PlacementError, Placer, allowed, requested_memory
from jupyter_gpushare.policy.placement import Need
from jupyter_gpushare.sim import device as device_module
from jupyter_gpushare.sim import simgpu
from jupyter_gpushare.sim.device import LocalBackend, SimDevice, visible_gpus
from jupyter_gpushare.sim.node import GiB, SimNode
from jupyter_gpushare.telemetry import GPUInfo

from . import scenarios
from .helpers import Execution, KernelConn, kernel_status, wait_for
from .scenarios import MiB

ROOM = {"placement": "room", **scenarios.SMALL_NODE}  # two GPUs of 2 GiB


# -- the simulated node honours CUDA_VISIBLE_DEVICES ------------------------------------------
@pytest.mark.parametrize(("value", "seen"), [
    (None, None), ("1", [1]), ("1,0", [1, 0]), ("", []), ("-1", []), (" 0 , 1 ", [0, 1]),
    ("0,2,1", [0]), ("1,1", [1]), ("GPU-abc,0", []),
])
def test_visible_gpus_read_as_cuda_reads_them(value, seen):
    assert visible_gpus(value, 2) == seen


def test_a_process_device_0_is_its_first_visible_gpu(monkeypatch):
    node = SimNode((GiB, GiB))
    dev = SimDevice(LocalBackend(node), visible="1")
    monkeypatch.setattr(device_module, "_device", dev)
    assert dev.visible() == [1] and simgpu.device_count() == 1
    with pytest.raises(simgpu.InvalidDeviceError, match=r"invalid device ordinal 1: this process sees 1"):
        simgpu.zeros((16,), device=1)
    assert issubclass(simgpu.InvalidDeviceError, ValueError) and node.pids() == {}
    x = simgpu.zeros((64, 1024, 1024), dtype=np.uint8, device=0)
    pid = os.getpid()
    assert node.pids() == {pid: {1: 64 * MiB}} and simgpu.memory_allocated(0) == 64 * MiB
    simgpu.burn(0.01, device=0)
    assert node.busy_fraction(pid, 1, 0, 1e12) > 0 and node.busy_fraction(pid, 0, 0, 1e12) == 0
    dev.lock()
    assert dev.checkpoint()["gpus"] == {"1": 64 * MiB} and node.used(1) == 0
    dev.restore()
    dev.unlock()
    assert node.used(1) == 64 * MiB and dev.placement()["device"] == {"1": 64 * MiB}
    assert x.device == 0  # the process's own numbering


def test_unset_keeps_the_node_numbering(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    node = SimNode((GiB, GiB))
    dev = SimDevice(LocalBackend(node))
    monkeypatch.setattr(device_module, "_device", dev)
    y = simgpu.zeros((16,), device=1)
    assert list(node.pids().values()) == [{1: y.nbytes}] and simgpu.device_count() == 2
    with pytest.raises(ValueError, match="invalid device 5: this node has 2 simulated GPUs"):
        simgpu.zeros((16,), device=5)  # the node's own refusal, as before


# -- the choice --------------------------------------------------------------------------------
def gpu(index: int, used: int = 0, util: float | None = 0.0, uuid: str = "") -> GPUInfo:
    return GPUInfo(index, uuid or f"SIM-{index}", "Simulated GPU", 2 * GiB, used, util)


class Spec:
    def __init__(self, gpus: Any = None):
        self.display_name = "Test"
        self.metadata = {} if gpus is None else {"gpushare": {"gpus": gpus}}


def placer(gpus: list[GPUInfo], held: dict[int, int] | None = None,
           reserved: dict[int, int] | None = None, **kw: Any) -> Placer:
    async def read_free(indices: list[int]) -> dict[int, int | None]:
        return {g.index: 2 * GiB - (g.memory_used or 0) for g in gpus if g.index in indices}

    return Placer(lambda: gpus, read_free, lambda: held or {}, lambda: reserved or {},
                  lambda: [], min_room=512 * MiB, **kw)


async def test_most_room_then_least_load_and_held_and_reserved_bytes_count():
    two = [gpu(0, used=GiB), gpu(1)]
    assert (await placer(two).place("k", Spec(), {})).value == "1"
    assert (await placer(two, held={1: 1536 * MiB}).place("k", Spec(), {})).value == "0"
    assert (await placer(two, reserved={1: 1536 * MiB}).place("k", Spec(), {})).value == "0"
    busy = [gpu(0, util=80.0), gpu(1, util=10.0)]
    assert (await placer(busy).place("k", Spec(), {})).value == "1"
    both = await placer(two).place("k", Spec(2), {})
    assert both is not None and both.gpus == [1, 0] and both.value == "1,0" and not both.note


async def test_within_an_existing_set_and_counts_that_do_not_fit():
    real = [gpu(0, uuid="GPU-aaa"), gpu(1, used=GiB, uuid="GPU-bbb"), gpu(2, uuid="GPU-ccc")]
    got = await placer(real).place("k", Spec(), {"CUDA_VISIBLE_DEVICES": "1,GPU-ccc"})
    assert got is not None and got.value == "GPU-ccc" and got.gpus == [2]  # kept as written
    got = await placer(real).place("k", Spec(), {})
    assert got is not None and got.value == "GPU-aaa"  # real GPUs are named by UUID
    assert [g.index for g, _ in allowed("2,nope,0", real)[0]] == [2]  # ends at "nope"
    with pytest.raises(PlacementError, match=r"asks for 2 GPU\(s\).*allows 1"):
        await placer(real).place("k", Spec(2), {"CUDA_VISIBLE_DEVICES": "1"})
    with pytest.raises(PlacementError, match="must be a whole number"):
        await placer(real).place("k", Spec("two"), {})
    capped = await placer(real, default_gpus=5).place("k", Spec(), {})
    assert capped is not None and len(capped.gpus) == 3  # the option's count is capped
    none = await placer(real).place("k", Spec(0), {})
    assert none is not None and none.value == "" and none.gpus == []


async def test_no_room_anywhere_still_places_with_a_note():
    full = [gpu(0, used=1900 * MiB), gpu(1, used=1800 * MiB)]
    got = await placer(full).place("k", Spec(), {})
    assert got is not None and got.gpus == [1] and "no GPU had room" in got.note


async def test_a_gpu_that_errors_when_read_is_placed_last():
    """A GPU whose memory cannot be read now (NVML error, a GPU fallen off the bus) and has
    no earlier reading is never chosen while another GPU can be."""
    two = [GPUInfo(0, "SIM-0", "Simulated GPU", 2 * GiB, None, None), gpu(1, used=1900 * MiB)]

    async def read_free(indices: list[int]) -> dict[int, int | None]:
        return {0: None, 1: 100 * MiB}

    got = await Placer(lambda: two, read_free, lambda: {}, lambda: {}, lambda: [],
                       min_room=512 * MiB).place("k", Spec(), {})
    assert got is not None and got.gpus == [1] and "no GPU had room" in got.note


async def test_the_hub_services_view_narrows_the_room_and_shares_come_first():
    two = [gpu(0), gpu(1, used=GiB)]
    views = {
        # GPU 0 reads empty, but another person's released 1.5 GiB comes back there
        "theirs": {"SIM-0": (512 * MiB, True), "SIM-1": (GiB, True)},
        # the person is over their share on GPU 0: GPU 1 first, though it has less room
        "share": {"SIM-0": (2 * GiB, False), "SIM-1": (GiB, True)},
        "silent": None,
    }
    for case, want in (("theirs", "1"), ("share", "1"), ("silent", "0")):
        async def service(uuids: list[str], view: Any = views[case]) -> Any:
            assert sorted(uuids) == ["SIM-0", "SIM-1"]
            return view

        got = await placer(two, service_room=service).place("k", Spec(), {})
        assert got is not None and got.value == want, case

    async def broken(uuids: list[str]) -> Any:
        raise OSError("connection refused")

    got = await placer(two, service_room=broken).place("k", Spec(), {})
    assert got is not None and got.value == "0"  # placed by the server's own view


async def test_where_the_services_room_counts_a_returning_state_its_room_now_places():
    """Another person's released state will come back to GPU 0 (the service's room there is
    256 MiB), but 2 GiB are free there now; GPU 1 has 400 MiB (this server's own view). A
    kernel expected to need 512 MiB fits neither once the state is counted: it starts where
    it fits now, GPU 0, with no note. A service before ``room_now`` gives none: what it
    counted beyond this server's view is taken as gone now too, and GPU 1's more room wins."""
    two = [gpu(0), gpu(1, used=2 * GiB - 400 * MiB)]

    async def service(uuids: list[str]) -> Any:
        return {"SIM-0": (256 * MiB, True), "SIM-1": (400 * MiB, True)}

    now = {"SIM-0": 2 * GiB, "SIM-1": 400 * MiB}
    got = await placer(two, service_room=service, service_room_now=lambda: now).place(
        "k", Spec(), {})
    assert got is not None and got.gpus == [0] and not got.note
    got = await placer(two, service_room=service, service_room_now=dict).place("k", Spec(), {})
    assert got is not None and got.gpus == [1] and "no GPU had room" in got.note


async def test_kernels_other_servers_placed_count_where_the_hub_service_saw_them():
    """Two servers of a node place kernels back to back: this one cannot see the other's
    kernel before it allocates, the hub service can (its ``pending``); the new kernel goes to
    the other GPU. Without the service's answer, only this server's own placements count."""
    two = [gpu(0), gpu(1, used=16 * MiB)]  # GPU 0 has a few bytes more room

    async def service(uuids: list[str]) -> Any:
        return {"SIM-0": (2 * GiB, True), "SIM-1": (2 * GiB, True)}

    seen = {"SIM-0": 1}  # another server's kernel placed on GPU 0, not computing yet
    got = await placer(two, service_room=service, service_pending=lambda: seen).place(
        "k", Spec(), {})
    assert got is not None and got.gpus == [1]

    async def silent(uuids: list[str]) -> Any:
        return None

    got = await placer(two, service_room=silent, service_pending=lambda: seen).place(
        "k", Spec(), {})
    assert got is not None and got.gpus == [0]  # an old answer is not taken for a new one


async def test_placed_kernels_count_before_they_allocate_and_exact_bytes_never_outrank_load():
    two = [gpu(0, used=16 * MiB), gpu(1)]  # GPU 1 has a few bytes more room
    p = placer(two)
    first = await p.place("a", Spec(), {})
    second = await p.place("b", Spec(), {})  # a has not allocated yet: it is expected there
    assert first is not None and second is not None
    assert (first.gpus, second.gpus) == ([1], [0])
    assert p.placed["a"].gpus == [1] and p.placed["a"].need.bytes == 512 * MiB  # min_room
    busy = [gpu(0, util=100.0), gpu(1, used=GiB)]  # more room, but its SMs are busy
    assert (await placer(busy).place("k", Spec(), {})).gpus == [1]  # type: ignore[union-attr]


def test_a_placement_is_forgotten_once_its_kernel_ended_and_kept_while_it_starts():
    ended: list[str] = []
    load = GpuLoad(dict, dict, ended=lambda: ended)
    load.place("starting", [0], Need(GiB))
    load.place("gone", [1], Need(GiB))
    load.forget([])  # neither is listed yet: both may still be starting
    assert set(load.placed) == {"starting", "gone"}
    ended.append("gone")  # the tracker dropped its record: shut down
    views = load.views({0: GiB, 1: GiB})
    assert set(load.placed) == {"starting"} and views[1].kernels == 0 and views[0].pending > 0
    load.forget([], now=clock.now() + 3600)  # never listed in an hour: not starting any more
    assert load.placed == {}


def test_placed_kernels_expected_bytes_count_against_room_until_they_use_the_gpu():
    records: dict[str, Any] = {}
    load = GpuLoad(dict, lambda: records)
    load.place("a", [0], Need(3 * GiB))
    views = load.views({0: 8 * GiB, 1: 8 * GiB, 2: None})
    assert (views[0].room, views[1].room, views[2].room) == (5 * GiB, 8 * GiB, None)
    assert load.views({0: 8 * GiB}, exclude="a")[0].room == 8 * GiB  # the one being placed
    records["a"] = KernelRecord("a", name="python3", peak_gpu_bytes={0: GiB})
    assert load.views({0: 8 * GiB})[0].room == 8 * GiB  # it allocated: free memory counts it


def test_what_a_failed_allocation_asked_for_is_wanted_until_held_or_for_a_grace():
    records: dict[str, Any] = {"b": KernelRecord("b", name="python3", gpu_bytes={0: GiB},
                                                  peak_gpu_bytes={0: GiB})}
    load = GpuLoad(dict, lambda: records)
    load.owe("b", [0], 2 * GiB)  # holds 1 GiB, asked for 2 GiB more
    assert load.promised() == {0: 2 * GiB} and load.unused() == {0: (2 * GiB, 0)}
    assert load.views({0: 8 * GiB})[0].room == 6 * GiB  # nor is it a new place's room
    assert load.views({0: 8 * GiB}, exclude="b")[0].room == 8 * GiB  # its own restore's is
    records["b"] = KernelRecord("b", name="python3", gpu_bytes={0: 2 * GiB}, peak_gpu_bytes={0: 2 * GiB})
    assert load.promised() == {0: GiB}  # part of it held now
    load.owe("a", [1], GiB)  # a kernel not listed: gone, nothing wanted
    assert load.promised(clock.now()) == {0: GiB} and "a" not in load.owed
    assert load.promised(clock.now() + OWED_GRACE + 1) == {} and load.owed == {}  # past the grace
    load.owe("b", [0], GiB)
    records["b"] = KernelRecord("b", name="python3", gpu_bytes={0: 3 * GiB}, peak_gpu_bytes={0: 3 * GiB})
    assert load.promised() == {} and load.owed == {}  # the next try holds it: done


class MemSpec(Spec):
    def __init__(self, memory: Any, name: str = "big"):
        super().__init__()
        self.name = name
        self.metadata = {"gpushare": {"memory": memory}}


async def test_the_expected_need_is_the_kernelspecs_else_its_recent_kernels_peak():
    two = [gpu(0, used=GiB, util=0.0), gpu(1, used=256 * MiB, util=60.0)]
    # 1.5 GiB fits on GPU 1 only, busy or not
    got = await placer(two).place("k", MemSpec("1.5GiB"), {})
    assert got is not None and got.gpus == [1]
    assert requested_memory(MemSpec(3 << 30)) == 3 << 30
    assert requested_memory(MemSpec("512 MiB")) == 512 * MiB and requested_memory(Spec()) is None
    for bad in ("lots", "25%", -1, 1.5, True, None, "1GiB per node"):
        with pytest.raises(PlacementError, match=r"metadata\.gpushare\.memory must be bytes per GPU"):
            requested_memory(MemSpec(bad))
    # no kernelspec figure: what its recent kernels held at most on one GPU
    recent = {"python3": [256 * MiB, 1536 * MiB]}
    spec = Spec()
    spec.name = "python3"  # type: ignore[attr-defined]
    got = await placer(two, recent=lambda name: recent.get(name, [])).place("k", spec, {})
    assert got is not None and got.gpus == [1] and got.note == ""
    assert (await placer(two).place("k", spec, {})).gpus == [0]  # type: ignore[union-attr]


def test_a_gpus_load_is_its_mean_over_the_window_and_peaks_outlive_their_kernels():
    rec = GPURecord(gpu(0), deque([(0.0, 0, 0.0), (2.0, 0, 100.0), (4.0, 0, 100.0), (6.0, 0, 0.0)]))
    assert rec.load(0.0, 6.0) == pytest.approx(200 / 3)  # each sample covers the 2 s before it
    assert rec.load(2.0, 6.0) == pytest.approx(50.0)
    assert rec.load(-100.0, 6.0) == pytest.approx(200 / 3)  # shrinks to the samples there are
    assert rec.load(6.0, 6.0) == 0.0  # a window of 0 s: the last sample
    rec.history.append((8.0, 0, 100.0))
    assert rec.load(8.0, 8.0) == 100.0 and rec.load(4.0, 8.0) == pytest.approx(50.0)
    assert GPURecord(gpu(0)).load(0.0, 10.0) == 0.0

    class KM:
        def list_kernel_ids(self) -> list[str]:
            return []

    tracker = Tracker(KM(), None, 60, 1)  # type: ignore[arg-type]
    for i, peak in enumerate([GiB, 2 * GiB] + [MiB] * 8):
        rec_k = KernelRecord(f"k{i}", name="python3", peak_gpu_bytes={0: peak, -1: 5 * GiB})
        tracker._remember_peak(rec_k)
    assert list(tracker.recent_peaks["python3"]) == [MiB] * 8  # the last 8 only
    tracker.kernels["live"] = KernelRecord("live", name="python3", peak_gpu_bytes={1: 3 * GiB})
    assert max(tracker.recent_peaks_of("python3")) == 3 * GiB and tracker.recent_peaks_of("R") == []
    tracker.close()


# -- end to end: a real server and real kernels ----------------------------------------------
async def start(jp_fetch, jp_ws_fetch, kernels, app, name: str = "python3") -> tuple[KernelConn, Execution]:
    """A kernel of kernelspec ``name`` and the output of its first cell."""
    r = await jp_fetch("api", "kernels", method="POST", body=json.dumps({"name": name}))
    kid = json.loads(r.body)["id"]
    ws = await jp_ws_fetch("api", "kernels", kid, "channels")
    conn = KernelConn(kid, ws, app.serverapp.kernel_manager)
    kernels.started.append(conn)
    first = await conn.run("print('first')")
    await wait_for(lambda: kid in app.channel.connections, what="the agent to connect")
    return conn, first


PROBE = ("import os\nfrom jupyter_gpushare.sim import simgpu\n"
         "print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')), simgpu.device_count())")


def fill(mib: int, device: int = 0, name: str = "x") -> str:
    return ("from jupyter_gpushare.sim import simgpu\nimport numpy as np\n"
            f"{name} = simgpu.zeros(({mib}, 1024, 1024), dtype=np.uint8, device={device})")


def spec(jp_data_dir, name: str, gpus: int) -> str:
    spec_dir = jp_data_dir / "kernels" / name
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python ({gpus} GPUs)", "language": "python",
        "metadata": {"gpushare": {"gpus": gpus}},
    }))
    return name


@pytest.mark.parametrize("gpushare_config", [ROOM])
async def test_a_new_kernel_lands_on_the_gpu_with_room(
    jp_fetch, jp_ws_fetch, kernels, gpushare_app, monkeypatch
):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    node = gpushare_app.node
    a, _ = await start(jp_fetch, jp_ws_fetch, kernels, gpushare_app)  # an empty node: GPU 0
    b, _ = await start(jp_fetch, jp_ws_fetch, kernels, gpushare_app)  # GPU 0 has a kernel: GPU 1
    assert (await a.run(PROBE)).stdout == "'0' 1\n" and (await b.run(PROBE)).stdout == "'1' 1\n"
    await a.run(fill(1800))  # GPU 0 is full of an active kernel
    await b.run(fill(256))
    assert (node.used(0), node.used(1)) == (1800 * MiB, 256 * MiB)

    c, first = await start(jp_fetch, jp_ws_fetch, kernels, gpushare_app)
    assert first.stdout == "first\n" and not first.stderr  # it had room: nothing to say
    assert (await c.run(PROBE)).stdout == "'1' 1\n"  # the most room, not the lowest index
    assert (await kernel_status(jp_fetch, c.id))["gpus"] == [1]  # shown before its first byte
    await c.run(fill(512))  # its device 0 is the node's GPU 1
    assert (node.used(0), node.used(1)) == (1800 * MiB, 768 * MiB)
    ex = await c.run(fill(1, device=1), ok=False)
    assert ex.error is not None and ex.error["ename"] == "SimInvalidDeviceError"
    assert "invalid device ordinal 1" in ex.error["evalue"]

    # a released kernel's bytes will come back: its GPU has no room for a newcomer
    code, body = await scenarios.rest(jp_fetch, a.id, "release")
    assert code == 200 and body["state"] == "released" and node.used(0) == 0
    d, _ = await start(jp_fetch, jp_ws_fetch, kernels, gpushare_app)
    assert (await d.run(PROBE)).stdout == "'1' 1\n"
    await a.run("print(x.shape)")  # restored first
    assert node.used(0) == 1800 * MiB  # back on its own GPU


@pytest.mark.parametrize("gpushare_config", [{"placement": "off", **scenarios.SMALL_NODE}])
async def test_placement_off_leaves_the_environment_alone(
    jp_fetch, jp_ws_fetch, kernels, gpushare_app, monkeypatch
):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    k, _ = await start(jp_fetch, jp_ws_fetch, kernels, gpushare_app)
    assert (await k.run(PROBE)).stdout == "None 2\n"
    assert (await kernel_status(jp_fetch, k.id))["gpus"] == []
    await k.run(fill(64, device=1))
    assert gpushare_app.node.used(1) == 64 * MiB


@pytest.mark.parametrize("gpushare_config", [ROOM])
async def test_the_servers_cuda_visible_devices_is_the_set_to_choose_within(
    jp_fetch, jp_ws_fetch, kernels, gpushare_app, jp_data_dir, monkeypatch
):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    k, _ = await start(jp_fetch, jp_ws_fetch, kernels, gpushare_app)
    assert (await k.run(PROBE)).stdout == "'1' 1\n"
    with pytest.raises(HTTPClientError) as refused:
        await start(jp_fetch, jp_ws_fetch, kernels, gpushare_app, spec(jp_data_dir, "two", 2))
    assert refused.value.code == 400
    assert "allows 1" in json.loads(refused.value.response.body)["message"]


@pytest.mark.parametrize("gpushare_config", [ROOM])
async def test_a_kernelspec_asking_for_two_gpus_gets_both(
    jp_fetch, jp_ws_fetch, kernels, gpushare_app, jp_data_dir, monkeypatch
):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    k, _ = await start(jp_fetch, jp_ws_fetch, kernels, gpushare_app, spec(jp_data_dir, "two", 2))
    assert (await k.run(PROBE)).stdout == "'0,1' 2\n"
    assert (await kernel_status(jp_fetch, k.id))["gpus"] == [0, 1]
    await k.run(fill(100, device=0, name="a") + "\n" + fill(200, device=1, name="b"))
    assert gpushare_app.node.pids()[k.km.get_kernel(k.id).provisioner.pid] == {0: 100 * MiB,
                                                                              1: 200 * MiB}


@pytest.mark.parametrize("gpushare_config", [ROOM])
async def test_a_kernelspec_asking_for_more_gpus_than_exist_is_refused_at_start(
    jp_fetch, jp_ws_fetch, kernels, gpushare_app, jp_data_dir, monkeypatch
):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(HTTPClientError) as refused:
        await jp_fetch("api", "kernels", method="POST",
                       body=json.dumps({"name": spec(jp_data_dir, "three", 3)}))
    assert refused.value.code == 400
    message = json.loads(refused.value.response.body)["message"]
    assert message == ("kernelspec 'Python (3 GPUs)' asks for 3 GPU(s) (metadata.gpushare.gpus) "
                       "and this node has 2: it cannot start here")
    with pytest.raises(HTTPClientError) as refused:  # JupyterLab starts kernels with a session
        await jp_fetch("api", "sessions", method="POST", body=json.dumps(
            {"path": "a.ipynb", "type": "notebook", "kernel": {"name": "three"}}))
    assert refused.value.code == 500  # jupyter_server's sessions answer any start error so
    assert json.loads(refused.value.response.body)["message"] == message
    assert gpushare_app.serverapp.kernel_manager.list_kernel_ids() == []


@pytest.mark.parametrize("gpushare_config", [ROOM])
async def test_no_room_anywhere_the_first_cell_says_so(
    jp_fetch, jp_ws_fetch, kernels, gpushare_app, monkeypatch
):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for _ in range(2):
        k, _ = await start(jp_fetch, jp_ws_fetch, kernels, gpushare_app)
        await k.run(fill(1800))
    late, first = await start(jp_fetch, jp_ws_fetch, kernels, gpushare_app)
    assert first.stdout == "first\n"
    assert first.stderr.startswith(
        "gpushare: no GPU had room for this kernel when it started (room = free memory less what "
        "released kernels will take back: GPU 0: 248.0 MiB, GPU 1: 248.0 MiB). It runs on GPU 0, "
        "the most there was; its allocations on GPU 0 may fail with out-of-memory"), first.stderr
    assert not (await late.run("print('second')")).stderr  # said once
    ex = await late.run(fill(512), ok=False)  # and that is what happens
    assert ex.error is not None and "out of memory" in ex.error["evalue"]
