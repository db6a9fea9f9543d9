"""Incremental releases end to end: a real jupyter_server on the simulated node, a real
kernel with simulated GPU arrays, releases and restores through the REST API.

A release after a restore copies only what the cells changed since (an unchanged state: 0
bytes), status shows the kept host copy and what is left to copy, and a kernel idle for
``precopy_after`` copies its changed state ahead, so the release copies nothing.
"""

from __future__ import annotations

import json

import pytest

from .helpers import kernel_status, rest, wait_for

MiB = 1 << 20

HOLD = """
from jupyter_gpushare.sim import device, simgpu
import numpy as np
xs = [simgpu.array(np.arange(1 << 18, dtype=np.uint32) * (i + 1), device=0) for i in range(4)]
sums = [x.checksum() for x in xs]
"""


async def release(jp_fetch, kid: str) -> dict:
    await jp_fetch("api", "gpushare", "kernels", kid, "release", method="POST", body=b"")
    status = await kernel_status(jp_fetch, kid)
    assert status["state"] == "released"
    return status


async def restore(jp_fetch, kid: str) -> None:
    await jp_fetch("api", "gpushare", "kernels", kid, "restore", method="POST", body=b"")
    assert (await kernel_status(jp_fetch, kid))["state"] in ("active", "idle")


async def copies_seen(jp_fetch, app, kid: str, current: int, to_copy: int) -> dict:
    """Poll until status shows the kernel's host copy as ``current`` / ``to_copy``."""
    async def seen():
        await app.poll_once()
        status = await kernel_status(jp_fetch, kid)
        got = (status["host_copy_bytes"], status["to_copy_bytes"])
        return status if got == (current, to_copy) else None

    return await wait_for(seen, what=f"host copy {current}, to copy {to_copy}")


async def test_a_release_after_an_unchanged_restore_copies_nothing(jp_fetch, kernels, gpushare_app):
    k = await kernels.start()
    await k.run(HOLD)
    await copies_seen(jp_fetch, gpushare_app, k.id, 0, 4 * MiB)
    first = await release(jp_fetch, k.id)
    assert "copied" not in (first["release_detail"] or "")  # everything was copied
    await restore(jp_fetch, k.id)
    await copies_seen(jp_fetch, gpushare_app, k.id, 4 * MiB, 0)
    shown = await k.run("%gpushare")
    assert "current: 4.0 MiB, to copy at release: 0 B" in shown.text

    second = await release(jp_fetch, k.id)
    assert second["released_bytes"] == 4 * MiB
    assert "copied 0 B of 4.0 MiB" in second["release_detail"]
    assert gpushare_app.node.used(0) == 0

    ex = await k.run("xs[2][:5] = 7\nsums[2] = xs[2].checksum()")  # restores, then writes
    assert not ex.error
    await copies_seen(jp_fetch, gpushare_app, k.id, 3 * MiB, MiB)
    third = await release(jp_fetch, k.id)
    assert "copied 1.0 MiB of 4.0 MiB" in third["release_detail"]
    ex = await k.run("assert [x.checksum() for x in xs] == sums\nprint(int(xs[2].get()[4]))")
    assert ex.stdout.strip() == "7"


@pytest.fixture
def gpushare_config(request):
    """No pre-copy unless a test asks for one (``precopy_after`` as its param, or the
    whole configuration)."""
    param = getattr(request, "param", 0)
    return param if isinstance(param, dict) else {"precopy_after": param}


@pytest.mark.parametrize("gpushare_config", [0.5], indirect=True)
async def test_an_idle_kernel_copies_ahead_and_its_release_copies_nothing(
    jp_fetch, kernels, gpushare_app
):
    k = await kernels.start()
    await k.run(HOLD)
    # idle for precopy_after: the server asks the agent, which copies in the background
    await copies_seen(jp_fetch, gpushare_app, k.id, 4 * MiB, 0)
    ex = await k.run("xs[0] += 1\nsums[0] = xs[0].checksum()")  # a write after the pre-copy
    assert not ex.error
    await copies_seen(jp_fetch, gpushare_app, k.id, 4 * MiB, 0)  # copied ahead again
    released = await release(jp_fetch, k.id)
    assert "copied 0 B of 4.0 MiB" in released["release_detail"]
    ex = await k.run("assert [x.checksum() for x in xs] == sums\nprint('same data')")
    assert "same data" in ex.stdout


async def test_host_memory_short_drops_the_kept_copies(jp_fetch, kernels, gpushare_app):
    k = await kernels.start()
    await k.run(HOLD)
    await copies_seen(jp_fetch, gpushare_app, k.id, 0, 4 * MiB)  # the server has seen it hold
    await release(jp_fetch, k.id)
    await restore(jp_fetch, k.id)
    await copies_seen(jp_fetch, gpushare_app, k.id, 4 * MiB, 0)
    gpushare_app.host_memory_reserve = 1 << 60  # no machine has that much room left
    await copies_seen(jp_fetch, gpushare_app, k.id, 0, 4 * MiB)
    assert gpushare_app.precopies.dropped == 4 * MiB


