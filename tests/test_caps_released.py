"""A cap that reaches a released kernel makes no GPU call: under the driver's checkpoint every
CUDA call of the process blocks until the restore, and the agent's thread that applies the
cap also serves the server. The cap waits, is said to apply "when the kernel's state is back
on the GPU", and holds from the restore on, before the next cell runs.

PyTorch's CUDA is faked at the driver boundary: its calls fail (unit test) or block until the
simulated GPU runs again (end to end), as CUDA's do while the process is checkpointed."""

from __future__ import annotations

import sys
import types

import pytest

from jupyter_gpushare.kernel import caps as kernel_caps

from .helpers import kernel_status, rest, wait_for
from .scenarios import MiB, hold, intact

GiB = 1 << 30
WAITS = "applies when the kernel's state is back on the GPU"


class FakeCuda:
    """torch.cuda after CUDA started, at the driver boundary: a call made while the process
    is checkpointed fails (the real one would block until the restore)."""

    def __init__(self, total: int):
        self.total = total
        self.checkpointed = False
        self.fraction: float | None = None
        self.calls_while_checkpointed: list[str] = []

    def _driver(self, what: str) -> None:
        if self.checkpointed:
            self.calls_while_checkpointed.append(what)
            raise RuntimeError(f"{what}: the process is checkpointed")

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1  # cached by PyTorch once CUDA started

    def get_device_properties(self, i: int) -> types.SimpleNamespace:
        self._driver("get_device_properties")
        return types.SimpleNamespace(total_memory=self.total)

    def set_per_process_memory_fraction(self, fraction: float, i: int) -> None:
        self._driver("set_per_process_memory_fraction")  # cudaMemGetInfo in PyTorch
        self.fraction = fraction

    def memory_reserved(self, i: int) -> int:
        return 0  # the allocator's own count: no driver call


def test_a_cap_set_while_released_waits_for_the_restore_and_makes_no_gpu_call(monkeypatch):
    cuda = FakeCuda(total=80 * GiB)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.delenv(kernel_caps.JAX_FRACTION_ENV, raising=False)
    monkeypatch.delenv(kernel_caps.CUPY_LIMIT_ENV, raising=False)
    c = kernel_caps.Caps()
    try:
        c.set(8 * GiB, 80 * GiB)
        assert cuda.fraction == pytest.approx(0.1)

        c.hold()  # released: the driver checkpoints the process
        cuda.checkpointed = True
        lines = c.set(4 * GiB)
        assert f"PyTorch: capped at 4.0 GiB per GPU; the cap {WAITS} (it is released now)" \
            in lines, lines
        assert cuda.calls_while_checkpointed == [] and cuda.fraction == pytest.approx(0.1)
        # what needs no GPU call is set at once: JAX reads it when it starts
        assert kernel_caps.os.environ[kernel_caps.JAX_FRACTION_ENV] == "0.0500"
        assert c.set(2 * GiB)  # a second change while released: the latest one waits
        assert cuda.calls_while_checkpointed == []

        cuda.checkpointed = False  # restored
        back = c.resume()
        assert back and back[0].startswith("PyTorch: already using the GPU; capped at 2.0 GiB"), back
        assert cuda.fraction == pytest.approx(2 / 80) and not c.held and not c.pending
        assert c.resume() == []  # once
    finally:
        c.set(None)  # the environment as it was
        if c._hook is not None:
            sys.meta_path.remove(c._hook)


# -- end to end: a real server, a real kernel, the simulated node ---------------------------------
FAKE_TORCH = """
import sys, types
from jupyter_gpushare.sim import device as _device

class _Cuda:
    # CUDA at the driver boundary: a call waits while the simulated GPU is checkpointed,
    # as CUDA's calls wait under the driver's checkpoint (bounded: a test never hangs)
    fraction = None
    waited = []
    def is_initialized(self): return True
    def device_count(self): return 1
    def memory_reserved(self, i): return 0
    def _driver(self, what):
        dev = _device.get_device()
        with dev._cond:
            if dev.state != "running":
                self.waited.append(what)
                dev._cond.wait_for(lambda: dev.state == "running", timeout=30)
    def get_device_properties(self, i):
        self._driver("get_device_properties")
        return types.SimpleNamespace(total_memory=16 << 30)
    def set_per_process_memory_fraction(self, fraction, i):
        self._driver("set_per_process_memory_fraction")
        type(self).fraction = fraction

sys.modules["torch"] = types.SimpleNamespace(cuda=_Cuda(), __spec__=None)
"""


@pytest.mark.parametrize("gpushare_config", [{"memory_limit": "64MiB",
                                              "release_method": "simulated"}])
async def test_a_released_kernel_gets_a_new_cap_keeps_answering_and_the_cap_holds_after_restore(
    jp_fetch, kernels, gpushare_app
):
    k = await kernels.start()
    await k.run(FAKE_TORCH + hold(16, chunk=16))
    await wait_for(lambda: gpushare_app.tracker.kernels[k.id].gpu_memory_bytes == 16 * MiB,
                   what="the server to see the 16 MiB")
    code, answer = await rest(jp_fetch, "POST", "kernels", k.id, "release")
    assert code == 200 and answer["state"] == "released", answer

    gpushare_app.memory_limit = "32MiB"  # the admin's cap drops (as the hub service's does)
    await gpushare_app.poll_once()
    assert (await kernel_status(jp_fetch, k.id))["memory_cap"] == 32 * MiB
    conn = gpushare_app.channel.connections[k.id]
    for _ in range(2):  # the agent answers the server at once, again and again
        reply = await conn.request("report", timeout=15)  # (its fake CUDA would block 30 s)
        assert reply.get("frameworks") is not None, reply

    out = await k.run("%gpushare cap")  # magics only: it runs without a restore
    assert f"PyTorch: capped at 32.0 MiB per GPU; the cap {WAITS}" in out.stdout, out.stdout
    assert "simulated GPU: capped at 32.0 MiB per GPU" in out.stdout, out.stdout
    assert (await kernel_status(jp_fetch, k.id))["state"] == "released"

    # the next cell restores the kernel; the cap holds from before its code runs
    out = await k.run("import torch\nprint(torch.cuda.fraction, torch.cuda.waited)")
    assert out.stdout.split() == [repr(32 * MiB / (16 * GiB)), "[]"], out.stdout
    ex = await k.run(hold(32, name="y", chunk=32), ok=False)  # 16 + 32 MiB: past the cap
    assert ex.error is not None and ex.error["ename"] == "SimOutOfMemoryError", ex.error
    assert "gpushare memory cap is 32.0 MiB per GPU" in ex.error["evalue"], ex.error
    assert "intact" in (await k.run(intact())).stdout
