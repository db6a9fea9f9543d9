"""On a real GPU (``pytest -m gpu``): a framework release that leaves the memory on the GPU
is undone and answers an error, and ``auto`` leaves a JAX kernel's preallocated pool to the
driver. The CPU twin with the device faked is tests/test_release_honest.py.
"""

from __future__ import annotations

import importlib.util

import pytest

from jupyter_gpushare.reclaim.driver import driver_support

from ..helpers import kernel_status, rest, wait_for

# each test's own timeout (seconds), so that a hang costs one test, not the GPU proof's stage
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(90)]

GiB = 1 << 30

# 1 GiB the user namespace cannot reach (a module's attribute), 64 MiB it can
TORCH_HIDDEN = """
import sys, types, torch
hidden = types.ModuleType("gpushare_hidden")
hidden.t = torch.ones((1 << 30) // 4, device="cuda:0")
sys.modules["gpushare_hidden"] = hidden
del hidden
small = torch.arange(16 << 20, device="cuda:0", dtype=torch.float32)
torch.cuda.synchronize()
print(int(small.sum().item()))
"""

JAX_POOL = """
import os
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"
os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = ".05"
import jax.numpy as jnp
x = jnp.arange(64 << 20, dtype=jnp.float32)
print(float(x.sum()))
"""


def needs(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"needs {module}")


async def held(app, jp_fetch, kid: str, at_least: int) -> dict:
    async def seen():
        await app.poll_once()
        info = await kernel_status(jp_fetch, kid)
        return info if info and info["gpu_memory_bytes"] >= at_least else None

    return await wait_for(seen, timeout=20, what=f"status to show {at_least} bytes")


@pytest.mark.parametrize("gpushare_config", [{"backend": "nvml", "release_method": "framework",
                                              "poll_interval": 0.5}])
async def test_a_framework_release_that_frees_little_fails_and_keeps_the_kernel(
    nvml, kernels, jp_fetch, gpushare_app
):
    needs("torch")
    k = await kernels.start()
    total = (await k.run(TORCH_HIDDEN, timeout=120)).stdout.strip()
    await held(gpushare_app, jp_fetch, k.id, GiB)
    code, body = await rest(jp_fetch, "POST", "kernels", k.id, "release")
    assert code == 409 and "not released: the framework method freed" in body["message"], body
    info = await kernel_status(jp_fetch, k.id)
    assert info["state"] in ("active", "idle")
    out = await k.run("print(int(small.sum().item()), small.device)")
    assert out.stdout.split() == [total, "cuda:0"]


@pytest.mark.parametrize("gpushare_config", [{"backend": "nvml", "release_method": "auto",
                                              "poll_interval": 0.5}])
async def test_auto_leaves_a_jax_pool_to_the_driver(nvml, kernels, jp_fetch, gpushare_app):
    needs("jax")
    if not driver_support().ok:
        pytest.skip(f"driver method unsupported: {driver_support().reason}")
    k = await kernels.start()
    await k.run(JAX_POOL, timeout=120)
    await held(gpushare_app, jp_fetch, k.id, 256 << 20)

    async def picked():
        await gpushare_app.poll_once()
        pick = gpushare_app.controller.kernels.picks.get(k.id, "")
        return pick if "JAX's memory pool" in pick else None

    pick = await wait_for(picked, timeout=20, what="auto to see JAX's pool")
    assert pick.startswith("driver: ")
    free_before = nvml.free_bytes(0)
    code, view = await rest(jp_fetch, "POST", "kernels", k.id, "release")
    assert code == 200 and view["method"] == "driver", view
    assert nvml.free_bytes(0) - free_before >= view["released_bytes"] * 0.9