@pytest.mark.parametrize("gpushare_config", [{"precopy_after": 0, "host_memory_reserve": 0}],
                         indirect=True)
async def test_the_host_memory_check_asks_only_for_what_a_release_still_copies(
    jp_fetch, kernels, gpushare_app, tmp_path
):
    """Host memory faked at its file (``/proc/meminfo``, 512 KiB available): a 4 MiB state
    whose host copy is current fits, since it needs no new host memory; once a cell wrote
    1 MiB of it, the release would copy that much and is refused, and says why."""
    from jupyter_gpushare.core.hostmem import HostMemory

    k = await kernels.start()
    await k.run(HOLD)
    await copies_seen(jp_fetch, gpushare_app, k.id, 0, 4 * MiB)
    await release(jp_fetch, k.id)
    await restore(jp_fetch, k.id)
    await copies_seen(jp_fetch, gpushare_app, k.id, 4 * MiB, 0)
    (tmp_path / "meminfo").write_text("MemTotal: 1048576 kB\nMemAvailable: 512 kB\n")
    gpushare_app.tracker.hostmem = HostMemory(proc=str(tmp_path), cgroup_root=str(tmp_path))
    await gpushare_app.poll_once()

    released = await release(jp_fetch, k.id)  # fits only because its copy is kept
    assert "copied 0 B of 4.0 MiB" in released["release_detail"]
    await restore(jp_fetch, k.id)
    ex = await k.run("xs[2][:5] = 7\nsums[2] = xs[2].checksum()")
    assert not ex.error
    await copies_seen(jp_fetch, gpushare_app, k.id, 3 * MiB, MiB)
    code, body = await rest(jp_fetch, "POST", "kernels", k.id, "release")
    assert code == 409, body
    assert "its GPU state (1.0 MiB) would not fit in host memory" in body["message"], body
    assert "512 KiB" in body["message"], body
    status = await kernel_status(jp_fetch, k.id)
    assert status["state"] in ("active", "idle") and "would not fit" in status["release_blocked"]
    ex = await k.run("assert [x.checksum() for x in xs] == sums\nprint('same data')")
    assert "same data" in ex.stdout


# -- PyTorch: a kept copy is trusted without reading it only while no code can have run ------
TORCH = """
import torch, threading, os, time
from tests.fakes import fake_torch_gpu as tg
tg.install()
ws = [tg.put(torch.full((1 << 18,), float(i))) for i in range(4)]
"""
FRAMEWORK = {"backend": "nvml", "idle_timeout": 0, "release_method": "framework",
             "precopy_after": 0}


def silent(k, code: str) -> str:
    """Send ``code`` as a silent execute request (no pre_run_cell, no history)."""
    from .helpers import Execution, execute_request

    msg = execute_request(code, k.session)
    msg["content"].update(silent=True, store_history=False)
    msg_id = msg["header"]["msg_id"]
    k.executions[msg_id] = Execution(msg_id)
    k.ws.write_message(json.dumps(msg))
    return msg_id


async def last_release(k) -> tuple[int, int, int]:
    """(bytes copied, trusted without a fingerprint, fingerprinted) of the last release."""
    shown = await k.run("r = [r for kind, r in tg.reports if kind == 'offload'][-1]\n"
                        "print(r.copied, r.trusted, r.checked)")
    copied, trusted, checked = map(int, shown.stdout.split())
    return copied, trusted, checked


@pytest.mark.torch
@pytest.mark.parametrize("gpushare_config", [FRAMEWORK], indirect=True)
async def test_a_kept_copy_is_checked_unless_no_code_can_have_written_it(
    fake_nvml, jp_fetch, kernels, gpushare_app, tmp_path
):
    pytest.importorskip("torch")
    from .test_release_honest import FAKE, framework_kernel

    k, _pid = await framework_kernel(gpushare_app, kernels, fake_nvml, FAKE + TORCH, 4 * MiB)
    await release(jp_fetch, k.id)
    await restore(jp_fetch, k.id)  # from the REST API: no cell runs, the copies are kept

    # nothing ran since the restore: trusted as it is, no byte read
    second = await release(jp_fetch, k.id)
    assert "copied 0 B of 4.0 MiB" in second["release_detail"]
    assert await last_release(k) == (0, 4 * MiB, 0)  # the cell restores first

    # a silent request writes behind the counters: the epoch moved, the check sees it
    await release(jp_fetch, k.id)  # the copies current again, after the cell above
    await restore(jp_fetch, k.id)
    ex = await k.wait(silent(k, "ws[1].data.add_(10)"))
    assert ex.status == "ok"
    third = await release(jp_fetch, k.id)
    assert "copied 1.0 MiB of 4.0 MiB" in third["release_detail"]
    copied, trusted, checked = await last_release(k)
    assert (copied, trusted) == (MiB, 0) and checked >= 3 * MiB

    # a thread a cell started writes after the copies were made current: checked too
    go, done = tmp_path / "go", tmp_path / "done"
    await k.run(f"def later():\n"
                f"    while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
                f"    ws[2].data.add_(20)\n"
                f"    open({str(done)!r}, 'w').close()\n"
                f"threading.Thread(target=later, daemon=True).start()")
    await release(jp_fetch, k.id)
    await restore(jp_fetch, k.id)  # kept while the thread runs
    go.touch()
    await wait_for(done.exists, what="the thread's write")
    fourth = await release(jp_fetch, k.id)
    assert "copied 1.0 MiB of 4.0 MiB" in fourth["release_detail"]
    copied, trusted, checked = await last_release(k)
    assert (copied, trusted) == (MiB, 0) and checked >= 3 * MiB
    shown = await k.run("print([float(w[7]) for w in ws])")
    assert shown.stdout.strip() == "[0.0, 11.0, 22.0, 3.0]"


