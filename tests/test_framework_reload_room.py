"""A framework-method restore whose reload runs out of GPU memory (another process took the
room after the controller granted it) leaves the kernel exactly as released, across
frameworks, and the method says only room was short (``ReclaimError.no_room``), so the
controller waits for room again as it does for the driver.

Through the real agent's ``reload`` with PyTorch and CuPy faked at their device (PyTorch:
``FakeGPUs``, CPU storages standing for GPU memory; CuPy: tests/fakes/fake_cupy.py), each
device with a byte budget that raises that framework's own out-of-memory error when full.
The adapters' code (walk, copies, kept host copies, re-pointing) is the real one.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from jupyter_gpushare.kernel import offload
from jupyter_gpushare.kernel import reload as kernel_reload
from jupyter_gpushare.kernel.offload import cupy_adapter as ca
from jupyter_gpushare.kernel.offload.base import KEEP_HOST_COPY_ENV, KEPT_CHECK_ENV
from jupyter_gpushare.protocol import RemoteError
from jupyter_gpushare.reclaim import KernelTarget, ReclaimError
from jupyter_gpushare.reclaim.framework import NO_ROOM_KIND, FrameworkMethod

from .fakes import fake_cupy

torch = pytest.importorskip("torch")

from jupyter_gpushare.kernel import agent as agent_module  # noqa: E402
from jupyter_gpushare.kernel.offload import torch_adapter  # noqa: E402

from .test_offload_fast import FakeGPUs  # noqa: E402

pytestmark = pytest.mark.torch
MiB = 1 << 20


class BudgetGPUs(FakeGPUs):
    """PyTorch's fake GPUs with ``room`` bytes left for new device memory (None: no limit);
    past it an allocation raises PyTorch's own out-of-memory error, worded as CUDA's."""

    room: int | None = None

    def alloc_device(self, nbytes: int, device: str):
        if self.room is not None:
            if nbytes > self.room:
                self.device_allocs += 1
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate {nbytes / MiB:.2f} MiB. GPU 0 has a "
                    f"total capacity of 16.00 GiB of which {self.room / MiB:.2f} MiB is free.")
            self.room -= nbytes
        return super().alloc_device(nbytes, device)


@pytest.fixture
def cupy(monkeypatch):
    """CuPy faked at its device, with ``budget`` bytes of GPU memory (``cupy.budget``, None:
    no limit): past it ``cuda.alloc`` raises CuPy's OutOfMemoryError with CuPy's wording."""
    monkeypatch.delenv(KEEP_HOST_COPY_ENV, raising=False)
    monkeypatch.delenv(KEPT_CHECK_ENV, raising=False)
    module = fake_cupy.install(monkeypatch)
    _fresh()
    module.budget = None
    alloc = module.cuda.alloc

    def budgeted(size: int):
        used = sum(fake_cupy.state.device_bytes.values())
        if module.budget is not None and used + size > module.budget:
            raise fake_cupy.OutOfMemoryError(
                f"Out of memory allocating {size:,} bytes (allocated so far: {used:,} bytes).")
        return alloc(size)

    monkeypatch.setattr(module.cuda, "alloc", budgeted)
    yield module
    _fresh()


def _fresh() -> None:
    ca.drop_kept()
    ca._pool = None
    ca._fp_weights.clear()
    ca._streams.clear()
    torch_adapter.drop_kept()


def released_kernel(monkeypatch, cupy):
    """A kernel's agent with PyTorch (two 1 MiB tensors, a view) and CuPy (two 1 MiB arrays)
    state, released by the framework method's offload."""
    gpus = BudgetGPUs()
    ns = {"w": gpus.put(torch.randn(MiB // 4)), "b": gpus.put(torch.randn(MiB // 4))}
    ns["view"] = ns["w"][3:9]
    with fake_cupy.Device(0):
        ns["x"] = cupy.asarray(np.arange(MiB // 8, dtype=np.float64))
        ns["y"] = cupy.asarray(np.full(MiB // 8, 7.0))
    adapters = [gpus.adapter(), ca.CupyAdapter()]
    monkeypatch.setattr(offload, "present_adapters", lambda: list(adapters))
    agent = agent_module.Agent(types.SimpleNamespace(user_ns=ns))
    assert agent._offload({})["bytes"] == 4 * MiB
    return agent, gpus, ns, adapters


def snapshot(ns) -> dict:
    """Every object's id() and bytes (read wherever they are)."""
    out = {}
    for k, v in ns.items():
        data = v.detach().clone().view(torch.uint8) if isinstance(v, torch.Tensor) else v.get()
        out[k] = (id(v), data)
    return out


def same(before: dict, ns) -> bool:
    now = snapshot(ns)
    return all(now[k][0] == before[k][0]
               and np.array_equal(np.asarray(now[k][1]), np.asarray(before[k][1])) for k in before)


def where(gpus, ns) -> dict:
    return {k: (gpus.on(v) if isinstance(v, torch.Tensor) else fake_cupy.on_device(v))
            for k, v in ns.items()}


def reply_of(agent) -> dict:
    """The agent's answer to ``reload`` as the channel sends it (kernel/client.py's shape)."""
    try:
        return {"ok": True, **agent._handlers()["reload"]({})}
    except Exception as e:
        return {"ok": False, "error": str(e) or type(e).__name__, "kind": type(e).__name__}


def test_no_room_for_the_second_framework_puts_the_first_back_in_host_memory(monkeypatch, cupy):
    agent, gpus, ns, adapters = released_kernel(monkeypatch, cupy)
    before, offloaded = snapshot(ns), list(agent._offloaded)
    released = where(gpus, ns)
    assert set(released.values()) == {None}
    cupy.budget = MiB + MiB // 2  # another process took the rest: one array fits, not two
    copies = gpus.copies

    reply = reply_of(agent)
    assert reply == {"ok": False, "kind": NO_ROOM_KIND,
                     "error": "CuPy ran out of GPU memory allocating 1.0 MiB"}, reply
    assert where(gpus, ns) == released and same(before, ns)  # as released: ids, bytes, host
    assert [id(a) for a in agent._offloaded] == [id(a) for a in offloaded] == [id(a) for a in adapters]
    assert adapters[0].offloaded and sum(fake_cupy.state.device_bytes.values()) == 0
    # the undo copied nothing: PyTorch's reload kept its host copies, current by their
    # version counters and fingerprints (2 copies: the reload's own, host to device)
    assert gpus.copies - copies == 2

    cupy.budget = None  # the other process is gone: the next reload brings everything back
    assert reply_of(agent) == {"ok": True, "bytes": 4 * MiB}
    assert set(where(gpus, ns).values()) == {"gpu0", 0} and same(before, ns)
    assert agent._offloaded == []


def test_no_room_for_the_first_says_the_bytes_and_gpu_and_another_failure_is_as_before(
    monkeypatch, cupy
):
    agent, gpus, ns, _ = released_kernel(monkeypatch, cupy)
    before = snapshot(ns)
    gpus.room = MiB // 2
    reply = reply_of(agent)
    assert reply["kind"] == NO_ROOM_KIND, reply
    assert reply["error"] == "PyTorch ran out of GPU memory allocating 1.0 MiB on GPU 0"
    assert set(where(gpus, ns).values()) == {None} and same(before, ns)

    gpus.room = None
    fake_cupy.state.fail_copy_at = fake_cupy.state.copies + 1  # not memory: a copy that breaks
    reply = reply_of(agent)
    assert reply["kind"] == "CopyFailed" and "failed halfway" in reply["error"], reply
    assert set(where(gpus, ns).values()) == {None} and same(before, ns)
    assert reply_of(agent)["ok"] and same(before, ns)


def test_an_undo_that_fails_says_what_is_on_the_gpu_and_what_is_not(monkeypatch, cupy):
    monkeypatch.setenv(KEEP_HOST_COPY_ENV, "0")  # PyTorch's undo then copies, and that fails
    agent, gpus, ns, _ = released_kernel(monkeypatch, cupy)
    before = snapshot(ns)
    cupy.budget = MiB // 2
    gpus.fail_copy_at = gpus.copies + 3  # the reload's 2 copies pass, the undo's first fails

    reply = reply_of(agent)
    assert reply["kind"] == "ReloadIncomplete", reply
    assert reply["error"].startswith("CuPy could not be moved back (Out of memory allocating "), reply
    assert reply["error"].endswith(
        "the PyTorch objects are on the GPU, the CuPy objects still in host memory; a restore "
        "brings the rest back"), reply
    assert "nothing" not in reply["error"]
    assert where(gpus, ns) == {"w": "gpu0", "b": "gpu0", "view": "gpu0", "x": None, "y": None}
    assert same(before, ns)

    cupy.budget = None  # a later restore brings the rest back
    assert reply_of(agent) == {"ok": True, "bytes": 2 * MiB}
    assert set(where(gpus, ns).values()) == {"gpu0", 0} and same(before, ns)


class Agent:
    def __init__(self, error: Exception):
        self.error = error

    async def request(self, op: str, timeout: float | None = None, **fields):
        raise self.error


@pytest.mark.parametrize(("error", "no_room"), [
    (RemoteError("CuPy ran out of GPU memory allocating 1.0 MiB", NO_ROOM_KIND),
     "CuPy ran out of GPU memory allocating 1.0 MiB"),
    (RemoteError("simulated: copy 3 failed halfway", "CopyFailed"), ""),
    (TimeoutError(), ""),
])
async def test_the_framework_method_says_no_room_only_for_the_agents_no_room(error, no_room):
    assert kernel_reload.NoRoomToReload.__name__ == NO_ROOM_KIND
    target = KernelTarget("k", pids=[1], gpu_bytes={0: MiB}, agent=Agent(error))
    with pytest.raises(ReclaimError) as e:
        await FrameworkMethod().restore(target)
    assert e.value.no_room == no_room and e.value.retryable and not e.value.resident
    if no_room:
        assert str(e.value) == (f"reload failed: {no_room}; nothing stayed on the GPU, the state "
                                "is held in host memory as released")


# -- a real server and kernel: the framework method on NVML faked at its library ----------------
OTHER = 1  # another process on the GPU: none of the server's kernels (init, always alive)
CUPY = """
import os
import numpy as np
from tests.fakes import fake_cupy
cupy = fake_cupy.install_module()
_alloc = cupy.cuda.alloc
def _alloc_unless_taken(size):  # another process holds the GPU's memory while TAKEN exists
    if os.path.exists({taken!r}):
        raise fake_cupy.OutOfMemoryError(
            f"Out of memory allocating {{size:,}} bytes (allocated so far: 0 bytes).")
    return _alloc(size)
cupy.cuda.alloc = _alloc_unless_taken
xs = [cupy.asarray(np.full(1 << 18, float(i), dtype=np.float32)) for i in range(4)]
"""


@pytest.fixture
def gpushare_config():
    return {"backend": "nvml", "idle_timeout": 0, "release_method": "framework",
            "precopy_after": 0}


class Other:
    """Another process that takes the GPU's memory (NVML sees it, the kernel's CuPy finds no
    room) right as the framework method asks the kernel to reload, and leaves on ``leave``."""

    def __init__(self, gpu, taken):
        self.gpu, self.taken, self.held, self.times = gpu, taken, 0, 0

    def take(self) -> None:
        from .fakes.fake_pynvml import FakeProcess

        self.times += 1
        self.held = self.gpu.memory_total - self.gpu.memory_used - MiB  # 1 MiB left
        self.gpu.processes = [*self.gpu.processes, FakeProcess(OTHER, self.held)]
        self.gpu.memory_used += self.held
        self.taken.write_text("taken")

    def leave(self) -> None:
        self.gpu.processes = [p for p in self.gpu.processes if p.pid != OTHER]
        self.gpu.memory_used -= self.held
        self.held = 0
        self.taken.unlink(missing_ok=True)


async def test_a_restore_whose_reload_runs_out_of_memory_waits_and_the_cell_runs_once_room_is_back(
    fake_nvml, jp_fetch, kernels, gpushare_app, monkeypatch, tmp_path
):
    from .helpers import kernel_status, rest, wait_for
    from .test_release_honest import FAKE, framework_kernel

    taken = tmp_path / "taken"
    k, _pid = await framework_kernel(gpushare_app, kernels, fake_nvml,
                                     FAKE + CUPY.format(taken=str(taken)), 4 * MiB)
    code, _ = await rest(jp_fetch, "POST", "kernels", k.id, "release")
    assert code == 200
    other = Other(fake_nvml.gpus[0], taken)
    conn = gpushare_app.channel.connections[k.id]
    request = conn.request

    async def at_the_worst_moment(op, *args, **fields):
        if op == "reload" and not other.times:  # after the grant, before the kernel moves
            other.take()
        return await request(op, *args, **fields)

    monkeypatch.setattr(conn, "request", at_the_worst_moment)

    async def waiting_again():
        body = await kernel_status(jp_fetch, k.id)
        return body if body and "taken" in (body["waiting"] or "") else None

    try:
        msg_id = k.send("print([float(x.get()[7]) for x in xs])")
        body = await wait_for(waiting_again, what="status to say the restore waits again")
        assert body["state"] == "released" and body["error"] is None, body
        # what it waits for comes first ("waiting for memory: ...", or a turn's or the room
        # check's words on a loaded machine), the reason it waits again last
        assert body["waiting"].endswith("the room was taken right before the restore (CuPy "
                                        "ran out of GPU memory allocating 1.0 MiB)"), body
        other.leave()  # the other process goes: the restore finds its room, the cell runs
        ex = await k.wait(msg_id, timeout=60)
    finally:
        other.leave()
    assert ex.status == "ok" and ex.stdout.strip() == "[0.0, 1.0, 2.0, 3.0]", ex
    assert other.times == 1
    lines = [d.get("data", {}).get("text/plain", "") for d in ex.displays]
    assert ("gpushare: the room was taken right before the restore (CuPy ran out of GPU memory "
            "allocating 1.0 MiB): waiting for room again (interrupt to stop waiting)") in lines, lines
    body = await kernel_status(jp_fetch, k.id)
    assert body is not None and body["state"] == "active" and body["error"] is None, body
