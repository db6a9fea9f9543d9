"""Room for a restore when the server cannot tell which GPU the state came from (a container
whose pid namespace hides the kernel's processes from NVML): reserved on every GPU, with a
CUDA context on top of the kernel's own count; and which processes a release acts on."""

from __future__ import annotations

import asyncio
from typing import Any

from jupyter_gpushare.core.controller import Controller, Held
from jupyter_gpushare.core.tracker import KernelRecord
from jupyter_gpushare.policy import PolicyConfig

GiB = 1 << 30


class _Tracker:
    def __init__(self) -> None:
        self.kernels: dict[str, KernelRecord] = {}
        self.km: set[str] = set()
        self.gpus: dict[int, Any] = {}


class _Node:
    """Two GPUs of 80 GiB, all free; no kernel has a method or an agent."""

    async def read_free(self, gpus: list[int]) -> dict[int, int | None]:
        return {g: 80 * GiB for g in gpus}

    def total_bytes(self) -> dict[int, int]:
        return {0: 80 * GiB, 1: 80 * GiB}

    async def host_room(self, pid: int | None) -> None:
        return None

    async def refresh(self) -> None:
        pass

    async def node_view(self, gpus: list[int]) -> None:
        return None

    def live_state(self, kernel_id: str) -> str:
        return "unknown"

    def overrides(self, kernel_id: str) -> dict[str, Any]:
        return {}

    def method_for(self, kernel_id: str) -> str | None:
        return None

    def agent(self, kernel_id: str) -> Any:
        return None


def controller(context_bytes: int = 512 << 20) -> Controller:
    node = _Node()
    return Controller(_Tracker(), {}, PolicyConfig(), node, node, lambda e: None,  # type: ignore[arg-type]
                      context_bytes=context_bytes)


def held(gpus: dict[int, int], attributed: bool) -> Held:
    return Held(method="driver", bytes=sum(gpus.values()), gpus=gpus, pids=[1], pid_bytes={},
                kernel_pid=1, attributed=attributed, since=0.0)


def test_a_state_on_an_unknown_gpu_needs_room_on_every_gpu_plus_a_context():
    c = controller()
    assert c.need(held({-1: 4 * GiB}, attributed=False)) == {
        0: 4 * GiB + (512 << 20), 1: 4 * GiB + (512 << 20)}


def test_a_measured_state_needs_exactly_what_it_held_where_it_held_it():
    c = controller()
    assert c.need(held({1: 3 * GiB}, attributed=True)) == {1: 3 * GiB}
    assert c.need(held({0: GiB, 1: 2 * GiB}, attributed=True)) == {0: GiB, 1: 2 * GiB}


def test_a_release_acts_on_every_process_with_a_gpu_open_when_nvml_cannot_tell():
    c = controller()
    rec = KernelRecord(id="k", pids=[10, 11, 12], gpu_bytes={-1: 4 * GiB}, attributed=False,
                       gpu_pids=[10, 12])
    assert c._release_target("k", rec).pids == [10, 12]
    measured = KernelRecord(id="k", pids=[10, 11, 12], gpu_bytes={0: GiB},
                            pid_gpu_bytes={11: {0: GiB}})
    assert c._release_target("k", measured).pids == [11]


def test_reservations_serialize_restores_per_gpu_and_show_in_free_memory():
    async def scenario() -> None:
        c = controller()
        first = await c.reservations.acquire([1, 0])
        first.reserve({0: GiB})
        assert c.reservations.reserved(0) == GiB and c.reservations.busy(1)
        second = asyncio.ensure_future(c.reservations.acquire([0]))
        await asyncio.sleep(0)
        assert not second.done()  # GPU 0 is taken by the first restore
        first.release()
        grant = await second
        assert c.reservations.reserved(0) == 0
        grant.release()
        assert c.reservations.snapshot() == {} and not c.reservations.busy(0)

    asyncio.run(scenario())