@pytest.mark.torch
@pytest.mark.parametrize("gpushare_config", [{**FRAMEWORK, "host_memory_reserve": 0}],
                         indirect=True)
async def test_a_written_storage_with_a_kept_buffer_needs_no_new_host_memory(
    fake_nvml, jp_fetch, kernels, gpushare_app, tmp_path
):
    """Host memory faked at its file (512 KiB available): a storage a cell wrote since its
    copy is copied again, but into its kept buffer, so the release (1 MiB to copy) is
    allowed; a new storage has no buffer to go into, and the same 1 MiB is refused."""
    pytest.importorskip("torch")
    from jupyter_gpushare.core.hostmem import HostMemory

    from .test_release_honest import FAKE, framework_kernel

    k, _pid = await framework_kernel(gpushare_app, kernels, fake_nvml, FAKE + TORCH, 4 * MiB)
    await release(jp_fetch, k.id)
    await restore(jp_fetch, k.id)
    assert not (await k.run("ws[1].add_(1)")).error  # PyTorch's counters see it
    await copies_seen(jp_fetch, gpushare_app, k.id, 3 * MiB, MiB)
    (tmp_path / "meminfo").write_text("MemTotal: 1048576 kB\nMemAvailable: 512 kB\n")
    gpushare_app.tracker.hostmem = HostMemory(proc=str(tmp_path), cgroup_root=str(tmp_path))
    await gpushare_app.poll_once()
    assert gpushare_app.tracker.kernels[k.id].to_copy_new_bytes == 0

    released = await release(jp_fetch, k.id)
    assert "copied 1.0 MiB of 4.0 MiB" in released["release_detail"]
    await restore(jp_fetch, k.id)
    assert not (await k.run("ws.append(tg.put(torch.zeros(1 << 18)))")).error
    await copies_seen(jp_fetch, gpushare_app, k.id, 4 * MiB, MiB)
    code, body = await rest(jp_fetch, "POST", "kernels", k.id, "release")
    assert code == 409, body
    assert "its GPU state (1.0 MiB) would not fit in host memory" in body["message"], body
    shown = await k.run("print([float(w[7]) for w in ws])")
    assert shown.stdout.strip() == "[0.0, 2.0, 2.0, 3.0, 0.0]"


# -- CuPy (faked at its device, tests/fakes/fake_cupy.py) in a real kernel ------------------------
CUPY = """
import numpy as np
from tests.fakes import fake_cupy
cupy = fake_cupy.install_module()
xs = [cupy.asarray(np.full(1 << 18, float(i), dtype=np.float32)) for i in range(4)]
"""


@pytest.mark.parametrize("gpushare_config", [FRAMEWORK], indirect=True)
async def test_cupy_releases_copy_only_the_allocations_a_cell_wrote(
    fake_nvml, jp_fetch, kernels, gpushare_app
):
    from .test_release_honest import FAKE, framework_kernel

    k, _pid = await framework_kernel(gpushare_app, kernels, fake_nvml, FAKE + CUPY, 4 * MiB)
    await release(jp_fetch, k.id)
    await restore(jp_fetch, k.id)  # from the REST API: no code ran since
    await copies_seen(jp_fetch, gpushare_app, k.id, 4 * MiB, 0)
    second = await release(jp_fetch, k.id)
    assert "copied 0 B of 4.0 MiB" in second["release_detail"]

    assert not (await k.run("xs[1] += 1")).error  # restores first, then writes one array
    third = await release(jp_fetch, k.id)  # the fingerprints say which one
    assert "copied 1.0 MiB of 4.0 MiB" in third["release_detail"]
    shown = await k.run("print([float(x.get()[7]) for x in xs])")
    assert shown.stdout.strip() == "[0.0, 2.0, 2.0, 3.0]"
