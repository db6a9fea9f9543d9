"""The agent's epoch (``kernel/offload/quiet.py``): a kept host copy is trusted without
reading it only while nothing but the kernel's requests can run code. Here what else can:
a task or a callback waiting on the kernel's event loop, a handler the agent does not wrap,
a thread (``tests/test_incremental_torch.py``) and, through a real kernel, silent requests and
threads a cell started (``tests/test_incremental_server.py``)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from jupyter_gpushare.kernel.offload import quiet


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    quiet.unwatch()
    loop.close()


def test_a_task_or_a_callback_on_the_kernels_loop_can_run_code(loop):
    quiet.watch(loop=lambda: loop)
    assert quiet.epoch() is not None
    task = loop.create_task(asyncio.sleep(3600))  # a cell's asyncio.ensure_future(...)
    assert quiet.epoch() is None and "task" in quiet.others_running()
    task.cancel()
    loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
    assert quiet.epoch() is not None
    handle = loop.call_later(3600, print)  # a cell's loop.call_later / PeriodicCallback
    assert quiet.epoch() is None and "callback" in quiet.others_running()
    handle.cancel()
    assert quiet.epoch() is not None


class Events:
    def __init__(self) -> None:
        self.callbacks: dict[str, list] = {}

    def register(self, name, callback) -> None:
        self.callbacks.setdefault(name, []).append(callback)


def test_every_request_that_may_run_code_moves_the_epoch_before_and_after(loop):
    calls = []

    async def execute_request(*args):
        calls.append(quiet.epoch())

    def comm_msg(*args):
        calls.append(quiet.epoch())

    kernel = SimpleNamespace(
        shell_handlers={"execute_request": execute_request, "comm_msg": comm_msg,
                        "kernel_info_request": lambda *a: None},
        control_handlers={"debug_request": comm_msg}, eventloop=None)
    shell = SimpleNamespace(kernel=kernel, events=Events())
    assert quiet.watch_kernel(shell)
    info = kernel.shell_handlers["kernel_info_request"]
    start = quiet.epoch()
    assert start is not None
    loop.run_until_complete(kernel.shell_handlers["execute_request"]())
    kernel.shell_handlers["comm_msg"]()
    kernel.control_handlers["debug_request"]()
    info()  # runs no code: the epoch stays
    assert calls == [start + 1, start + 3, start + 5] and quiet.epoch() == start + 6
    assert shell.events.callbacks == {"pre_execute": [quiet.bump], "post_execute": [quiet.bump]}

    kernel.shell_handlers["inspect_request"] = comm_msg  # added later, unwrapped
    assert quiet.epoch() is None and "inspect_request" in quiet.others_running()
    del kernel.shell_handlers["inspect_request"]
    kernel.eventloop = object()  # %gui qt: the GUI's loop runs between cells
    assert quiet.epoch() is None and "GUI" in quiet.others_running()


def test_a_kernel_without_request_handlers_is_not_watched():
    assert not quiet.watch_kernel(SimpleNamespace(events=Events()))
    assert quiet.epoch() is None
