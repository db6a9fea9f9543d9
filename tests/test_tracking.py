"""Tracking GPU memory and utilization per kernel and per GPU, end to end on the simulated
node: allocations, busy time, several kernels, history, bad input."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tornado.httpclient import HTTPClientError

from jupyter_gpushare import clock
from jupyter_gpushare.sim.node import GiB

from .helpers import get_json, kernel_status, wait_for

MiB = 1 << 20

ALLOC_3G_GPU1 = (
    "from jupyter_gpushare.sim import simgpu\nimport numpy as np\n"
    "x = simgpu.zeros((3, 1024, 1024, 1024), dtype=np.uint8, device=1)"
)


async def test_status_shows_simulated_node(jp_fetch):
    status = await get_json(jp_fetch, "api", "gpushare", "status")
    assert status["backend"] == "simulated"
    assert status["method"] == "simulated"
    assert [g["index"] for g in status["gpus"]] == [0, 1]
    assert all(g["memory_total"] == 16 * GiB for g in status["gpus"])
    assert status["kernels"] == []


async def test_allocation_shows_on_kernel_and_gpu_within_two_polls(jp_fetch, kernels, gpushare_app):
    k = await kernels.start()
    await k.run(ALLOC_3G_GPU1)
    for _ in range(2):
        await gpushare_app.poll_once()
    info = await kernel_status(jp_fetch, k.id)
    assert info is not None
    assert info["gpu_memory_bytes"] == 3 * GiB
    assert info["gpus"] == [1]
    assert info["pids"] and info["state"] in ("active", "idle")
    status = await get_json(jp_fetch, "api", "gpushare", "status")
    gpus = {g["index"]: g for g in status["gpus"]}
    assert gpus[1]["memory_used"] == 3 * GiB
    assert gpus[0]["memory_used"] == 0


async def test_busy_work_shows_utilization(jp_fetch, kernels, gpushare_app):
    k = await kernels.start()
    await k.run(ALLOC_3G_GPU1)
    await gpushare_app.poll_once()
    msg_id = k.send("simgpu.burn(1.5, device=1)")
    await wait_for(lambda: gpushare_app.node.busy_fraction(None, 1, 0, 1e12) >= 0, what="burn start")
    import asyncio

    await asyncio.sleep(0.6)
    await gpushare_app.poll_once()
    info = await kernel_status(jp_fetch, k.id)
    await k.wait(msg_id)
    assert info["sm_utilization"] is not None and info["sm_utilization"] > 50
    status = await get_json(jp_fetch, "api", "gpushare", "status")
    assert {g["index"]: g for g in status["gpus"]}[1]["utilization"] > 50


async def test_utilization_is_per_gpu_a_gpu_that_never_computed_shows_0(
    jp_fetch, kernels, gpushare_app
):
    """A kernel with data on both GPUs that computes on GPU 0 only: GPU 1 shows 0 % for it,
    in status and in history (the panel's "held while computing" per GPU reads these)."""
    k = await kernels.start()
    await k.run("from jupyter_gpushare.sim import simgpu\nimport numpy as np\n"
                "a = simgpu.zeros((1024, 1024, 64), dtype=np.uint8, device=0)\n"
                "b = simgpu.zeros((1024, 1024, 64), dtype=np.uint8, device=1)")
    await gpushare_app.poll_once()
    since = clock.now()
    await k.run("simgpu.burn(0.2, device=0)")
    await wait_for(lambda: gpushare_app.node.busy_fraction(None, 0, since, clock.now()) > 0,
                   what="the burn reaches the node")
    await gpushare_app.poll_once()

    # the server's own poll loop runs too: the burn shows in some sample of the history,
    # not necessarily in the last one
    hist = await get_json(jp_fetch, "api", "gpushare", "history", params={"seconds": 600})
    series = hist["kernels"][k.id]
    assert set(series["gpu_utilization"]) == set(series["gpu"]) == {"0", "1"}
    assert all(len(v) == len(series["t"]) for v in series["gpu_utilization"].values())
    util, held = series["gpu_utilization"], series["gpu"]
    # per GPU, sample by sample: null, not 0, exactly where the kernel held nothing on that
    # GPU (a poll may land between the cell's two allocations: GPU 0 held, GPU 1 not yet)
    for g in ("0", "1"):
        assert [u is None for u in util[g]] == [not b for b in held[g]], g
    assert any(held["1"]) and all(u == 0 for u in util["1"] if u is not None)  # no compute
    assert max(u for u in util["0"] if u is not None) > 0
    for i, sm in enumerate(series["sm_utilization"]):  # the busiest GPU it held, else null
        seen = [util[g][i] for g in ("0", "1") if util[g][i] is not None]
        assert sm == (max(seen) if seen else None), i

    info = await kernel_status(jp_fetch, k.id)
    assert info["gpu_bytes"] == {"0": 64 * MiB, "1": 64 * MiB}
    assert set(info["gpu_utilization"]) == {"0", "1"} and info["gpu_utilization"]["1"] == 0
    assert info["sm_utilization"] == max(info["gpu_utilization"].values())


async def test_two_kernels_are_attributed_separately_and_shutdown_drops(jp_fetch, kernels, gpushare_app):
    a = await kernels.start()
    b = await kernels.start()
    await a.run(ALLOC_3G_GPU1)
    await b.run("from jupyter_gpushare.sim import simgpu\nimport numpy as np\n"
                "y = simgpu.zeros((1024, 1024, 1024), dtype=np.uint8, device=0)")
    await gpushare_app.poll_once()
    ia, ib = await kernel_status(jp_fetch, a.id), await kernel_status(jp_fetch, b.id)
    assert (ia["gpu_memory_bytes"], ia["gpus"]) == (3 * GiB, [1])
    assert (ib["gpu_memory_bytes"], ib["gpus"]) == (1 * GiB, [0])
    assert set(ia["pids"]).isdisjoint(ib["pids"])

    await jp_fetch("api", "kernels", a.id, method="DELETE")
    await wait_for(lambda: a.id not in gpushare_app.channel.connections, what="agent disconnect")
    await gpushare_app.poll_once()
    assert await kernel_status(jp_fetch, a.id) is None
    status = await get_json(jp_fetch, "api", "gpushare", "status")
    assert {g["index"]: g for g in status["gpus"]}[1]["memory_used"] == 0
    assert a.id not in gpushare_app.tracker.kernels


async def test_out_of_memory_raises_clear_error_in_kernel(kernels):
    k = await kernels.start()
    ex = await k.run(
        "from jupyter_gpushare.sim import simgpu\nimport numpy as np\n"
        "big = simgpu.zeros((17, 1024, 1024, 1024), dtype=np.uint8, device=0)", ok=False)
    assert ex.status == "error"
    assert ex.error["ename"] == "SimOutOfMemoryError"
    assert "out of memory on simulated GPU 0" in ex.error["evalue"]
    assert "16.0 GiB" in ex.error["evalue"]


async def test_out_of_memory_counts_other_kernels(kernels):
    a = await kernels.start()
    b = await kernels.start()
    await a.run("from jupyter_gpushare.sim import simgpu\nimport numpy as np\n"
                "x = simgpu.zeros((10, 1024, 1024, 1024), dtype=np.uint8, device=0)")
    ex = await b.run("from jupyter_gpushare.sim import simgpu\nimport numpy as np\n"
                     "y = simgpu.zeros((10, 1024, 1024, 1024), dtype=np.uint8, device=0)", ok=False)
    assert ex.error and "out of memory" in ex.error["evalue"]


async def test_history_has_series_per_gpu_and_kernel(jp_fetch, kernels, gpushare_app):
    k = await kernels.start()
    await k.run(ALLOC_3G_GPU1)
    for _ in range(3):
        await gpushare_app.poll_once()
    hist = await get_json(jp_fetch, "api", "gpushare", "history", params={"seconds": 60})
    assert set(hist["gpus"]) == {"0", "1"}
    assert hist["gpus"]["1"]["memory_used"][-1] == 3 * GiB
    series = hist["kernels"][k.id]
    assert series["gpu_memory_bytes"][-1] == 3 * GiB
    assert series["gpu"]["1"][-1] == 3 * GiB
    assert len(series["t"]) == len(series["sm_utilization"]) >= 3


@pytest.mark.parametrize("seconds", ["abc", "-1", "0", "99999999"])
async def test_history_rejects_bad_seconds(jp_fetch, seconds):
    with pytest.raises(HTTPClientError) as e:
        await jp_fetch("api", "gpushare", "history", params={"seconds": seconds})
    assert e.value.code == 400


async def test_unauthenticated_status_is_refused(jp_fetch):
    for path in (("status",), ("history",)):
        with pytest.raises(HTTPClientError) as e:
            await jp_fetch("api", "gpushare", *path, headers={"Authorization": "token wrong"})
        assert e.value.code == 403


async def test_polling_status_is_not_activity(jp_fetch, jp_serverapp):
    await jp_fetch("api", "contents")  # a tracked request sets the activity clock
    before = jp_serverapp.web_app.settings["api_last_activity"]
    await jp_fetch("api", "gpushare", "status")
    await jp_fetch("api", "gpushare", "history")
    assert jp_serverapp.web_app.settings["api_last_activity"] == before


async def test_metrics_exposed(jp_fetch, kernels, gpushare_app):
    k = await kernels.start()
    await k.run(ALLOC_3G_GPU1)
    await gpushare_app.poll_once()
    r = await jp_fetch("metrics")
    text = r.body.decode()
    assert 'gpushare_gpu_memory_used_bytes{gpu="1"} 3.221225472e+09' in text
    assert f'gpushare_kernel_gpu_memory_bytes{{gpu="1",kernel_id="{k.id}"}} 3.221225472e+09' in text


async def test_asyncio_tasks_gauge_counts_the_servers_tasks(jp_fetch, gpushare_app):
    async def tasks_seen() -> float:
        await gpushare_app.poll_once()
        text = (await jp_fetch("metrics")).body.decode()
        line = next(x for x in text.splitlines() if x.startswith("gpushare_asyncio_tasks "))
        return float(line.split()[1])

    stop = asyncio.Event()
    extra = [asyncio.ensure_future(stop.wait()) for _ in range(25)]
    with_extra = await tasks_seen()
    stop.set()
    await asyncio.gather(*extra)
    without = await tasks_seen()
    assert with_extra - without >= 25  # other tasks of the server may come and go meanwhile
    assert without >= 1  # at least the poll itself


async def test_events_schema_registered(jp_serverapp):
    from jupyter_gpushare.events import KERNEL_SCHEMA_ID

    assert KERNEL_SCHEMA_ID in jp_serverapp.event_logger.schemas.schema_ids


def test_json_shapes_are_json(gpushare_app):
    json.dumps(gpushare_app.status())


# -- the highest SM utilization over a window, asked at every poll and status request ----------
_samples = st.lists(  # (time step, SM %, ask after this sample?): asked now and then, so the
    st.tuples(st.floats(0, 5), st.one_of(st.none(), st.floats(0, 100)), st.booleans()),
    max_size=60,  # ring buffer also wraps past what was last asked about
)


@settings(max_examples=300, deadline=None)
@given(_samples, st.integers(1, 12), st.lists(st.floats(-1, 1), min_size=1, max_size=4))
def test_max_utilization_since_equals_a_scan_of_the_history(steps, maxlen, windows):
    """The incremental answer equals the plain scan over what the ring buffer holds, for
    windows that start before, inside and after the history (equal times included)."""
    from collections import deque

    from jupyter_gpushare.core.tracker import KernelRecord

    rec = KernelRecord(id="k")
    rec.history = deque(maxlen=maxlen)
    t = 1000.0
    for step, util, ask in steps:
        t += step
        rec.history.append((t, 0, util, {}))
        if not ask:
            continue
        span = rec.history[-1][0] - rec.history[0][0]
        for w in windows:  # from a little before the oldest sample to a little after now
            since = rec.history[0][0] + w * (span + 1)
            want = max((u for ts, _, u, _ in rec.history if ts >= since and u is not None), default=0.0)
            assert rec.max_utilization_since(since) == want


def test_max_utilization_since_follows_a_new_history_buffer():
    from collections import deque

    from jupyter_gpushare.core.tracker import KernelRecord

    rec = KernelRecord(id="k")
    rec.history.append((1.0, 0, 90.0, {}))
    assert rec.max_utilization_since(0) == 90.0
    rec.history = deque([(2.0, 0, 10.0, {})], maxlen=5)  # the tracker gives each record its own
    assert rec.max_utilization_since(0) == 10.0
    rec.history.clear()
    assert rec.max_utilization_since(0) == 0.0
